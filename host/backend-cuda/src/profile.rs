//! Optional per-op timing (`K3_PROFILE=1`): each `Backend` op waits for the stream before and
//! after itself and adds its wall time to a per-op (and, for matmuls, per-shape) total. This
//! serialises host and device, so it is for finding where a step's time goes, never for
//! throughput figures; the report is printed to stderr when the backend is dropped. Each key's
//! first call is also shown apart from the mean of the others: a process's first prefill pays
//! one-time costs (cuBLAS loading its kernels for new shapes, the memory pool growing) that a
//! mean over a few calls would otherwise blame on the op.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Default)]
pub(crate) struct OpProfile {
    totals: Mutex<BTreeMap<String, OpTime>>,
}

#[derive(Default, Clone, Copy)]
struct OpTime {
    total: Duration,
    calls: u64,
    first: Duration,
}

impl OpProfile {
    /// Enabled when `K3_PROFILE` is set to anything but `0` or the empty string.
    pub(crate) fn from_env() -> Option<Self> {
        let on = std::env::var("K3_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0");
        on.then(Self::default)
    }

    pub(crate) fn time<T>(&self, key: String, sync: impl Fn(), f: impl FnOnce() -> T) -> T {
        sync();
        let t0 = Instant::now();
        let out = f();
        sync();
        let dt = t0.elapsed();
        let mut totals = self.totals.lock().unwrap_or_else(|p| p.into_inner());
        let e = totals.entry(key).or_default();
        if e.calls == 0 {
            e.first = dt;
        }
        e.total += dt;
        e.calls += 1;
        out
    }

    /// One line per key, largest total first, with its share of the timed total.
    pub(crate) fn report(&self) -> String {
        let totals = self.totals.lock().unwrap_or_else(|p| p.into_inner());
        let all: Duration = totals.values().map(|v| v.total).sum();
        let mut rows: Vec<_> = totals.iter().collect();
        rows.sort_by_key(|b| std::cmp::Reverse(b.1.total));
        let mut s = format!("op profile (K3_PROFILE): {:.1} ms timed\n", ms(all));
        for (k, t) in rows {
            let share = if all.is_zero() {
                0.0
            } else {
                100.0 * t.total.as_secs_f64() / all.as_secs_f64()
            };
            let rest = match t.calls {
                0 | 1 => String::new(),
                n => format!(
                    "  first {:.1} us, then {:.1} us/call",
                    1e3 * ms(t.first),
                    1e3 * ms(t.total - t.first) / (n - 1) as f64
                ),
            };
            s += &format!(
                "  {k:<40} {:>10.2} ms {share:>5.1}%  {:>7} calls  {:>9.1} us/call{rest}\n",
                ms(t.total),
                t.calls,
                1e3 * ms(t.total) / t.calls.max(1) as f64
            );
        }
        s
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_orders_by_total_and_counts_calls() {
        let p = OpProfile::default();
        let syncs = std::cell::Cell::new(0);
        let sync = || syncs.set(syncs.get() + 1);
        let v = p.time("short".into(), sync, || 7);
        assert_eq!(v, 7, "the timed closure's value comes back");
        for _ in 0..2 {
            p.time("long".into(), sync, || {
                std::thread::sleep(Duration::from_millis(5))
            });
        }
        assert_eq!(syncs.get(), 6, "one wait before and one after every op");
        let r = p.report();
        let (long, short) = (r.find("long").unwrap(), r.find("short").unwrap());
        assert!(long < short, "largest total first:\n{r}");
        assert!(r.contains("2 calls") && r.contains("1 calls"), "{r}");
    }

    #[test]
    fn first_call_is_reported_apart_from_the_rest() {
        let p = OpProfile::default();
        for i in 0..3 {
            p.time(
                "the_op".into(),
                || {},
                || std::thread::sleep(Duration::from_millis(if i == 0 { 30 } else { 2 })),
            );
        }
        let r = p.report();
        let line = r.lines().find(|l| l.contains("the_op")).unwrap();
        let num = |tag: &str| -> f64 {
            let rest = &line[line.find(tag).unwrap() + tag.len()..];
            rest.trim_start()
                .split(' ')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        };
        let (first, then) = (num("first"), num("then"));
        assert!(
            first >= 30_000.0 && then >= 2_000.0 && then < first / 2.0,
            "{line}"
        );
    }
}
