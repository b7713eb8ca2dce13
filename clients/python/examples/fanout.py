"""A fan-out coordinator under a request rate and a token budget (seed 003).

A coordinator fans out 120 sub-tasks, each a 3,000-token prompt expecting a
500-token answer, against a provider allowing 60 requests per minute, with
a run budget of 350,000 tokens. That is 420,000 tokens of work for a budget
that holds 100 sub-tasks: 20 must be refused, and the coordinator reports
them, with the scope that said no. The rate limit makes sub-tasks wait
(``reserve_or_wait``: the server's queue, then ``retry_after``) rather than
fail.

What it shows:

- one reservation per sub-task against both ceilings at once: the run's
  ``tokens`` budget (``tenant:acme/run:<id>``, a ``total`` window) and the
  provider's ``requests`` bucket (the shared scope ``upstream:openai``);
- keys on the work, not the attempt (:func:`allowance.idempotency_key`):
  running the coordinator again with the same ``--run`` pays nothing twice,
  the finished sub-tasks answer as already done;
- a transient model failure is retried inside the same hold, so a retry
  takes no new request slot (seed 003's 10 % of sub-tasks failing once);
- the report names what refused each sub-task, and the run's budget after
  (used ≤ capacity: zero overspend).

The model call is simulated (a short sleep) and uses exactly its estimate,
as in the seed's arithmetic; a real call settles its real usage, and then
more sub-tasks fit. Run it against a local server configured with
``examples/allowance.toml``::

    allowance token        # twice: an admin token and a tenant token for acme
    allowance serve --config clients/python/examples/allowance.toml
    python clients/python/examples/fanout.py --url http://127.0.0.1:8787 \\
        --token $ACME_TOKEN --admin-token $ADMIN_TOKEN

The defaults are the seed's numbers; at 60 requests per minute the 40
sub-tasks past the first 60 take about 40 s. ``--time-scale 0.02`` shrinks
the bucket's period and the simulated latency by that factor (it needs
``--admin-token``, to set the provider scope's limits); the tests use it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import secrets
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from allowance import AsyncClient, Client, Denied, HeldElsewhere, ScopeStatus, idempotency_key


@dataclass(frozen=True)
class FanoutConfig:
    """The run's parameters; the defaults are seed 003's."""

    url: str
    token: str
    admin_token: str | None = None
    tenant: str = "acme"
    run: str = field(default_factory=lambda: f"run-{secrets.token_hex(4)}")
    provider: str = "openai"
    tasks: int = 120
    input_tokens: int = 3_000
    output_tokens: int = 500
    budget_tokens: int = 350_000
    requests_per_minute: int = 60
    time_scale: float = 1.0
    workers: int = 16
    latency_s: float = 0.5
    transient_failure_rate: float = 0.1
    seed: int = 3
    wait_timeout_s: float = 300.0

    @property
    def run_scope(self) -> str:
        """The run's budget scope."""
        return f"tenant:{self.tenant}/run:{self.run}"

    @property
    def upstream_scope(self) -> str:
        """The provider's shared scope."""
        return f"upstream:{self.provider}"


@dataclass(frozen=True)
class Outcome:
    """What became of one sub-task."""

    task: str
    result: str
    """``admitted``, ``already_done`` (a replay of finished work), ``in_progress``
    (held by another run with the same ``--run`` right now) or ``refused``."""
    attempts: int = 0
    """Model-call attempts inside the hold (1 = no retry)."""
    denial: Denied | None = None


@dataclass
class Report:
    """The coordinator's report."""

    config: FanoutConfig
    outcomes: list[Outcome]
    run_status: ScopeStatus
    wall_s: float

    def count(self, result: str) -> int:
        """Sub-tasks with ``result``."""
        return sum(1 for o in self.outcomes if o.result == result)

    @property
    def refusals(self) -> Counter[tuple[str, str, str]]:
        """Refused sub-tasks by (denial type, scope, dimension)."""
        return Counter(
            (o.denial.type, o.denial.scope, o.denial.dimension)
            for o in self.outcomes
            if o.denial is not None
        )

    @property
    def overspend_tokens(self) -> int:
        """Tokens used beyond the run's budget (0 when it held)."""
        tokens = self.run_status.limit("tokens", "total")
        return max(0, tokens.used - tokens.capacity)

    def text(self) -> str:
        """The report as printed."""
        c = self.config
        tokens = self.run_status.limit("tokens", "total")
        retried = sum(1 for o in self.outcomes if o.attempts > 1)
        lines = [
            f"fan-out {c.run}: {c.tasks} sub-tasks of {c.input_tokens} + {c.output_tokens} "
            f"tokens, {c.requests_per_minute} requests/min (time scale {c.time_scale:g}), "
            f"{c.budget_tokens}-token budget",
            f"  admitted      {self.count('admitted'):4d}  "
            f"({retried} retried a transient failure inside their hold)",
            f"  already done  {self.count('already_done'):4d}  (replayed by idempotency key)",
            f"  refused       {self.count('refused'):4d}",
        ]
        if self.count("in_progress"):
            lines.append(
                f"  in progress   {self.count('in_progress'):4d}  (held by another run right now)"
            )
        for (kind, scope, dimension), n in sorted(self.refusals.items()):
            refused = [o.task for o in self.outcomes if o.denial and o.denial.scope == scope]
            lines.append(f"    {n:4d} {kind} by {scope} ({dimension}): {' '.join(refused)}")
        lines += [
            f"  budget {c.run_scope}: used {tokens.used} of {tokens.capacity} tokens, "
            f"held {tokens.held}, overspend {self.overspend_tokens}",
            f"  wall time {self.wall_s:.1f} s",
        ]
        return "\n".join(lines)


class TransientModelError(Exception):
    """A simulated provider hiccup (a 500, a dropped connection)."""


def prepare_scopes(cfg: FanoutConfig) -> None:
    """Gives the run its budget and the provider its rate (admin). Without
    an admin token the server's configured plans apply as they are."""
    if cfg.admin_token is None:
        if cfg.time_scale != 1.0:
            raise SystemExit("--time-scale needs --admin-token (it sets the provider's limits)")
        return
    period_ms = max(1, round(60_000 * cfg.time_scale))
    with Client(cfg.url, cfg.admin_token) as admin:
        admin.set_scope(
            cfg.run_scope,
            limits=[{"dimension": "tokens", "capacity": cfg.budget_tokens, "window": "total"}],
        )
        admin.set_scope(
            cfg.upstream_scope,
            limits=[
                {
                    "dimension": "requests",
                    "capacity": cfg.requests_per_minute,
                    "window": "bucket",
                    "period_ms": period_ms,
                }
            ],
        )


async def call_model(cfg: FanoutConfig, task: int, attempt: int) -> dict[str, int]:
    """The simulated model call: its latency, a transient failure on the
    first attempt of about ``transient_failure_rate`` of the sub-tasks, and
    usage equal to the estimate."""
    rng = random.Random(f"{cfg.seed}:{task}:{attempt}")
    await asyncio.sleep(cfg.latency_s * cfg.time_scale * rng.uniform(0.5, 1.5))
    if attempt == 1 and rng.random() < cfg.transient_failure_rate:
        raise TransientModelError(f"t{task}: upstream 500")
    return {"input_tokens": cfg.input_tokens, "output_tokens": cfg.output_tokens}


async def sub_task(
    client: AsyncClient, cfg: FanoutConfig, task: int, workers: asyncio.Semaphore
) -> Outcome:
    """Reserves, calls the model (retrying a transient failure in the same
    hold), settles; or reports the denial."""
    name = f"t{task}"
    # The structured inputs the prompt is rendered from, not the prompt text.
    inputs = {"document": f"chunk-{task:03d}", "instruction": "summarise", "max_words": 300}
    key = idempotency_key(cfg.run, name, cfg.provider, inputs)
    async with workers:
        try:
            async with client.reserve_or_wait(
                cfg.tenant,
                {"input_tokens": cfg.input_tokens, "output_tokens": cfg.output_tokens},
                scopes={"run": cfg.run, "upstream": cfg.provider},
                idempotency_key=key,
                labels={"run": cfg.run, "task": name},
                timeout_s=cfg.wait_timeout_s,
            ) as r:
                if r.status != "held":
                    # A replay of work already finished (or ended): skip it.
                    return Outcome(name, "already_done")
                for attempt in range(1, 4):
                    try:
                        usage = await call_model(cfg, task, attempt)
                    except TransientModelError:
                        if attempt == 3:
                            raise  # the block refunds: the call failed
                        continue
                    await r.settle(usage)
                    return Outcome(name, "admitted", attempts=attempt)
        except HeldElsewhere:
            # Another run with the same --run holds this sub-task right now:
            # its work is in progress there, not to be done twice.
            return Outcome(name, "in_progress")
        except Denied as denial:
            return Outcome(name, "refused", denial=denial)
    raise AssertionError("unreachable: every attempt returns or raises")


async def run(cfg: FanoutConfig) -> Report:
    """Runs the whole fan-out and reads the run's budget afterwards."""
    prepare_scopes(cfg)
    started = time.monotonic()
    workers = asyncio.Semaphore(cfg.workers)
    async with AsyncClient(cfg.url, cfg.token) as client:
        outcomes = await asyncio.gather(
            *(sub_task(client, cfg, i, workers) for i in range(cfg.tasks))
        )
        run_status = await client.status(cfg.run_scope)
    return Report(cfg, list(outcomes), run_status, time.monotonic() - started)


def parse_args(argv: Sequence[str] | None) -> FanoutConfig:
    """The command line → a :class:`FanoutConfig`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--url", default="http://127.0.0.1:8787", help="the allowance server")
    p.add_argument("--token", required=True, help="a token for the tenant (or admin)")
    p.add_argument("--admin-token", help="sets the run's budget and the provider's rate")
    p.add_argument("--tenant", default="acme")
    p.add_argument("--run", help="the run id (the same id replays finished work)")
    p.add_argument("--tasks", type=int, default=120)
    p.add_argument("--budget-tokens", type=int, default=350_000)
    p.add_argument("--requests-per-minute", type=int, default=60)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=16)
    a = p.parse_args(argv)
    extra = {"run": a.run} if a.run else {}
    return FanoutConfig(
        url=a.url,
        token=a.token,
        admin_token=a.admin_token,
        tenant=a.tenant,
        tasks=a.tasks,
        budget_tokens=a.budget_tokens,
        requests_per_minute=a.requests_per_minute,
        time_scale=a.time_scale,
        workers=a.workers,
        **extra,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the coordinator and prints its report; exit 1 on an overspend."""
    report = asyncio.run(run(parse_args(argv)))
    print(report.text())
    return 1 if report.overspend_tokens else 0


if __name__ == "__main__":
    sys.exit(main())
