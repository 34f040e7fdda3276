//! CUDA graphs for decode steps: the step's kernels are captured once and replayed as one graph
//! launch, instead of a few hundred launches (each a driver call of a few µs on the host, and a
//! gap on the GPU between small kernels).
//!
//! How a step is matched to a graph. The model code stays the one source of truth for what a
//! step queues: every replayable step first runs the forward pass *dry* — the host logic runs,
//! every op logs what it would queue (kernel, grid, scalar arguments, arena offsets, GEMM shapes,
//! upload sizes) and writes the bytes it would upload (token ids, state slots, page tables) into
//! one pinned staging buffer, but nothing is launched. If a captured graph logged exactly the
//! same work, it is launched: its first nodes copy the staging buffer's new contents to the
//! device. Otherwise the step runs eagerly, and the second time the same log is seen the pass is
//! captured (`cuStreamBeginCapture`), which records the same work with uploads from the same
//! staging offsets. Anything the dry pass cannot vouch for (a download, a path that is not
//! logged: such an op returns an error) fails it and the step runs eagerly. What the log leaves out — the
//! addresses of weights and of the step's own activations — follows from the same host code
//! taking the same path, which the identical log attests; a missed replay only costs speed.
//!
//! Buffers: activations allocated inside the capture become graph allocation nodes (fixed
//! addresses, freed inside the graph); the step's result is copied into a buffer the graph owns
//! and from there into a fresh output after each launch.

use crate::device::{CudaBackend, DeviceMat};
use crate::error::{CudaError, Result};
use crate::geometry::Launch;
use cudarc::driver::{CudaEvent, CudaSlice, CudaView, DevicePtr, DeviceRepr, sys};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};

/// How the current pass treats device work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Queue it (the normal case, and every non-replayable step).
    Eager = 0,
    /// Log it, upload into staging, queue nothing.
    Dry = 1,
    /// Log it and queue it under stream capture.
    Capture = 2,
}

/// Log tags, so that different kinds of entries can never produce the same word sequence.
const TAG_LAUNCH: u64 = 1 << 60;
const TAG_UPLOAD: u64 = 2 << 60;
const TAG_GEMM: u64 = 3 << 60;
const TAG_COPY: u64 = 4 << 60;
const TAG_ARENA: u64 = 5 << 60;

/// Pinned staging for the uploads of one step. 8 MiB: a decode step of 64 sequences at 32k
/// tokens uploads ~0.3 MB per MLA layer (page tables); a step that needs more runs eagerly.
const STAGING_BYTES: usize = 8 << 20;
/// Graphs kept (one per distinct step log: batch size, MLA split count, page-table bucket),
/// least recently used dropped first. Each holds its result buffer (rows x vocab f32) and the
/// graph's own activation memory, which the 6 GiB work reserve of `--gpu-memory-utilization`
/// must cover.
const MAX_GRAPHS: usize = 16;
/// A log is captured the second time it is seen, so one-off shapes never pay for a capture.
const CAPTURE_AFTER: u32 = 2;
const NEVER: u32 = u32::MAX;

/// Page-locked host memory (the graph's upload nodes read it at every launch).
struct Pinned {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain host memory owned by this value; access is serialised by StepState's mutex.
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(len: usize) -> Result<Self> {
        // SAFETY: allocates `len` bytes of page-locked memory; freed once in Drop.
        let ptr = unsafe { cudarc::driver::result::malloc_host(len, 0) }? as *mut u8;
        Ok(Self { ptr, len })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host in `new`, freed exactly once.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

struct Captured {
    graph: cudarc::driver::CudaGraph,
    log: Vec<u64>,
    /// The step's result `(rows, cols, buffer)`, written by the graph's last node.
    out: Option<(usize, usize, CudaSlice<f32>)>,
    last_used: u64,
}

// SAFETY: CUDA graph handles may be used from any thread as long as calls on one graph are
// serialised (the driver API's graph thread-safety rule); every use goes through StepState's
// mutex.
unsafe impl Send for Captured {}

#[derive(Default)]
struct Inner {
    log: Vec<u64>,
    staging: Option<Pinned>,
    used: usize,
    graphs: HashMap<u64, Captured>,
    seen: HashMap<u64, u32>,
    clock: u64,
    /// Recorded after each graph launch: staging is rewritten only once the launch has read it.
    launched: Option<CudaEvent>,
    /// Arenas `(base, end, id)`: arena pointers are logged as (id, offset), other buffers not.
    arenas: Vec<(u64, u64, u64)>,
    next_arena: u64,
    counts: GraphCounts,
}

/// Steps by outcome (for `k3serve bench` and the tests).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GraphCounts {
    pub replayed: u64,
    pub captured: u64,
    pub eager: u64,
    pub aborted: u64,
}

/// The per-backend state of the graph machinery.
pub(crate) struct StepState {
    mode: AtomicU8,
    enabled: bool,
    inner: Mutex<Inner>,
}

impl StepState {
    /// Graphs `enabled` (`CudaOptions::cuda_graphs`), never while per-op profiling (which waits
    /// around every op) is on.
    pub fn new(enabled: bool, profiling: bool) -> Self {
        Self {
            mode: AtomicU8::new(Mode::Eager as u8),
            enabled: enabled && !profiling,
            inner: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn mode(&self) -> Mode {
        match self.mode.load(Ordering::Relaxed) {
            1 => Mode::Dry,
            2 => Mode::Capture,
            _ => Mode::Eager,
        }
    }

    /// Device work is to be logged (dry pass or capture).
    pub fn recording(&self) -> bool {
        self.mode() != Mode::Eager
    }

    /// Device work is to be skipped (dry pass).
    pub fn dry(&self) -> bool {
        self.mode() == Mode::Dry
    }

    /// A new arena: pointers into it are logged as its id and an offset, so a graph captured
    /// over one arena never replays over another (ids are never reused).
    pub fn add_arena(&self, base: u64, bytes: usize) {
        let mut g = self.lock();
        let id = g.next_arena;
        g.next_arena += 1;
        g.arenas
            .retain(|&(b, e, _)| e <= base || b >= base + bytes as u64);
        g.arenas.push((base, base + bytes as u64, id));
        g.graphs.clear(); // graphs over an arena that is gone would only take memory
        g.seen.clear();
    }

    pub fn counts(&self) -> GraphCounts {
        self.lock().counts
    }

    /// Log one word sequence (tag in the first word).
    pub fn log(&self, words: &[u64]) {
        self.lock().log.extend_from_slice(words);
    }

    pub fn log_launch(&self, name: &'static str, l: &Launch, args: &[u64]) {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        name.hash(&mut h);
        let mut g = self.lock();
        g.log.push(TAG_LAUNCH | (args.len() as u64));
        g.log.push(h.finish());
        g.log.push(u64::from(l.grid.0) | u64::from(l.grid.1) << 32);
        g.log.push(u64::from(l.grid.2) | u64::from(l.block) << 32);
        g.log.push(u64::from(l.shared));
        g.log.extend_from_slice(args);
    }

    pub fn log_gemm(&self, dims: &[usize]) {
        let mut g = self.lock();
        g.log.push(TAG_GEMM | dims.len() as u64);
        g.log.extend(dims.iter().map(|&d| d as u64));
    }

    pub fn log_copy(&self, bytes: usize) {
        self.log(&[TAG_COPY, bytes as u64]);
    }

    /// The word logged for a device-buffer argument: its arena offset for arena pointers
    /// (state slots and pages may be passed as sub-slices), 0 for anything else (weights, and
    /// activations whose addresses differ between the dry pass and the capture).
    pub fn ptr_word(&self, ptr: u64) -> u64 {
        let g = self.lock();
        match g.arenas.iter().find(|&&(b, e, _)| ptr >= b && ptr < e) {
            // 44 bits of offset (16 TiB) and 12 of id; ids past 4095 only alias after wrapping.
            Some(&(b, _, id)) => TAG_ARENA | (id & 0xFFF) << 44 | (ptr - b),
            None => 0,
        }
    }

    /// Copy `bytes` into staging; returns the host address they were written to.
    fn stage(&self, bytes: &[u8]) -> Result<*const u8> {
        let mut g = self.lock();
        if g.staging.is_none() {
            g.staging = Some(Pinned::new(STAGING_BYTES)?);
        }
        let at = g.used.next_multiple_of(16);
        let end = at + bytes.len();
        let cap = g.staging.as_ref().map_or(0, |p| p.len);
        if end > cap {
            return Err(CudaError::Unsupported(format!(
                "step uploads exceed the {cap}-byte graph staging buffer"
            )));
        }
        g.used = end;
        g.log.push(TAG_UPLOAD | bytes.len() as u64);
        let p = g.staging.as_ref().map_or(std::ptr::null_mut(), |p| p.ptr);
        // SAFETY: [at, end) is inside the allocation (checked above); the source is a live slice;
        // the previous graph launch has finished reading staging (run_step waits for it).
        unsafe {
            let dst = p.add(at);
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len());
            Ok(dst)
        }
    }

    fn begin(&self, mode: Mode) {
        let mut g = self.lock();
        g.log.clear();
        g.used = 0;
        self.mode.store(mode as u8, Ordering::Relaxed);
    }

    fn finish(&self) -> Vec<u64> {
        self.mode.store(Mode::Eager as u8, Ordering::Relaxed);
        std::mem::take(&mut self.lock().log)
    }
}

/// A kernel argument's contribution to the step log (`launch!` logs every argument).
pub(crate) trait StepArg {
    fn step_word(&self, s: &StepState, stream: &cudarc::driver::CudaStream) -> u64;
}

macro_rules! scalar_step_arg {
    ($($t:ty),*) => {$(
        impl StepArg for &$t {
            fn step_word(&self, _: &StepState, _: &cudarc::driver::CudaStream) -> u64 {
                let mut w = [0u8; 8];
                let b = self.to_le_bytes();
                w[..b.len()].copy_from_slice(&b);
                u64::from_le_bytes(w)
            }
        }
    )*};
}
scalar_step_arg!(i32, u32, i64, u64, f32);

impl<T> StepArg for &CudaSlice<T> {
    fn step_word(&self, s: &StepState, stream: &cudarc::driver::CudaStream) -> u64 {
        let (p, _sync) = self.device_ptr(stream);
        s.ptr_word(p)
    }
}

impl<T> StepArg for &mut CudaSlice<T> {
    fn step_word(&self, s: &StepState, stream: &cudarc::driver::CudaStream) -> u64 {
        let (p, _sync) = (**self).device_ptr(stream);
        s.ptr_word(p)
    }
}

impl<T> StepArg for &CudaView<'_, T> {
    fn step_word(&self, s: &StepState, stream: &cudarc::driver::CudaStream) -> u64 {
        let (p, _sync) = self.device_ptr(stream);
        s.ptr_word(p)
    }
}

fn as_bytes<T: DeviceRepr>(data: &[T]) -> &[u8] {
    // SAFETY: DeviceRepr types are plain old data; the byte view covers exactly the slice.
    unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) }
}

fn hash_log(log: &[u64]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    log.hash(&mut h);
    h.finish()
}

impl CudaBackend {
    /// Host → device copy of a small per-step input (ids, slots, page tables). Eager: a plain
    /// copy. Dry pass: into staging only. Capture: into staging, and a captured copy from
    /// staging, so every replay uploads whatever the dry pass staged at the same offset.
    pub fn upload_slice<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        match self.step.mode() {
            Mode::Eager => Ok(self.stream.memcpy_stod(data)?),
            Mode::Dry => {
                self.step.stage(as_bytes(data))?;
                self.uninit::<T>(data.len())
            }
            Mode::Capture => {
                let bytes = as_bytes(data);
                let src = self.step.stage(bytes)?;
                let dst = self.uninit::<T>(data.len())?;
                if !bytes.is_empty() {
                    let (d, _sync) = dst.device_ptr(&self.stream);
                    // SAFETY: `src` is `bytes.len()` bytes of pinned staging that lives as long as
                    // the backend (and so every graph); `dst` holds at least as many bytes.
                    unsafe {
                        sys::cuMemcpyHtoDAsync_v2(
                            d,
                            src as *const std::ffi::c_void,
                            bytes.len(),
                            self.stream.cu_stream(),
                        )
                    }
                    .result()?;
                }
                Ok(dst)
            }
        }
    }

    /// Device → device copy of a whole or partial buffer (logged; skipped in a dry pass).
    pub(crate) fn copy_dtod<T, S, D>(&self, src: &S, dst: &mut D) -> Result<()>
    where
        S: DevicePtr<T>,
        D: cudarc::driver::DevicePtrMut<T>,
    {
        if self.step.recording() {
            self.step.log_copy(src.num_bytes());
        }
        if self.step.dry() {
            return Ok(());
        }
        Ok(self.stream.memcpy_dtod(src, dst)?)
    }

    /// Device → host copy (waits for the stream). Every read-back goes through here, so a logged
    /// pass refuses it in one place: it would need the pass's work to have run.
    pub(crate) fn read_back<T: DeviceRepr, S: DevicePtr<T>>(
        &self,
        what: &str,
        src: &S,
    ) -> Result<Vec<T>> {
        self.refuse_while_recording(what)?;
        Ok(self.stream.memcpy_dtov(src)?)
    }

    /// Refuse, inside a logged pass, what a graph cannot hold: device → host reads (they need the
    /// work to have run) and the cache moves between steps.
    pub(crate) fn refuse_while_recording(&self, what: &str) -> Result<()> {
        if self.step.recording() {
            return Err(CudaError::Unsupported(format!(
                "{what}: a device read inside a replayable step"
            )));
        }
        Ok(())
    }

    /// Turn CUDA graphs for decode steps on or off (default: `CudaOptions::cuda_graphs`).
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.step.enabled = on;
    }

    /// Steps by outcome since start-up.
    pub fn graph_counts(&self) -> GraphCounts {
        self.step.counts()
    }

    /// One engine step's forward pass, through a CUDA graph when `replayable` (module doc).
    pub(crate) fn run_graph_step(
        &self,
        replayable: bool,
        pass: &mut dyn FnMut() -> std::result::Result<Option<DeviceMat>, k3_model::exec::ExecError>,
    ) -> std::result::Result<Option<DeviceMat>, k3_model::exec::ExecError> {
        if !replayable || !self.step.enabled {
            return pass();
        }
        if let Some(ev) = self.step.lock().launched.take() {
            // The previous launch must be done reading staging before the dry pass rewrites it
            // (normally it is: its logits were downloaded).
            let _ = ev.synchronize();
        }
        self.step.begin(Mode::Dry);
        let dry = pass();
        let log = self.step.finish();
        let shape = match &dry {
            Ok(out) => out.as_ref().map(|m| (m.rows, m.cols)),
            Err(_) => return self.eager(pass, true),
        };
        drop(dry);
        let key = hash_log(&log);
        match self.replay(key, &log, true) {
            Ok(Some(out)) => return Ok(out.map_err(k3_model::BackendError::from)?),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!("CUDA graph launch failed ({e}); running the step eagerly");
                self.step.lock().graphs.remove(&key);
                return self.eager(pass, true);
            }
        }
        let seen = {
            let mut g = self.step.lock();
            if g.seen.len() > 4096 {
                g.seen.clear();
            }
            let n = g.seen.entry(key).or_insert(0);
            if *n != NEVER {
                *n += 1;
            }
            *n
        };
        if seen < CAPTURE_AFTER || seen == NEVER {
            return self.eager(pass, false);
        }
        match self.capture(key, log, shape, pass) {
            Ok(out) => Ok(out.map_err(k3_model::BackendError::from)?),
            Err(why) => {
                tracing::info!("decode step not captured as a CUDA graph: {why}");
                self.step.lock().seen.insert(key, NEVER);
                self.eager(pass, true)
            }
        }
    }

    fn eager(
        &self,
        pass: &mut dyn FnMut() -> std::result::Result<Option<DeviceMat>, k3_model::exec::ExecError>,
        aborted: bool,
    ) -> std::result::Result<Option<DeviceMat>, k3_model::exec::ExecError> {
        {
            let mut g = self.step.lock();
            if aborted {
                g.counts.aborted += 1;
            } else {
                g.counts.eager += 1;
            }
        }
        pass()
    }

    /// Launch the graph captured for `log`, if any; returns the step's result. The outer error
    /// means nothing was queued; the inner one that the step ran but its result was lost.
    fn replay(
        &self,
        key: u64,
        log: &[u64],
        count: bool,
    ) -> Result<Option<Result<Option<DeviceMat>>>> {
        let mut g = self.step.lock();
        g.clock += 1;
        let clock = g.clock;
        let Some(c) = g.graphs.get_mut(&key) else {
            return Ok(None);
        };
        if c.log != log {
            return Ok(None); // a hash collision: not the same work
        }
        c.last_used = clock;
        // An error here means nothing was queued: the caller may still run the step eagerly.
        c.graph.launch()?;
        // From here on the step has run (states advanced, rows appended): a failure must be
        // reported, never answered by running the step a second time.
        let copied = match &c.out {
            None => Ok(None),
            Some((rows, cols, buf)) => self.output(*rows, *cols).and_then(|mut m| {
                self.stream.memcpy_dtod(buf, &mut m.buf)?;
                Ok(Some(m))
            }),
        };
        g.launched = self.stream.record_event(None).ok();
        if count {
            g.counts.replayed += 1;
        }
        drop(g);
        Ok(Some(copied))
    }

    /// Capture `pass` (whose dry pass logged `log`), then launch it once for this step.
    fn capture(
        &self,
        key: u64,
        log: Vec<u64>,
        shape: Option<(usize, usize)>,
        pass: &mut dyn FnMut() -> std::result::Result<Option<DeviceMat>, k3_model::exec::ExecError>,
    ) -> std::result::Result<Result<Option<DeviceMat>>, String> {
        // Allocated before the capture: it outlives every launch of the graph.
        let mut out = match shape {
            Some((r, c)) => Some((r, c, self.uninit::<f32>(r * c).map_err(|e| e.to_string())?)),
            None => None,
        };
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| format!("begin capture: {e}"))?;
        self.step.begin(Mode::Capture);
        let res = pass();
        let copied = match (&res, out.as_mut()) {
            (Ok(Some(m)), Some((_, _, dst))) => self
                .stream
                .memcpy_dtod(&m.buf, dst)
                .map_err(|e| format!("result copy: {e}")),
            (Ok(None), None) => Ok(()),
            (Ok(_), _) => Err("result shape differs from the dry pass".to_string()),
            (Err(e), _) => Err(format!("pass failed: {e}")),
        };
        drop(res); // inside the capture: its buffers' frees become graph nodes
        let clog = self.step.finish();
        let graph = self.stream.end_capture(
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
        );
        // A failed capture leaves its error in the context's deferred slot: clear it so it is
        // not reported by an unrelated later call.
        let _ = self.ctx.check_err();
        let graph = match (graph, copied) {
            (_, Err(why)) => return Err(why),
            (Err(e), _) => return Err(format!("end capture: {e}")),
            (Ok(None), _) => return Err("empty capture".into()),
            (Ok(Some(g)), Ok(())) => g,
        };
        if clog != log {
            return Err("the captured pass logged different work than its dry pass".into());
        }
        {
            let mut g = self.step.lock();
            if g.graphs.len() >= MAX_GRAPHS
                && let Some(&old) = g
                    .graphs
                    .iter()
                    .min_by_key(|(_, c)| c.last_used)
                    .map(|(k, _)| k)
            {
                g.graphs.remove(&old);
            }
            g.counts.captured += 1;
            let last_used = g.clock;
            g.graphs.insert(
                key,
                Captured {
                    graph,
                    log: log.clone(),
                    out: out.take(),
                    last_used,
                },
            );
        }
        match self.replay(key, &log, false) {
            Ok(Some(res)) => Ok(res),
            Ok(None) => Err("captured graph vanished".into()),
            Err(e) => {
                self.step.lock().graphs.remove(&key);
                Err(format!("first launch: {e}"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(grid: usize) -> Launch {
        Launch::new((grid, 1, 1), 128).unwrap()
    }

    #[test]
    fn logs_differ_exactly_when_the_queued_work_differs() {
        let s = StepState::new(true, false);
        let run = |grid: usize, arg: u64, upload: usize| {
            s.begin(Mode::Dry);
            s.log_launch("k_a", &launch(grid), &[arg, 0]);
            s.log_gemm(&[0, 1, 2, 3]);
            s.lock().log.push(TAG_UPLOAD | upload as u64);
            s.finish()
        };
        let base = run(4, 7, 64);
        assert_eq!(base, run(4, 7, 64), "same work, same log");
        assert_ne!(base, run(5, 7, 64), "grid");
        assert_ne!(base, run(4, 8, 64), "scalar argument");
        assert_ne!(base, run(4, 7, 72), "upload size");
        s.begin(Mode::Dry);
        s.log_launch("k_b", &launch(4), &[7, 0]);
        s.log_gemm(&[0, 1, 2, 3]);
        s.lock().log.push(TAG_UPLOAD | 64);
        assert_ne!(base, s.finish(), "kernel name");
        assert_eq!(s.mode(), Mode::Eager, "finish ends the pass");
    }

    #[test]
    fn arena_pointers_are_logged_by_arena_and_offset() {
        let s = StepState::new(true, false);
        s.add_arena(0x1000, 0x100);
        s.add_arena(0x8000, 0x100);
        assert_eq!(s.ptr_word(0x0fff), 0, "outside every arena: not logged");
        assert_eq!(s.ptr_word(0x1010), TAG_ARENA | 0x10);
        assert_eq!(s.ptr_word(0x8010), TAG_ARENA | 1 << 44 | 0x10);
        assert_ne!(s.ptr_word(0x1010), s.ptr_word(0x8010));
        // A new arena over the first one's range gets a new id: old graphs can never match.
        s.add_arena(0x1000, 0x100);
        assert_eq!(s.ptr_word(0x1010), TAG_ARENA | 2 << 44 | 0x10);
    }

    #[test]
    fn a_pass_starts_with_an_empty_log() {
        let s = StepState::new(true, false);
        s.begin(Mode::Capture);
        assert!(s.recording() && !s.dry());
        s.log_gemm(&[0, 1, 2, 3]);
        assert!(!s.finish().is_empty());
        s.begin(Mode::Dry);
        assert!(s.dry());
        assert!(s.finish().is_empty());
    }
}
