//! k3serve: thin dispatcher over the subcommands in `cmd/`.

mod cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "k3serve",
    version,
    about = "Inference server for the Kimi K3 model family"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a raw prompt on the CPU, streaming to stdout.
    Generate(cmd::generate::Args),
    /// Measure CPU throughput: batch-1 decode, prefill of a long prompt, peak RSS.
    Bench(cmd::bench::Args),
    /// Serve the OpenAI and Anthropic HTTP APIs.
    Serve(Box<cmd::serve::Args>),
    /// Route the HTTP APIs across several `serve` replicas by a wasm policy (cache-aware).
    Router(Box<cmd::router::Args>),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Generate(a) => cmd::generate::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Serve(a) => cmd::serve::run(*a),
        Command::Router(a) => cmd::router::run(*a),
    }
}
