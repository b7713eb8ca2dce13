"""The gateway with the official Anthropic SDK as its client (`/v1/messages`):
what the SDK sees (answers, errors, retries) and what the ledger settled."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import anthropic
import pytest
from anthropic.types import MessageParam, RawMessageStreamEvent

from harness import (
    GATEWAY_MAX_RETRIES,
    TENANT,
    TRANCHE_TOKENS,
    TRANSPORT_ERRORS,
    USER,
    Stack,
    Task,
    as_whole,
    fixture,
    gaps_ms,
    price_micros,
    wait_for,
)

MODEL = "claude-sonnet-4-6"
HELLO: list[MessageParam] = [{"role": "user", "content": "Say hello a few times."}]


Sdk = Callable[..., anthropic.Anthropic]


@pytest.fixture
def sdk(stack: Stack, task: Task) -> Iterator[Sdk]:
    """Makes `anthropic.Anthropic` clients on the gateway, in the test's task
    scope (`sdk(max_retries=0)`), and closes them after the test."""
    made: list[anthropic.Anthropic] = []

    def make(max_retries: int = 2, api_key: str | None = None) -> anthropic.Anthropic:
        client = anthropic.Anthropic(
            base_url=stack.gateway_url,
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


def text_of(event: RawMessageStreamEvent) -> str:
    if event.type == "content_block_delta" and event.delta.type == "text_delta":
        return event.delta.text
    return ""


def test_message_settles_exactly_the_sdks_usage(stack: Stack, task: Task, sdk: Sdk) -> None:
    stack.stub.behave(output_tokens=27)
    raw = sdk().messages.with_raw_response.create(
        model=MODEL, max_tokens=60, system="Be brief.", messages=HELLO
    )
    answer = raw.parse()
    assert answer.usage.output_tokens == 27
    record = task.only_settled()
    assert record["scopes"] == [f"tenant:{TENANT}", f"tenant:{TENANT}/user:{USER}", task.scope]
    assert record["model"] == MODEL
    assert record["held"]["input_tokens"] == answer.usage.input_tokens
    assert record["held"]["output_tokens"] == 60
    assert record["charged"]["input_tokens"] == answer.usage.input_tokens
    assert record["charged"]["output_tokens"] == answer.usage.output_tokens
    assert record["charged"]["requests"] == 1
    assert record["charged"]["cost_micros"] == price_micros(
        MODEL, answer.usage.input_tokens, answer.usage.output_tokens
    )
    # Anthropic's own rate-limit headers, not OpenAI's.
    limit = int(raw.headers["anthropic-ratelimit-tokens-limit"])
    assert 0 <= int(raw.headers["anthropic-ratelimit-tokens-remaining"]) <= limit
    assert "x-ratelimit-limit-tokens" not in raw.headers
    task.assert_nothing_held()


def test_message_stream_settles_the_streamed_usage(stack: Stack, task: Task, sdk: Sdk) -> None:
    stack.stub.behave(output_tokens=22)
    events = list(sdk().messages.create(model=MODEL, max_tokens=100, messages=HELLO, stream=True))
    starts = [e for e in events if e.type == "message_start"]
    deltas = [e for e in events if e.type == "message_delta"]
    assert len(starts) == 1
    assert len(deltas) == 1
    input_tokens = starts[0].message.usage.input_tokens
    output_tokens = deltas[0].usage.output_tokens
    assert output_tokens == 22 == len([e for e in events if text_of(e)])
    assert events[-1].type == "message_stop"
    record = task.only_settled()
    assert record["held"]["input_tokens"] == input_tokens
    assert record["charged"]["input_tokens"] == input_tokens
    assert record["charged"]["output_tokens"] == output_tokens
    assert record["charged"]["cost_micros"] == price_micros(MODEL, input_tokens, output_tokens)
    # A tranche at a time, never the whole bound of 100.
    assert record["held"]["output_tokens"] % TRANCHE_TOKENS == 0
    assert 22 <= record["held"]["output_tokens"] < 22 + 2 * TRANCHE_TOKENS
    task.assert_nothing_held()


def test_message_stream_cut_by_a_refused_top_up_raises(stack: Stack, task: Task, sdk: Sdk) -> None:
    room = 2 * TRANCHE_TOKENS
    stack.ledger.set_limits(
        task.scope, [{"dimension": "output_tokens", "capacity": 1000, "window": "total"}]
    )
    stack.ledger.adjust(task.scope, "output_tokens", -(1000 - room))
    stack.stub.behave(output_tokens=200)
    stream = sdk().messages.create(model=MODEL, max_tokens=1000, messages=HELLO, stream=True)
    texts: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as caught:
        for event in stream:
            if text_of(event):
                texts.append(text_of(event))
    assert 0 < len(texts) <= room
    e = caught.value
    assert e.status_code == 200  # raised from the `error` event of a 200 stream
    assert e.type == "billing_error"
    body = e.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["allowance"]["scope"] == task.scope
    record = task.only_settled()
    assert record["charged"]["output_tokens"] == len(texts)
    assert record["charged"]["input_tokens"] == record["held"]["input_tokens"]
    task.assert_nothing_held()


def test_client_disconnect_mid_stream_settles_what_was_generated(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    stack.stub.behave(output_tokens=400, token_delay_ms=25)
    stream = sdk().messages.create(model=MODEL, max_tokens=1000, messages=HELLO, stream=True)
    read = 0
    for event in stream:
        if text_of(event):
            read += 1
        if read == 5:
            break
    stream.close()
    record = task.only_settled()
    charged = record["charged"]["output_tokens"]
    assert read <= charged <= read + 8, charged
    # The input was known from message_start: the provider's count, settled.
    assert record["charged"]["input_tokens"] == record["held"]["input_tokens"]
    task.assert_nothing_held()
    wait_for(
        lambda: True if stack.stub.stats()["in_flight"] == 0 else None,
        "the stub to see the upstream connection closed",
    )


def test_upstream_500_is_refunded_and_not_retried_by_the_sdk(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    attempts = 1 + GATEWAY_MAX_RETRIES
    stack.stub.enqueue(*[{"status": 500} for _ in range(attempts)])
    errors_before = stack.ledger.calls("messages", "upstream_error")
    with pytest.raises(anthropic.InternalServerError) as caught:
        sdk(max_retries=2).messages.create(model=MODEL, max_tokens=20, messages=HELLO)
    assert caught.value.status_code == 500
    assert caught.value.type == "api_error"
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert len(stack.stub.model_requests()) == attempts
    assert stack.ledger.calls("messages", "upstream_error") == errors_before + 1
    (record,) = task.wait_records(1)
    assert record["kind"] == "refunded"
    assert [a["kind"] for a in task.attempts()] == ["settled"] * attempts
    task.assert_nothing_held()


def test_upstream_429_is_retried_after_retry_after(stack: Stack, task: Task, sdk: Sdk) -> None:
    stack.stub.enqueue({"status": 429, "headers": {"retry-after": "1"}})
    stack.stub.behave(output_tokens=9)
    raw = sdk().messages.with_raw_response.create(model=MODEL, max_tokens=20, messages=HELLO)
    answer = raw.parse()
    assert answer.usage.output_tokens == 9
    assert raw.headers["x-should-retry"] == "false"
    sent = stack.stub.model_requests()
    assert len(sent) == 2
    # The SDK's own headers pass through to the provider.
    assert all(r["headers"].get("anthropic-version") for r in sent)
    (gap,) = gaps_ms(sent)
    assert 1000 <= gap < 1600, gap
    record = task.only_settled()
    assert record["charged"]["output_tokens"] == 9
    assert [a["kind"] for a in task.attempts()] == ["settled", "settled"]


def test_upstream_break_mid_stream_is_an_error_for_the_sdk(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    # Straight from the provider, a dropped stream makes the SDK raise
    # (incomplete chunked read); through the gateway it must too.
    stack.stub.enqueue({"cut_after_tokens": 5})
    stream = sdk(max_retries=0).messages.create(
        model=MODEL, max_tokens=100, messages=HELLO, stream=True
    )
    texts: list[str] = []
    with pytest.raises((anthropic.APIError, *TRANSPORT_ERRORS)):
        for event in stream:
            if text_of(event):
                texts.append(text_of(event))
    assert len(texts) == 5
    record = task.only_settled()
    assert record["charged"]["output_tokens"] == 5
    task.assert_nothing_held()


def test_rate_limit_denial_is_an_sdk_rate_limit_error(stack: Stack, task: Task, sdk: Sdk) -> None:
    stack.ledger.set_limits(
        task.scope,
        [{"dimension": "requests", "capacity": 1, "window": "bucket", "period_ms": 60_000}],
    )
    client = sdk(max_retries=0)
    client.messages.create(model=MODEL, max_tokens=5, messages=HELLO)
    with pytest.raises(anthropic.RateLimitError) as caught:
        client.messages.create(model=MODEL, max_tokens=5, messages=HELLO)
    e = caught.value
    assert e.status_code == 429
    assert e.type == "rate_limit_error"
    retry_after_ms = int(e.response.headers["retry-after-ms"])
    assert 0 < retry_after_ms <= 60_000
    assert int(e.response.headers["retry-after"]) == math.ceil(retry_after_ms / 1000)
    body = e.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["allowance"]["scope"] == task.scope
    assert body["error"]["allowance"]["dimension"] == "requests"
    assert len(stack.stub.model_requests()) == 1
    task.only_settled()


def test_budget_exhausted_is_a_402_the_sdk_does_not_retry(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    stack.ledger.set_limits(
        task.scope, [{"dimension": "tokens", "capacity": 1000, "window": "total"}]
    )
    stack.ledger.adjust(task.scope, "tokens", -1000)
    denied_before = stack.ledger.calls("messages", "denied")
    with pytest.raises(anthropic.APIStatusError) as caught:
        sdk(max_retries=2).messages.create(model=MODEL, max_tokens=5, messages=HELLO)
    e = caught.value
    assert e.status_code == 402
    assert not isinstance(e, anthropic.RateLimitError)
    assert e.type == "billing_error"
    body = e.body
    assert isinstance(body, dict)
    assert body["error"]["allowance"]["scope"] == task.scope
    assert body["error"]["allowance"]["retry_after_ms"] is None
    assert stack.ledger.calls("messages", "denied") == denied_before + 1
    assert stack.stub.model_requests() == []
    assert task.records() == []


def test_rate_limit_headers_are_anthropics(stack: Stack, task: Task, sdk: Sdk) -> None:
    stack.ledger.set_limits(
        task.scope,
        [{"dimension": "requests", "capacity": 5, "window": "bucket", "period_ms": 60_000}],
    )
    client = sdk()
    client.messages.create(model=MODEL, max_tokens=5, messages=HELLO)
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=5, messages=HELLO)
    raw.parse()
    # The task's bucket is the only requests limit: one used, one held.
    assert raw.headers["anthropic-ratelimit-requests-limit"] == "5"
    assert raw.headers["anthropic-ratelimit-requests-remaining"] == "3"
    reset = datetime.fromisoformat(raw.headers["anthropic-ratelimit-requests-reset"])
    now = datetime.now(UTC)
    assert now - timedelta(seconds=2) <= reset <= now + timedelta(seconds=61)
    assert "x-ratelimit-limit-requests" not in raw.headers
    task.wait_records(2)


def test_unknown_key_is_an_authentication_error(stack: Stack, task: Task, sdk: Sdk) -> None:
    with pytest.raises(anthropic.AuthenticationError) as caught:
        sdk(api_key="sk-not-a-gateway-key").messages.create(
            model=MODEL, max_tokens=5, messages=HELLO
        )
    assert caught.value.status_code == 401
    assert caught.value.type == "authentication_error"
    assert stack.stub.model_requests() == []
    assert task.records() == []


@pytest.mark.parametrize(
    "name", ["english", "code", "multilingual", "multiturn_tools", "100", "4k"]
)
def test_input_estimate_is_the_upstreams_count(
    stack: Stack, task: Task, sdk: Sdk, name: str
) -> None:
    # The fixtures name a model the SDK now warns about; the count does not
    # depend on it (o200k_base either way).
    body: dict[str, Any] = as_whole(fixture(f"anthropic_{name}")) | {"model": MODEL}
    answer = sdk().messages.create(**body)
    record = task.only_settled()
    # The stub counts with the shared formula (o200k_base plus the
    # per-message overhead); the gateway's estimate must be that number.
    assert record["held"]["input_tokens"] == answer.usage.input_tokens > 0
    assert record["charged"]["input_tokens"] == answer.usage.input_tokens


def test_streamed_fixture_settles_its_estimate_and_usage(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    body: dict[str, Any] = fixture("anthropic_code") | {"model": MODEL}
    assert body.pop("stream") is True
    events = list(sdk().messages.create(**body, stream=True))
    starts = [e for e in events if e.type == "message_start"]
    ends = [e for e in events if e.type == "message_delta"]
    assert len(starts) == len(ends) == 1
    input_tokens = starts[0].message.usage.input_tokens
    record = task.only_settled()
    assert record["held"]["input_tokens"] == input_tokens > 0
    assert record["charged"]["input_tokens"] == input_tokens
    assert record["charged"]["output_tokens"] == ends[0].usage.output_tokens


def test_thinking_stream_holds_its_whole_bound_up_front(stack: Stack, task: Task, sdk: Sdk) -> None:
    # Thinking is billed as output but not streamed as text (at most a
    # summary): a stream that asks for it holds its whole bound, as a whole
    # call does, and is refused up front when the budget cannot cover it.
    stack.ledger.set_limits(
        task.scope, [{"dimension": "output_tokens", "capacity": 1000, "window": "total"}]
    )
    stack.ledger.adjust(task.scope, "output_tokens", -500)
    stack.stub.behave(output_tokens=2, reasoning_tokens=300)
    client = sdk(max_retries=0)
    with (
        pytest.raises(anthropic.APIStatusError) as caught,
        client.messages.stream(
            model=MODEL,
            max_tokens=800,
            messages=HELLO,
            thinking={"type": "enabled", "budget_tokens": 700},
        ) as refused,
    ):
        refused.until_done()
    assert caught.value.status_code == 402
    assert stack.stub.model_requests() == []
    with client.messages.stream(
        model=MODEL,
        max_tokens=400,
        messages=HELLO,
        thinking={"type": "enabled", "budget_tokens": 350},
    ) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens == 302
    record = task.only_settled()
    assert record["held"]["output_tokens"] == 400
    assert record["charged"]["output_tokens"] == 302
    task.assert_nothing_held()


def test_upstream_break_mid_stream_reaches_the_sdk_as_its_error_event(
    stack: Stack, task: Task, sdk: Sdk
) -> None:
    for _ in range(3):
        stack.stub.enqueue({"cut_after_tokens": 4})
        stream = sdk(max_retries=0).messages.create(
            model=MODEL, max_tokens=100, messages=HELLO, stream=True
        )
        with pytest.raises(anthropic.APIError) as caught:
            for _event in stream:
                pass
        assert "broke off" in caught.value.message
