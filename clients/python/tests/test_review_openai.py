"""Review: the in-process `openai` wrapper at its edges, against the stub
upstream (the real OpenAI protocol) and a real allowance server."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Iterator
from typing import Any, cast

import httpx
import openai
import pytest
from client_harness import Stub, unique

from allowance import AsyncClient, Client, ReservationInfo
from allowance.openai import (
    AsyncBudgetedOpenAI,
    BudgetedOpenAI,
    estimate_chat_input_tokens,
)

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You summarise documents."},
    {"role": "user", "content": "Summarise the quarterly report in three bullet points."},
]


@pytest.fixture(scope="module")
def stub() -> Iterator[Stub]:
    s = Stub("--output-tokens", "40")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def upstream(stub: Stub) -> Iterator[openai.OpenAI]:
    httpx.post(f"{stub.base_url}/_stub/reset").raise_for_status()
    with openai.OpenAI(base_url=f"{stub.base_url}/v1", api_key="sk-stub", max_retries=0) as c:
        yield c


def stub_requests(stub: Stub) -> list[dict[str, Any]]:
    reply = httpx.get(f"{stub.base_url}/_stub/requests")
    reply.raise_for_status()
    return list(reply.json())


def output_cap(admin: Client, capacity: int) -> tuple[str, str]:
    task = unique("t")
    scope = f"tenant:acme/task:{task}"
    admin.set_scope(
        scope, limits=[{"dimension": "output_tokens", "capacity": capacity, "window": "total"}]
    )
    return task, scope


def settled_record(acme: Client, cursor: str | None, label: str) -> ReservationInfo | None:
    for rec in acme.usage(since=cursor).records:
        if rec.labels.get("review") == label and rec.reservation is not None:
            return acme.get(rec.reservation)
    return None


# A stream that is never read ------------------------------------------------------


def test_a_stream_closed_before_it_is_read_does_not_stay_held(
    stub: Stub, upstream: openai.OpenAI, acme: Client
) -> None:
    # The request went to the provider (it answered 200 and is streaming);
    # the caller closes the stream without reading it (an early return, a
    # `with` block that raised before the loop). The wrapper's generator
    # never started, so nothing settles or refunds: the hold blocks the
    # scope until its TTL and then expires — free.
    user = unique("u")
    ai = BudgetedOpenAI(upstream, acme, tenant="acme", scopes={"user": user})
    stream = ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True)
    assert len(stub_requests(stub)) == 1, "the call was sent"
    stream.close()
    status = acme.get(stream.reservation.id).status
    assert status != "held", "a stream closed unread left its hold (and the call) behind"


async def test_async_a_stream_closed_before_it_is_read_does_not_stay_held(
    stub: Stub, aacme: AsyncClient, acme: Client
) -> None:
    user = unique("u")
    async with openai.AsyncOpenAI(
        base_url=f"{stub.base_url}/v1", api_key="sk-stub", max_retries=0
    ) as upstream:
        ai = AsyncBudgetedOpenAI(upstream, aacme, tenant="acme", scopes={"user": user})
        stream = await ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True)
        await stream.aclose()
    status = acme.get(stream.reservation.id).status
    assert status != "held", "a stream closed unread left its hold (and the call) behind"


def test_a_stream_dropped_unread_and_unclosed_is_settled(
    stub: Stub, upstream: openai.OpenAI, acme: Client
) -> None:
    # Neither read nor closed, only dropped: the provider has the prompt, so
    # the finalizer settles it (an audit found it expired, charged nothing).
    user = unique("u")
    ai = BudgetedOpenAI(upstream, acme, tenant="acme", scopes={"user": user})
    stream = ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True)
    rid = stream.reservation.id
    assert len(stub_requests(stub)) == 1, "the call was sent"
    # The stream and its unstarted generator hold each other: the cycle
    # collector finalizes them.
    del stream
    with pytest.warns(ResourceWarning, match="dropped unread"):
        gc.collect()
    info = acme.get(rid)
    assert info.status == "settled", f"a dropped stream's call was {info.status}"
    assert info.charged is not None and info.charged["input_tokens"] > 0


async def test_async_a_stream_dropped_unread_and_unclosed_is_settled(
    stub: Stub, aacme: AsyncClient, acme: Client
) -> None:
    user = unique("u")
    async with openai.AsyncOpenAI(
        base_url=f"{stub.base_url}/v1", api_key="sk-stub", max_retries=0
    ) as upstream:
        ai = AsyncBudgetedOpenAI(upstream, aacme, tenant="acme", scopes={"user": user})
        stream = await ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True)
        rid = stream.reservation.id
        del stream
        with pytest.warns(ResourceWarning, match="dropped unread"):
            gc.collect()
        # The settle runs as a task of the client: let it finish.
        await asyncio.gather(*aacme._background)
    info = acme.get(rid)
    assert info.status == "settled", f"a dropped stream's call was {info.status}"


# A stream within its bound --------------------------------------------------------


def test_a_stream_within_its_bound_and_budget_is_not_cut(
    admin: Client, upstream: openai.OpenAI, acme: Client
) -> None:
    # 30 output tokens of budget, a call bounded at max_tokens=30: it can
    # never exceed its budget. Tranches of 8 top the hold up to 32 (past the
    # call's own bound), which is refused, and the stream is cut at the
    # 24th token of 30. The gateway never tops up past the bound.
    task, scope = output_cap(admin, 30)
    ai = BudgetedOpenAI(upstream, acme, tenant="acme", scopes={"task": task}, tranche_tokens=8)
    stream = ai.chat.completions.create(
        model="gpt-4o",
        messages=MESSAGES,
        stream=True,
        max_tokens=30,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    assert stream.cut is None, f"cut after {content} of 30 tokens: {stream.cut}"
    assert content == 30
    assert chunks[-1].usage is not None, "the stream was read to its usage chunk"
    lim = acme.status(scope).limit("output_tokens")
    assert (lim.used, lim.held) == (30, 0)


def test_a_stream_that_ends_at_its_max_tokens_is_not_cut(
    admin: Client, upstream: openai.OpenAI, acme: Client
) -> None:
    # The commonest stream: max_tokens below the tranche (1024 by default),
    # so the hold is the whole bound, and an answer that runs to max_tokens
    # (finish_reason "length"). At its last token the meter asks for another
    # 1024 tokens the call can never use; with less than that left in the
    # budget the ask is refused and a complete answer is reported cut, its
    # usage chunk never read.
    task, scope = output_cap(admin, 500)
    ai = BudgetedOpenAI(upstream, acme, tenant="acme", scopes={"task": task})
    stream = ai.chat.completions.create(
        model="gpt-4o",
        messages=MESSAGES,
        stream=True,
        max_tokens=10,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert stream.cut is None, f"a complete answer was reported cut: {stream.cut}"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    lim = acme.status(scope).limit("output_tokens")
    assert (lim.used, lim.held) == (10, 0)


async def test_async_a_stream_within_its_bound_and_budget_is_not_cut(
    admin: Client, stub: Stub, aacme: AsyncClient, acme: Client
) -> None:
    task, _ = output_cap(admin, 30)
    async with openai.AsyncOpenAI(
        base_url=f"{stub.base_url}/v1", api_key="sk-stub", max_retries=0
    ) as upstream:
        ai = AsyncBudgetedOpenAI(
            upstream, aacme, tenant="acme", scopes={"task": task}, tranche_tokens=8
        )
        stream = await ai.chat.completions.create(
            model="gpt-4o", messages=MESSAGES, stream=True, max_tokens=30
        )
        content = len([c async for c in stream if c.choices and c.choices[0].delta.content])
    assert stream.cut is None, f"cut after {content} of 30 tokens: {stream.cut}"
    assert content == 30


# What the SDK accepts, the wrapper must accept ----------------------------------


def test_messages_given_as_an_iterator_reach_the_provider(
    stub: Stub, upstream: openai.OpenAI, acme: Client
) -> None:
    # The SDK types `messages` as Iterable[...]. The wrapper reads it once to
    # estimate, then hands the SDK the exhausted iterator: the provider gets
    # an empty conversation (and the answer is billed against it).
    ai = BudgetedOpenAI(upstream, acme, tenant="acme", scopes={"user": unique("u")})
    with contextlib.suppress(openai.BadRequestError):
        ai.chat.completions.create(model="gpt-4o", messages=iter(MESSAGES), max_tokens=5)
    (sent,) = stub_requests(stub)
    assert sent["body"]["messages"] == MESSAGES, "the provider got another conversation"


def test_a_message_object_from_a_previous_reply_is_accepted(
    upstream: openai.OpenAI, acme: Client
) -> None:
    # The usual agent loop appends `reply.choices[0].message` (a pydantic
    # model) to the conversation; the SDK serialises it. The estimate calls
    # `.items()` on it and the wrapper raises AttributeError instead.
    ai = BudgetedOpenAI(
        upstream, acme, tenant="acme", scopes={"user": unique("u")}, labels={"review": "obj"}
    )
    first = ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=5)
    follow_up = [*MESSAGES, first.choices[0].message, {"role": "user", "content": "More."}]
    cursor = acme.usage().next_cursor
    reply = ai.chat.completions.create(
        model="gpt-4o",
        messages=follow_up,
        max_tokens=5,
    )
    assert reply.usage is not None
    info = settled_record(acme, cursor, "obj")
    assert info is not None and info.held["input_tokens"] > estimate_chat_input_tokens(MESSAGES)


def test_n_choices_hold_n_times_the_bound(upstream: openai.OpenAI, acme: Client) -> None:
    # `n=3` asks for three completions of up to max_tokens each, billed
    # together; holding one bound lets the call spend three times its hold.
    ai = BudgetedOpenAI(
        upstream, acme, tenant="acme", scopes={"user": unique("u")}, labels={"review": "n"}
    )
    cursor = acme.usage().next_cursor
    ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=10, n=3)
    info = settled_record(acme, cursor, "n")
    assert info is not None
    assert info.held["output_tokens"] >= 30, f"held {info.held['output_tokens']} for 3 × 10"


# Failures and usage ------------------------------------------------------------


def test_a_stream_refused_by_the_provider_is_refunded(
    stub: Stub, upstream: openai.OpenAI, acme: Client
) -> None:
    user = unique("u")
    httpx.post(f"{stub.base_url}/_stub/enqueue", json=[{"status": 500}]).raise_for_status()
    ai = BudgetedOpenAI(upstream, acme, tenant="acme", scopes={"user": user})
    with pytest.raises(openai.InternalServerError):
        ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True)
    st = acme.status(f"tenant:acme/user:{user}")
    assert (st.limit("tokens").used, st.limit("tokens").held, st.held_reservations) == (0, 0, 0)


def test_include_usage_false_is_respected_and_the_settle_is_exact(
    stub: Stub, upstream: openai.OpenAI, acme: Client
) -> None:
    user = unique("u")
    ai = BudgetedOpenAI(upstream, acme, tenant="acme", scopes={"user": user})
    plain = upstream.chat.completions.create(
        model="gpt-4o", messages=cast(Any, MESSAGES), max_tokens=7
    )
    assert plain.usage is not None
    stream = ai.chat.completions.create(
        model="gpt-4o",
        messages=MESSAGES,
        stream=True,
        max_tokens=7,
        stream_options={"include_usage": False},
    )
    chunks = list(stream)
    assert all(c.usage is None for c in chunks), "the caller said no usage chunk"
    info = acme.get(stream.reservation.id)
    assert info.charged is not None
    assert (info.charged["input_tokens"], info.charged["output_tokens"]) == (
        plain.usage.prompt_tokens,
        7,
    ), "settled from the provider's usage, not the estimate"


def test_the_estimate_is_never_zero_for_a_prompt() -> None:
    prompts: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": "x"}],
        [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
        [{"role": "tool", "tool_call_id": "c1", "content": "42"}],
    ]
    for messages in prompts:
        assert estimate_chat_input_tokens(messages) > 3, messages
