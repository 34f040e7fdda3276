//! The DSpark drafter (`k3-dspark`) as the server's draft source: one model loaded at start-up,
//! run on the CPU next to whatever device the target uses, one drafter per sequence.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use k3_backend_cpu::CpuBackend;
use k3_dspark::{DsparkDrafter, DsparkModel};
use k3_speculative::{DraftSource, DraftSourceFactory};

struct Dspark {
    model: Arc<DsparkModel<CpuBackend>>,
}

impl DraftSourceFactory for Dspark {
    fn method(&self) -> &str {
        "dspark"
    }

    fn create(&self) -> Box<dyn DraftSource> {
        Box::new(DsparkDrafter::new(Arc::clone(&self.model)))
    }

    fn tap_layers(&self) -> Vec<usize> {
        self.model.tap_layers().to_vec()
    }
}

/// Load the drafter in `dir` for the target model in `target_dir` (whose embedding and LM head
/// it shares).
pub fn load(dir: &Path, target_dir: &Path) -> anyhow::Result<Arc<dyn DraftSourceFactory>> {
    let model = DsparkModel::load(dir, target_dir, CpuBackend::new())
        .with_context(|| format!("loading the DSpark drafter from {}", dir.display()))?;
    Ok(Arc::new(Dspark {
        model: Arc::new(model),
    }))
}
