//! Engine configuration.

use crate::memory::PoolMode;
use k3_speculative::{DraftSourceFactory, StepCostProfile};
use std::sync::Arc;

/// Speculative decoding (docs/speculative-decoding.md): where drafts come from, how long they
/// may be, and what a target step costs (for the verify planner).
#[derive(Clone)]
pub struct SpeculationConfig {
    /// One draft source per speculating request.
    pub source: Arc<dyn DraftSourceFactory>,
    /// Most draft tokens one verify checks (`num_speculative_tokens`).
    pub max_draft: usize,
    /// Seconds of a target step by token count. With it the planner keeps a draft token only
    /// while its expected value pays for its cost; without it every proposed token is verified.
    pub cost: Option<StepCostProfile>,
}

impl std::fmt::Debug for SpeculationConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpeculationConfig")
            .field("method", &self.source.method())
            .field("max_draft", &self.max_draft)
            .field("cost", &self.cost)
            .finish()
    }
}

impl PartialEq for SpeculationConfig {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.source, &other.source)
            && self.max_draft == other.max_draft
            && self.cost == other.cost
    }
}

/// How the engine schedules and where it keeps memory. Page size and block sizes come from the
/// executor ([`k3_model::CacheLayout`]: `page_tokens`, default 16 in the model's executors).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// One arena for state and KV (default) or two fixed pools (for comparison).
    pub pool_mode: PoolMode,
    /// Radix prefix cache with KDA checkpoints.
    pub prefix_cache: bool,
    /// Checkpoint alignment in tokens (a multiple of the page size); 0 = 4 pages.
    pub checkpoint_interval: usize,
    /// Most checkpoints on one root-to-leaf path of the prefix tree.
    pub checkpoints_per_path: usize,
    /// State slots a running request holds (working, snapshot, two retention spares): ≥ 4.
    pub state_slots_per_request: usize,
    /// Most requests in the running batch.
    pub max_running: usize,
    /// Most requests waiting for admission before submissions are refused.
    pub max_waiting: usize,
    /// Token budget of one step when many requests run (decode first, prefill fills the rest).
    pub step_tokens: usize,
    /// Token budget when at most `few_running` requests run, so a long prompt is not cut into
    /// many forwards.
    pub max_step_tokens: usize,
    pub few_running: usize,
    /// Context length: prompt + generated tokens.
    pub max_context: usize,
    /// Tokens that end generation unless a request sets `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// Prepare the next step while the current forward runs.
    pub overlap: bool,
    /// Speculative decoding for requests whose sampler supports it; `None`: off.
    pub speculation: Option<SpeculationConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            pool_mode: PoolMode::Unified,
            prefix_cache: true,
            checkpoint_interval: 0,
            checkpoints_per_path: 4,
            state_slots_per_request: 4,
            max_running: 64,
            max_waiting: 1024,
            step_tokens: 512,
            max_step_tokens: 4096,
            few_running: 4,
            max_context: 32768,
            eos_token_ids: Vec::new(),
            overlap: true,
            speculation: None,
        }
    }
}

/// Why an [`EngineConfig`] cannot start an engine (the model's `config.json` has its own
/// `k3_model::ConfigError`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineConfigError {
    #[error("checkpoint_interval {interval} is not a positive multiple of the page size {page}")]
    Interval { interval: usize, page: usize },
    #[error("state_slots_per_request must be at least 4 (got {0})")]
    Slots(usize),
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    #[error(transparent)]
    Pool(#[from] crate::memory::PoolError),
    #[error("vocabulary size is 0")]
    EmptyVocab,
    #[error("cannot start the engine thread: {0}")]
    Spawn(String),
    #[error("speculative decoding: {0}")]
    Speculation(String),
}

impl EngineConfig {
    /// The effective checkpoint interval for a page size.
    pub fn interval(&self, page: usize) -> usize {
        if self.checkpoint_interval == 0 {
            4 * page
        } else {
            self.checkpoint_interval
        }
    }

    /// Checks that need the executor's layout (speculation's verify length).
    pub(crate) fn validate_for(
        &self,
        layout: &k3_model::CacheLayout,
    ) -> Result<(), EngineConfigError> {
        self.validate(layout.page_tokens)?;
        if let Some(s) = &self.speculation {
            if s.max_draft == 0 {
                return Err(EngineConfigError::Speculation(
                    "num_speculative_tokens must be at least 1".into(),
                ));
            }
            if s.max_draft + 1 > layout.verify_tokens_max {
                return Err(EngineConfigError::Speculation(
                    if layout.verify_tokens_max == 0 {
                        "this backend cannot verify draft tokens yet".into()
                    } else {
                        format!(
                            "num_speculative_tokens {} is more than this model verifies at once ({})",
                            s.max_draft,
                            layout.verify_tokens_max - 1
                        )
                    },
                ));
            }
        }
        Ok(())
    }

    pub(crate) fn validate(&self, page: usize) -> Result<(), EngineConfigError> {
        let interval = self.interval(page);
        if page == 0 || !interval.is_multiple_of(page) {
            return Err(EngineConfigError::Interval { interval, page });
        }
        if self.state_slots_per_request < 4 {
            return Err(EngineConfigError::Slots(self.state_slots_per_request));
        }
        for (v, name) in [
            (self.checkpoints_per_path, "checkpoints_per_path"),
            (self.max_running, "max_running"),
            (self.step_tokens, "step_tokens"),
            (self.max_step_tokens, "max_step_tokens"),
            (self.max_context, "max_context"),
        ] {
            if v == 0 {
                return Err(EngineConfigError::Zero(name));
            }
        }
        Ok(())
    }
}
