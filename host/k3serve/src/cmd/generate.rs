//! `k3serve generate`: placeholder replaced below.
#[derive(clap::Args)]
pub struct Args {}
pub fn run(_a: Args) -> anyhow::Result<()> { Ok(()) }
