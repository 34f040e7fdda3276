//! One module per subcommand.

pub mod bench;
pub mod cache_budget;
pub mod generate;
pub mod model_loading;
pub mod serve;
pub mod serve_config;
pub mod vllm_flags;
