"""Fixtures: one real `allowance serve` per test module, killed at its end."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
from client_harness import BASE_CONFIG, Server

from allowance import AsyncClient, Client


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """`allowance serve` with the base configuration, for this module."""
    s = Server(BASE_CONFIG)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def admin(server: Server) -> Iterator[Client]:
    """A client with the admin token."""
    with Client(server.base_url, server.tokens.admin) as c:
        yield c


@pytest.fixture
def acme(server: Server) -> Iterator[Client]:
    """A client with the tenant token of `acme`."""
    with Client(server.base_url, server.tokens.acme) as c:
        yield c


@pytest.fixture
def beta(server: Server) -> Iterator[Client]:
    """A client with the tenant token of `beta`."""
    with Client(server.base_url, server.tokens.beta) as c:
        yield c


@pytest_asyncio.fixture
async def aadmin(server: Server) -> AsyncIterator[AsyncClient]:
    """An async client with the admin token."""
    async with AsyncClient(server.base_url, server.tokens.admin) as c:
        yield c


@pytest_asyncio.fixture
async def aacme(server: Server) -> AsyncIterator[AsyncClient]:
    """An async client with the tenant token of `acme`."""
    async with AsyncClient(server.base_url, server.tokens.acme) as c:
        yield c
