"""503 store_unavailable from a real outage: the server runs on a private
redis-server that the test kills (SIGKILL) and starts again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from client_harness import BASE_CONFIG, Redis, Server, unique

from allowance import (
    AsyncClient,
    Client,
    Reservation,
    StoreUnavailable,
    UnsettledReservationWarning,
    idempotency_key,
)


@pytest.fixture(scope="module")
def redis() -> Iterator[Redis]:
    r = Redis()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="module")
def server(redis: Redis) -> Iterator[Server]:
    store = f'kind = "redis"\nurl = "{redis.url}"\ntimeout_ms = 300\non_error = "fail_closed"'
    config = f"{BASE_CONFIG}\n[store]\n{store}\n"
    s = Server(config)
    try:
        yield s
    finally:
        s.stop()


AMOUNTS = {"input_tokens": 100, "output_tokens": 10}


def wait_until_ready(client: Client) -> None:
    # `/readyz` answers 200 even while Redis is down (reported to the
    # server's owners), so readiness is a read that needs the store.
    deadline = time.monotonic() + 15
    while True:
        try:
            client.status("tenant:acme")
            return
        except StoreUnavailable:
            assert time.monotonic() < deadline, "the server did not recover after Redis returned"
            time.sleep(0.1)


async def test_every_operation_answers_503_while_the_store_is_down(
    redis: Redis, acme: Client, aacme: AsyncClient
) -> None:
    user = unique("u")
    held = acme.reserve("acme", AMOUNTS, scopes={"user": user})
    redis.kill()
    try:
        t = time.monotonic()
        with pytest.raises(StoreUnavailable) as e:
            acme.reserve("acme", AMOUNTS, scopes={"user": user})
        assert time.monotonic() - t < 5, "bounded by the store timeout, no hang"
        err = e.value
        assert (err.status_code, err.type) == (503, "store_unavailable")
        assert err.message
        for call in (
            lambda: held.settle(AMOUNTS),
            lambda: held.refund(),
            lambda: held.extend(ttl_ms=1000),
            lambda: acme.status(f"tenant:acme/user:{user}"),
        ):
            with pytest.raises(StoreUnavailable):
                call()
        with pytest.raises(StoreUnavailable):
            await aacme.reserve("acme", AMOUNTS)
        assert acme.healthz() is True, "the process is up; only the store is not"
    finally:
        redis.start()
    wait_until_ready(acme)
    # A settle that answered 503 is simply retried (idempotent).
    assert held.settle(AMOUNTS).status == "settled"


def test_reserve_or_wait_retries_a_503_with_the_same_key(redis: Redis, acme: Client) -> None:
    user = unique("u")
    key = idempotency_key(unique("run"), "t1", "openai", {"n": 1})
    redis.kill()
    # The reserve retries in a thread while Redis is down; the test restarts
    # Redis a second later.
    got: list[Reservation | BaseException] = []

    def reserve() -> None:
        try:
            got.append(
                acme.reserve_or_wait(
                    "acme", AMOUNTS, scopes={"user": user}, idempotency_key=key, timeout_s=20
                )
            )
        except BaseException as e:
            got.append(e)

    worker = threading.Thread(target=reserve)
    t = time.monotonic()
    worker.start()
    try:
        time.sleep(1.0)
        assert not got, "still retrying while the store is down"
    finally:
        redis.start()
        worker.join(timeout=30)
    assert time.monotonic() - t >= 0.9
    (r,) = got
    assert isinstance(r, Reservation), r
    assert r.status == "held"
    assert acme.status(f"tenant:acme/user:{user}").held_reservations == 1
    r.settle(AMOUNTS)


def test_reserve_or_wait_does_not_retry_a_503_without_a_key(redis: Redis, acme: Client) -> None:
    redis.kill()
    try:
        t = time.monotonic()
        with pytest.raises(StoreUnavailable):
            acme.reserve_or_wait("acme", AMOUNTS, timeout_s=20)
        assert time.monotonic() - t < 5, "without a key a retry could hold twice"
    finally:
        redis.start()
    wait_until_ready(acme)


class Boom(Exception):
    """The model call failed."""


def test_a_failed_cleanup_never_hides_the_callers_exception(redis: Redis, acme: Client) -> None:
    user = unique("u")
    try:
        with pytest.raises(Boom) as e, acme.reserve("acme", AMOUNTS, scopes={"user": user}):
            redis.kill()
            raise Boom
        notes = getattr(e.value, "__notes__", [])
        assert any("refund after this exception failed" in n for n in notes), notes
        assert any("StoreUnavailable" in n for n in notes), notes

        # Leaving normally, the settle at the estimate must not be lost in
        # silence: its failure is raised.
        redis.start()
        wait_until_ready(acme)
        with (
            pytest.raises(StoreUnavailable),
            pytest.warns(UnsettledReservationWarning),
            acme.reserve("acme", AMOUNTS, scopes={"user": user}),
        ):
            redis.kill()
    finally:
        redis.start()
    wait_until_ready(acme)
