"""Fixtures: one stub and one gateway per test module, and a fresh task scope
per test (the stub reset, the usage log's cursor taken)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import Stack, Task, new_task, start_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work_dir: Path = tmp_path_factory.mktemp("gateway")
    running = start_stack(work_dir)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def task(stack: Stack, request: pytest.FixtureRequest) -> Task:
    return new_task(stack, request.node.name)
