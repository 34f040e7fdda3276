//! Dry passes run ahead. A replayed decode step leaves the host idle while the device runs it;
//! the runner uses that time to run the dry pass (graph.rs) of the step it expects next: the
//! same sequences one position on, with placeholder token ids. The pass stages into the staging
//! buffer the running step's copy does not read (step.rs keeps two), notes where it staged the
//! ids, and is kept if its log matches a captured graph. When the next step comes and the runner
//! finds it equal to the expected one but for its ids, the ids are written over the placeholders
//! and the graph is launched: the step's only host work on the device's critical path is that
//! write, one staging copy and the launch.
//!
//! Token ids are the one input a decode step's host logic never branches on (they are only
//! uploaded, for the embedding gather), which is what lets them be filled in afterwards.

use crate::device::{CudaBackend, DeviceMat};
use crate::error::Result;
use crate::step::{Mode, Prepared, as_bytes, hash_log};

impl CudaBackend {
    /// Run `pass` dry for the step expected next and keep it if it can be launched later:
    /// its log matches a captured graph and it staged one set of token ids. Returns whether it
    /// was kept.
    pub(crate) fn prepare_graph_step(
        &self,
        pass: &mut dyn FnMut() -> std::result::Result<Option<DeviceMat>, k3_model::ExecError>,
    ) -> bool {
        if !self.step.enabled {
            return false;
        }
        self.step.wait_for_staging();
        let t0 = std::time::Instant::now();
        self.step.begin(Mode::Dry);
        let ok = pass().is_ok();
        let log = self.step.finish();
        let mut g = self.step.lock();
        g.counts.prepared += 1;
        g.counts.prepared_ns += t0.elapsed().as_nanos() as u64;
        let key = hash_log(&log);
        let matched = g.graphs.get(&key).is_some_and(|c| c.log == log);
        if !ok || !matched || g.ids.len() != 1 {
            return false;
        }
        let (used, side, ids) = (g.used, g.side, g.ids[0]);
        g.prepared = Some(Prepared {
            key,
            log,
            used,
            side,
            ids,
        });
        true
    }

    /// Launch the prepared step with `ids` over its placeholders (module doc). `Ok(None)`: none
    /// is prepared, or it no longer fits (other ids' length, its graph dropped): nothing was
    /// queued. The outer error also means nothing was queued; the inner one that the step ran
    /// but its result was lost.
    pub(crate) fn launch_prepared_step(
        &self,
        ids: &[u32],
    ) -> Result<Option<Result<Option<DeviceMat>>>> {
        let t0 = std::time::Instant::now();
        let bytes = as_bytes(ids);
        let p = {
            let mut g = self.step.lock();
            let Some(p) = g.prepared.take() else {
                return Ok(None);
            };
            // No pass has begun since (`begin` drops the prepared one), so nothing has staged
            // into or launched from its buffer; checked all the same.
            let Some(staging) = g.staging[p.side].as_ref().filter(|_| g.side == p.side) else {
                return Ok(None);
            };
            if p.ids.1 != bytes.len() || p.ids.0 + p.ids.1 > staging.len {
                return Ok(None);
            }
            // SAFETY: [ids.0, ids.0 + ids.1) lies inside the pinned buffer (checked above); no
            // copy reads this buffer now (the prepared pass waited for the last one).
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), staging.ptr.add(p.ids.0), p.ids.1)
            };
            g.used = p.used;
            p
        };
        let replayed = self.replay(p.key, &p.log, true);
        if let Ok(Some(_)) = &replayed {
            let mut g = self.step.lock();
            g.counts.prepared_replays += 1;
            g.counts.launch_ns += t0.elapsed().as_nanos() as u64;
        }
        replayed
    }
}
