"""Idempotency keys per seed 003, and idempotent retries against the server."""

from __future__ import annotations

import hashlib

import pytest
from client_harness import unique

from allowance import AsyncClient, Client, Conflict, canonical_json, idempotency_key

AMOUNTS = {"input_tokens": 3000, "output_tokens": 500}


def test_key_is_versioned_and_hashes_the_canonical_inputs() -> None:
    inputs = {"doc": "report.pdf", "pages": [1, 2], "lang": "fr"}
    key = idempotency_key("run42", "t7", "openai", inputs)
    digest = hashlib.sha256(b'{"doc":"report.pdf","lang":"fr","pages":[1,2]}').hexdigest()
    assert key == f"v1:run42:t7:openai:{digest}"


def test_key_ignores_dict_order_but_not_content() -> None:
    a = idempotency_key("r", "t", "openai", {"a": 1, "b": {"x": [1, 2], "y": "é"}})
    b = idempotency_key("r", "t", "openai", {"b": {"y": "é", "x": [1, 2]}, "a": 1})
    assert a == b
    assert a != idempotency_key("r", "t", "openai", {"a": 1, "b": {"x": [2, 1], "y": "é"}})
    assert canonical_json({"y": "é", "x": 1.5}) == '{"x":1.5,"y":"é"}'


def test_key_names_the_provider_so_a_failover_is_new_work() -> None:
    inputs = {"q": "same"}
    assert idempotency_key("r", "t", "openai", inputs) != idempotency_key(
        "r", "t", "anthropic", inputs
    )
    assert idempotency_key("r", "t1", "openai", inputs) != idempotency_key(
        "r", "t2", "openai", inputs
    )


def test_key_refuses_what_would_break_it() -> None:
    with pytest.raises(ValueError, match="run"):
        idempotency_key("", "t", "p", {})
    with pytest.raises(ValueError, match="task: must not contain ':'"):
        idempotency_key("r", "a:b", "p", {})
    with pytest.raises(ValueError, match="200"):
        idempotency_key("r" * 150, "t", "p", {})
    with pytest.raises(ValueError, match="Out of range float"):
        idempotency_key("r", "t", "p", {"x": float("nan")})
    with pytest.raises(TypeError):
        idempotency_key("r", "t", "p", {"x": {1, 2}})


def test_a_retried_reserve_holds_once(acme: Client) -> None:
    user = unique("u")
    key = idempotency_key(unique("run"), "t1", "openai", {"prompt_id": 7})
    first = acme.reserve("acme", AMOUNTS, scopes={"user": user}, idempotency_key=key)
    assert first.replayed is False
    # The retry may differ in ttl, labels, wait and priority: still the same work.
    again = acme.reserve(
        "acme",
        AMOUNTS,
        scopes={"user": user},
        idempotency_key=key,
        ttl_ms=5000,
        labels={"try": "2"},
    )
    assert again.replayed is True and again.id == first.id
    st = acme.status(f"tenant:acme/user:{user}")
    assert (st.held_reservations, st.limit("tokens").held) == (1, 3500)

    # The context manager leaves a replay of ended work alone.
    first.settle(AMOUNTS)
    with acme.reserve("acme", AMOUNTS, scopes={"user": user}, idempotency_key=key) as third:
        assert third.replayed and third.status == "settled"
    assert acme.status(f"tenant:acme/user:{user}").limit("tokens").used == 3500


def test_same_key_for_different_work_is_a_conflict(acme: Client) -> None:
    key = idempotency_key(unique("run"), "t1", "openai", {"n": 1})
    acme.reserve("acme", AMOUNTS, idempotency_key=key).refund()
    with pytest.raises(Conflict):
        acme.reserve("acme", {"input_tokens": 1}, idempotency_key=key)


async def test_async_retry_is_replayed(aacme: AsyncClient) -> None:
    key = idempotency_key(unique("run"), "t1", "openai", {"n": 2})
    first = await aacme.reserve("acme", AMOUNTS, idempotency_key=key)
    second = await aacme.reserve("acme", AMOUNTS, idempotency_key=key)
    assert (second.replayed, second.id) == (True, first.id)
    await first.settle(AMOUNTS)
    assert (await aacme.get(second.id)).status == "settled"
