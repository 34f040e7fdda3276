use std::path::PathBuf;
use std::time::Duration;

/// Plugin host settings. `Default` is sized for a server: 64 MiB per store, 250 ms per parser
/// call, 2 s per template render; 256 MiB and 10 s per image in the media stage.
#[derive(Debug, Clone)]
pub struct PluginHostConfig {
    /// Directory for precompiled components (`<sha256>-<engine hash>.cwasm`); `None` compiles
    /// in memory on every start.
    pub cache_dir: Option<PathBuf>,
    /// Linear-memory cap per store (bytes). Growth past it traps and fails only that call.
    pub memory_limit: usize,
    /// CPU-time cap per parser / load-time call (epoch deadline; precision is `epoch_tick`).
    pub call_timeout: Duration,
    /// CPU-time cap per chat-template call (long conversations take longer to render).
    pub template_timeout: Duration,
    /// Linear-memory cap of a media-stage store, one per image: decoding needs the image's
    /// pixels in memory (a 12-megapixel photo is 36 MB as RGB8), far beyond what text stages
    /// use. Also the pooling allocator's per-memory maximum when larger than `memory_limit`.
    pub media_memory_limit: usize,
    /// CPU-time cap per image in the media stage (decode, orient, resize, normalise).
    pub media_timeout: Duration,
    /// Epoch ticker period.
    pub epoch_tick: Duration,
    /// Concurrent plugin instances the pooling allocator reserves (every live stream holds one;
    /// see [`PluginHostConfig::instances_for`]). When all are taken, starting one more fails
    /// with [`crate::PluginError::Capacity`].
    pub max_instances: u32,
    /// Warm chat-template instances kept per version.
    pub template_pool_size: usize,
    /// A warm chat-template instance whose linear memory grew past this (bytes) is dropped
    /// after its render instead of going back to the pool: wasm memory never shrinks, so one
    /// huge prompt would otherwise pin that much resident memory for good.
    pub template_keep_memory: usize,
    /// Loaded (inactive) versions kept per stage; the oldest inactive ones are dropped.
    pub max_versions_per_stage: usize,
}

impl Default for PluginHostConfig {
    fn default() -> Self {
        Self {
            cache_dir: None,
            memory_limit: 64 << 20,
            call_timeout: Duration::from_millis(250),
            template_timeout: Duration::from_secs(2),
            media_memory_limit: 256 << 20,
            media_timeout: Duration::from_secs(10),
            epoch_tick: Duration::from_millis(10),
            max_instances: 1000,
            template_pool_size: 4,
            template_keep_memory: 16 << 20,
            max_versions_per_stage: 8,
        }
    }
}

impl PluginHostConfig {
    /// Instance slots for a server that runs up to `concurrent_choices` generations at once
    /// (admitted requests × `n`):
    /// - 2 per choice: each streaming choice holds a reasoning- and a tool-parser stream, one
    ///   instance each, for its whole life;
    /// - the warm chat-template pools: `template_pool_size` for the active version and as many
    ///   again for the previous one (a swap leaves its pool alive until it is dropped);
    /// - headroom for short-lived instances (renders beyond the pool, one-shot parses, output
    ///   grammars, a plugin load's self-test and smoke test): 64, or 1/8 of the choices if more.
    ///
    /// Slots cost address space, not memory: each reserves two linear-memory slots of about
    /// 4 GiB of virtual address space (the pooling allocator's default reservation, which lets
    /// compiled code skip bounds checks), so ~15,000 instances fill a 47-bit address space; past
    /// what the OS grants the host falls back to on-demand allocation, which has no slot limit.
    pub fn instances_for(&self, concurrent_choices: usize) -> u32 {
        let choices = u64::try_from(concurrent_choices).unwrap_or(u64::MAX);
        let pools = 2 * self.template_pool_size as u64;
        let headroom = (choices / 8).max(64);
        let total = choices
            .saturating_mul(2)
            .saturating_add(pools)
            .saturating_add(headroom);
        u32::try_from(total).unwrap_or(u32::MAX)
    }

    pub fn with_cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cache_dir = Some(dir.into());
        self
    }
}
