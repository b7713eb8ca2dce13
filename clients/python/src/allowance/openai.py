"""Budgeting around the official ``openai`` SDK, in your own process.

For users who do not run the allowance gateway: each
``chat.completions.create`` call (chat completions only: the Responses API
is not wrapped) reserves its estimate on an allowance
server, calls OpenAI (or any compatible endpoint) directly, and settles the
``usage`` the answer reports. A failed call is refunded; a denial raises
before anything is sent upstream. A reply the provider sent is always
returned: a settle that fails with an unknown outcome is retried
(:data:`SETTLE_RETRY_DELAYS_S`), then warned about
(:class:`~allowance.SettleFailedWarning`), never raised in its place.

    from openai import OpenAI
    from allowance import Client
    from allowance.openai import BudgetedOpenAI

    ai = BudgetedOpenAI(OpenAI(), Client(url, token), tenant="acme", scopes={"user": "bob"})
    reply = ai.chat.completions.create(model="gpt-4o", messages=[...], max_tokens=300)

The estimate needs no network: Python's ``tiktoken`` downloads its ranks
at run time, so input tokens are estimated by
:func:`estimate_chat_input_tokens` (the gateway's per-message formula with
``ceil(characters / 4)`` per text, OpenAI's rule of thumb for English), or
by your own ``count_tokens``. The estimate only sizes the hold; the settle
records the real ``usage``. The output is held at the call's bound
(``max_completion_tokens`` / ``max_tokens``, else ``default_max_output_tokens``),
times ``n`` when it asks for several choices. Without a bound of the
call's own, the default is only the estimate: the request is sent as
written (nothing tells the provider to stop there), so a whole call settles
what the provider reports (the plan's overrun policy governs) and a stream
tops up past the default.

Streams hold the prompt plus one tranche of output and top it up as
tokens arrive, never past the call's own bound (without one, on until a
top-up is refused); a top-up refused once the tokens seen exceed the hold
ends the stream cleanly, like the gateway. A stream that asks for reasoning
(``reasoning_effort``, unless ``"none"``) holds its whole output bound up
front, as a whole call does: reasoning is billed as output but never
streamed, so top-ups would never see it.
``stream_options.include_usage`` is added so the settle uses the
real usage, and the extra usage chunk is not shown unless you asked for it.

Install with the extra: ``pip install 'allowance[openai]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import warnings
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from types import TracebackType
from typing import Any, Literal, cast, overload

import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_usage import CompletionUsage

from ._shared import DEFAULT_TRANCHE_TOKENS, SettleFailedWarning
from .aio import AsyncClient, AsyncReservation, AsyncStreamMeter
from .client import Client, Reservation, StreamMeter
from .errors import AllowanceError, ConnectionFailed, Denied, StoreUnavailable
from .types import ReserveOptions

__all__ = [
    "AsyncBudgetedOpenAI",
    "AsyncBudgetedStream",
    "BudgetedOpenAI",
    "BudgetedStream",
    "estimate_chat_input_tokens",
    "estimate_stream_text_tokens",
    "estimate_text_tokens",
]

CHARS_PER_TOKEN = 4
"""OpenAI's rule of thumb for English text."""

MESSAGE_OVERHEAD_TOKENS = 3
"""What each chat message costs before its fields (OpenAI's counting guide)."""

REPLY_PRIMING_TOKENS = 3
"""What every chat request adds for the reply's priming."""

NAME_TOKENS = 1
"""What a message's ``name`` adds beyond its value."""

IMAGE_TOKENS = 765
"""A flat price for one image part (a high-detail 512×512 tile's worth)."""

DEFAULT_MAX_OUTPUT_TOKENS = 4096
"""Output held when a call names no bound."""

SETTLE_RETRY_DELAYS_S: tuple[float, ...] = (0.2, 0.5, 1.0, 2.0)
"""Pauses before each further settle of a reply that arrived, while the
settle's outcome is unknown (a 503, a broken connection); after the last,
the reply is returned with a :class:`~allowance.SettleFailedWarning`."""

TokenCounter = Callable[[Sequence[Mapping[str, Any]], Sequence[Any] | None], int]
"""``(messages, tools) -> input tokens``: your own estimate."""


def estimate_text_tokens(text: str) -> int:
    """``ceil(len(text) / 4)``: a tokenizer-free estimate of ``text``."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _json_tokens(value: object) -> int:
    return estimate_text_tokens(json.dumps(value, separators=(",", ":"), default=str))


def _part_tokens(part: object) -> int:
    if isinstance(part, Mapping):
        if part.get("type") in ("image_url", "input_image", "image"):
            return IMAGE_TOKENS
        text = part.get("text")
        if isinstance(text, str):
            return estimate_text_tokens(text)
    return _json_tokens(part)


def _as_mapping(message: object) -> Mapping[str, Any]:
    """A chat message as a mapping: a dict as is, an SDK object (the
    ``message`` of an earlier reply, a pydantic model) by the fields it
    has set, as the SDK would send them."""
    if isinstance(message, Mapping):
        return message
    dump = getattr(message, "model_dump", None)
    if callable(dump):
        dumped = dump(exclude_unset=True)
        if isinstance(dumped, Mapping):
            return dumped
    raise TypeError(
        f"messages: each message must be a mapping or an SDK message object, "
        f"got {type(message).__name__}"
    )


def estimate_chat_input_tokens(
    messages: Iterable[Mapping[str, Any] | Any], tools: Sequence[Any] | None = None
) -> int:
    """The input tokens of a chat request, without a tokenizer.

    Each message counts 3, plus each field: a string by
    :func:`estimate_text_tokens`, ``content`` parts by their text (an image
    765), anything else by its compact JSON; ``name`` adds 1. The request
    adds 3 for the reply's priming, and the compact JSON of ``tools``.
    A message may be a dict or an SDK object (a previous reply's
    ``message``), read by the fields it has set.
    """
    total = REPLY_PRIMING_TOKENS
    for message in messages:
        total += MESSAGE_OVERHEAD_TOKENS
        for key, value in _as_mapping(message).items():
            if isinstance(value, str):
                total += estimate_text_tokens(value)
            elif key == "content" and isinstance(value, list):
                total += sum(_part_tokens(p) for p in value)
            else:
                total += _json_tokens(value)
            if key == "name":
                total += NAME_TOKENS
    if tools:
        total += _json_tokens(list(tools))
    return total


def _usage_of(usage: CompletionUsage) -> dict[str, int]:
    """An OpenAI ``usage`` as settle usage."""
    out = {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else None
    if cached:
        out["cached_input_tokens"] = cached
    return out


def estimate_stream_text_tokens(text: str) -> int:
    """Output tokens of one streamed piece of text: ``max(1, len // 4)``.

    A provider usually streams one token per chunk (`` hello`` is one token
    of six characters), so a chunk with text counts at least one and only a
    longer batch counts more; the settle uses the real ``usage`` when the
    stream reports it.
    """
    return max(1, len(text) // CHARS_PER_TOKEN) if text else 0


def _given(value: object) -> bool:
    """Whether a request field is set: not absent, ``None``, or the SDK's
    ``NOT_GIVEN`` / ``omit``."""
    return value is not None and not isinstance(value, (openai.NotGiven, openai.Omit))


def _asks_for_reasoning(request: Mapping[str, Any]) -> bool:
    """Whether a chat completions request asks the model to reason:
    ``reasoning_effort`` is set, and not ``"none"`` (the gateway's rule)."""
    effort = request.get("reasoning_effort")
    return _given(effort) and effort != "none"


def _delta_tokens(chunk: ChatCompletionChunk) -> int:
    """Output tokens a chunk carries, estimated."""
    total = 0
    for choice in chunk.choices:
        delta = choice.delta
        total += estimate_stream_text_tokens((delta.content or "") + (delta.refusal or ""))
        if delta.tool_calls:
            total += _json_tokens([t.model_dump() for t in delta.tool_calls])
    return total


class _Plan:
    """What one call reserves and how it is sent: shared by sync and async."""

    def __init__(self, owner: _Options, kwargs: dict[str, Any]) -> None:
        messages = kwargs.get("messages")
        if not isinstance(messages, Iterable) or isinstance(messages, (str, bytes, Mapping)):
            raise TypeError("messages: required, a list of chat messages")
        self.kwargs = dict(kwargs)
        # Read once: an iterator estimated here must still reach the SDK.
        sent = list(messages)
        self.kwargs["messages"] = sent
        self.stream = bool(kwargs.get("stream"))
        tools = kwargs.get("tools") or kwargs.get("functions")
        input_tokens = owner.count_tokens([_as_mapping(m) for m in sent], tools)
        bounds = (kwargs.get("max_completion_tokens"), kwargs.get("max_tokens"))
        bound = next((b for b in bounds if _given(b)), None)
        # Without a bound of the request's own, the default is only the
        # estimate: nothing tells the provider to stop there (the request is
        # sent as written), so a stream tops up past it and a whole call
        # settles what the provider reports.
        self.bounded = bound is not None
        per_choice = int(bound) if bound is not None else owner.default_max_output_tokens
        n = kwargs.get("n")
        choices = int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
        # `n` choices of up to the bound each, billed together.
        output_bound = per_choice * choices
        self.output_bound = output_bound
        # Reasoning is billed as output but never streamed, so a stream's
        # top-ups (counting its text) would never see it: a stream that asks
        # for it holds its whole bound up front, as a whole call does.
        self.reasoning = _asks_for_reasoning(kwargs)
        if self.stream and not self.reasoning:
            output_hold = min(owner.tranche_tokens, output_bound)
        else:
            output_hold = output_bound
        self.amounts = {"input_tokens": input_tokens, "output_tokens": output_hold}
        self.options: ReserveOptions = ReserveOptions(**owner.options)
        model = kwargs.get("model")
        if owner.price_model and isinstance(model, str):
            self.options["model"] = model
        # Without it a stream reports no usage and would be settled from
        # estimates; the extra chunk is hidden unless the caller asked.
        self.hide_usage_chunk = False
        if self.stream:
            stream_options = dict(kwargs.get("stream_options") or {})
            if not stream_options.get("include_usage"):
                stream_options["include_usage"] = True
                self.hide_usage_chunk = True
            self.kwargs["stream_options"] = stream_options


class _Options:
    """The wrapper's settings (shared by sync and async)."""

    def __init__(
        self,
        tenant: str,
        scopes: Mapping[str, str] | None,
        count_tokens: TokenCounter | None,
        default_max_output_tokens: int,
        tranche_tokens: int,
        price_model: bool,
        ttl_ms: int | None,
        labels: Mapping[str, str] | None,
        wait_s: float | None,
    ) -> None:
        if default_max_output_tokens < 1:
            raise ValueError("default_max_output_tokens: must be ≥ 1")
        if tranche_tokens < 1:
            raise ValueError("tranche_tokens: must be ≥ 1")
        self.tenant = tenant
        self.count_tokens: TokenCounter = count_tokens or estimate_chat_input_tokens
        self.default_max_output_tokens = default_max_output_tokens
        self.tranche_tokens = tranche_tokens
        self.price_model = price_model
        self.wait_s = wait_s
        self.options = ReserveOptions()
        if scopes:
            self.options["scopes"] = dict(scopes)
        if ttl_ms is not None:
            self.options["ttl_ms"] = ttl_ms
        if labels:
            self.options["labels"] = dict(labels)


class BudgetedOpenAI:
    """An ``openai.OpenAI`` whose chat completions are reserved and settled
    on an allowance server (see the module docs).

    ``wait_s``: queue up to that long for room (``reserve_or_wait``) rather
    than raise a rate denial at once. ``price_model``: name the call's model
    on the reservation so the server prices ``cost_micros`` (the model must
    be in its model table).
    """

    def __init__(
        self,
        client: openai.OpenAI,
        allowance: Client,
        *,
        tenant: str,
        scopes: Mapping[str, str] | None = None,
        count_tokens: TokenCounter | None = None,
        default_max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS,
        tranche_tokens: int = DEFAULT_TRANCHE_TOKENS,
        price_model: bool = True,
        ttl_ms: int | None = None,
        labels: Mapping[str, str] | None = None,
        wait_s: float | None = None,
    ) -> None:
        self.openai = client
        self.allowance = allowance
        self._options = _Options(
            tenant,
            scopes,
            count_tokens,
            default_max_output_tokens,
            tranche_tokens,
            price_model,
            ttl_ms,
            labels,
            wait_s,
        )
        self.chat = _Chat(self)

    def _reserve(self, plan: _Plan) -> Reservation:
        o = self._options
        if o.wait_s is not None:
            return self.allowance.reserve_or_wait(
                o.tenant, plan.amounts, timeout_s=o.wait_s, **plan.options
            )
        return self.allowance.reserve(o.tenant, plan.amounts, **plan.options)

    def _create(self, kwargs: dict[str, Any]) -> ChatCompletion | BudgetedStream:
        plan = _Plan(self._options, kwargs)
        reservation = self._reserve(plan)
        if plan.stream:
            try:
                stream = self.openai.chat.completions.create(**plan.kwargs)
            except BaseException as e:
                reservation.__exit__(type(e), e, e.__traceback__)
                raise
            return BudgetedStream(
                cast("openai.Stream[ChatCompletionChunk]", stream), reservation, plan, self._options
            )
        reply: ChatCompletion | None = None
        try:
            with reservation:
                reply = cast("ChatCompletion", self.openai.chat.completions.create(**plan.kwargs))
                if reply.usage is not None:
                    reservation.settle(_usage_of(reply.usage))
                # No usage reported: the guard settles at the estimate (and warns).
        except AllowanceError as e:
            if reply is None:
                raise
            # The call ran and was paid: its reply is never thrown away.
            # The settle (sent again by the guard) failed; retry it a while.
            error: AllowanceError | None = e
            for delay in SETTLE_RETRY_DELAYS_S:
                if not _worth_resending(reservation, error):
                    break
                time.sleep(delay)
                try:
                    _resend_settle(reservation)
                    error = None
                except AllowanceError as again:
                    error = again
            if error is not None:
                _warn_settle_failed(reservation, error)
        return reply


def _worth_resending(
    reservation: Reservation | AsyncReservation, error: AllowanceError | None
) -> bool:
    """True when the settle of a paid reply failed with an unknown outcome
    (a 503, a broken connection) and is worth sending again (settle is
    idempotent); any other error is final."""
    return isinstance(error, (StoreUnavailable, ConnectionFailed)) and (
        reservation._state.settle_attempt is not None
    )


def _resend_settle(reservation: Reservation) -> None:
    attempt = reservation._state.settle_attempt
    assert attempt is not None
    reservation.settle(attempt.usage, attempt.charges)


async def _aresend_settle(reservation: AsyncReservation) -> None:
    attempt = reservation._state.settle_attempt
    assert attempt is not None
    await reservation.settle(attempt.usage, attempt.charges)


def _warn_settle_failed(reservation: Reservation | AsyncReservation, error: AllowanceError) -> None:
    attempt = reservation._state.settle_attempt
    usage = attempt.usage if attempt is not None else reservation.held
    warnings.warn(
        f"reservation {reservation.id}: the call ran, but its settle failed ({error!r}); "
        f"the reply is returned, but the call is uncharged unless {usage} is recorded "
        "(its hold expires by TTL, recording nothing)",
        SettleFailedWarning,
        stacklevel=4,
    )


class _Chat:
    def __init__(self, owner: BudgetedOpenAI) -> None:
        self.completions = _Completions(owner)


class _Completions:
    def __init__(self, owner: BudgetedOpenAI) -> None:
        self._owner = owner

    @overload
    def create(self, *, stream: Literal[True], **kwargs: Any) -> BudgetedStream: ...

    @overload
    def create(self, *, stream: Literal[False] | None = None, **kwargs: Any) -> ChatCompletion: ...

    @overload
    def create(self, *, stream: bool, **kwargs: Any) -> ChatCompletion | BudgetedStream: ...

    def create(self, **kwargs: Any) -> ChatCompletion | BudgetedStream:
        """``openai.OpenAI().chat.completions.create``, reserved and settled:
        a ``ChatCompletion``, or a :class:`BudgetedStream` with ``stream=True``."""
        return self._owner._create(kwargs)


class BudgetedStream:
    """A streamed chat completion whose hold grows as tokens arrive.

    Iterate it as the SDK's stream. It settles when the stream ends (from
    the final usage chunk, else from the tokens seen); if you stop early or
    close it (even before reading it, or drop it unclosed: the finalizer
    settles it, with a ``ResourceWarning``; the provider already has the
    prompt), it settles the prompt as estimated plus the output that
    arrived; if the stream breaks with nothing arrived, it refunds. When a
    top-up is refused once the tokens seen exceed the hold, the stream ends
    cleanly after the chunk that went past it (its tokens arrived and are
    charged) and :attr:`cut` holds the denial. The hold never grows past
    the call's own bound; a call without one grows past
    ``default_max_output_tokens`` (only the estimate) until a top-up is
    refused. A call that asks for reasoning holds its whole bound from the
    start.
    """

    def __init__(
        self,
        stream: openai.Stream[ChatCompletionChunk],
        reservation: Reservation,
        plan: _Plan,
        options: _Options,
    ) -> None:
        self._stream = stream
        self.reservation = reservation
        self._plan = plan
        # Never past the request's own bound; without one, on past the
        # default (only the estimate) until a top-up is refused.
        self._meter: StreamMeter = reservation.meter(
            tranche_tokens=options.tranche_tokens,
            max_output_tokens=plan.output_bound if plan.bounded else None,
        )
        self.cut: Denied | None = None
        self._started = False
        self._chunks = self._run()

    def __iter__(self) -> Iterator[ChatCompletionChunk]:
        return self._chunks

    def __next__(self) -> ChatCompletionChunk:
        return next(self._chunks)

    def __enter__(self) -> BudgetedStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped unread and unclosed: the provider has the prompt, so it is
        # settled now rather than left to expire, charged nothing.
        if getattr(self, "_started", True):
            return
        # A finalizer must not raise: if this fails, the TTL is the backstop.
        with contextlib.suppress(Exception):
            self.close()
            warnings.warn(
                "a BudgetedStream was dropped unread and unclosed: its prompt was settled "
                "then; close it (or use `with`)",
                ResourceWarning,
                stacklevel=2,
            )

    def close(self) -> None:
        """Stops reading: settles the prompt and what arrived."""
        started, self._started = self._started, True
        self._chunks.close()
        if not started:
            # The generator never ran, so its guard never entered: settle here.
            try:
                with self.reservation:
                    self.reservation.settle(self._meter.usage())
            finally:
                self._stream.close()

    def _run(self) -> Generator[ChatCompletionChunk, None, None]:
        self._started = True
        usage: CompletionUsage | None = None
        try:
            with self.reservation:
                try:
                    for chunk in self._stream:
                        if chunk.usage is not None:
                            usage = chunk.usage
                        tokens = _delta_tokens(chunk)
                        if tokens:
                            try:
                                self._meter.add(tokens)
                            except Denied as denial:
                                self.cut = denial
                                yield chunk
                                break
                        if self._plan.hide_usage_chunk and not chunk.choices:
                            continue
                        yield chunk
                except GeneratorExit:
                    # The caller stopped reading; the call did not fail.
                    stopped = _usage_of(usage) if usage is not None else self._meter.usage()
                    self.reservation.settle(stopped)
                    raise
                final = _usage_of(usage) if usage is not None else self._meter.usage()
                self.reservation.settle(final)
        finally:
            self._stream.close()


class AsyncBudgetedOpenAI:
    """An ``openai.AsyncOpenAI`` whose chat completions are reserved and
    settled on an allowance server (see :class:`BudgetedOpenAI`)."""

    def __init__(
        self,
        client: openai.AsyncOpenAI,
        allowance: AsyncClient,
        *,
        tenant: str,
        scopes: Mapping[str, str] | None = None,
        count_tokens: TokenCounter | None = None,
        default_max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS,
        tranche_tokens: int = DEFAULT_TRANCHE_TOKENS,
        price_model: bool = True,
        ttl_ms: int | None = None,
        labels: Mapping[str, str] | None = None,
        wait_s: float | None = None,
    ) -> None:
        self.openai = client
        self.allowance = allowance
        self._options = _Options(
            tenant,
            scopes,
            count_tokens,
            default_max_output_tokens,
            tranche_tokens,
            price_model,
            ttl_ms,
            labels,
            wait_s,
        )
        self.chat = _AsyncChat(self)

    async def _reserve(self, plan: _Plan) -> AsyncReservation:
        o = self._options
        if o.wait_s is not None:
            return await self.allowance.reserve_or_wait(
                o.tenant, plan.amounts, timeout_s=o.wait_s, **plan.options
            )
        return await self.allowance.reserve(o.tenant, plan.amounts, **plan.options)

    async def _create(self, kwargs: dict[str, Any]) -> ChatCompletion | AsyncBudgetedStream:
        plan = _Plan(self._options, kwargs)
        reservation = await self._reserve(plan)
        if plan.stream:
            try:
                stream = await self.openai.chat.completions.create(**plan.kwargs)
            except BaseException as e:
                await reservation.__aexit__(type(e), e, e.__traceback__)
                raise
            return AsyncBudgetedStream(
                cast("openai.AsyncStream[ChatCompletionChunk]", stream),
                reservation,
                plan,
                self._options,
            )
        reply: ChatCompletion | None = None
        try:
            async with reservation:
                created = await self.openai.chat.completions.create(**plan.kwargs)
                reply = cast("ChatCompletion", created)
                if reply.usage is not None:
                    await reservation.settle(_usage_of(reply.usage))
        except AllowanceError as e:
            if reply is None:
                raise
            # The call ran and was paid: its reply is never thrown away.
            error: AllowanceError | None = e
            for delay in SETTLE_RETRY_DELAYS_S:
                if not _worth_resending(reservation, error):
                    break
                await asyncio.sleep(delay)
                try:
                    await _aresend_settle(reservation)
                    error = None
                except AllowanceError as again:
                    error = again
            if error is not None:
                _warn_settle_failed(reservation, error)
        return reply


class _AsyncChat:
    def __init__(self, owner: AsyncBudgetedOpenAI) -> None:
        self.completions = _AsyncCompletions(owner)


class _AsyncCompletions:
    def __init__(self, owner: AsyncBudgetedOpenAI) -> None:
        self._owner = owner

    @overload
    async def create(self, *, stream: Literal[True], **kwargs: Any) -> AsyncBudgetedStream: ...

    @overload
    async def create(
        self, *, stream: Literal[False] | None = None, **kwargs: Any
    ) -> ChatCompletion: ...

    @overload
    async def create(
        self, *, stream: bool, **kwargs: Any
    ) -> ChatCompletion | AsyncBudgetedStream: ...

    async def create(self, **kwargs: Any) -> ChatCompletion | AsyncBudgetedStream:
        """``openai.AsyncOpenAI().chat.completions.create``, reserved and
        settled: a ``ChatCompletion``, or an :class:`AsyncBudgetedStream`."""
        return await self._owner._create(kwargs)


class AsyncBudgetedStream:
    """An async streamed chat completion whose hold grows as tokens arrive
    (see :class:`BudgetedStream`)."""

    def __init__(
        self,
        stream: openai.AsyncStream[ChatCompletionChunk],
        reservation: AsyncReservation,
        plan: _Plan,
        options: _Options,
    ) -> None:
        self._stream = stream
        self.reservation = reservation
        self._plan = plan
        self._meter: AsyncStreamMeter = reservation.meter(
            tranche_tokens=options.tranche_tokens,
            max_output_tokens=plan.output_bound if plan.bounded else None,
        )
        self.cut: Denied | None = None
        self._started = False
        self._chunks = self._run()

    def __aiter__(self) -> AsyncIterator[ChatCompletionChunk]:
        return self._chunks

    async def __anext__(self) -> ChatCompletionChunk:
        return await self._chunks.__anext__()

    async def __aenter__(self) -> AsyncBudgetedStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # Dropped unread and unclosed: the provider has the prompt. A
        # finalizer cannot await, so the settle runs as a task of the client
        # (its ``aclose`` waits for it).
        if getattr(self, "_started", True):
            return
        # A finalizer must not raise: if this fails, the TTL is the backstop.
        with contextlib.suppress(Exception):
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                warnings.warn(
                    "an AsyncBudgetedStream was dropped unread and unclosed with no event loop "
                    "running: its hold expires unsettled; close it (or use `async with`)",
                    ResourceWarning,
                    stacklevel=2,
                )
                return
            self.reservation._client._in_background(self.aclose())
            warnings.warn(
                "an AsyncBudgetedStream was dropped unread and unclosed: its prompt is being "
                "settled; close it (or use `async with`)",
                ResourceWarning,
                stacklevel=2,
            )

    async def aclose(self) -> None:
        """Stops reading: settles the prompt and what arrived."""
        started, self._started = self._started, True
        await self._chunks.aclose()
        if not started:
            # The generator never ran, so its guard never entered: settle here.
            try:
                async with self.reservation:
                    await self.reservation.settle(self._meter.usage())
            finally:
                await self._stream.close()

    async def _run(self) -> AsyncGenerator[ChatCompletionChunk, None]:
        self._started = True
        usage: CompletionUsage | None = None
        try:
            async with self.reservation:
                try:
                    async for chunk in self._stream:
                        if chunk.usage is not None:
                            usage = chunk.usage
                        tokens = _delta_tokens(chunk)
                        if tokens:
                            try:
                                await self._meter.add(tokens)
                            except Denied as denial:
                                self.cut = denial
                                yield chunk
                                break
                        if self._plan.hide_usage_chunk and not chunk.choices:
                            continue
                        yield chunk
                except GeneratorExit:
                    # The caller stopped reading; the call did not fail.
                    stopped = _usage_of(usage) if usage is not None else self._meter.usage()
                    await self.reservation.settle(stopped)
                    raise
                final = _usage_of(usage) if usage is not None else self._meter.usage()
                await self.reservation.settle(final)
        finally:
            await self._stream.close()
