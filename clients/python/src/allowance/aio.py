"""The asynchronous client (asyncio) and its reservation guard.

Same calls, same wire format (:mod:`allowance._api`), same decisions
(:mod:`allowance._shared`) as :class:`allowance.Client`; only the I/O awaits.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Mapping,
    Sequence,
)
from types import TracebackType
from typing import Any, TypeVar, Unpack, overload

import httpx

from . import _api
from ._shared import (
    DEFAULT_MAX_QUEUE_MS,
    DEFAULT_TRANCHE_TOKENS,
    GuardState,
    MeterCore,
    WaitPolicy,
    add_note,
    caller_exception,
)
from .client import DEFAULT_TIMEOUT_S
from .errors import AllowanceError, Conflict, ConnectionFailed, Denied, StoreUnavailable
from .types import (
    Charge,
    LimitSpec,
    Plan,
    ReservationInfo,
    ReservationStatus,
    ReserveOptions,
    ScopeStatus,
    UsagePage,
)

T = TypeVar("T")

_UNKNOWN = (StoreUnavailable, ConnectionFailed)
"""Errors after which the server may have acted or not (outcome unknown)."""


class AsyncClient:
    """An asyncio client of the allowance HTTP API (see :class:`allowance.Client`).

    >>> async with AsyncClient(url, token) as c:                  # doctest: +SKIP
    ...     async with c.reserve("acme", {"input_tokens": 3000}) as r:
    ...         reply = await call_model()
    ...         await r.settle({"input_tokens": 2950, "output_tokens": 412})
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=_api.headers(token, headers),
            timeout=timeout_s,
            transport=transport,
        )
        # Reserves cancelled in flight, and the refunds of what they held;
        # settles and refunds cancelled in flight: referenced here until
        # done (or the event loop could drop them half-way), and awaited by
        # ``aclose`` before it closes the pool.
        self._background: set[asyncio.Future[Any]] = set()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes the connection pool, once the work the client still owes
        is done: a reserve cancelled in flight runs to its answer and what
        it held is refunded; a settle or refund cancelled in flight runs to
        its end (each bounded by the client's timeouts)."""
        # A task that ends may start another (a reserve's answer, then its
        # refund): wait until none is left. `wait`, not `gather`: cancelling
        # this must not cancel them.
        while self._background:
            await asyncio.wait(list(self._background))
        await self._http.aclose()

    async def _send(self, call: _api.Call[T]) -> T:
        try:
            response = await self._http.request(**_api.request_kwargs(call, self.timeout_s))
        except httpx.TransportError as e:
            raise ConnectionFailed(f"{call.method} {call.path}: {e!r}") from e
        return call.finish(response)

    async def _reserve_once(
        self,
        tenant: str,
        amounts: Mapping[str, int],
        options: ReserveOptions,
        *,
        replay_is_ours: bool = False,
    ) -> AsyncReservation:
        """One reserve request, safe to cancel: once sent, the server may
        hold for it whatever happens to the caller, so the request runs to
        its answer in its own task (``aclose`` waits for it), and a hold
        nobody will receive is refunded when it arrives. A replayed one is
        left to its owner — unless ``replay_is_ours``: an earlier attempt of
        the same call, with the same key, had an unknown outcome, so the
        hold is that call's. An answer that leaves the outcome unknown (a
        503, a lost answer) is cleared up by replaying the key, if any."""
        request = asyncio.ensure_future(self._send(_api.reserve(tenant, amounts, options)))
        try:
            info = await asyncio.shield(request)
        except asyncio.CancelledError:
            # The release first: it keeps its refund before the request is
            # dropped from `_background`, so `aclose` never sees it empty.
            request.add_done_callback(
                lambda r: self._release_abandoned(
                    r, tenant, amounts, options, replay_is_ours=replay_is_ours
                )
            )
            self._keep(request)
            raise
        return AsyncReservation(self, info, replay_is_ours=replay_is_ours)

    def _release_abandoned(
        self,
        request: asyncio.Future[ReservationInfo],
        tenant: str,
        amounts: Mapping[str, int],
        options: ReserveOptions,
        *,
        replay_is_ours: bool,
    ) -> None:
        if request.cancelled():
            return
        error = request.exception()
        if error is not None:
            if isinstance(error, _UNKNOWN):
                self._release_unknown(tenant, amounts, options)
            return  # otherwise nothing was granted
        info = request.result()
        if info.status != "held" or (info.replayed and not replay_is_ours) or info.id is None:
            return
        self._in_background(self._refund_until_known(info.id))

    def _release_unknown(
        self, tenant: str, amounts: Mapping[str, int], options: ReserveOptions
    ) -> None:
        """A reserve of a call that will not receive its hold had an unknown
        outcome: with an idempotency key, replay it in the background and
        refund what the key holds (without a key nobody can know: the TTL
        is the backstop)."""
        if options.get("idempotency_key") is not None:
            self._in_background(self._replay_and_refund(tenant, amounts, options))

    async def _replay_and_refund(
        self, tenant: str, amounts: Mapping[str, int], options: ReserveOptions
    ) -> None:
        """Replays a reserve whose outcome was unknown (same key, no
        queueing) until the answer is known, within the client's timeout,
        and refunds what it holds: the earlier attempt's hold (the replay is
        this call's, as in ``reserve_or_wait``), or a new one if that
        attempt held nothing. A denial means the key holds nothing."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        replay = ReserveOptions(**options)
        replay.pop("wait_ms", None)
        delay = 0.05
        while True:
            try:
                info = await self._send(_api.reserve(tenant, amounts, replay))
                break
            except (*_UNKNOWN, Conflict):
                # Still unknown, or the first attempt still waits in the
                # server's queue (a 409): ask again.
                if loop.time() + delay > deadline:
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
            except AllowanceError:
                return
        if info.status == "held" and info.id is not None:
            await self._refund_until_known(info.id, deadline)

    async def _refund_until_known(self, reservation_id: str, deadline: float | None = None) -> None:
        """Refunds a hold nobody will receive, retrying (refund is
        idempotent) while the outcome is unknown, within the client's
        timeout."""
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.timeout_s
        delay = 0.05
        while True:
            try:
                await self.refund(reservation_id)
                return
            except _UNKNOWN:
                if loop.time() + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _in_background(self, call: Awaitable[Any]) -> asyncio.Future[Any]:
        """Runs ``call`` in a task of its own, kept until done (``aclose``
        waits for it)."""
        task = asyncio.ensure_future(call)
        self._keep(task)
        return task

    def _keep(self, task: asyncio.Future[Any]) -> None:
        """Keeps ``task`` referenced until done (``aclose`` waits for it)."""
        self._background.add(task)
        task.add_done_callback(self._background_done)

    async def _to_the_end(self, call: Awaitable[T]) -> T:
        """Awaits ``call``, which runs to its end even if the caller is
        cancelled meanwhile, however often (an anyio deadline cancels every
        await after it): once a settle or refund is on its way, stopping it
        half-way leaves the hold to its TTL, and a call that ran free. The
        caller still gets its cancellation."""
        task = asyncio.ensure_future(call)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                self._keep(task)
            raise

    def _background_done(self, task: asyncio.Future[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a failed refund leaves the hold to its TTL

    # Data plane ---------------------------------------------------------

    def reserve(
        self, tenant: str, amounts: Mapping[str, int], **options: Unpack[ReserveOptions]
    ) -> PendingReservation:
        """Holds ``amounts``; ``await`` it, use it directly in ``async with``,
        or hand it to ``asyncio.create_task`` (it is a coroutine; see
        :meth:`allowance.Client.reserve`)."""

        async def run() -> AsyncReservation:
            return await self._reserve_once(tenant, amounts, options)

        return PendingReservation(run)

    def reserve_or_wait(
        self,
        tenant: str,
        amounts: Mapping[str, int],
        *,
        timeout_s: float = 60.0,
        max_backoff_s: float = 30.0,
        jitter: float = 0.25,
        max_queue_ms: int = DEFAULT_MAX_QUEUE_MS,
        rng: random.Random | None = None,
        **options: Unpack[ReserveOptions],
    ) -> PendingReservation:
        """Reserves, waiting up to ``timeout_s`` for room (see
        :meth:`allowance.Client.reserve_or_wait`)."""

        async def run() -> AsyncReservation:
            policy = WaitPolicy(
                timeout_s=timeout_s,
                max_backoff_s=max_backoff_s,
                jitter=jitter,
                max_queue_ms=max_queue_ms,
                idempotent=options.get("idempotency_key") is not None,
                rng=rng or random.Random(),
            )
            # An attempt whose outcome is unknown (a 503, a lost answer) may
            # have held: a retry's replay of it is this call's hold.
            unknown = False
            while True:
                attempt = ReserveOptions(**options)
                attempt["wait_ms"] = policy.wait_ms()
                try:
                    return await self._reserve_once(
                        tenant, amounts, attempt, replay_is_ours=unknown
                    )
                except AllowanceError as e:
                    if isinstance(e, _UNKNOWN):
                        unknown = True
                    if policy.adapt(e):
                        continue
                    delay = policy.delay_s(e)
                    if delay is None:
                        raise
                try:
                    await asyncio.sleep(delay)
                except asyncio.CancelledError:
                    # Cancelled between attempts: one that had an unknown
                    # outcome may have held, for nobody now.
                    if unknown:
                        self._release_unknown(tenant, amounts, options)
                    raise

        return PendingReservation(run)

    async def dry_run(
        self, tenant: str, amounts: Mapping[str, int], **options: Unpack[ReserveOptions]
    ) -> ReservationInfo:
        """Answers exactly as a reserve would, holding nothing."""
        return await self._send(_api.dry_run(tenant, amounts, options))

    async def get(self, reservation_id: str) -> ReservationInfo:
        """A reservation by id."""
        return await self._send(_api.get(reservation_id))

    async def settle(
        self,
        reservation_id: str,
        usage: Mapping[str, int],
        charges: Sequence[Charge] | None = None,
    ) -> ReservationInfo:
        """Records the actual ``usage`` and releases the hold (idempotent)."""
        return await self._send(_api.settle(reservation_id, usage, charges))

    async def refund(self, reservation_id: str) -> ReservationInfo:
        """Releases the hold, recording nothing (idempotent)."""
        return await self._send(_api.refund(reservation_id))

    async def extend(
        self,
        reservation_id: str,
        amounts: Mapping[str, int] | None = None,
        ttl_ms: int | None = None,
    ) -> ReservationInfo:
        """Raises the hold and/or pushes the expiry (all or nothing)."""
        return await self._send(_api.extend(reservation_id, amounts, ttl_ms))

    async def status(self, scope: str) -> ScopeStatus:
        """A scope's limits with their use."""
        return await self._send(_api.status(scope))

    async def usage(self, since: str | None = None, limit: int | None = None) -> UsagePage:
        """A page of the usage log after cursor ``since``."""
        return await self._send(_api.usage(since, limit))

    async def healthz(self) -> bool:
        """True when the process is up (raises otherwise)."""
        return await self._send(_api.healthz())

    async def readyz(self) -> bool:
        """True when the store answers (raises otherwise)."""
        return await self._send(_api.readyz())

    # Admin plane --------------------------------------------------------

    async def plans(self) -> list[Plan]:
        """Every plan (admin)."""
        return await self._send(_api.plans())

    async def put_plan(
        self,
        name: str,
        limits: Sequence[LimitSpec],
        *,
        overrun: str | None = None,
        overrun_percent: int | None = None,
        queue_weight: int | None = None,
    ) -> Plan:
        """Defines or changes a plan (admin)."""
        call = _api.put_plan(
            name,
            limits,
            overrun=overrun,
            overrun_percent=overrun_percent,
            queue_weight=queue_weight,
        )
        return await self._send(call)

    async def set_scope(
        self,
        scope: str,
        *,
        plan: str | None = None,
        limits: Sequence[LimitSpec] | None = None,
    ) -> ScopeStatus:
        """Moves a scope to ``plan`` or gives it its own ``limits`` (admin)."""
        return await self._send(_api.put_scope(scope, plan=plan, limits=limits))

    async def delete_override(self, scope: str) -> ScopeStatus:
        """Returns a scope to its kind's default plan (admin)."""
        return await self._send(_api.delete_override(scope))

    async def adjust(self, scope: str, dimension: str, amount: int, reason: str) -> ScopeStatus:
        """Credits (``amount`` > 0) or debits a ``total`` budget (admin)."""
        return await self._send(_api.adjust(scope, dimension, amount, reason))


class PendingReservation(Coroutine[Any, Any, "AsyncReservation"]):
    """A reserve in flight: ``await`` it for the :class:`AsyncReservation`,
    enter it with ``async with`` to guard the block, or run it as a task
    (``asyncio.create_task``, a ``TaskGroup``: it is a coroutine).

    The reserve is sent once, on the first ``await`` (or ``async with``,
    or the task's first step); awaiting again answers the same
    reservation. Cancelling the awaiting task while the request is on the
    wire leaks no hold: a hold granted after the cancellation is refunded
    (``aclose`` waits for it)."""

    def __init__(self, run: Callable[[], Awaitable[AsyncReservation]]) -> None:
        self._run = run
        self._task: asyncio.Future[AsyncReservation] | None = None
        self._reservation: AsyncReservation | None = None
        self._driver: Generator[Any, None, AsyncReservation] | None = None

    async def _result(self) -> AsyncReservation:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        return await self._task

    def __await__(self) -> Generator[Any, None, AsyncReservation]:
        return self._result().__await__()

    # The coroutine protocol, for a task that runs this object itself.

    def _drive(self) -> Generator[Any, None, AsyncReservation]:
        if self._driver is None:
            self._driver = self.__await__()
        return self._driver

    def send(self, value: Any) -> Any:
        """Steps the reserve (what a task does with its coroutine)."""
        return self._drive().send(value)

    @overload
    def throw(
        self,
        typ: type[BaseException],
        val: BaseException | object = None,
        tb: TracebackType | None = None,
        /,
    ) -> Any: ...

    @overload
    def throw(
        self, typ: BaseException, val: None = None, tb: TracebackType | None = None, /
    ) -> Any: ...

    def throw(self, typ: Any, val: Any = None, tb: Any = None, /) -> Any:
        """Raises ``typ`` where the reserve waits (a task's cancellation)."""
        driver = self._drive()
        if val is None and tb is None:
            return driver.throw(typ)
        return driver.throw(typ, val, tb)

    def close(self) -> None:
        """Closes the coroutine (a reserve already sent still runs to its
        answer, and what it held is refunded)."""
        if self._driver is not None:
            self._driver.close()

    async def __aenter__(self) -> AsyncReservation:
        reservation = await self._result()
        reservation._state.enter()
        self._reservation = reservation
        return reservation

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._reservation is not None:
            await self._reservation._exit(exc, stacklevel=3)


class AsyncReservation:
    """A live reservation (see :class:`allowance.Reservation`): in ``async
    with``, an exception refunds, a settle that failed (or was cancelled in
    flight) is sent again, and a forgotten settle charges the estimate."""

    def __init__(
        self, client: AsyncClient, info: ReservationInfo, *, replay_is_ours: bool = False
    ) -> None:
        self._client = client
        self._state = GuardState.of(info, replay_is_ours=replay_is_ours)

    @property
    def info(self) -> ReservationInfo:
        """The reservation as last answered by the server."""
        return self._state.info

    @property
    def id(self) -> str:
        """The reservation's id."""
        return self._state.info.id or ""

    @property
    def status(self) -> ReservationStatus:
        """``held``, ``settled``, ``refunded`` or ``expired`` (as last seen)."""
        return self._state.info.status

    @property
    def held(self) -> dict[str, int]:
        """Amounts held, ``requests`` and ``concurrent`` included."""
        return self._state.info.held

    @property
    def replayed(self) -> bool:
        """True when the reserve was an idempotent repeat."""
        return self._state.info.replayed

    @property
    def owned(self) -> bool:
        """False when the reserve replayed a reservation this call did not
        make (another caller's, same idempotency key): the guard leaves it
        to its owner (see :class:`allowance.Reservation`)."""
        return self._state.owned

    @property
    def cut(self) -> Denied | None:
        """The denial that stopped :meth:`stream`, if one did."""
        return self._state.cut

    async def settle(
        self, usage: Mapping[str, int], charges: Sequence[Charge] | None = None
    ) -> ReservationInfo:
        """Records the actual usage. If it fails (or is cancelled in
        flight), leaving the ``async with`` block sends it again."""
        attempt = self._state.begin_settle(usage, charges)
        try:
            info = await self._client._to_the_end(
                self._client.settle(self.id, attempt.usage, attempt.charges)
            )
        except BaseException as e:
            attempt.error = e
            raise
        self._state.settled(info)
        return info

    async def refund(self) -> ReservationInfo:
        """Releases the hold, recording nothing (sent to its end even if the
        caller is cancelled meanwhile)."""
        self._state.info = await self._client._to_the_end(self._client.refund(self.id))
        return self._state.info

    async def extend(
        self, amounts: Mapping[str, int] | None = None, ttl_ms: int | None = None
    ) -> ReservationInfo:
        """Raises the hold and/or pushes the expiry."""
        self._state.info = await self._client.extend(self.id, amounts, ttl_ms)
        return self._state.info

    async def refresh(self) -> ReservationInfo:
        """Reads the reservation again."""
        self._state.info = await self._client.get(self.id)
        return self._state.info

    def meter(
        self,
        *,
        tranche_tokens: int = DEFAULT_TRANCHE_TOKENS,
        ttl_ms: int | None = None,
        max_output_tokens: int | None = None,
    ) -> AsyncStreamMeter:
        """A meter for a streamed answer (see :class:`AsyncStreamMeter`)."""
        return AsyncStreamMeter(
            self, tranche_tokens=tranche_tokens, ttl_ms=ttl_ms, max_output_tokens=max_output_tokens
        )

    async def stream(
        self,
        chunks: AsyncIterable[T],
        count: Callable[[T], int],
        *,
        tranche_tokens: int = DEFAULT_TRANCHE_TOKENS,
        ttl_ms: int | None = None,
        max_output_tokens: int | None = None,
    ) -> AsyncIterator[T]:
        """Yields ``chunks``, topping up the hold as output tokens arrive;
        stops cleanly, after yielding the chunk that went past the hold,
        when a top-up is refused (:attr:`cut`; see
        :meth:`allowance.Reservation.stream`)."""
        meter = self.meter(
            tranche_tokens=tranche_tokens, ttl_ms=ttl_ms, max_output_tokens=max_output_tokens
        )
        async for chunk in chunks:
            try:
                await meter.add(count(chunk))
            except Denied as e:
                self._state.cut = e
                yield chunk
                return
            yield chunk

    async def __aenter__(self) -> AsyncReservation:
        self._state.enter()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._exit(exc, stacklevel=3)

    async def _exit(self, exc: BaseException | None, stacklevel: int) -> None:
        plan = self._state.exit_plan(exc)
        caller = caller_exception(exc)
        try:
            if plan.action == "refund":
                await self.refund()
            elif plan.action == "settle" and plan.usage is not None:
                await self.settle(plan.usage, plan.charges)
        except BaseException as cleanup:
            # Settle first, warn after: with warnings as errors the call is
            # still charged.
            if plan.warning is not None:
                self._state.warn(plan.warning, stacklevel + 1, in_flight=caller or cleanup)
            if exc is None or not isinstance(cleanup, AllowanceError):
                raise
            add_note(exc, plan.why, cleanup)
        else:
            if plan.warning is not None:
                self._state.warn(plan.warning, stacklevel + 1, in_flight=caller)


class AsyncStreamMeter:
    """Counts streamed output tokens and tops up the hold ahead of them
    (see :class:`allowance.StreamMeter`)."""

    def __init__(
        self,
        reservation: AsyncReservation,
        *,
        tranche_tokens: int,
        ttl_ms: int | None,
        max_output_tokens: int | None = None,
    ) -> None:
        self._reservation = reservation
        self._core = MeterCore(
            held_output_tokens=reservation.held.get("output_tokens", 0),
            tranche_tokens=tranche_tokens,
            ttl_ms=ttl_ms,
            bound_output_tokens=max_output_tokens,
        )

    @property
    def output_tokens(self) -> int:
        """Output tokens seen so far."""
        return self._core.seen_output_tokens

    async def add(self, tokens: int) -> None:
        """Records ``tokens`` more output, topping up the hold if needed;
        raises the denial when a top-up is refused and the tokens seen
        exceed the hold (see :class:`allowance.StreamMeter`)."""
        extra = self._core.top_up(tokens)
        self._reservation._state.observed_output_tokens = self._core.seen_output_tokens
        if extra:
            try:
                info = await self._reservation.extend({"output_tokens": extra}, self._core.ttl_ms)
            except Denied:
                if self._core.over_hold():
                    raise
                return
            self._core.extended(info)

    def usage(self, input_tokens: int | None = None) -> dict[str, int]:
        """Usage to settle with: ``input_tokens`` (the estimate by default)
        and the output tokens seen."""
        held_input = self._reservation.held.get("input_tokens", 0)
        return {
            "input_tokens": held_input if input_tokens is None else input_tokens,
            "output_tokens": self._core.seen_output_tokens,
        }
