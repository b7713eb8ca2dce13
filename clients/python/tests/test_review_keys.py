"""Review: idempotency keys — canonical JSON, stability across processes,
and agreement with what the server accepts."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
from client_harness import unique

from allowance import Client, InvalidRequest, canonical_json, idempotency_key

NESTED = {
    "doc": "rapport-trimestriel.pdf",
    "pages": [3, 1, 2],
    "opts": {"lang": "fr", "temperature": 0.2, "strict": True, "extra": None},
    "who": {"name": "Zoë", "emoji": "🦀", "cjk": "漢字"},
}


def test_canonical_json_is_order_free_compact_and_utf8() -> None:
    shuffled = {
        "who": {"cjk": "漢字", "emoji": "🦀", "name": "Zoë"},
        "opts": {"extra": None, "strict": True, "temperature": 0.2, "lang": "fr"},
        "pages": [3, 1, 2],
        "doc": "rapport-trimestriel.pdf",
    }
    text = canonical_json(NESTED)
    assert text == canonical_json(shuffled)
    assert text == (
        '{"doc":"rapport-trimestriel.pdf",'
        '"opts":{"extra":null,"lang":"fr","strict":true,"temperature":0.2},'
        '"pages":[3,1,2],'
        '"who":{"cjk":"漢字","emoji":"🦀","name":"Zoë"}}'
    )
    # Lists keep their order (it is content); a tuple is the same JSON array.
    assert canonical_json({"p": [1, 2]}) != canonical_json({"p": [2, 1]})
    assert canonical_json({"p": (1, 2)}) == canonical_json({"p": [1, 2]})
    # True == 1 in Python, but they are different inputs.
    assert canonical_json({"x": True}) != canonical_json({"x": 1})
    key = idempotency_key("run42", "t7", "openai", NESTED)
    assert key == "v1:run42:t7:openai:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


_CHILD = """
import json, sys
from allowance import idempotency_key
inputs = json.loads(sys.stdin.read())
# Build the dicts in reverse insertion order: the key must not notice.
def rev(v):
    if isinstance(v, dict):
        return {k: rev(v[k]) for k in reversed(list(v))}
    if isinstance(v, list):
        return [rev(x) for x in v]
    return v
print(idempotency_key("run42", "t7", "openai", rev(inputs)))
"""


def test_a_key_is_the_same_in_another_process() -> None:
    expected = idempotency_key("run42", "t7", "openai", NESTED)
    for seed in ("0", "1", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD],
            input=json.dumps(NESTED),
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONIOENCODING": "utf-8"},
            timeout=30,
        )
        assert out.stdout.strip() == expected, f"PYTHONHASHSEED={seed}"


def test_a_key_the_client_builds_is_one_the_server_accepts(acme: Client) -> None:
    # The server and SEMANTICS.md bound a key at 200 *characters* (code
    # points), not bytes: a key of exactly 200 characters, most of them
    # two-byte letters (328 bytes of UTF-8), is one the client must build
    # and the server accepts.
    fixed = len("v1:") + len(":t7:openai:") + 64  # prefix, separators, the sha256
    tag = unique("r")
    run = "é" * (200 - fixed - len(tag)) + tag
    key = idempotency_key(run, "t7", "openai", {"n": 1})
    assert len(key) == 200
    assert len(key.encode("utf-8")) > 300
    try:
        r = acme.reserve("acme", {"tokens": 1}, idempotency_key=key)
    except InvalidRequest as e:
        pytest.fail(f"{len(key)} characters, {len(key.encode())} bytes: the server says {e}")
    assert r.replayed is False
    r.refund()


def test_a_key_one_character_too_long_is_refused_before_the_server(acme: Client) -> None:
    fixed = len("v1:") + len(":t7:openai:") + 64
    run = "a" * (201 - fixed)
    with pytest.raises(ValueError, match="201 characters"):
        idempotency_key(run, "t7", "openai", {"n": 1})
    # ... as the server would refuse it: 201 characters is a 400.
    with pytest.raises(InvalidRequest) as e:
        acme.reserve("acme", {"tokens": 1}, idempotency_key="é" * 201)
    assert e.value.field == "idempotency_key"


def test_a_key_refuses_inputs_json_cannot_name_exactly() -> None:
    with pytest.raises(ValueError, match="Out of range float"):
        idempotency_key("r", "t", "p", {"x": float("inf")})
    with pytest.raises(TypeError):
        idempotency_key("r", "t", "p", {"x": b"bytes"})
