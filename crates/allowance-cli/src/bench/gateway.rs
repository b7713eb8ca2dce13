//! `allowance bench --scenario gateway`: the gateway's added latency over
//! its upstream called directly (`allowance_bench::gateway`).

use std::fmt;
use std::str::FromStr;

use allowance_bench::gateway::{DEFAULT_PROMPT_SIZES_TOKENS, GATEWAY_SCENARIO};
use allowance_bench::{GatewayBenchOptions, GatewayTarget, Progress, Scenario};
use anyhow::Context;

/// `--scenario`: one of the load scenarios, or `gateway`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScenarioArg {
    /// A scenario of `allowance_bench::run`.
    Load(Scenario),
    /// The gateway's latency against its upstream.
    Gateway,
}

impl fmt::Display for ScenarioArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScenarioArg::Load(s) => s.fmt(f),
            ScenarioArg::Gateway => f.write_str(GATEWAY_SCENARIO),
        }
    }
}

impl FromStr for ScenarioArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == GATEWAY_SCENARIO {
            return Ok(ScenarioArg::Gateway);
        }
        s.parse().map(ScenarioArg::Load).map_err(|_| {
            let names: Vec<&str> = Scenario::ALL.iter().map(|s| s.name()).collect();
            format!(
                "unknown scenario {s:?}: expected one of {}, {GATEWAY_SCENARIO}",
                names.join(", ")
            )
        })
    }
}

/// The `gateway` scenario's flags (other scenarios ignore them).
#[derive(Debug, clap::Args)]
pub struct GatewayArgs {
    /// gateway: an endpoint to measure against --direct, `NAME=URL` (repeat for several, e.g.
    /// memory=http://127.0.0.1:8787 litellm=http://127.0.0.1:4000).
    #[arg(long = "target", value_name = "NAME=URL")]
    targets: Vec<GatewayTarget>,
    /// gateway: the upstream itself, called directly (the stub's base URL, no /v1).
    #[arg(long, value_name = "URL")]
    direct: Option<String>,
    /// gateway: the key sent as `Authorization: Bearer` to every endpoint.
    #[arg(long, env = "ALLOWANCE_GATEWAY_KEY", hide_env_values = true)]
    key: Option<String>,
    /// gateway: prompt sizes in input tokens, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = DEFAULT_PROMPT_SIZES_TOKENS)]
    sizes: Vec<u64>,
    /// gateway: measured rounds (the report gives medians over them).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// gateway: calls of each shape to each endpoint per round.
    #[arg(long, default_value_t = 40)]
    iterations: usize,
    /// gateway: iterations before measuring.
    #[arg(long, default_value_t = 5)]
    warmup_iterations: usize,
    /// gateway: the model requested.
    #[arg(long, default_value = "gpt-4o")]
    model: String,
    /// gateway: max_tokens of every request.
    #[arg(long, default_value_t = 20)]
    max_tokens: u64,
    /// gateway: a target whose overhead the others' are divided by (e.g. litellm).
    #[arg(long)]
    reference: Option<String>,
    /// gateway: interleave the reference call by call with the other targets instead of
    /// measuring it in a phase of its own in every round (its work after each answer then
    /// lands on the others' calls).
    #[arg(long)]
    reference_mixed: bool,
}

/// Runs the `gateway` scenario with `concurrency` workers (1 unless given).
pub async fn bench(args: GatewayArgs, concurrency: Option<usize>) -> anyhow::Result<String> {
    let direct = args
        .direct
        .context("--direct: the gateway scenario needs the upstream's URL to compare with")?;
    let opts = GatewayBenchOptions {
        key: args.key,
        model: args.model,
        max_tokens: args.max_tokens,
        prompt_sizes_tokens: args.sizes,
        rounds: args.rounds,
        iterations: args.iterations,
        warmup_iterations: args.warmup_iterations,
        concurrency: concurrency.unwrap_or(1),
        reference: args.reference,
        reference_apart: !args.reference_mixed,
        progress: Progress::auto(),
        ..GatewayBenchOptions::new(direct, args.targets)
    };
    let report = allowance_bench::run_gateway(&opts)
        .await
        .context("gateway benchmark")?;
    Ok(format!("{report}"))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    /// `bench`'s flags as the binary parses them.
    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: super::super::BenchArgs,
    }

    #[test]
    fn the_gateway_scenario_and_its_flags_parse() {
        let cli = Cli::try_parse_from([
            "bench",
            "--scenario",
            "gateway",
            "--target",
            "memory=http://127.0.0.1:1",
            "--target",
            "litellm=http://127.0.0.1:2",
            "--direct",
            "http://127.0.0.1:3",
            "--sizes",
            "100,4096",
            "--reference",
            "litellm",
        ])
        .unwrap();
        assert_eq!(cli.args.scenario, ScenarioArg::Gateway);
        assert_eq!(
            cli.args.concurrency, None,
            "the gateway's default (1) applies"
        );
        let g = &cli.args.gateway;
        let names: Vec<&str> = g.targets.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["memory", "litellm"]);
        assert_eq!(g.direct.as_deref(), Some("http://127.0.0.1:3"));
        assert_eq!(g.sizes, [100, 4096]);
        assert_eq!((g.rounds, g.iterations), (5, 40));

        let defaults = Cli::try_parse_from(["bench"]).unwrap();
        assert_eq!(defaults.args.scenario, ScenarioArg::Load(Scenario::Pairs));
        assert_eq!(defaults.args.gateway.sizes, DEFAULT_PROMPT_SIZES_TOKENS);
    }

    #[test]
    fn an_unknown_scenario_lists_every_name() {
        let err = Cli::try_parse_from(["bench", "--scenario", "gatewya"]).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("fanout") && text.contains("gateway"),
            "{text}"
        );
        let err = Cli::try_parse_from(["bench", "--target", "a b=http://x"]).unwrap_err();
        assert!(err.to_string().contains("--target"), "{err}");
    }

    #[tokio::test]
    async fn the_gateway_scenario_needs_direct() {
        let cli = Cli::try_parse_from([
            "bench",
            "--scenario",
            "gateway",
            "--target",
            "gw=http://127.0.0.1:1",
        ])
        .unwrap();
        let err = bench(*cli.args.gateway, None).await.unwrap_err();
        assert!(format!("{err:#}").contains("--direct"), "{err:#}");
    }
}
