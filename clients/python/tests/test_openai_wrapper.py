"""The in-process wrapper around the official `openai` SDK, against the stub
upstream (real OpenAI protocol, SSE included) and a real allowance server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from client_harness import Stub, unique

from allowance import AsyncClient, BudgetExhausted, Client, Denied, UnexpectedResponse
from allowance.openai import (
    AsyncBudgetedOpenAI,
    BudgetedOpenAI,
    estimate_chat_input_tokens,
    estimate_stream_text_tokens,
    estimate_text_tokens,
)

MESSAGES = [
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
    # The SDK's own retries are off: each test scripts exactly one answer.
    with openai.OpenAI(base_url=f"{stub.base_url}/v1", api_key="sk-stub", max_retries=0) as c:
        yield c


def stub_requests(stub: Stub) -> list[dict[str, Any]]:
    reply = httpx.get(f"{stub.base_url}/_stub/requests")
    reply.raise_for_status()
    return list(reply.json())


def wrapper(upstream: openai.OpenAI, acme: Client, user: str, **kw: Any) -> BudgetedOpenAI:
    return BudgetedOpenAI(upstream, acme, tenant="acme", scopes={"user": user}, **kw)


def test_estimates_need_no_tokenizer() -> None:
    assert estimate_text_tokens("") == 0
    assert estimate_text_tokens("abcd") == 1 and estimate_text_tokens("abcde") == 2
    # 3 priming + per message 3 + role + content (+1 for a name).
    assert estimate_chat_input_tokens([{"role": "user", "content": "abcdefgh"}]) == 3 + 3 + 1 + 2
    named = [{"role": "user", "name": "bob", "content": "hi"}]
    assert estimate_chat_input_tokens(named) == 3 + 3 + 1 + 1 + 1 + 1
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert estimate_chat_input_tokens(image) == 3 + 3 + 1 + 765
    assert estimate_stream_text_tokens(" hello") == 1
    assert estimate_stream_text_tokens("x" * 40) == 10


def test_a_call_is_reserved_then_settled_from_the_real_usage(
    stub: Stub, upstream: openai.OpenAI, acme: Client
) -> None:
    user = unique("u")
    ai = wrapper(upstream, acme, user, labels={"app": "wrapper-test"})
    cursor = acme.usage().next_cursor
    reply = ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=25)
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 25
    (rec,) = [r for r in acme.usage(since=cursor).records if r.labels.get("app") == "wrapper-test"]
    assert rec.kind == "settled"
    assert rec.held["input_tokens"] == estimate_chat_input_tokens(MESSAGES)
    assert rec.held["output_tokens"] == 25, "the call's bound is held"
    assert rec.charged["input_tokens"] == reply.usage.prompt_tokens
    assert rec.charged["output_tokens"] == 25
    assert rec.model == "gpt-4o" and rec.charged["cost_micros"] > 0
    lim = acme.status(f"tenant:acme/user:{user}").limit("tokens")
    assert (lim.used, lim.held) == (reply.usage.total_tokens, 0)
    assert len(stub_requests(stub)) == 1


def test_without_a_bound_the_default_is_held(upstream: openai.OpenAI, acme: Client) -> None:
    ai = wrapper(upstream, acme, unique("u"), default_max_output_tokens=77, labels={"t": "dflt"})
    cursor = acme.usage().next_cursor
    ai.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    (rec,) = [r for r in acme.usage(since=cursor).records if r.labels.get("t") == "dflt"]
    assert rec.held["output_tokens"] == 77 and rec.charged["output_tokens"] == 40


def test_a_failed_call_is_refunded(stub: Stub, upstream: openai.OpenAI, acme: Client) -> None:
    user = unique("u")
    httpx.post(f"{stub.base_url}/_stub/enqueue", json=[{"status": 500}]).raise_for_status()
    with pytest.raises(openai.InternalServerError):
        wrapper(upstream, acme, user).chat.completions.create(model="gpt-4o", messages=MESSAGES)
    st = acme.status(f"tenant:acme/user:{user}")
    assert (st.limit("tokens").used, st.limit("tokens").held, st.held_reservations) == (0, 0, 0)


def test_a_denial_sends_nothing_upstream(
    stub: Stub, admin: Client, upstream: openai.OpenAI, acme: Client
) -> None:
    task = unique("t")
    admin.set_scope(
        f"tenant:acme/task:{task}",
        limits=[{"dimension": "tokens", "capacity": 100, "window": "total"}],
    )
    ai = BudgetedOpenAI(upstream, acme, tenant="acme", scopes={"task": task})
    ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=30)
    with pytest.raises(BudgetExhausted) as e:
        ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=30)
    assert e.value.scope == f"tenant:acme/task:{task}"
    assert len(stub_requests(stub)) == 1, "the denied call never reached the provider"


def test_a_stream_tops_up_and_settles_from_its_usage_chunk(
    stub: Stub, upstream: openai.OpenAI, acme: Client
) -> None:
    user = unique("u")
    ai = wrapper(upstream, acme, user, tranche_tokens=8, labels={"t": "stream"})
    cursor = acme.usage().next_cursor
    stream = ai.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True, max_tokens=30
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.count("hello") == 30
    assert all(c.choices for c in chunks), "the usage chunk the caller did not ask for is hidden"
    (sent,) = stub_requests(stub)
    assert sent["body"]["stream_options"] == {"include_usage": True}
    (rec,) = [r for r in acme.usage(since=cursor).records if r.labels.get("t") == "stream"]
    assert rec.kind == "settled"
    # Tranches of 8 ahead of 30 tokens, never past the call's bound: the
    # hold reached 30 (8, 16, 24, then the 6 left to max_tokens).
    assert rec.held["output_tokens"] == 30
    assert rec.charged["output_tokens"] == 30
    assert stream.reservation.status == "settled"


def test_a_stream_that_asked_for_usage_sees_it(upstream: openai.OpenAI, acme: Client) -> None:
    ai = wrapper(upstream, acme, unique("u"))
    stream = ai.chat.completions.create(
        model="gpt-4o",
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=5,
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5


def test_a_stream_is_cut_when_a_top_up_is_refused(
    admin: Client, upstream: openai.OpenAI, acme: Client
) -> None:
    task = unique("t")
    scope = f"tenant:acme/task:{task}"
    admin.set_scope(
        scope, limits=[{"dimension": "output_tokens", "capacity": 20, "window": "total"}]
    )
    ai = BudgetedOpenAI(upstream, acme, tenant="acme", scopes={"task": task}, tranche_tokens=10)
    stream = ai.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True, max_tokens=40
    )
    chunks = list(stream)
    assert stream.cut is not None and stream.cut.scope == scope
    # Holds of 10, then 20. The top-up asked at the 20th token is refused,
    # but the hold still covers what arrived: no cut. At the 21st the hold
    # is exceeded and the refusal cuts; that chunk is still yielded (its
    # token arrived and is charged), then the stream stops.
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 21
    lim = acme.status(scope).limit("output_tokens")
    assert (lim.used, lim.held) == (21, 0), "what arrived is charged, no more"


def test_a_broken_stream_settles_what_arrived(
    stub: Stub, upstream: openai.OpenAI, acme: Client
) -> None:
    user = unique("u")
    httpx.post(f"{stub.base_url}/_stub/enqueue", json=[{"cut_after_tokens": 5}]).raise_for_status()
    ai = wrapper(upstream, acme, user)
    stream = ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True)
    seen = 0
    with pytest.raises(openai.APIConnectionError):
        for chunk in stream:
            seen += 1 if chunk.choices and chunk.choices[0].delta.content else 0
    assert seen == 5
    info = acme.get(stream.reservation.id)
    assert info.status == "settled", "the provider counted those tokens: never free"
    assert info.charged is not None and info.charged["output_tokens"] == 5


def test_stopping_early_settles_what_arrived(upstream: openai.OpenAI, acme: Client) -> None:
    ai = wrapper(upstream, acme, unique("u"))
    with ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True) as stream:
        for i, _ in enumerate(stream):
            if i == 3:
                break
    info = acme.get(stream.reservation.id)
    assert info.status == "settled" and info.charged is not None
    assert 1 <= info.charged["output_tokens"] <= 4


def test_a_stream_closed_unread_settles_its_prompt_once(
    upstream: openai.OpenAI, acme: Client
) -> None:
    # The provider already has the prompt: it is charged as estimated, with
    # no output; closing again changes nothing.
    user = unique("u")
    ai = wrapper(upstream, acme, user, labels={"t": "unread"})
    cursor = acme.usage().next_cursor
    stream = ai.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True, max_tokens=20
    )
    stream.close()
    stream.close()
    assert list(stream) == []
    info = acme.get(stream.reservation.id)
    assert info.status == "settled" and info.charged is not None
    assert info.charged["input_tokens"] == estimate_chat_input_tokens(MESSAGES)
    assert info.charged.get("output_tokens", 0) == 0
    records = [r for r in acme.usage(since=cursor).records if r.labels.get("t") == "unread"]
    assert [r.kind for r in records] == ["settled"]


def test_a_streamed_call_for_n_choices_holds_n_times_its_bound(
    upstream: openai.OpenAI, acme: Client
) -> None:
    # Tranches of 8, max_tokens=5, n=2: the first tranche (8) is within
    # 2 × 5, and the hold never grows past 10.
    ai = wrapper(upstream, acme, unique("u"), tranche_tokens=8)
    stream = ai.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True, max_tokens=5, n=2
    )
    assert stream.reservation.held["output_tokens"] == 8
    list(stream)
    assert stream.cut is None
    assert stream.reservation.held["output_tokens"] <= 10
    assert stream.reservation.status == "settled"


async def test_async_wrapper(stub: Stub, aacme: AsyncClient, acme: Client) -> None:
    user = unique("u")
    async with (
        httpx.AsyncClient(base_url=stub.base_url) as control,
        openai.AsyncOpenAI(
            base_url=f"{stub.base_url}/v1", api_key="sk-stub", max_retries=0
        ) as upstream,
    ):
        (await control.post("/_stub/reset")).raise_for_status()
        ai = AsyncBudgetedOpenAI(
            upstream, aacme, tenant="acme", scopes={"user": user}, tranche_tokens=16
        )
        reply = await ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=12)
        assert reply.usage is not None
        assert reply.usage.completion_tokens == 12
        stream = await ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True)
        texts = [c.choices[0].delta.content async for c in stream if c.choices]
        assert sum(1 for t in texts if t) == 40
        assert stream.reservation.held["output_tokens"] == 48
        (await control.post("/_stub/enqueue", json=[{"status": 500}])).raise_for_status()
        with pytest.raises(openai.InternalServerError):
            await ai.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    lim = acme.status(f"tenant:acme/user:{user}").limit("tokens")
    assert lim.held == 0
    assert lim.used == reply.usage.total_tokens + 40 + reply.usage.prompt_tokens


def behave(stub: Stub, **behavior: int) -> None:
    """Sets the stub's behaviour until the next test's reset."""
    httpx.post(f"{stub.base_url}/_stub/behavior", json=behavior).raise_for_status()


def limit_output(admin: Client, capacity: int) -> tuple[str, str]:
    """A fresh task with ``capacity`` output tokens in all: (its id, its scope)."""
    task = unique("t")
    scope = f"tenant:acme/task:{task}"
    admin.set_scope(
        scope, limits=[{"dimension": "output_tokens", "capacity": capacity, "window": "total"}]
    )
    return task, scope


# --- output the request does not bound -----------------------------------------


def test_a_stream_without_a_bound_goes_past_the_default_until_a_top_up_is_refused(
    stub: Stub, admin: Client, upstream: openai.OpenAI, acme: Client
) -> None:
    # default_max_output_tokens is only the estimate of a call that names no
    # bound: nothing tells the provider to stop there (it answers 40). The
    # stream tops up past it, tranche by tranche, and is cut when the budget
    # refuses, never spending past the budget.
    task, scope = limit_output(admin, 20)
    ai = BudgetedOpenAI(
        upstream,
        acme,
        tenant="acme",
        scopes={"task": task},
        default_max_output_tokens=10,
        tranche_tokens=5,
    )
    stream = ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True)
    chunks = list(stream)
    assert stream.cut is not None and stream.cut.scope == scope
    # Holds of 5, 10 (the default), 15, 20; the top-up asked past 20 is
    # refused and the 21st token cuts.
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 21
    lim = acme.status(scope).limit("output_tokens")
    assert (lim.used, lim.held) == (21, 0), "never past the budget"
    (sent,) = stub_requests(stub)
    assert "max_tokens" not in sent["body"] and "max_completion_tokens" not in sent["body"]


def test_a_whole_call_without_a_bound_is_sent_as_written_and_settled_as_reported(
    stub: Stub, upstream: openai.OpenAI, acme: Client
) -> None:
    ai = wrapper(upstream, acme, unique("u"), default_max_output_tokens=10, labels={"t": "nob"})
    cursor = acme.usage().next_cursor
    reply = ai.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert reply.usage is not None and reply.usage.completion_tokens == 40
    (rec,) = [r for r in acme.usage(since=cursor).records if r.labels.get("t") == "nob"]
    assert rec.held["output_tokens"] == 10, "the default is the estimate held"
    assert rec.charged["output_tokens"] == 40, "what the provider reports is settled"
    (sent,) = stub_requests(stub)
    assert "max_tokens" not in sent["body"] and "max_completion_tokens" not in sent["body"]


# --- reasoning -----------------------------------------------------------------


def test_a_reasoning_stream_is_refused_up_front_as_the_whole_call_is(
    stub: Stub, admin: Client, upstream: openai.OpenAI, acme: Client
) -> None:
    # Reasoning is billed as output but never streamed: a stream would never
    # top up while the model thinks (2 tokens of text, 30 of reasoning here).
    # It holds its whole bound up front, so the budget refuses it before
    # anything is sent, as it refuses the whole call.
    behave(stub, output_tokens=2, reasoning_tokens=30)
    task, scope = limit_output(admin, 20)
    ai = BudgetedOpenAI(upstream, acme, tenant="acme", scopes={"task": task}, tranche_tokens=8)
    call: dict[str, Any] = {
        "model": "gpt-4o",
        "messages": MESSAGES,
        "max_tokens": 40,
        "reasoning_effort": "high",
    }
    with pytest.raises(Denied) as whole:
        ai.chat.completions.create(**call)
    with pytest.raises(Denied) as streamed:
        list(ai.chat.completions.create(**call, stream=True))
    assert type(streamed.value) is type(whole.value)
    assert (streamed.value.scope, streamed.value.dimension) == (scope, "output_tokens")
    assert stub_requests(stub) == [], "nothing was sent upstream"
    lim = acme.status(scope).limit("output_tokens")
    assert (lim.used, lim.held) == (0, 0)


def test_a_reasoning_stream_holds_its_bound_and_settles_the_reasoning(
    stub: Stub, upstream: openai.OpenAI, acme: Client
) -> None:
    behave(stub, output_tokens=2, reasoning_tokens=30)
    ai = wrapper(upstream, acme, unique("u"), tranche_tokens=8)
    stream = ai.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True, max_tokens=40, reasoning_effort="low"
    )
    assert stream.reservation.held["output_tokens"] == 40, "the whole bound, up front"
    chunks = list(stream)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 2
    info = acme.get(stream.reservation.id)
    assert info.status == "settled" and info.charged is not None
    assert info.charged["output_tokens"] == 32, "the reasoning is charged"
    # Turned off, it is an ordinary stream: one tranche.
    off = ai.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True, max_tokens=40, reasoning_effort="none"
    )
    assert off.reservation.held["output_tokens"] == 8
    off.close()


def test_a_reasoning_stream_without_a_bound_holds_the_default_then_tops_up(
    stub: Stub, upstream: openai.OpenAI, acme: Client
) -> None:
    behave(stub, output_tokens=30, reasoning_tokens=5)
    ai = wrapper(upstream, acme, unique("u"), tranche_tokens=8, default_max_output_tokens=12)
    stream = ai.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True, reasoning_effort="medium"
    )
    assert stream.reservation.held["output_tokens"] == 12
    list(stream)
    assert stream.cut is None
    # Past the default (only the estimate), tranche by tranche: 12, 20, 28, 36.
    assert stream.reservation.held["output_tokens"] == 36
    info = acme.get(stream.reservation.id)
    assert info.charged is not None and info.charged["output_tokens"] == 35


async def test_async_streams_without_a_bound_or_with_reasoning(
    stub: Stub, admin: Client, aacme: AsyncClient, acme: Client
) -> None:
    task, scope = limit_output(admin, 20)
    async with (
        httpx.AsyncClient(base_url=stub.base_url) as control,
        openai.AsyncOpenAI(
            base_url=f"{stub.base_url}/v1", api_key="sk-stub", max_retries=0
        ) as upstream,
    ):
        (await control.post("/_stub/reset")).raise_for_status()
        ai = AsyncBudgetedOpenAI(
            upstream,
            aacme,
            tenant="acme",
            scopes={"task": task},
            default_max_output_tokens=10,
            tranche_tokens=5,
        )
        stream = await ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True)
        texts = [c.choices[0].delta.content async for c in stream if c.choices]
        assert stream.cut is not None and stream.cut.scope == scope
        assert sum(1 for t in texts if t) == 21
        lim = acme.status(scope).limit("output_tokens")
        assert (lim.used, lim.held) == (21, 0)
        # A fresh budget of 20: a reasoning stream bound to 40 is refused up front.
        (await control.post("/_stub/reset")).raise_for_status()
        behave(stub, output_tokens=2, reasoning_tokens=30)
        task, scope = limit_output(admin, 20)
        ai = AsyncBudgetedOpenAI(
            upstream, aacme, tenant="acme", scopes={"task": task}, tranche_tokens=8
        )
        call: dict[str, Any] = {"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 40}
        with pytest.raises(Denied) as refused:
            await ai.chat.completions.create(**call, reasoning_effort="high", stream=True)
        assert refused.value.scope == scope
        assert stub_requests(stub) == [], "nothing was sent upstream"


def test_an_answer_that_is_not_allowance_is_an_unexpected_response(stub: Stub) -> None:
    # Pointed at the wrong server (here the stub, speaking OpenAI's shapes).
    with Client(stub.base_url, "t") as wrong, pytest.raises(UnexpectedResponse) as e:
        wrong.reserve("acme", {"tokens": 1})
    err = e.value
    assert err.status_code == 404
    assert err.type == "invalid_request_error", "the foreign type is kept"
    assert "Invalid URL" in err.message
