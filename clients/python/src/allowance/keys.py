"""Idempotency keys for agent work (seed 003, SEMANTICS.md "Idempotency").

A key names a unit of *work*, never an *attempt*: the run, the task, the
provider it targets, and a hash of the structured inputs the prompt is
rendered from. A retry of the same work then carries the same key, so the
server answers the existing reservation instead of holding twice.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

KEY_VERSION = "v1"
"""The key format's version: a change of format changes the prefix, so an
old key and a new one never collide (a format change must not silently
double-spend)."""

MAX_KEY_CHARS = 200
"""The server's bound on an idempotency key, in characters (Unicode code
points, as SEMANTICS.md counts them: ``é`` and ``🦀`` count one each)."""


def canonical_json(inputs: Any) -> str:
    """The canonical JSON of ``inputs``: keys sorted, no whitespace, UTF-8
    text kept as is, NaN and infinities refused. Equal structures give equal
    text whatever their dict order or formatting."""
    return json.dumps(
        inputs, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def idempotency_key(run: str, task: str, provider: str, inputs: Any) -> str:
    """``v1:{run}:{task}:{provider}:{sha256 of the canonical JSON of inputs}``.

    - key on the work, not the attempt: leave attempt numbers, timestamps
      and worker ids out of ``inputs``;
    - hash the structured inputs, not the rendered prompt, so a reworded
      template does not turn a retry into new work;
    - name the ``provider`` (and model family): a failover to another
      provider is a different quota and must not collide with the primary.

    Raises ``ValueError`` naming the argument when a part is empty or holds
    ``:``, or when the key would exceed the server's 200 characters;
    ``TypeError`` when ``inputs`` is not JSON-serialisable.
    """
    for name, part in (("run", run), ("task", task), ("provider", provider)):
        if not part:
            raise ValueError(f"{name}: must not be empty")
        if ":" in part:
            raise ValueError(f"{name}: must not contain ':' (the key's separator), got {part!r}")
    digest = hashlib.sha256(canonical_json(inputs).encode("utf-8")).hexdigest()
    key = f"{KEY_VERSION}:{run}:{task}:{provider}:{digest}"
    if len(key) > MAX_KEY_CHARS:
        raise ValueError(
            f"run/task/provider: the key would be {len(key)} characters, over the "
            f"server's {MAX_KEY_CHARS}; shorten the ids"
        )
    return key
