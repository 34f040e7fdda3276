//! `k3serve bench`: placeholder replaced below.
#[derive(clap::Args)]
pub struct Args {}
pub fn run(_a: Args) -> anyhow::Result<()> { Ok(()) }
