//! Prometheus metrics: what the HTTP layer measures itself (requests by status, latencies, token
//! counts) plus the backend's snapshot (queue, prefix cache, pool, plugin counters), rendered in
//! the text exposition format.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use std::sync::{Arc, Mutex, MutexGuard};

use crate::backend::BackendMetrics;
use crate::unknown_fields::IgnoredFields;

/// Lock ignoring poison: a metrics update never leaves half-written state worth refusing.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

const LATENCY_BUCKETS: [f64; 16] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const E2E_BUCKETS: [f64; 14] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

pub struct Histogram {
    bounds: &'static [f64],
    state: Mutex<HistogramState>,
}

struct HistogramState {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            state: Mutex::new(HistogramState {
                counts: vec![0; bounds.len()],
                sum: 0.0,
                count: 0,
            }),
        }
    }

    pub fn observe(&self, value: f64) {
        let mut s = lock(&self.state);
        if let Some(i) = self.bounds.iter().position(|b| value <= *b) {
            s.counts[i] += 1;
        }
        s.sum += value;
        s.count += 1;
    }

    pub fn count(&self) -> u64 {
        lock(&self.state).count
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let s = lock(&self.state);
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&s.counts) {
            cumulative += count;
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", s.count);
        let _ = writeln!(out, "{name}_sum {}", s.sum);
        let _ = writeln!(out, "{name}_count {}", s.count);
    }
}

/// What the HTTP layer counts.
pub struct HttpMetrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    finished: Mutex<BTreeMap<&'static str, u64>>,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub e2e: Histogram,
    /// The engine's split of the time to the first token (`RequestTiming`).
    pub queue_time: Histogram,
    pub prefill_time: Histogram,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub cached_prompt_tokens: AtomicU64,
    pub client_disconnects: AtomicU64,
    /// Unknown request fields ignored, by field pattern.
    pub ignored_fields: Arc<IgnoredFields>,
    /// Open connections and why the server closed some.
    pub connections: Arc<ConnectionMetrics>,
}

/// What the accept loop and the connection timeouts count.
#[derive(Default)]
pub struct ConnectionMetrics {
    /// Connections open now.
    pub open: AtomicU64,
    /// Connections accepted since start.
    pub accepted: AtomicU64,
    /// Closed because a request head did not arrive in time.
    pub header_timeouts: AtomicU64,
    /// Closed because a keep-alive connection stayed idle too long.
    pub idle_timeouts: AtomicU64,
    /// Requests whose body stalled (answered 408, connection closed).
    pub body_timeouts: AtomicU64,
    /// Times the accept loop paused because the connection cap was reached.
    pub cap_reached: AtomicU64,
    /// Requests refused at their headers for a declared body over the route's limit.
    pub declared_body_too_large: AtomicU64,
}

impl ConnectionMetrics {
    fn render(&self, out: &mut String) {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        gauge(
            out,
            "k3serve_http_connections_open",
            "HTTP connections open now.",
            load(&self.open) as f64,
        );
        counter(
            out,
            "k3serve_http_connections_accepted_total",
            "HTTP connections accepted.",
            load(&self.accepted),
        );
        let _ = writeln!(
            out,
            "# HELP k3serve_http_connections_timed_out_total Connections or requests the server cut, by timeout.\n# TYPE k3serve_http_connections_timed_out_total counter"
        );
        for (reason, n) in [
            ("header", &self.header_timeouts),
            ("idle", &self.idle_timeouts),
            ("body", &self.body_timeouts),
        ] {
            let _ = writeln!(
                out,
                "k3serve_http_connections_timed_out_total{{timeout=\"{reason}\"}} {}",
                load(n)
            );
        }
        counter(
            out,
            "k3serve_http_connection_cap_reached_total",
            "Times the server stopped accepting because --max-connections were open.",
            load(&self.cap_reached),
        );
        counter(
            out,
            "k3serve_http_declared_body_too_large_total",
            "Requests refused at their headers for a Content-Length over the route's limit.",
            load(&self.declared_body_too_large),
        );
    }
}

impl Default for HttpMetrics {
    fn default() -> Self {
        HttpMetrics {
            requests: Mutex::new(BTreeMap::new()),
            finished: Mutex::new(BTreeMap::new()),
            ttft: Histogram::new(&LATENCY_BUCKETS),
            inter_token: Histogram::new(&LATENCY_BUCKETS),
            e2e: Histogram::new(&E2E_BUCKETS),
            queue_time: Histogram::new(&LATENCY_BUCKETS),
            prefill_time: Histogram::new(&LATENCY_BUCKETS),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            cached_prompt_tokens: AtomicU64::new(0),
            client_disconnects: AtomicU64::new(0),
            ignored_fields: Arc::default(),
            connections: Arc::default(),
        }
    }
}

impl HttpMetrics {
    pub fn record_request(&self, route: &str, status: u16) {
        *lock(&self.requests)
            .entry((route.to_string(), status))
            .or_default() += 1;
    }

    pub fn record_finish(&self, reason: &'static str) {
        *lock(&self.finished).entry(reason).or_default() += 1;
    }

    pub fn record_usage(&self, prompt: u32, completion: u32, cached: u32) {
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.generation_tokens
            .fetch_add(completion as u64, Ordering::Relaxed);
        self.cached_prompt_tokens
            .fetch_add(cached as u64, Ordering::Relaxed);
    }

    /// The whole `/metrics` page.
    pub fn render(&self, backend: &BackendMetrics) -> String {
        let mut out = String::with_capacity(8192);
        let _ = writeln!(
            out,
            "# HELP k3serve_http_requests_total HTTP requests by route and status.\n# TYPE k3serve_http_requests_total counter"
        );
        for ((route, status), n) in lock(&self.requests).iter() {
            let _ = writeln!(
                out,
                "k3serve_http_requests_total{{route=\"{}\",status=\"{status}\"}} {n}",
                escape(route)
            );
        }
        let _ = writeln!(
            out,
            "# HELP k3serve_request_finished_total Finished generations by finish reason.\n# TYPE k3serve_request_finished_total counter"
        );
        for (reason, n) in lock(&self.finished).iter() {
            let _ = writeln!(
                out,
                "k3serve_request_finished_total{{finish_reason=\"{reason}\"}} {n}"
            );
        }
        gauge(
            &mut out,
            "k3serve_num_requests_running",
            "Requests in the engine's running batch.",
            backend.running as f64,
        );
        gauge(
            &mut out,
            "k3serve_num_requests_waiting",
            "Requests waiting to be scheduled.",
            backend.waiting as f64,
        );
        self.ttft.render(
            &mut out,
            "k3serve_time_to_first_token_seconds",
            "Time from request arrival to its first output.",
        );
        self.inter_token.render(
            &mut out,
            "k3serve_inter_token_latency_seconds",
            "Time between successive outputs of one request.",
        );
        self.e2e.render(
            &mut out,
            "k3serve_e2e_request_latency_seconds",
            "Time from request arrival to its end.",
        );
        self.queue_time.render(
            &mut out,
            "k3serve_request_queue_time_seconds",
            "Time a request waited in the engine's queue before it was first scheduled.",
        );
        self.prefill_time.render(
            &mut out,
            "k3serve_request_prefill_time_seconds",
            "Time from a request's first scheduling to its first token (prefill).",
        );
        counter(
            &mut out,
            "k3serve_prompt_tokens_total",
            "Prompt tokens of finished requests.",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "k3serve_generation_tokens_total",
            "Generated tokens of finished requests.",
            self.generation_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "k3serve_cached_prompt_tokens_total",
            "Prompt tokens of finished requests served from the prefix cache.",
            self.cached_prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "k3serve_client_disconnects_total",
            "Requests aborted because the client went away.",
            self.client_disconnects.load(Ordering::Relaxed),
        );
        self.connections.render(&mut out);
        let _ = writeln!(
            out,
            "# HELP k3serve_ignored_request_fields_total Unknown request fields accepted and ignored, by field path (array indices dropped).\n# TYPE k3serve_ignored_request_fields_total counter"
        );
        for (field, n) in self.ignored_fields.snapshot() {
            let _ = writeln!(
                out,
                "k3serve_ignored_request_fields_total{{field=\"{}\"}} {n}",
                escape(&field)
            );
        }
        counter(
            &mut out,
            "k3serve_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
            backend.prefix_cache_queried_tokens,
        );
        counter(
            &mut out,
            "k3serve_prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache.",
            backend.prefix_cache_hit_tokens,
        );
        let hit_rate = if backend.prefix_cache_queried_tokens == 0 {
            0.0
        } else {
            backend.prefix_cache_hit_tokens as f64 / backend.prefix_cache_queried_tokens as f64
        };
        gauge(
            &mut out,
            "k3serve_prefix_cache_hit_rate",
            "Share of looked-up prompt tokens found in the prefix cache.",
            hit_rate,
        );
        counter(
            &mut out,
            "k3serve_num_preemptions_total",
            "Requests preempted for memory.",
            backend.preemptions,
        );
        let _ = writeln!(
            out,
            "# HELP k3serve_pool_used_bytes Memory pool bytes in use, by kind.\n# TYPE k3serve_pool_used_bytes gauge"
        );
        for p in &backend.pool {
            let _ = writeln!(
                out,
                "k3serve_pool_used_bytes{{kind=\"{}\"}} {}",
                escape(&p.kind),
                p.used_bytes
            );
        }
        let _ = writeln!(
            out,
            "# HELP k3serve_pool_capacity_bytes Memory pool bytes available, by kind.\n# TYPE k3serve_pool_capacity_bytes gauge"
        );
        for p in &backend.pool {
            let _ = writeln!(
                out,
                "k3serve_pool_capacity_bytes{{kind=\"{}\"}} {}",
                escape(&p.kind),
                p.capacity_bytes
            );
        }
        let _ = writeln!(
            out,
            "# HELP k3serve_pool_usage_ratio Share of the pool in use, by kind.\n# TYPE k3serve_pool_usage_ratio gauge"
        );
        for p in &backend.pool {
            let ratio = if p.capacity_bytes == 0 {
                0.0
            } else {
                p.used_bytes as f64 / p.capacity_bytes as f64
            };
            let _ = writeln!(
                out,
                "k3serve_pool_usage_ratio{{kind=\"{}\"}} {ratio}",
                escape(&p.kind)
            );
        }
        if let Some(n) = backend.plugin_instances_in_use {
            gauge(
                &mut out,
                "k3serve_plugin_instances_in_use",
                "Wasm plugin instances alive (parser streams, template renders and warm templates).",
                n as f64,
            );
        }
        counter(
            &mut out,
            "k3serve_plugin_capacity_refusals_total",
            "Plugin instance starts refused because every instance slot was taken (answered 503).",
            backend.plugin_capacity_refusals,
        );
        if let Some(spec) = &backend.speculative {
            render_spec(&mut out, spec);
        }
        for (name, help, pick) in [
            (
                "k3serve_plugin_calls_total",
                "Plugin calls by stage and version.",
                (|c: &crate::backend::PluginCounters| c.calls) as fn(&_) -> u64,
            ),
            (
                "k3serve_plugin_errors_total",
                "Plugin errors (traps, timeouts, rejected output) by stage and version.",
                |c| c.errors,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for c in &backend.plugins {
                let _ = writeln!(
                    out,
                    "{name}{{stage=\"{}\",version=\"{}\"}} {}",
                    escape(&c.stage),
                    escape(&c.version),
                    pick(c)
                );
            }
        }
        out
    }
}

/// Speculative decoding's section of `/metrics` (names after vLLM's `spec_decode_*`).
fn render_spec(out: &mut String, spec: &crate::backend::SpecDecodeMetrics) {
    let _ = writeln!(
        out,
        "# HELP k3serve_spec_decode_info The speculative decoding method in use.\n# TYPE k3serve_spec_decode_info gauge\nk3serve_spec_decode_info{{method=\"{}\"}} 1",
        escape(&spec.method)
    );
    counter(
        out,
        "k3serve_spec_decode_num_drafts_total",
        "Verify rounds: drafts checked by the target.",
        spec.drafts,
    );
    counter(
        out,
        "k3serve_spec_decode_num_draft_tokens_total",
        "Draft tokens verified.",
        spec.draft_tokens,
    );
    counter(
        out,
        "k3serve_spec_decode_num_accepted_tokens_total",
        "Draft tokens accepted.",
        spec.accepted_tokens,
    );
    let mean = if spec.drafts == 0 {
        0.0
    } else {
        (spec.accepted_tokens + spec.drafts) as f64 / spec.drafts as f64
    };
    gauge(
        out,
        "k3serve_spec_decode_mean_acceptance_length",
        "Tokens committed per verify round (accepted drafts + the target's own).",
        mean,
    );
    for (name, help, label, values) in [
        (
            "k3serve_spec_decode_num_accepted_tokens_per_pos_total",
            "Accepted draft tokens by position in the draft.",
            "position",
            &spec.accepted_by_position,
        ),
        (
            "k3serve_spec_decode_verify_length_total",
            "Verify rounds by the number of draft tokens the planner kept.",
            "draft_tokens",
            &spec.verify_lengths,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for (i, v) in values.iter().enumerate() {
            let _ = writeln!(out, "{name}{{{label}=\"{i}\"}} {v}");
        }
    }
}

fn gauge(out: &mut String, name: &str, help: &str, value: f64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
    );
}

fn counter(out: &mut String, name: &str, help: &str, value: u64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
    );
}

/// Escape a label value per the exposition format.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{PluginCounters, PoolUsage};

    #[test]
    fn renders_histograms_and_labels() {
        let m = HttpMetrics::default();
        m.record_request("/v1/chat/completions", 200);
        m.ttft.observe(0.003);
        m.ttft.observe(100.0);
        m.ignored_fields
            .record("messages[1].provider_specific_fields");
        let text = m.render(&BackendMetrics {
            running: 2,
            pool: vec![PoolUsage {
                kind: "kv".into(),
                used_bytes: 5,
                capacity_bytes: 10,
            }],
            plugins: vec![PluginCounters {
                stage: "tool-parser".into(),
                version: "a\"b".into(),
                calls: 3,
                errors: 1,
            }],
            speculative: Some(crate::backend::SpecDecodeMetrics {
                method: "ngram".into(),
                drafts: 4,
                draft_tokens: 12,
                accepted_tokens: 6,
                accepted_by_position: vec![3, 2, 1],
                verify_lengths: vec![0, 1, 0, 3],
            }),
            ..Default::default()
        });
        assert!(text.contains("k3serve_spec_decode_info{method=\"ngram\"} 1"));
        assert!(text.contains("k3serve_spec_decode_mean_acceptance_length 2.5"));
        assert!(
            text.contains(
                "k3serve_spec_decode_num_accepted_tokens_per_pos_total{position=\"1\"} 2"
            )
        );
        assert!(text.contains("k3serve_spec_decode_verify_length_total{draft_tokens=\"3\"} 3"));
        assert!(text.contains(
            "k3serve_http_requests_total{route=\"/v1/chat/completions\",status=\"200\"} 1"
        ));
        assert!(text.contains("k3serve_time_to_first_token_seconds_bucket{le=\"0.001\"} 0"));
        assert!(text.contains("k3serve_time_to_first_token_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("k3serve_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2"));
        assert!(text.contains("k3serve_num_requests_running 2"));
        assert!(text.contains(
            "k3serve_ignored_request_fields_total{field=\"messages[].provider_specific_fields\"} 1"
        ));
        assert!(text.contains("k3serve_pool_usage_ratio{kind=\"kv\"} 0.5"));
        assert!(
            text.contains(
                "k3serve_plugin_errors_total{stage=\"tool-parser\",version=\"a\\\"b\"} 1"
            )
        );
    }
}
