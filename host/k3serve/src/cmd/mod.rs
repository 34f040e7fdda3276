//! One module per subcommand.

pub mod bench;
pub mod cache_budget;
pub mod dspark_source;
pub mod generate;
pub mod media_config;
pub mod model_loading;
pub mod plugin_install;
pub mod router;
pub mod serve;
pub mod serve_config;
pub mod speculative;
pub mod vllm_flags;

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether log lines are JSON (`serve --log-format json`): then operator messages go through
/// the logger too, so that every line of the output is one JSON object.
pub static JSON_LOGS: AtomicBool = AtomicBool::new(false);

/// A start-up or shutdown message for the operator: a plain stderr line, or a log event when
/// logs are JSON.
pub fn say(message: &str) {
    if JSON_LOGS.load(Ordering::Relaxed) {
        tracing::info!(target: "k3serve", "{message}");
    } else {
        eprintln!("{message}");
    }
}
