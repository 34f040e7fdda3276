//! The threaded engine: a scheduling thread owning the [`EngineCore`], an executor thread owning
//! the model, and a cloneable [`EngineHandle`] for callers (async or not).
//!
//! With `overlap` on, while the executor runs step N the scheduling thread plans step N+1
//! (admissions, prefix matching, allocation, restores); only the sampled tokens of step N are
//! filled in after it completes.

use crate::config::{EngineConfig, EngineConfigError};
use crate::metrics::EngineMetrics;
use crate::request::{Request, RequestError, RequestId, RequestStream, SubmitError};
use crate::scheduler::{EngineCore, StepJob};
use k3_cache_events::CacheEvent;
use k3_model::{CacheLayout, ExecError, Executor, ForwardOutput};
use parking_lot::Mutex;
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub(crate) enum Command {
    Submit(Box<Request>, crate::scheduler::EventSender),
    Cancel(RequestId),
    FlushCache(Sender<()>),
    SubscribeCache(CacheEventSender),
    Shutdown(Instant),
}

type CacheEventSender = tokio::sync::mpsc::UnboundedSender<CacheEvent>;

struct Shared {
    layout: CacheLayout,
    vocab: usize,
    cfg: EngineConfig,
    live: Mutex<HashSet<RequestId>>,
    metrics: Mutex<EngineMetrics>,
    shutting_down: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Entry point: `Engine::start(executor, config)`.
pub struct Engine;

impl Engine {
    /// Start the engine threads. The executor moves to its own thread (forwards are blocking).
    pub fn start(
        mut executor: Box<dyn Executor>,
        cfg: EngineConfig,
    ) -> Result<EngineHandle, EngineConfigError> {
        if let Some(spec) = &cfg.speculation {
            let taps = spec.source.tap_layers();
            if !taps.is_empty() {
                executor
                    .set_hidden_taps(&taps)
                    .map_err(|e| EngineConfigError::Speculation(e.to_string()))?;
            }
        }
        let layout = executor.layout();
        let vocab = executor.vocab_size();
        let core = EngineCore::new(layout, vocab, cfg.clone())?;
        let (tx, rx) = channel();
        let shared = Arc::new(Shared {
            layout,
            vocab,
            cfg,
            live: Mutex::new(HashSet::new()),
            metrics: Mutex::new(core.metrics()),
            shutting_down: AtomicBool::new(false),
            thread: Mutex::new(None),
        });
        let loop_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("k3-engine".into())
            .spawn(move || run_loop(core, executor, rx, loop_shared))
            .map_err(|e| EngineConfigError::Spawn(e.to_string()))?;
        *shared.thread.lock() = Some(thread);
        Ok(EngineHandle { tx, shared })
    }
}

/// A cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    shared: Arc<Shared>,
}

impl EngineHandle {
    /// Queue a request. Checks that do not depend on load happen here, synchronously.
    pub fn submit(&self, req: Request) -> Result<RequestStream, SubmitError> {
        let s = &self.shared;
        if s.shutting_down.load(Ordering::Acquire) {
            return Err(SubmitError::ShuttingDown);
        }
        EngineCore::validate(&s.layout, s.vocab, &s.cfg, &req)?;
        {
            let mut live = s.live.lock();
            let running = s.metrics.lock().running;
            let waiting = live.len().saturating_sub(running);
            if waiting >= s.cfg.max_waiting {
                return Err(SubmitError::Overloaded { waiting });
            }
            if !live.insert(req.id) {
                return Err(SubmitError::DuplicateId(req.id));
            }
        }
        let id = req.id;
        let (etx, erx) = tokio::sync::mpsc::unbounded_channel();
        if self.tx.send(Command::Submit(Box::new(req), etx)).is_err() {
            s.live.lock().remove(&id);
            return Err(SubmitError::ShuttingDown);
        }
        Ok(RequestStream::new(id, erx, self.tx.clone()))
    }

    /// Abort a request; everything it holds is freed at once. Unknown ids are ignored.
    pub fn cancel(&self, id: RequestId) {
        let _ = self.tx.send(Command::Cancel(id));
    }

    /// The latest metrics snapshot (updated after every step).
    pub fn metrics(&self) -> EngineMetrics {
        self.shared.metrics.lock().clone()
    }

    /// The speculative decoding method in use (`None`: off).
    pub fn speculation_method(&self) -> Option<String> {
        let spec = self.shared.cfg.speculation.as_ref()?;
        Some(spec.source.method().to_string())
    }

    /// Follow the prefix cache: a [`CacheEvent::Snapshot`] first, then every change, in order
    /// (`None` when the prefix cache is off). Dropping the receiver unsubscribes.
    pub fn subscribe_cache(&self) -> Option<tokio::sync::mpsc::UnboundedReceiver<CacheEvent>> {
        if !self.shared.cfg.prefix_cache {
            return None;
        }
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.tx.send(Command::SubscribeCache(tx)).ok()?;
        Some(rx)
    }

    /// Drop every prefix-cache entry not in use (blocks until done).
    pub fn flush_prefix_cache(&self) {
        let (tx, rx) = channel();
        if self.tx.send(Command::FlushCache(tx)).is_ok() {
            let _ = rx.recv();
        }
    }

    /// Stop accepting requests, let the queued ones run until `deadline` from now, then end the
    /// rest with [`RequestError::Shutdown`]. Blocks until the engine threads have exited (call it
    /// from a blocking context).
    pub fn shutdown(&self, deadline: Duration) {
        self.shared.shutting_down.store(true, Ordering::Release);
        let _ = self.tx.send(Command::Shutdown(Instant::now() + deadline));
        if let Some(t) = self.shared.thread.lock().take() {
            let _ = t.join();
        }
    }
}

/// The executor's thread: runs jobs in order, returns results in order.
struct Worker {
    jobs: Sender<StepJob>,
    results: Receiver<Result<ForwardOutput, ExecError>>,
}

impl Worker {
    fn spawn(mut exec: Box<dyn Executor>) -> Self {
        let (jtx, jrx) = channel::<StepJob>();
        let (rtx, rrx) = channel();
        let spawned = std::thread::Builder::new()
            .name("k3-engine-exec".into())
            .spawn(move || {
                for job in jrx {
                    if rtx.send(job.run(exec.as_mut())).is_err() {
                        break;
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!("cannot spawn the executor thread: {e}");
        }
        Self {
            jobs: jtx,
            results: rrx,
        }
    }

    fn run(&self, job: StepJob) -> bool {
        self.jobs.send(job).is_ok()
    }

    fn wait(&self) -> Result<ForwardOutput, ExecError> {
        self.results.recv().unwrap_or_else(|_| {
            Err(ExecError::Backend(
                "the executor thread stopped (panic?)".into(),
            ))
        })
    }
}

fn run_loop(
    mut core: EngineCore,
    exec: Box<dyn Executor>,
    rx: Receiver<Command>,
    shared: Arc<Shared>,
) {
    let worker = Worker::spawn(exec);
    let overlap = core.config().overlap;
    let mut inflight = None;
    let mut deadline: Option<Instant> = None;
    let mut listeners: Vec<CacheEventSender> = Vec::new();
    let handle = |core: &mut EngineCore,
                  cmd: Command,
                  deadline: &mut Option<Instant>,
                  listeners: &mut Vec<CacheEventSender>| match cmd {
        Command::Submit(req, events) => {
            let id = req.id;
            if let Err(e) = core.enqueue(*req, events.clone()) {
                let _ = events.send(Err(RequestError::Rejected(e.to_string())));
                shared.live.lock().remove(&id);
            }
        }
        Command::Cancel(id) => {
            core.cancel(id);
        }
        Command::FlushCache(reply) => {
            core.flush_cache();
            let _ = reply.send(());
        }
        Command::SubscribeCache(tx) => {
            // Earlier listeners get the changes up to now first, so the new snapshot and the
            // events after it line up for everyone.
            forward_cache_events(core, listeners);
            if let Some(snapshot) = core.subscribe_cache()
                && tx.send(snapshot).is_ok()
            {
                listeners.push(tx);
            }
        }
        Command::Shutdown(d) => *deadline = Some(d),
    };
    loop {
        if inflight.is_none() && !core.has_work() {
            if deadline.is_some() {
                break;
            }
            match rx.recv() {
                Ok(cmd) => handle(&mut core, cmd, &mut deadline, &mut listeners),
                Err(_) => break,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            handle(&mut core, cmd, &mut deadline, &mut listeners);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            if let Some(l) = inflight.take() {
                core.complete(l, worker.wait());
            }
            core.abort_all(RequestError::Shutdown);
            publish(&mut core, &shared, &mut listeners);
            break;
        }
        // Prepared while the forward runs; sampled tokens are filled in at launch.
        let mut next = if overlap && inflight.is_some() {
            core.schedule()
        } else {
            None
        };
        if let Some(l) = inflight.take() {
            core.complete(l, worker.wait());
        }
        match next.as_mut() {
            // Requests whose verify just completed join the prepared step.
            Some(plan) => core.plan_ready(plan),
            None => next = core.schedule(),
        }
        if let Some((job, l)) = next.and_then(|p| core.launch(p)) {
            if worker.run(job) {
                inflight = Some(l);
            } else {
                core.abort_all(RequestError::Execution(
                    "the executor thread is gone".into(),
                ));
            }
        } else if core.has_work() {
            // Nothing runnable (e.g. waiting on memory): wait for a command instead of spinning.
            if let Ok(cmd) = rx.recv_timeout(Duration::from_millis(5)) {
                handle(&mut core, cmd, &mut deadline, &mut listeners);
            }
        }
        publish(&mut core, &shared, &mut listeners);
    }
    publish(&mut core, &shared, &mut listeners);
}

/// Send the prefix cache's changes to every listener; stop recording when none is left.
fn forward_cache_events(core: &mut EngineCore, listeners: &mut Vec<CacheEventSender>) {
    if listeners.is_empty() {
        return;
    }
    let events = core.take_cache_events();
    if !events.is_empty() {
        listeners.retain(|l| events.iter().all(|e| l.send(e.clone()).is_ok()));
    } else {
        listeners.retain(|l| !l.is_closed());
    }
    if listeners.is_empty() {
        core.unsubscribe_cache();
    }
}

fn publish(core: &mut EngineCore, shared: &Shared, listeners: &mut Vec<CacheEventSender>) {
    forward_cache_events(core, listeners);
    let retired = core.take_retired();
    if !retired.is_empty() {
        let mut live = shared.live.lock();
        for id in retired {
            live.remove(&id);
        }
    }
    *shared.metrics.lock() = core.metrics();
}
