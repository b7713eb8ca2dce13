"""RFC 3339 parsing for the server's timestamps."""

from __future__ import annotations

from datetime import datetime


def parse_time(text: str) -> datetime:
    """Parses the server's ``2026-11-29T16:05:00.000Z`` (UTC, aware)."""
    # `fromisoformat` takes a trailing `Z` only from Python 3.11 on.
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    return datetime.fromisoformat(text)
