"""The gateway with the official OpenAI SDK as its client: what the SDK sees
(answers, errors, retries) and what the ledger settled, for chat completions
and responses, whole and streamed."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from harness import (
    GATEWAY_MAX_RETRIES,
    SMALL_BOUND_MAX_OUTPUT,
    SMALL_BOUND_MODEL,
    TENANT,
    TRANCHE_TOKENS,
    TRANSPORT_ERRORS,
    UPSTREAM,
    USER,
    Json,
    Stack,
    Task,
    as_whole,
    fixture,
    gaps_ms,
    price_micros,
    wait_for,
)

MODEL = "gpt-4o"
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello a few times."}]


Sdk = Callable[..., openai.OpenAI]


@pytest.fixture
def sdk(stack: Stack, task: Task) -> Iterator[Sdk]:
    """Makes `openai.OpenAI` clients on the gateway, in the test's task scope
    (`sdk(max_retries=0)`), and closes them after the test."""
    made: list[openai.OpenAI] = []

    def make(max_retries: int = 2, api_key: str | None = None) -> openai.OpenAI:
        client = openai.OpenAI(
            base_url=f"{stack.gateway_url}/v1",
            api_key=api_key or stack.key,
            max_retries=max_retries,
            timeout=20.0,
            default_headers=task.headers,
        )
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def content_of(chunk: ChatCompletionChunk) -> str:
    return "".join(c.delta.content or "" for c in chunk.choices)


# --- success and exact settlement -------------------------------------------


def test_chat_settles_exactly_the_sdks_usage(stack: Stack, task: Task, sdk: Sdk) -> None:
    stack.stub.behave(output_tokens=23)
    answer = sdk().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=50)
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 23
    record = task.only_settled()
    assert record["scopes"] == [f"tenant:{TENANT}", f"tenant:{TENANT}/user:{USER}", task.scope]
    assert record["model"] == MODEL
    assert record["held"]["input_tokens"] == answer.usage.prompt_tokens
    assert record["held"]["output_tokens"] == 50  # the call's bound, whole
    charged = record["charged"]
    assert charged["input_tokens"] == answer.usage.prompt_tokens
    assert charged["output_tokens"] == answer.usage.completion_tokens
    assert charged["tokens"] == answer.usage.total_tokens
    assert charged["requests"] == 1
    assert charged["cost_micros"] == price_micros(
        MODEL, answer.usage.prompt_tokens, answer.usage.completion_tokens
    )
    used = {limit["dimension"]: limit["used"] for limit in stack.ledger.scope(task.scope)["limits"]}
    assert used["tokens"] == answer.usage.total_tokens
    task.assert_nothing_held()


def test_responses_settles_exactly_the_sdks_usage(stack: Stack, task: Task, sdk: Sdk) -> None:
    stack.stub.behave(output_tokens=31)
    answer = sdk().responses.create(
        model=MODEL, instructions="Be brief.", input="Say hello.", max_output_tokens=64
    )
    assert answer.usage is not None
    assert answer.usage.output_tokens == 31
    record = task.only_settled()
    assert record["held"]["input_tokens"] == answer.usage.input_tokens
    assert record["held"]["output_tokens"] == 64
    assert record["charged"]["input_tokens"] == answer.usage.input_tokens
    assert record["charged"]["output_tokens"] == answer.usage.output_tokens
    assert record["charged"]["cost_micros"] == price_micros(
        MODEL, answer.usage.input_tokens, answer.usage.output_tokens
    )
    task.assert_nothing_held()


GO_DURATION = re.compile(r"^(\d+h)?(\d+m)?(\d+(\.\d+)?s|\d+ms)$")


def test_success_carries_openai_rate_limit_headers(stack: Stack, task: Task, sdk: Sdk) -> None:
    stack.ledger.set_limits(
        task.scope,
        [{"dimension": "requests", "capacity": 5, "window": "bucket", "period_ms": 60_000}],
    )
    client = sdk()
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=10
    )
    assert raw.parse().choices[0].message.content
    # The task's bucket is the only requests limit: one used, one held.
    assert raw.headers["x-ratelimit-limit-requests"] == "5"
    assert raw.headers["x-ratelimit-remaining-requests"] == "3"
    assert GO_DURATION.match(raw.headers["x-ratelimit-reset-requests"])
    limit = int(raw.headers["x-ratelimit-limit-tokens"])
    assert 0 <= int(raw.headers["x-ratelimit-remaining-tokens"]) <= limit
    assert "x-should-retry" not in raw.headers
    assert "anthropic-ratelimit-requests-limit" not in raw.headers
    task.wait_records(2)


def test_embeddings_settle_the_input_alone(stack: Stack, task: Task, sdk: Sdk) -> None:
    answer = sdk().embeddings.create(
        model="text-embedding-3-small", input=["budget one", "budget two, longer"]
    )
    assert len(answer.data) == 2
    record = task.only_settled()
    assert record["held"]["input_tokens"] == answer.usage.prompt_tokens > 0
    assert record["charged"]["input_tokens"] == answer.usage.prompt_tokens
    assert record["charged"].get("output_tokens", 0) == 0


def test_unknown_key_is_an_authentication_error(stack: Stack, task: Task, sdk: Sdk) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        sdk(api_key="sk-not-a-gateway-key").chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=5
        )
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    assert stack.stub.model_requests() == []
    assert task.records() == []


# --- streams ------------------------------------------------------------------


def test_stream_without_include_usage_hides_the_injected_usage_chunk(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    stack.stub.behave(output_tokens=17)
    chunks = list(sdk().chat.completions.create(model=MODEL, messages=HELLO, stream=True))
    assert chunks, "the stream was empty"
    assert all(c.usage is None for c in chunks), [c.usage for c in chunks if c.usage]
    assert all(c.choices for c in chunks), "a usage-only chunk (choices: []) leaked"
    texts = [content_of(c) for c in chunks if content_of(c)]
    assert len(texts) == 17
    # The gateway asked the upstream for usage itself, to settle from it.
    (sent,) = stack.stub.model_requests()
    assert sent["body"]["stream_options"] == {"include_usage": True}
    record = task.only_settled()
    assert record["charged"]["output_tokens"] == 17
    assert record["charged"]["input_tokens"] == record["held"]["input_tokens"]
    # Held a tranche at a time, never the model's whole bound.
    assert record["held"]["output_tokens"] % TRANCHE_TOKENS == 0
    assert 17 <= record["held"]["output_tokens"] < 17 + 2 * TRANCHE_TOKENS
    task.assert_nothing_held()


def test_stream_with_include_usage_passes_the_usage_chunk(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    stack.stub.behave(output_tokens=19)
    chunks = list(
        sdk().chat.completions.create(
            model=MODEL,
            messages=HELLO,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1
    (last,) = with_usage
    assert last is chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 19
    record = task.only_settled()
    assert record["held"]["input_tokens"] == last.usage.prompt_tokens
    assert record["charged"]["input_tokens"] == last.usage.prompt_tokens
    assert record["charged"]["output_tokens"] == last.usage.completion_tokens
    assert record["charged"]["cost_micros"] == price_micros(
        MODEL, last.usage.prompt_tokens, last.usage.completion_tokens
    )
    task.assert_nothing_held()


def test_responses_stream_settles_the_completed_usage(stack: Stack, task: Task, sdk: Sdk) -> None:
    stack.stub.behave(output_tokens=21)
    events = list(sdk().responses.create(model=MODEL, input="Say hello.", stream=True))
    completed = [e for e in events if e.type == "response.completed"]
    assert len(completed) == 1
    usage = completed[0].response.usage
    assert usage is not None
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 21 == usage.output_tokens
    record = task.only_settled()
    assert record["held"]["input_tokens"] == usage.input_tokens
    assert record["charged"]["input_tokens"] == usage.input_tokens
    assert record["charged"]["output_tokens"] == usage.output_tokens
    task.assert_nothing_held()


def leave_room_for_output(stack: Stack, task: Task, output_tokens: int) -> None:
    """The task may produce `output_tokens` more, then its budget is spent."""
    stack.ledger.set_limits(
        task.scope, [{"dimension": "output_tokens", "capacity": 1000, "window": "total"}]
    )
    stack.ledger.adjust(task.scope, "output_tokens", -(1000 - output_tokens))


def test_stream_cut_by_a_refused_top_up_raises_mid_iteration(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    room = 2 * TRANCHE_TOKENS
    leave_room_for_output(stack, task, room)
    stack.stub.behave(output_tokens=200)
    cuts_before = stack.ledger.metric("allowance_gateway_streams_cut_total", reason="budget")
    stream = sdk().chat.completions.create(model=MODEL, messages=HELLO, stream=True)
    received: list[str] = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            received.append(content_of(chunk))
    texts = [t for t in received if t]
    assert 0 < len(texts) <= room, "the cut came before any output, or after the budget"
    assert not isinstance(caught.value, openai.APIStatusError)  # the answer was a 200
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["code"] == "budget_exhausted"
    assert body["type"] == "insufficient_quota"
    assert body["allowance"]["scope"] == task.scope
    assert body["allowance"]["dimension"] == "output_tokens"
    record = task.only_settled()
    # What was generated, as the client saw it (one token per delta).
    assert record["charged"]["output_tokens"] == len(texts)
    assert record["charged"]["input_tokens"] == record["held"]["input_tokens"]
    task.assert_nothing_held()
    assert (
        stack.ledger.metric("allowance_gateway_streams_cut_total", reason="budget")
        == cuts_before + 1
    )


def test_responses_stream_cut_ends_with_an_error_event(stack: Stack, task: Task, sdk: Sdk) -> None:
    room = 2 * TRANCHE_TOKENS
    leave_room_for_output(stack, task, room)
    stack.stub.behave(output_tokens=200)
    events = list(sdk().responses.create(model=MODEL, input="Say hello.", stream=True))
    # The Responses API reports a failed stream as an `error` event (the SDK
    # yields it rather than raising): it must be the last one.
    last = events[-1]
    assert last.type == "error"
    assert last.code == "budget_exhausted"
    assert not [e for e in events if e.type == "response.completed"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert 0 < len(deltas) <= room
    record = task.only_settled()
    assert record["charged"]["output_tokens"] == len(deltas)
    task.assert_nothing_held()


def test_client_disconnect_mid_stream_settles_what_was_generated(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    stack.stub.behave(output_tokens=400, token_delay_ms=25)
    gone_before = stack.ledger.metric("allowance_gateway_streams_cut_total", reason="client_gone")
    stream = sdk().chat.completions.create(model=MODEL, messages=HELLO, stream=True)
    read = 0
    for chunk in stream:
        if content_of(chunk):
            read += 1
        if read == 6:
            break
    stream.close()
    record = task.only_settled()
    charged = record["charged"]["output_tokens"]
    # The client read 6; a few more may have been on the wire when it left.
    assert read <= charged <= read + 8, charged
    assert record["charged"]["input_tokens"] == record["held"]["input_tokens"]
    task.assert_nothing_held()
    # The gateway hung up on the upstream too (it stops generating).
    wait_for(
        lambda: True if stack.stub.stats()["in_flight"] == 0 else None,
        "the stub to see the upstream connection closed",
    )
    assert (
        stack.ledger.metric("allowance_gateway_streams_cut_total", reason="client_gone")
        == gone_before + 1
    )


# --- upstream failures --------------------------------------------------------


def test_upstream_500_is_refunded_and_not_retried_by_the_sdk(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    attempts = 1 + GATEWAY_MAX_RETRIES
    stack.stub.enqueue(*[{"status": 500} for _ in range(attempts)])
    errors_before = stack.ledger.calls("chat_completions", "upstream_error")
    client = sdk(max_retries=2)
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20)
    assert caught.value.status_code == 500
    assert caught.value.response.headers["x-should-retry"] == "false"
    # The gateway retried; the SDK (which would have retried twice more) did not.
    assert len(stack.stub.model_requests()) == attempts
    assert stack.ledger.calls("chat_completions", "upstream_error") == errors_before + 1
    (record,) = task.wait_records(1)
    assert record["kind"] == "refunded"
    used = {limit["dimension"]: limit["used"] for limit in stack.ledger.scope(task.scope)["limits"]}
    assert used["tokens"] == 0
    # Every attempt reached the provider, and counts on its shared scope.
    upstream = task.attempts()
    assert [a["kind"] for a in upstream] == ["settled"] * attempts
    assert all(a["charged"]["requests"] == 1 for a in upstream)
    task.assert_nothing_held()


@pytest.mark.parametrize(
    ("header", "value", "wait_ms"),
    [("retry-after", "1", 1000), ("retry-after-ms", "700", 700)],
)
def test_upstream_429_is_retried_after_the_stated_time(
    stack: Stack, task: Task, sdk: Sdk, header: str, value: str, wait_ms: int
) -> None:
    stack.stub.enqueue({"status": 429, "headers": {header: value}})
    stack.stub.behave(output_tokens=12)
    raw = sdk().chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=20
    )
    answer = raw.parse()
    assert answer.usage is not None
    assert raw.headers["x-should-retry"] == "false"
    sent = stack.stub.model_requests()
    assert len(sent) == 2
    (gap,) = gaps_ms(sent)
    assert wait_ms <= gap < wait_ms + 600, gap
    record = task.only_settled()
    assert record["charged"]["output_tokens"] == answer.usage.completion_tokens == 12
    assert [a["kind"] for a in task.attempts()] == ["settled", "settled"]
    task.assert_nothing_held()


def test_upstream_break_mid_stream_is_an_error_for_the_sdk(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    # Straight from the provider, a stream whose connection drops makes the
    # SDK raise (incomplete chunked read); through the gateway it must too,
    # or the client takes a truncated answer for a whole one.
    stack.stub.enqueue({"cut_after_tokens": 5})
    stream = sdk(max_retries=0).chat.completions.create(model=MODEL, messages=HELLO, stream=True)
    texts: list[str] = []
    with pytest.raises((openai.APIError, *TRANSPORT_ERRORS)):
        for chunk in stream:
            if content_of(chunk):
                texts.append(content_of(chunk))
    assert len(texts) == 5
    record = task.only_settled()
    assert record["charged"]["output_tokens"] == 5
    task.assert_nothing_held()


# --- budget denials -----------------------------------------------------------


def one_request_per(stack: Stack, task: Task, period_ms: int) -> None:
    stack.ledger.set_limits(
        task.scope,
        [{"dimension": "requests", "capacity": 1, "window": "bucket", "period_ms": period_ms}],
    )


def test_rate_limit_denial_is_an_sdk_rate_limit_error(stack: Stack, task: Task, sdk: Sdk) -> None:
    one_request_per(stack, task, 60_000)
    client = sdk(max_retries=0)
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5)
    e = caught.value
    assert e.status_code == 429
    retry_after_ms = int(e.response.headers["retry-after-ms"])
    assert 0 < retry_after_ms <= 60_000
    assert int(e.response.headers["retry-after"]) == math.ceil(retry_after_ms / 1000)
    assert e.response.headers["x-budget-scope"] == task.scope
    assert e.code == "rate_limited"
    assert e.type == "rate_limit_exceeded"
    body = e.body
    assert isinstance(body, dict)
    assert body["allowance"]["scope"] == task.scope
    assert body["allowance"]["dimension"] == "requests"
    assert body["allowance"]["retry_after_ms"] == retry_after_ms
    assert len(stack.stub.model_requests()) == 1  # the denied call went nowhere
    task.only_settled()


def test_rate_limit_denial_is_retried_by_the_sdk_after_retry_after(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    period_ms = 2000
    one_request_per(stack, task, period_ms)
    client = sdk(max_retries=2)
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5)
    denied_before = stack.ledger.calls("chat_completions", "denied")
    answer = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5)
    assert answer.choices
    # Exactly one 429: the SDK waited as long as it was told, not less
    # (its own backoff without the header would be 0.5 s, then 1 s).
    assert stack.ledger.calls("chat_completions", "denied") == denied_before + 1
    sent = stack.stub.model_requests()
    assert len(sent) == 2
    (gap,) = gaps_ms(sent)
    assert period_ms - 100 <= gap < period_ms + 1000, gap
    assert len(task.wait_records(2)) == 2


def test_budget_exhausted_is_a_402_the_sdk_does_not_retry(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    stack.ledger.set_limits(
        task.scope, [{"dimension": "tokens", "capacity": 1000, "window": "total"}]
    )
    stack.ledger.adjust(task.scope, "tokens", -1000)
    denied_before = stack.ledger.calls("chat_completions", "denied")
    client = sdk(max_retries=2)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5)
    e = caught.value
    assert e.status_code == 402
    assert not isinstance(e, openai.RateLimitError)
    assert e.code == "budget_exhausted"
    assert e.type == "insufficient_quota"
    body = e.body
    assert isinstance(body, dict)
    assert body["allowance"]["scope"] == task.scope
    assert body["allowance"]["dimension"] == "tokens"
    assert body["allowance"]["retry_after_ms"] is None
    assert "retry-after" not in e.response.headers
    # One call reached the gateway: the SDK did not retry the 402.
    assert stack.ledger.calls("chat_completions", "denied") == denied_before + 1
    assert stack.stub.model_requests() == []
    assert task.records() == []


# --- input estimates ----------------------------------------------------------

ESTIMATE_FIXTURES = ["english", "code", "multilingual", "multiturn_tools", "100", "4k"]


@pytest.mark.parametrize("name", ESTIMATE_FIXTURES)
def test_chat_input_estimate_is_the_upstreams_count(
    stack: Stack, task: Task, sdk: Sdk, name: str
) -> None:
    body: dict[str, Any] = as_whole(fixture(f"chat_{name}"))
    answer = sdk().chat.completions.create(**body)
    assert answer.usage is not None
    record = task.only_settled()
    # The stub counts with the shared formula (o200k_base plus the per-message
    # overhead); the gateway's estimate must be that number exactly.
    assert record["held"]["input_tokens"] == answer.usage.prompt_tokens > 0
    assert record["charged"]["input_tokens"] == answer.usage.prompt_tokens


@pytest.mark.parametrize("name", ESTIMATE_FIXTURES)
def test_responses_input_estimate_is_the_upstreams_count(
    stack: Stack, task: Task, sdk: Sdk, name: str
) -> None:
    body: dict[str, Any] = as_whole(fixture(f"responses_{name}"))
    answer = sdk().responses.create(**body)
    assert answer.usage is not None
    record = task.only_settled()
    assert record["held"]["input_tokens"] == answer.usage.input_tokens > 0
    assert record["charged"]["input_tokens"] == answer.usage.input_tokens


def test_estimates_differ_across_fixtures(stack: Stack, task: Task, sdk: Sdk) -> None:
    # Guards the tests above against a constant on both sides.
    client = sdk()
    counts: Json = {}
    for name in ("english", "code", "multilingual"):
        body: dict[str, Any] = as_whole(fixture(f"chat_{name}"))
        answer = client.chat.completions.create(**body)
        assert answer.usage is not None
        counts[name] = answer.usage.prompt_tokens
    assert len(set(counts.values())) == 3, counts
    held = sorted(r["held"]["input_tokens"] for r in task.wait_records(3))
    assert held == sorted(counts.values())


def test_streamed_fixture_settles_its_estimate_and_usage(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    # chat_code streams with include_usage: the usage chunk reaches the SDK.
    body: dict[str, Any] = fixture("chat_code")
    assert body.pop("stream") is True
    assert body["stream_options"] == {"include_usage": True}
    chunks = list(sdk().chat.completions.create(**body, stream=True))
    usage = chunks[-1].usage
    assert usage is not None
    record = task.only_settled()
    assert record["held"]["input_tokens"] == usage.prompt_tokens
    assert record["charged"]["input_tokens"] == usage.prompt_tokens
    assert record["charged"]["output_tokens"] == usage.completion_tokens
    # The upstream's shared scope counted the same attempt.
    (attempt,) = task.attempts()
    assert attempt["scopes"] == ["tenant:~gateway", f"upstream:{UPSTREAM}"]
    assert attempt["charged"]["input_tokens"] == usage.prompt_tokens
    assert attempt["charged"]["output_tokens"] == usage.completion_tokens


# --- output the request does not bound, and reasoning -------------------------


def test_stream_without_a_bound_is_cut_past_the_models_estimate(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    # The model's max_output_tokens is only the estimate of a call that names
    # no bound: the provider was never told it. The stream goes on topping up
    # past it and is cut when the budget refuses, never spending past it.
    room = 100
    leave_room_for_output(stack, task, room)
    stack.stub.behave(output_tokens=300)
    stream = sdk(max_retries=0).chat.completions.create(
        model=SMALL_BOUND_MODEL, messages=HELLO, stream=True
    )
    texts: list[str] = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            if content_of(chunk):
                texts.append(content_of(chunk))
    assert not isinstance(caught.value, openai.APIStatusError)  # the answer was a 200
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["code"] == "budget_exhausted"
    assert SMALL_BOUND_MAX_OUTPUT < len(texts) <= room
    record = task.only_settled()
    assert record["charged"]["output_tokens"] == len(texts)
    (limit,) = stack.ledger.scope(task.scope)["limits"]
    assert limit["used"] <= limit["capacity"]
    # Sent as the client wrote it: no bound added.
    (sent,) = stack.stub.model_requests()
    assert "max_tokens" not in sent["body"]
    assert "max_completion_tokens" not in sent["body"]
    task.assert_nothing_held()


def test_reasoning_stream_is_refused_up_front_as_the_whole_call_is(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    # Reasoning is billed as output but never streamed: the stream would never
    # top up while the model thinks. It holds its whole bound up front, so the
    # budget refuses it before anything is sent, as it refuses the whole call.
    leave_room_for_output(stack, task, 500)
    stack.stub.behave(output_tokens=2, reasoning_tokens=900)
    client = sdk(max_retries=0)
    with pytest.raises(openai.APIStatusError) as whole:
        client.responses.create(
            model=MODEL, input="Think hard.", max_output_tokens=1000, reasoning={"effort": "high"}
        )
    with pytest.raises(openai.APIStatusError) as streamed:
        stream = client.responses.create(
            model=MODEL,
            input="Think hard.",
            max_output_tokens=1000,
            reasoning={"effort": "high"},
            stream=True,
        )
        list(stream)
    assert whole.value.status_code == 402
    assert streamed.value.status_code == whole.value.status_code
    assert streamed.value.code == "budget_exhausted"
    assert stack.stub.model_requests() == []
    assert task.records() == []
    task.assert_nothing_held()


def test_reasoning_stream_holds_its_bound_and_settles_the_reasoning(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    stack.stub.behave(output_tokens=2, reasoning_tokens=300)
    events = list(
        sdk().responses.create(
            model=MODEL,
            input="Think.",
            max_output_tokens=400,
            reasoning={"effort": "low"},
            stream=True,
        )
    )
    (completed,) = [e for e in events if e.type == "response.completed"]
    usage = completed.response.usage
    assert usage is not None
    assert usage.output_tokens_details.reasoning_tokens == 300
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 2
    record = task.only_settled()
    assert record["held"]["output_tokens"] == 400  # the whole bound, up front
    assert record["charged"]["output_tokens"] == usage.output_tokens == 302
    task.assert_nothing_held()


# --- 502s the SDK must not retry ------------------------------------------------


def test_whole_answer_broken_off_is_a_502_the_sdk_does_not_retry(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    # The provider generated the answer (and bills it) before it broke off: a
    # retry would be a second generation, billed again.
    stack.stub.enqueue({"cut_after_tokens": 3})
    with pytest.raises(openai.InternalServerError) as caught:
        sdk(max_retries=2).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20)
    assert caught.value.status_code == 502
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert len(stack.stub.model_requests()) == 1
    record = task.only_settled()
    assert record["charged"]["output_tokens"] == 20  # charged as held, never free
    task.assert_nothing_held()


def test_upstream_401_is_not_the_clients_key(stack: Stack, task: Task, sdk: Sdk) -> None:
    # The provider refused the gateway's upstream key: an AuthenticationError
    # would tell the client its own gateway key is wrong.
    stack.stub.enqueue({"status": 401})
    with pytest.raises(openai.APIStatusError) as caught:
        sdk(max_retries=2).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5)
    assert not isinstance(caught.value, openai.AuthenticationError)
    assert caught.value.status_code == 502
    assert "upstream key" in caught.value.message
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert len(stack.stub.model_requests()) == 1
    (record,) = task.wait_records(1)
    assert record["kind"] == "refunded"
    task.assert_nothing_held()


def test_upstream_break_mid_stream_reaches_the_sdk_as_its_error_event(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    # The gateway's error event is written out before the body is aborted:
    # the SDK raises it (naming the break), not a bare transport error.
    for _ in range(3):
        stack.stub.enqueue({"cut_after_tokens": 4})
        stream = sdk(max_retries=0).chat.completions.create(
            model=MODEL, messages=HELLO, stream=True
        )
        with pytest.raises(openai.APIError) as caught:
            for _chunk in stream:
                pass
        assert "broke off" in caught.value.message
