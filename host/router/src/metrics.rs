//! `/metrics`: the router's own counters in the Prometheus text format, all named `k3router_*`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
const POLICY_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1,
];

/// A per-replica gauge: name suffix, help, value.
type Gauge = (&'static str, &'static str, fn(&crate::ReplicaStatus) -> u64);
/// A per-replica counter: name suffix, help, value.
type Counter = (&'static str, &'static str, fn(&ReplicaMetrics) -> u64);

/// A fixed-bucket histogram of durations.
pub(crate) struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_nanos: AtomicU64::new(0),
        }
    }

    pub(crate) fn latency() -> Self {
        Self::new(LATENCY_BUCKETS)
    }

    pub(crate) fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = self.bounds.iter().position(|b| s <= *b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cumulative += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {sum}");
        let _ = writeln!(out, "{name}_count{braces} {count}");
    }
}

/// Why a request to a replica failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum ErrorKind {
    /// Could not connect (refused, unreachable, connect timeout).
    Connect,
    /// The request timed out after connecting.
    Timeout,
    /// The connection failed before response headers (reset, closed).
    Transport,
    /// 502/503/504 before any byte of the body.
    Unavailable,
    /// The response body broke off after it started.
    Stream,
}

impl ErrorKind {
    pub(crate) const ALL: [ErrorKind; 5] = [
        ErrorKind::Connect,
        ErrorKind::Timeout,
        ErrorKind::Transport,
        ErrorKind::Unavailable,
        ErrorKind::Stream,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Connect => "connect",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Transport => "transport",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Stream => "stream",
        }
    }
}

/// What `/metrics` shows of one replica: its status and counters (`Shared::metrics_text` builds
/// these from the replicas, so this module needs nothing of `replica`).
pub(crate) struct ReplicaRow<'a> {
    pub status: crate::ReplicaStatus,
    pub metrics: &'a ReplicaMetrics,
}

/// One replica's counters.
pub(crate) struct ReplicaMetrics {
    pub requests: AtomicU64,
    errors: [AtomicU64; 5],
    pub time_to_headers: Histogram,
    pub duration: Histogram,
    pub events: AtomicU64,
    pub bad_events: AtomicU64,
    pub event_connects: AtomicU64,
}

impl ReplicaMetrics {
    pub(crate) fn new() -> Self {
        ReplicaMetrics {
            requests: AtomicU64::new(0),
            errors: Default::default(),
            time_to_headers: Histogram::latency(),
            duration: Histogram::latency(),
            events: AtomicU64::new(0),
            bad_events: AtomicU64::new(0),
            event_connects: AtomicU64::new(0),
        }
    }

    pub(crate) fn error(&self, kind: ErrorKind) {
        self.errors[kind as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// Lets one warning through per interval and counts the ones held back.
pub(crate) struct LogLimiter {
    interval: Duration,
    state: Mutex<(Option<std::time::Instant>, u64)>,
}

impl LogLimiter {
    pub(crate) fn new(interval: Duration) -> Self {
        LogLimiter {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(held back since the last one)` when this warning may be logged.
    pub(crate) fn allow(&self) -> Option<u64> {
        let now = std::time::Instant::now();
        let mut s = self.state.lock();
        match s.0 {
            Some(last) if now.duration_since(last) < self.interval => {
                s.1 += 1;
                None
            }
            _ => {
                s.0 = Some(now);
                Some(std::mem::take(&mut s.1))
            }
        }
    }
}

/// How a replica was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Outcome {
    /// The policy's choice, on the first attempt.
    Policy,
    /// The built-in least-load, because the policy failed (first attempt).
    Fallback,
    /// A later attempt after a replica failed.
    Retry,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Policy => "policy",
            Outcome::Fallback => "fallback",
            Outcome::Retry => "retry",
        }
    }
}

/// The router's counters that are not per replica.
pub(crate) struct Metrics {
    decisions: Mutex<BTreeMap<(String, String, Outcome), u64>>,
    policy_errors: Mutex<BTreeMap<(String, &'static str), u64>>,
    pub policy_call: Histogram,
    pub prefix_blocks_requested: AtomicU64,
    pub prefix_blocks_hit: AtomicU64,
    pub unroutable: AtomicU64,
}

impl Metrics {
    pub(crate) fn new() -> Self {
        Metrics {
            decisions: Mutex::new(BTreeMap::new()),
            policy_errors: Mutex::new(BTreeMap::new()),
            policy_call: Histogram::new(POLICY_BUCKETS),
            prefix_blocks_requested: AtomicU64::new(0),
            prefix_blocks_hit: AtomicU64::new(0),
            unroutable: AtomicU64::new(0),
        }
    }

    pub(crate) fn decision(&self, replica: &str, policy: &str, outcome: Outcome) {
        *self
            .decisions
            .lock()
            .entry((replica.to_string(), policy.to_string(), outcome))
            .or_default() += 1;
    }

    /// `kind`: `error` (the policy said so), `timeout`, `unknown_replica` (named no candidate).
    pub(crate) fn policy_error(&self, policy: &str, kind: &'static str) {
        *self
            .policy_errors
            .lock()
            .entry((policy.to_string(), kind))
            .or_default() += 1;
    }

    pub(crate) fn render(&self, replicas: &[ReplicaRow<'_>]) -> String {
        let mut out = String::with_capacity(8192);
        let o = &mut out;
        header(o, "k3router_replica_info", "gauge", "A configured replica.");
        for r in replicas {
            let _ = writeln!(
                o,
                "k3router_replica_info{{replica=\"{}\",url=\"{}\"}} 1",
                r.status.id,
                escape(&r.status.url)
            );
        }
        let gauges: [Gauge; 8] = [
            ("healthy", "1 when the replica is admitted.", |s| {
                u64::from(s.healthy)
            }),
            (
                "events_synced",
                "1 while the replica's cache events are followed from a snapshot.",
                |s| u64::from(s.events_synced),
            ),
            ("running", "Running sequences (last load event).", |s| {
                u64::from(s.running)
            }),
            ("waiting", "Waiting requests (last load event).", |s| {
                u64::from(s.waiting)
            }),
            ("in_flight", "Requests the router has open to it.", |s| {
                u64::from(s.in_flight)
            }),
            ("free_blocks", "Free KV blocks (last load event).", |s| {
                u64::from(s.free_blocks)
            }),
            (
                "index_blocks",
                "Cached blocks in the router's index.",
                |s| s.index_blocks as u64,
            ),
            (
                "index_checkpoints",
                "Cached blocks ending at a KDA checkpoint.",
                |s| s.index_checkpoints as u64,
            ),
        ];
        for (name, help, get) in gauges {
            let full = format!("k3router_replica_{name}");
            header(o, &full, "gauge", help);
            for r in replicas {
                let s = &r.status;
                let _ = writeln!(o, "{full}{{replica=\"{}\"}} {}", s.id, get(s));
            }
        }
        let counters: [Counter; 4] = [
            (
                "requests_total",
                "Requests sent to the replica (each attempt).",
                |m| m.requests.load(Ordering::Relaxed),
            ),
            ("cache_events_total", "Cache events applied.", |m| {
                m.events.load(Ordering::Relaxed)
            }),
            (
                "cache_events_invalid_total",
                "Cache events that did not parse (skipped).",
                |m| m.bad_events.load(Ordering::Relaxed),
            ),
            (
                "cache_events_connects_total",
                "Cache-event streams opened.",
                |m| m.event_connects.load(Ordering::Relaxed),
            ),
        ];
        for (name, help, get) in counters {
            let full = format!("k3router_{name}");
            header(o, &full, "counter", help);
            for r in replicas {
                let _ = writeln!(
                    o,
                    "{full}{{replica=\"{}\"}} {}",
                    r.status.id,
                    get(r.metrics)
                );
            }
        }
        header(
            o,
            "k3router_errors_total",
            "counter",
            "Failed requests to a replica, by kind.",
        );
        for r in replicas {
            for kind in ErrorKind::ALL {
                let n = r.metrics.errors[kind as usize].load(Ordering::Relaxed);
                let _ = writeln!(
                    o,
                    "k3router_errors_total{{replica=\"{}\",kind=\"{}\"}} {n}",
                    r.status.id,
                    kind.as_str()
                );
            }
        }
        header(
            o,
            "k3router_time_to_headers_seconds",
            "histogram",
            "From sending a request to a replica to its response headers.",
        );
        for r in replicas {
            let l = format!("replica=\"{}\"", r.status.id);
            r.metrics
                .time_to_headers
                .render(o, "k3router_time_to_headers_seconds", &l);
        }
        header(
            o,
            "k3router_request_duration_seconds",
            "histogram",
            "From sending a request to a replica to the end of its response body.",
        );
        for r in replicas {
            let l = format!("replica=\"{}\"", r.status.id);
            r.metrics
                .duration
                .render(o, "k3router_request_duration_seconds", &l);
        }
        header(
            o,
            "k3router_decisions_total",
            "counter",
            "Routing decisions by replica, policy and outcome (policy, fallback, retry).",
        );
        for ((replica, policy, outcome), n) in self.decisions.lock().iter() {
            let _ = writeln!(
                o,
                "k3router_decisions_total{{replica=\"{replica}\",policy=\"{}\",outcome=\"{}\"}} {n}",
                escape(policy),
                outcome.as_str()
            );
        }
        header(
            o,
            "k3router_policy_errors_total",
            "counter",
            "Policy calls that failed (error, timeout, unknown_replica) and fell back.",
        );
        for ((policy, kind), n) in self.policy_errors.lock().iter() {
            let _ = writeln!(
                o,
                "k3router_policy_errors_total{{policy=\"{}\",kind=\"{kind}\"}} {n}",
                escape(policy)
            );
        }
        header(
            o,
            "k3router_policy_call_seconds",
            "histogram",
            "Time of one policy call.",
        );
        self.policy_call
            .render(o, "k3router_policy_call_seconds", "");
        let requested = self.prefix_blocks_requested.load(Ordering::Relaxed);
        let hit = self.prefix_blocks_hit.load(Ordering::Relaxed);
        header(
            o,
            "k3router_prefix_blocks_requested_total",
            "counter",
            "Full prompt blocks of routed requests whose prompt was known.",
        );
        let _ = writeln!(o, "k3router_prefix_blocks_requested_total {requested}");
        header(
            o,
            "k3router_prefix_blocks_hit_total",
            "counter",
            "Of those, blocks the chosen replica could restore (usable hit) at decision time.",
        );
        let _ = writeln!(o, "k3router_prefix_blocks_hit_total {hit}");
        header(
            o,
            "k3router_estimated_prefix_hit_rate",
            "gauge",
            "prefix_blocks_hit_total / prefix_blocks_requested_total.",
        );
        let rate = if requested == 0 {
            0.0
        } else {
            hit as f64 / requested as f64
        };
        let _ = writeln!(o, "k3router_estimated_prefix_hit_rate {rate}");
        header(
            o,
            "k3router_unroutable_total",
            "counter",
            "Requests answered 503 because no replica could take them.",
        );
        let _ = writeln!(
            o,
            "k3router_unroutable_total {}",
            self.unroutable.load(Ordering::Relaxed)
        );
        out
    }
}

fn header(o: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// A label value in the exposition format.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limiter_counts_what_it_holds_back() {
        let l = LogLimiter::new(Duration::from_secs(3600));
        assert_eq!(l.allow(), Some(0));
        assert_eq!(l.allow(), None);
        assert_eq!(l.allow(), None);
        let l = LogLimiter::new(Duration::ZERO);
        assert_eq!(l.allow(), Some(0));
        assert_eq!(l.allow(), Some(0));
    }

    #[test]
    fn histogram_is_cumulative() {
        let h = Histogram::new(&[0.1, 1.0]);
        h.observe(Duration::from_millis(50));
        h.observe(Duration::from_millis(500));
        h.observe(Duration::from_secs(5));
        let mut s = String::new();
        h.render(&mut s, "x", "a=\"b\"");
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.1\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"1\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3\n"), "{s}");
        assert!(s.contains("x_count{a=\"b\"} 3\n"), "{s}");
        assert_eq!(escape("a\"b\\"), "a\\\"b\\\\");
    }
}
