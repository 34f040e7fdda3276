//! One module per subcommand.

pub mod bench;
pub mod generate;
pub mod model_loading;
