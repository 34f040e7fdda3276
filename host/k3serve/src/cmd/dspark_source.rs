//! The DSpark drafter as a draft source factory.

use std::path::Path;
use std::sync::Arc;

use k3_speculative::DraftSourceFactory;

pub fn load(dir: &Path, target_dir: &Path) -> anyhow::Result<Arc<dyn DraftSourceFactory>> {
    anyhow::bail!(
        "the DSpark drafter ({}) for {} is not wired in this build",
        dir.display(),
        target_dir.display()
    )
}
