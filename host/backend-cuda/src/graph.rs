//! CUDA graphs for decode steps: the step's kernels are captured once and replayed as one graph
//! launch, instead of a few hundred launches (each a driver call of a few µs on the host, and a
//! gap on the GPU between small kernels).
//!
//! How a step is matched to a graph. The model code stays the one source of truth for what a step
//! queues: every replayable step first runs the forward pass *dry* — the host logic runs, every op
//! logs what it would queue (kernel, grid, scalar arguments, arena offsets, GEMM shapes, upload
//! sizes) and writes the bytes it would upload (token ids, state slots, page tables) into one
//! pinned staging buffer, but nothing is launched. If a captured graph logged exactly the same
//! work, it is launched after one copy of the staging buffer's new contents into its device mirror,
//! where the graph's kernels read their uploads. Otherwise the step runs eagerly, and the second
//! time the same log is seen the pass is captured (`cuStreamBeginCapture`), which records the same
//! work with uploads from the same staging offsets. Anything the dry pass cannot vouch for (a
//! download, a path that is not logged: such an op returns an error) fails it and the step runs
//! eagerly. What the log leaves out — the addresses of weights and of the step's own activations —
//! follows from the same host code taking the same path, which the identical log attests; a missed
//! replay only costs speed.
//!
//! Buffers: activations allocated inside the capture become graph allocation nodes (fixed
//! addresses, freed inside the graph); the step's result is copied into a buffer the graph owns
//! and from there into a fresh output after each launch.

use crate::buf::Buf;
use crate::device::{CudaBackend, DeviceMat};
use crate::error::{CudaError, Result};
use crate::step::{
    CAPTURE_AFTER, Captured, GraphCounts, MAX_GRAPHS, Mode, NEVER, STAGING_BYTES, as_bytes,
    hash_log,
};
use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, sys};

impl CudaBackend {
    /// Host → device copy of a small per-step input (ids, slots, page tables). Eager: a plain
    /// copy. Dry pass and capture: the bytes go into staging, and the buffer is a view of the
    /// same offset in the device mirror of staging, which a replay fills with one copy before it
    /// launches the graph (`replay`): one transfer per step instead of a graph node per upload.
    pub fn upload_slice<T: DeviceRepr>(&self, data: &[T]) -> Result<Buf<T>> {
        Ok(self.upload_staged(data)?.0)
    }

    /// `upload_slice` for a step's token ids: a dry pass notes where it staged them, so that a
    /// prepared step can be launched with other ids in their place (prepared.rs).
    pub(crate) fn upload_ids(&self, ids: &[u32]) -> Result<Buf<u32>> {
        let (buf, at) = self.upload_staged(ids)?;
        if let (Some(at), true) = (at, self.step.dry()) {
            self.step.lock().ids.push((at, std::mem::size_of_val(ids)));
        }
        Ok(buf)
    }

    /// `upload_slice`, with the staging offset of a logged pass's upload.
    fn upload_staged<T: DeviceRepr>(&self, data: &[T]) -> Result<(Buf<T>, Option<usize>)> {
        let mode = self.step.mode();
        if mode == Mode::Eager {
            return Ok((Buf::owned(self.stream.memcpy_stod(data)?), None));
        }
        let at = self.step.stage(as_bytes(data))?;
        let base = self.upload_mirror(mode == Mode::Dry)?;
        // SAFETY: the mirror lives as long as the backend (and so every graph and every queued
        // launch that reads it); [at, at + len) lies inside it (`stage` checked the extent).
        let buf = unsafe { Buf::alias(&self.stream, base + at as u64, data.len().max(1)) };
        Ok((buf, Some(at)))
    }

    /// Host → device copy of data kept beyond a step (weights, vectors): refused inside a
    /// logged pass, whose uploads live only as long as the step.
    pub(crate) fn upload_kept<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        self.refuse_while_recording("a kept upload")?;
        Ok(self.stream.memcpy_stod(data)?)
    }

    /// The device mirror of staging (STAGING_BYTES). Allocated by the first dry pass: an
    /// allocation inside a capture would become a graph node.
    fn upload_mirror(&self, may_alloc: bool) -> Result<u64> {
        let mut g = self.step.lock();
        if g.mirror.is_none() {
            if !may_alloc {
                return Err(CudaError::Unsupported(
                    "a capture before any dry pass has no upload mirror".into(),
                ));
            }
            g.mirror = Some(self.alloc_kept::<u8>(STAGING_BYTES)?);
        }
        let mirror = g.mirror.as_ref().expect("allocated above");
        let (ptr, _sync) = mirror.device_ptr(&self.stream);
        Ok(ptr)
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
        pass: &mut dyn FnMut() -> std::result::Result<Option<DeviceMat>, k3_model::ExecError>,
    ) -> std::result::Result<Option<DeviceMat>, k3_model::ExecError> {
        if !replayable || !self.step.enabled {
            return pass();
        }
        self.step.wait_for_staging();
        let t0 = std::time::Instant::now();
        self.step.begin(Mode::Dry);
        let dry = pass();
        let log = self.step.finish();
        {
            let mut g = self.step.lock();
            g.counts.dry_passes += 1;
            g.counts.dry_pass_ns += t0.elapsed().as_nanos() as u64;
        }
        let shape = match &dry {
            Ok(out) => out.as_ref().map(|m| (m.rows, m.cols)),
            Err(_) => return self.eager(pass, true),
        };
        drop(dry);
        let key = hash_log(&log);
        let t1 = std::time::Instant::now();
        let replayed = self.replay(key, &log, true);
        if let Ok(Some(_)) = &replayed {
            self.step.lock().counts.launch_ns += t1.elapsed().as_nanos() as u64;
        }
        match replayed {
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
        pass: &mut dyn FnMut() -> std::result::Result<Option<DeviceMat>, k3_model::ExecError>,
        aborted: bool,
    ) -> std::result::Result<Option<DeviceMat>, k3_model::ExecError> {
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
    pub(crate) fn replay(
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
        // The step's uploads (staged by the dry pass that matched this graph) into the mirror
        // the graph's kernels read; stream-ordered after the previous step's reads of it.
        let side = g.side;
        if g.used > 0 {
            let (Some(staging), Some(mirror)) = (&g.staging[side], &g.mirror) else {
                return Ok(None);
            };
            let (dst, _sync) = mirror.device_ptr(&self.stream);
            // SAFETY: `used` bytes of pinned staging (stage kept them inside both buffers, which
            // are the same size); the host rewrites this buffer only after the event below.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dst,
                    staging.ptr as *const std::ffi::c_void,
                    g.used,
                    self.stream.cu_stream(),
                )
            }
            .result()?;
        }
        let c = g.graphs.get_mut(&key).expect("looked up above");
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
        g.launched[side] = self.stream.record_event(None).ok();
        // The next pass stages into the other buffer: it may run while this copy is pending.
        g.side = side ^ 1;
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
        pass: &mut dyn FnMut() -> std::result::Result<Option<DeviceMat>, k3_model::ExecError>,
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
        let nodes = self.captured_nodes();
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
            if let Some(n) = nodes {
                g.counts.captured_kernels += n.kernels;
                g.counts.captured_memsets += n.memsets;
                g.counts.captured_copies += n.copies;
                g.counts.captured_mem_nodes += n.mem;
                g.counts.captured_other_nodes += n.other;
            }
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

    /// The nodes of the graph this stream is capturing into, by kind (None if the driver will
    /// not say): what a replay of the step puts on the GPU's critical path.
    fn captured_nodes(&self) -> Option<NodeCounts> {
        use sys::CUgraphNodeType as T;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let (mut id, mut graph, mut ndeps) = (0u64, std::ptr::null_mut(), 0usize);
        let (mut deps, mut edges) = (std::ptr::null(), std::ptr::null());
        // SAFETY: every out-pointer is a live local; the driver allows queries of a graph under
        // capture (only destroying it or removing nodes is refused).
        unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                self.stream.cu_stream(),
                &mut status,
                &mut id,
                &mut graph,
                &mut deps,
                &mut edges,
                &mut ndeps,
            )
        }
        .result()
        .ok()?;
        if graph.is_null() {
            return None;
        }
        let mut n = 0usize;
        // SAFETY: a null array asks for the count only.
        unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) }
            .result()
            .ok()?;
        let mut nodes = vec![std::ptr::null_mut(); n];
        // SAFETY: `nodes` has room for the `n` nodes the driver writes.
        unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) }
            .result()
            .ok()?;
        let mut c = NodeCounts::default();
        for &node in &nodes[..n] {
            let mut t = T::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: `node` belongs to `graph`, which lives until the capture ends.
            unsafe { sys::cuGraphNodeGetType(node, &mut t) }
                .result()
                .ok()?;
            match t {
                T::CU_GRAPH_NODE_TYPE_KERNEL => c.kernels += 1,
                T::CU_GRAPH_NODE_TYPE_MEMSET => c.memsets += 1,
                T::CU_GRAPH_NODE_TYPE_MEMCPY => c.copies += 1,
                T::CU_GRAPH_NODE_TYPE_MEM_ALLOC | T::CU_GRAPH_NODE_TYPE_MEM_FREE => c.mem += 1,
                _ => c.other += 1,
            }
        }
        Some(c)
    }
}

/// A captured graph's nodes by kind (`GraphCounts::captured_*`).
#[derive(Default)]
struct NodeCounts {
    kernels: u64,
    memsets: u64,
    copies: u64,
    mem: u64,
    other: u64,
}
