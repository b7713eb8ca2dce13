"""A streaming agent loop that tops up its hold as tokens arrive.

Each step of the loop sends the whole conversation so far (agent loops
re-bill their history, so the input grows every step) as a streamed chat
completion, through the official ``openai`` SDK, to any OpenAI-compatible
endpoint: the stub upstream in the tests, a real provider otherwise.

Per step:

1. reserve the prompt's estimate (priced from the *current* context, not a
   fixed average) plus one tranche of output, against the agent's scope;
2. stream the answer through ``Reservation.stream``, which extends the hold
   tranche by tranche as tokens arrive (never past the call's ``max_tokens``),
   and ends the stream cleanly when a top-up is refused once the tokens
   seen exceed the hold;
3. settle from the stream's final usage chunk (``stream_options.include_usage``),
   or from the tokens seen when the stream was cut.

The loop stops when the agent's budget refuses a step (the reserve or a
top-up), and prints a report of every step. Run it with
``examples/allowance.toml`` and the stub::

    target/debug/allowance-stub --listen 127.0.0.1:9900 --output-tokens 200 &
    allowance serve --config clients/python/examples/allowance.toml &
    python clients/python/examples/streaming_agent.py --url http://127.0.0.1:8787 \\
        --token $ACME_TOKEN --admin-token $ADMIN_TOKEN --upstream http://127.0.0.1:9900/v1
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import openai
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from allowance import Client, Denied, ScopeStatus
from allowance.openai import estimate_chat_input_tokens, estimate_stream_text_tokens


@dataclass(frozen=True)
class AgentConfig:
    """The loop's parameters."""

    url: str
    token: str
    upstream: str
    """An OpenAI-compatible base URL, ``/v1`` included."""
    upstream_key: str = "sk-local"
    admin_token: str | None = None
    tenant: str = "acme"
    agent: str = field(default_factory=lambda: f"agent-{secrets.token_hex(4)}")
    model: str = "gpt-4o-mini"
    steps: int = 8
    max_output_tokens: int = 200
    tranche_tokens: int = 64
    budget_tokens: int | None = 2_500
    """A ``total`` token budget set on the agent's scope (needs
    ``admin_token``); ``None`` keeps the server's plan."""
    quiet: bool = False

    @property
    def scope(self) -> str:
        """The agent's scope."""
        return f"tenant:{self.tenant}/agent:{self.agent}"


@dataclass(frozen=True)
class Step:
    """What one step cost."""

    number: int
    estimated_input_tokens: int
    held_output_tokens: int
    """The output hold when the step ended (after its top-ups)."""
    usage: dict[str, int]
    """What was settled."""
    from_usage_chunk: bool
    """True when settled from the provider's usage; False when cut."""
    cut_by: Denied | None


@dataclass
class AgentReport:
    """Every step, why the loop stopped, and the agent's budget after."""

    config: AgentConfig
    steps: list[Step]
    stopped_by: Denied | None
    status: ScopeStatus

    def text(self) -> str:
        """The report as printed."""
        lines = [f"agent {self.config.scope}: {len(self.steps)} step(s)"]
        for s in self.steps:
            how = "usage chunk" if s.from_usage_chunk else f"cut by {s.cut_by and s.cut_by.type}"
            lines.append(
                f"  step {s.number}: input ~{s.estimated_input_tokens} est / "
                f"{s.usage['input_tokens']} settled, output held {s.held_output_tokens}, "
                f"settled {s.usage['output_tokens']} ({how})"
            )
        if self.stopped_by is not None:
            d = self.stopped_by
            lines.append(f"  stopped: {d.type} by {d.scope} ({d.dimension})")
        for lim in self.status.limits:
            lines.append(
                f"  {lim.dimension} ({lim.window}): used {lim.used} of {lim.capacity}, "
                f"held {lim.held}"
            )
        return "\n".join(lines)


FIRST_MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a research agent. Think step by step."},
    {"role": "user", "content": "Plan the migration of our billing to usage-based pricing."},
]
"""The conversation the loop starts from."""


def prepare(cfg: AgentConfig) -> None:
    """Gives the agent its token budget (admin), when asked."""
    if cfg.budget_tokens is None or cfg.admin_token is None:
        return
    with Client(cfg.url, cfg.admin_token) as admin:
        admin.set_scope(
            cfg.scope,
            limits=[{"dimension": "tokens", "capacity": cfg.budget_tokens, "window": "total"}],
        )


def chunk_tokens(chunk: ChatCompletionChunk) -> int:
    """Output tokens in a chunk (estimated; the usage chunk settles the truth)."""
    return sum(estimate_stream_text_tokens(c.delta.content or "") for c in chunk.choices)


def run(cfg: AgentConfig) -> AgentReport:
    """Runs the loop until its steps are done or its budget says no."""
    prepare(cfg)
    history = list(FIRST_MESSAGES)
    steps: list[Step] = []
    stopped_by: Denied | None = None
    with (
        Client(cfg.url, cfg.token) as allowance,
        openai.OpenAI(base_url=cfg.upstream, api_key=cfg.upstream_key, max_retries=0) as ai,
    ):
        for number in range(1, cfg.steps + 1):
            estimate = estimate_chat_input_tokens(history)
            try:
                reservation = allowance.reserve(
                    cfg.tenant,
                    {"input_tokens": estimate, "output_tokens": cfg.tranche_tokens},
                    scopes={"agent": cfg.agent},
                    labels={"agent": cfg.agent, "step": str(number)},
                )
            except Denied as denial:
                stopped_by = denial
                break
            with reservation as r:
                stream = ai.chat.completions.create(
                    model=cfg.model,
                    messages=history,
                    max_tokens=cfg.max_output_tokens,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                text: list[str] = []
                usage: dict[str, int] | None = None
                with stream:
                    for chunk in r.stream(
                        stream,
                        chunk_tokens,
                        tranche_tokens=cfg.tranche_tokens,
                        max_output_tokens=cfg.max_output_tokens,
                    ):
                        if chunk.usage is not None:
                            usage = {
                                "input_tokens": chunk.usage.prompt_tokens,
                                "output_tokens": chunk.usage.completion_tokens,
                            }
                        for choice in chunk.choices:
                            text.append(choice.delta.content or "")
                            if not cfg.quiet:
                                print(choice.delta.content or "", end="", flush=True)
                if not cfg.quiet:
                    print()
                seen = sum(estimate_stream_text_tokens(t) for t in text)
                settled = usage or {"input_tokens": estimate, "output_tokens": seen}
                r.settle(settled)
            steps.append(
                Step(number, estimate, r.held["output_tokens"], settled, usage is not None, r.cut)
            )
            history.append({"role": "assistant", "content": "".join(text)})
            history.append({"role": "user", "content": f"Continue with step {number + 1}."})
            if r.cut is not None:
                stopped_by = r.cut
                break
        status = allowance.status(cfg.scope)
    return AgentReport(cfg, steps, stopped_by, status)


def parse_args(argv: Sequence[str] | None) -> AgentConfig:
    """The command line → an :class:`AgentConfig`."""
    p = argparse.ArgumentParser(description="A streaming agent loop on an allowance budget.")
    p.add_argument("--url", default="http://127.0.0.1:8787", help="the allowance server")
    p.add_argument("--token", required=True, help="a token for the tenant (or admin)")
    p.add_argument("--admin-token", help="sets the agent's token budget")
    p.add_argument("--upstream", required=True, help="OpenAI-compatible base URL, with /v1")
    p.add_argument("--upstream-key", default="sk-local")
    p.add_argument("--model", default="gpt-4o-mini")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-output-tokens", type=int, default=200)
    p.add_argument("--tranche-tokens", type=int, default=64)
    p.add_argument("--budget-tokens", type=int, default=2_500)
    p.add_argument("--quiet", action="store_true", help="print the report only")
    a = p.parse_args(argv)
    return AgentConfig(
        url=a.url,
        token=a.token,
        upstream=a.upstream,
        upstream_key=a.upstream_key,
        admin_token=a.admin_token,
        model=a.model,
        steps=a.steps,
        max_output_tokens=a.max_output_tokens,
        tranche_tokens=a.tranche_tokens,
        budget_tokens=a.budget_tokens,
        quiet=a.quiet,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the loop and prints its report."""
    report = run(parse_args(argv))
    print(report.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
