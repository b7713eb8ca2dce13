"""The synchronous client and its reservation guard."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TypeVar, Unpack

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
from .errors import AllowanceError, ConnectionFailed, Denied, StoreUnavailable
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

DEFAULT_TIMEOUT_S = 10.0
"""Per-request timeout; a reserve with ``wait_ms`` gets that much more."""


class Client:
    """A synchronous client of the allowance HTTP API.

    ``token`` is an API token (``Authorization: Bearer``): an admin token,
    or a tenant token for that tenant's data plane. Use it as a context
    manager, or call :meth:`close`, to release its connections.

    >>> with Client("http://127.0.0.1:8787", token) as c:      # doctest: +SKIP
    ...     with c.reserve("acme", {"input_tokens": 3000, "output_tokens": 500}) as r:
    ...         reply = call_model()
    ...         r.settle({"input_tokens": 2950, "output_tokens": 412})
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=_api.headers(token, headers),
            timeout=timeout_s,
            transport=transport,
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the connection pool."""
        self._http.close()

    def _send(self, call: _api.Call[T]) -> T:
        try:
            response = self._http.request(**_api.request_kwargs(call, self.timeout_s))
        except httpx.TransportError as e:
            raise ConnectionFailed(f"{call.method} {call.path}: {e!r}") from e
        return call.finish(response)

    # Data plane ---------------------------------------------------------

    def reserve(
        self, tenant: str, amounts: Mapping[str, int], **options: Unpack[ReserveOptions]
    ) -> Reservation:
        """Holds ``amounts`` against the tenant and ``scopes``; raises a
        :class:`~allowance.Denied` subclass when a limit says no.

        The answer is a :class:`Reservation`; use it in a ``with`` block so
        a failure refunds and a forgotten settle still charges the estimate.
        A replay (same ``idempotency_key``) of a hold another caller still
        has raises :class:`~allowance.HeldElsewhere` when the block is
        entered.
        """
        return Reservation(self, self._send(_api.reserve(tenant, amounts, options)))

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
    ) -> Reservation:
        """Reserves, waiting up to ``timeout_s`` for room.

        Each attempt queues in the server (``wait_ms``, at most
        ``max_queue_ms``, lowered to the server's ``queue.max_wait_ms`` if that
        is less) so it is admitted the moment room frees; a
        ``rate_limited`` answer is retried after its ``retry_after`` plus up
        to ``jitter`` × it (that extra capped at ``max_backoff_s``), never
        sooner than the server said; a ``retry_after`` longer than
        the time left raises the denial at once. With an
        ``idempotency_key``, a 503 or a broken connection is retried too
        (same key: it cannot hold twice), and the replay that answers
        the retry is this call's own hold. ``budget_exhausted`` and
        ``exceeds_limit`` raise at once; the last denial raises when time
        is up.
        """
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
                info = self._send(_api.reserve(tenant, amounts, attempt))
                return Reservation(self, info, replay_is_ours=unknown)
            except AllowanceError as e:
                if isinstance(e, (StoreUnavailable, ConnectionFailed)):
                    unknown = True
                if policy.adapt(e):
                    continue
                delay = policy.delay_s(e)
                if delay is None:
                    raise
                time.sleep(delay)

    def dry_run(
        self, tenant: str, amounts: Mapping[str, int], **options: Unpack[ReserveOptions]
    ) -> ReservationInfo:
        """Answers exactly as a reserve would (or raises the same denial),
        holding nothing."""
        return self._send(_api.dry_run(tenant, amounts, options))

    def get(self, reservation_id: str) -> ReservationInfo:
        """A reservation by id (expiry observed: past ``expires_at`` it is
        ``expired``)."""
        return self._send(_api.get(reservation_id))

    def settle(
        self,
        reservation_id: str,
        usage: Mapping[str, int],
        charges: Sequence[Charge] | None = None,
    ) -> ReservationInfo:
        """Records the actual ``usage`` and releases the hold. Idempotent; a
        refunded reservation raises :class:`~allowance.Conflict`."""
        return self._send(_api.settle(reservation_id, usage, charges))

    def refund(self, reservation_id: str) -> ReservationInfo:
        """Releases the hold, recording nothing. Idempotent; a settled
        reservation raises :class:`~allowance.Conflict`."""
        return self._send(_api.refund(reservation_id))

    def extend(
        self,
        reservation_id: str,
        amounts: Mapping[str, int] | None = None,
        ttl_ms: int | None = None,
    ) -> ReservationInfo:
        """Raises the hold by ``amounts`` (all or nothing) and/or pushes the
        expiry to now + ``ttl_ms``. A denial leaves the reservation as it was."""
        return self._send(_api.extend(reservation_id, amounts, ttl_ms))

    def status(self, scope: str) -> ScopeStatus:
        """A scope's limits with their use (``tenant:acme/user:bob``)."""
        return self._send(_api.status(scope))

    def usage(self, since: str | None = None, limit: int | None = None) -> UsagePage:
        """A page of the usage log after cursor ``since``."""
        return self._send(_api.usage(since, limit))

    def healthz(self) -> bool:
        """True when the process is up (raises otherwise)."""
        return self._send(_api.healthz())

    def readyz(self) -> bool:
        """True when the store answers (raises otherwise)."""
        return self._send(_api.readyz())

    # Admin plane --------------------------------------------------------

    def plans(self) -> list[Plan]:
        """Every plan (admin)."""
        return self._send(_api.plans())

    def put_plan(
        self,
        name: str,
        limits: Sequence[LimitSpec],
        *,
        overrun: str | None = None,
        overrun_percent: int | None = None,
        queue_weight: int | None = None,
    ) -> Plan:
        """Defines or changes a plan (admin); effective for the next operation."""
        call = _api.put_plan(
            name,
            limits,
            overrun=overrun,
            overrun_percent=overrun_percent,
            queue_weight=queue_weight,
        )
        return self._send(call)

    def set_scope(
        self,
        scope: str,
        *,
        plan: str | None = None,
        limits: Sequence[LimitSpec] | None = None,
    ) -> ScopeStatus:
        """Moves a scope to ``plan`` or gives it its own ``limits`` (admin)."""
        return self._send(_api.put_scope(scope, plan=plan, limits=limits))

    def delete_override(self, scope: str) -> ScopeStatus:
        """Returns a scope to its kind's default plan (admin)."""
        return self._send(_api.delete_override(scope))

    def adjust(self, scope: str, dimension: str, amount: int, reason: str) -> ScopeStatus:
        """Credits (``amount`` > 0) or debits a ``total`` budget (admin)."""
        return self._send(_api.adjust(scope, dimension, amount, reason))


class Reservation:
    """A live reservation; a context manager that never lets a call go free.

    - ``r.settle(usage)`` records the real usage (do this);
    - an exception inside the ``with`` block refunds (the call failed), then
      re-raises — unless a streaming meter saw tokens arrive, in which case
      those are settled (the provider counted them);
    - a settle that failed inside the block (a lost answer, Ctrl-C) is
      sent again on the way out, never turned into a refund; one refused
      as invalid settles the estimate instead;
    - leaving the block normally without a settle settles at the estimate
      (or what a meter saw, if more) and then warns
      :class:`~allowance.UnsettledReservationWarning`; so does a generator
      holding the block that is closed early (``GeneratorExit``).

    A replayed reserve (same ``idempotency_key``) of a reservation that
    already ended is left alone: check :attr:`replayed` and :attr:`status`
    to skip work that was already done. One of a reservation another caller
    still holds is not this guard's (:attr:`owned` is false): entering the
    ``with`` block raises :class:`~allowance.HeldElsewhere` before it runs,
    and the guard never settles or refunds it.
    """

    def __init__(
        self, client: Client, info: ReservationInfo, *, replay_is_ours: bool = False
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
        to its owner."""
        return self._state.owned

    @property
    def cut(self) -> Denied | None:
        """The denial that stopped :meth:`stream`, if one did."""
        return self._state.cut

    def settle(
        self, usage: Mapping[str, int], charges: Sequence[Charge] | None = None
    ) -> ReservationInfo:
        """Records the actual usage (see :meth:`Client.settle`). If it
        fails, leaving the ``with`` block sends it again."""
        attempt = self._state.begin_settle(usage, charges)
        try:
            info = self._client.settle(self.id, attempt.usage, attempt.charges)
        except BaseException as e:
            attempt.error = e
            raise
        self._state.settled(info)
        return info

    def refund(self) -> ReservationInfo:
        """Releases the hold, recording nothing (see :meth:`Client.refund`)."""
        self._state.info = self._client.refund(self.id)
        return self._state.info

    def extend(
        self, amounts: Mapping[str, int] | None = None, ttl_ms: int | None = None
    ) -> ReservationInfo:
        """Raises the hold and/or pushes the expiry (see :meth:`Client.extend`)."""
        self._state.info = self._client.extend(self.id, amounts, ttl_ms)
        return self._state.info

    def refresh(self) -> ReservationInfo:
        """Reads the reservation again."""
        self._state.info = self._client.get(self.id)
        return self._state.info

    def meter(
        self,
        *,
        tranche_tokens: int = DEFAULT_TRANCHE_TOKENS,
        ttl_ms: int | None = None,
        max_output_tokens: int | None = None,
    ) -> StreamMeter:
        """A meter for a streamed answer: :meth:`StreamMeter.add` the output
        tokens as they arrive and the hold grows tranche by tranche, never
        past ``max_output_tokens`` (the call's own bound, if it has one)."""
        return StreamMeter(
            self, tranche_tokens=tranche_tokens, ttl_ms=ttl_ms, max_output_tokens=max_output_tokens
        )

    def stream(
        self,
        chunks: Iterable[T],
        count: Callable[[T], int],
        *,
        tranche_tokens: int = DEFAULT_TRANCHE_TOKENS,
        ttl_ms: int | None = None,
        max_output_tokens: int | None = None,
    ) -> Iterator[T]:
        """Yields ``chunks``, topping up the hold by ``count(chunk)`` output
        tokens each (never past ``max_output_tokens``). When a top-up is
        refused once the tokens seen exceed the hold, the stream stops
        cleanly and :attr:`cut` holds the denial (like the gateway's
        streams); the chunk that went past the hold is still yielded, as
        its tokens arrived and are charged. A refusal while the hold still
        covers what arrived is not a cut."""
        meter = self.meter(
            tranche_tokens=tranche_tokens, ttl_ms=ttl_ms, max_output_tokens=max_output_tokens
        )
        for chunk in chunks:
            try:
                meter.add(count(chunk))
            except Denied as e:
                self._state.cut = e
                yield chunk
                return
            yield chunk

    def __enter__(self) -> Reservation:
        self._state.enter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        plan = self._state.exit_plan(exc)
        caller = caller_exception(exc)
        try:
            if plan.action == "refund":
                self.refund()
            elif plan.action == "settle" and plan.usage is not None:
                self.settle(plan.usage, plan.charges)
        except BaseException as cleanup:
            # Settle first, warn after: with warnings as errors the call is
            # still charged.
            if plan.warning is not None:
                self._state.warn(plan.warning, stacklevel=3, in_flight=caller or cleanup)
            if exc is None or not isinstance(cleanup, AllowanceError):
                raise
            add_note(exc, plan.why, cleanup)
        else:
            if plan.warning is not None:
                self._state.warn(plan.warning, stacklevel=3, in_flight=caller)


class StreamMeter:
    """Counts a streamed answer's output tokens and extends the hold ahead
    of them, ``tranche_tokens`` at a time, never past ``max_output_tokens``
    (and pushes the TTL with each top-up when ``ttl_ms`` is given).
    :meth:`add` raises the denial when a top-up is refused and the tokens
    seen exceed the hold: stop reading the stream. A refusal while the hold
    still covers them is no cut (the answer may end within it); the next
    :meth:`add` asks again.

    It counts against the hold's ``output_tokens`` and tops up
    ``output_tokens``: a hold of ``tokens`` alone is not output cover, so
    the first token asks for a tranche on top of it."""

    def __init__(
        self,
        reservation: Reservation,
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

    def add(self, tokens: int) -> None:
        """Records ``tokens`` more output, topping up the hold if needed."""
        extra = self._core.top_up(tokens)
        self._reservation._state.observed_output_tokens = self._core.seen_output_tokens
        if extra:
            try:
                info = self._reservation.extend({"output_tokens": extra}, self._core.ttl_ms)
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
