//! The state of a replayable step (graph.rs): the mode of the current pass (eager, dry, capture),
//! the log of the work it queues, the pinned staging buffer of its uploads, the captured graphs
//! and their counters. Kept apart from the capture and replay code so the backend's device state
//! can hold it without depending on that code.

use crate::buf::Buf;
use crate::error::{CudaError, Result};
use crate::geometry::Launch;
use cudarc::driver::{CudaEvent, CudaSlice, CudaView, DevicePtr, DeviceRepr};
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
pub(crate) const TAG_LAUNCH: u64 = 1 << 60;
pub(crate) const TAG_UPLOAD: u64 = 2 << 60;
pub(crate) const TAG_GEMM: u64 = 3 << 60;
pub(crate) const TAG_COPY: u64 = 4 << 60;
pub(crate) const TAG_ARENA: u64 = 5 << 60;

/// Pinned staging for the uploads of one step. 8 MiB: a decode step of 64 sequences at 32k
/// tokens uploads ~0.3 MB per MLA layer (page tables); a step that needs more runs eagerly.
pub(crate) const STAGING_BYTES: usize = 8 << 20;
/// Graphs kept (one per distinct step log: batch size, MLA split count, page-table bucket),
/// least recently used dropped first. Each holds its result buffer (rows x vocab f32) and the
/// graph's own activation memory, which the 6 GiB work reserve of `--gpu-memory-utilization`
/// must cover.
pub(crate) const MAX_GRAPHS: usize = 16;
/// A log is captured the second time it is seen, so one-off shapes never pay for a capture.
pub(crate) const CAPTURE_AFTER: u32 = 2;
pub(crate) const NEVER: u32 = u32::MAX;

/// Page-locked host memory (the graph's upload nodes read it at every launch).
pub(crate) struct Pinned {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
}

// SAFETY: plain host memory owned by this value; access is serialised by StepState's mutex.
unsafe impl Send for Pinned {}

impl Pinned {
    pub(crate) fn new(len: usize) -> Result<Self> {
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

pub(crate) struct Captured {
    pub(crate) graph: cudarc::driver::CudaGraph,
    pub(crate) log: Vec<u64>,
    /// The step's result `(rows, cols, buffer)`, written by the graph's last node.
    pub(crate) out: Option<(usize, usize, Buf<f32>)>,
    pub(crate) last_used: u64,
}

// SAFETY: CUDA graph handles may be used from any thread as long as calls on one graph are
// serialised (the driver API's graph thread-safety rule); every use goes through StepState's
// mutex.
unsafe impl Send for Captured {}

#[derive(Default)]
pub(crate) struct Inner {
    pub(crate) log: Vec<u64>,
    /// Two staging buffers, written by alternate replayed steps: the pass for the next step can
    /// be staged (`CudaBackend::prepare_graph_step`) while this step's copy still reads the other.
    pub(crate) staging: [Option<Pinned>; 2],
    /// The staging buffer the current pass writes; a replay flips it.
    pub(crate) side: usize,
    /// Device copy of staging (STAGING_BYTES) that captured kernels read their uploads from.
    pub(crate) mirror: Option<CudaSlice<u8>>,
    pub(crate) used: usize,
    pub(crate) graphs: HashMap<u64, Captured>,
    pub(crate) seen: HashMap<u64, u32>,
    pub(crate) clock: u64,
    /// Recorded after each replay's copy of staging `[side]`: that buffer is rewritten only once
    /// the copy has read it.
    pub(crate) launched: [Option<CudaEvent>; 2],
    /// Staging offset and length in bytes of each token-id upload of the current pass.
    pub(crate) ids: Vec<(usize, usize)>,
    /// A dry pass run ahead for the step expected next, if it matched a captured graph.
    pub(crate) prepared: Option<Prepared>,
    /// Arenas `(base, end, id)`: arena pointers are logged as (id, offset), other buffers not.
    pub(crate) arenas: Vec<(u64, u64, u64)>,
    pub(crate) next_arena: u64,
    pub(crate) counts: GraphCounts,
}

/// A dry pass run for the step expected next, while the current one runs on the device: if that
/// step comes with only its token ids differing (the runner checks), it is launched with them
/// written over the placeholders the pass staged, and needs no dry pass of its own.
pub(crate) struct Prepared {
    pub(crate) key: u64,
    pub(crate) log: Vec<u64>,
    pub(crate) used: usize,
    pub(crate) side: usize,
    /// Staging offset and length in bytes of the step's token ids.
    pub(crate) ids: (usize, usize),
}

/// Steps by outcome and the graph machinery's host time (for `k3serve bench` and the tests).
pub use k3_model::backend::GraphCounts;

/// The per-backend state of the graph machinery.
pub(crate) struct StepState {
    pub(crate) mode: AtomicU8,
    pub(crate) enabled: bool,
    pub(crate) inner: Mutex<Inner>,
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

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
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

    /// Copy `bytes` into staging; returns their offset (16-byte aligned, with at least 16 bytes
    /// inside the buffer even for an empty upload, whose view is one element long).
    pub(crate) fn stage(&self, bytes: &[u8]) -> Result<usize> {
        let mut g = self.lock();
        let side = g.side;
        if g.staging[side].is_none() {
            g.staging[side] = Some(Pinned::new(STAGING_BYTES)?);
        }
        let at = g.used.next_multiple_of(16);
        let end = at + bytes.len();
        let cap = g.staging[side].as_ref().map_or(0, |p| p.len);
        if at + bytes.len().max(16) > cap {
            return Err(CudaError::Unsupported(format!(
                "step uploads exceed the {cap}-byte graph staging buffer"
            )));
        }
        g.used = end;
        g.log.push(TAG_UPLOAD | bytes.len() as u64);
        let p = g.staging[side]
            .as_ref()
            .map_or(std::ptr::null_mut(), |p| p.ptr);
        // SAFETY: [at, end) is inside the allocation (checked above); the source is a live slice;
        // the last replay that copied from this buffer is done reading it (a pass waits for its
        // `launched` event before it begins).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.add(at), bytes.len()) };
        Ok(at)
    }

    /// Wait until the last replay that copied from the staging buffer the next pass writes is done
    /// reading it (normally it is: that step's results were downloaded).
    pub(crate) fn wait_for_staging(&self) {
        let ev = {
            let mut g = self.lock();
            let side = g.side;
            g.launched[side].take()
        };
        if let Some(ev) = ev {
            let _ = ev.synchronize();
        }
    }

    pub(crate) fn begin(&self, mode: Mode) {
        let mut g = self.lock();
        g.log.clear();
        g.used = 0;
        g.ids.clear();
        // It staged into the buffer this pass is about to write.
        g.prepared = None;
        self.mode.store(mode as u8, Ordering::Relaxed);
    }

    pub(crate) fn finish(&self) -> Vec<u64> {
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

impl<T> StepArg for &Buf<T> {
    fn step_word(&self, s: &StepState, stream: &cudarc::driver::CudaStream) -> u64 {
        (&**self as &CudaSlice<T>).step_word(s, stream)
    }
}

impl<T> StepArg for &mut Buf<T> {
    fn step_word(&self, s: &StepState, stream: &cudarc::driver::CudaStream) -> u64 {
        (&***self as &CudaSlice<T>).step_word(s, stream)
    }
}

impl<T> StepArg for &CudaView<'_, T> {
    fn step_word(&self, s: &StepState, stream: &cudarc::driver::CudaStream) -> u64 {
        let (p, _sync) = self.device_ptr(stream);
        s.ptr_word(p)
    }
}

pub(crate) fn as_bytes<T: DeviceRepr>(data: &[T]) -> &[u8] {
    // SAFETY: DeviceRepr types are plain old data; the byte view covers exactly the slice.
    unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) }
}

pub(crate) fn hash_log(log: &[u64]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    log.hash(&mut h);
    h.finish()
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
