//! Optional per-op timing (`K3_PROFILE=1`): each `Backend` op waits for the stream before and
//! after itself and adds its wall time to a per-op (and, for matmuls, per-shape) total. This
//! serialises host and device, so it is for finding where a step's time goes, never for
//! throughput figures; the report is printed to stderr when the backend is dropped.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Default)]
pub(crate) struct OpProfile {
    totals: Mutex<BTreeMap<String, (Duration, u64)>>,
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
        e.0 += dt;
        e.1 += 1;
        out
    }

    /// One line per key, largest total first, with its share of the timed total.
    pub(crate) fn report(&self) -> String {
        let totals = self.totals.lock().unwrap_or_else(|p| p.into_inner());
        let all: Duration = totals.values().map(|v| v.0).sum();
        let mut rows: Vec<_> = totals.iter().collect();
        rows.sort_by_key(|b| std::cmp::Reverse(b.1.0));
        let mut s = format!("op profile (K3_PROFILE): {:.1} ms timed\n", ms(all));
        for (k, (d, n)) in rows {
            let share = if all.is_zero() {
                0.0
            } else {
                100.0 * d.as_secs_f64() / all.as_secs_f64()
            };
            s += &format!(
                "  {k:<40} {:>10.2} ms {share:>5.1}%  {n:>7} calls  {:>9.1} us/call\n",
                ms(*d),
                1e3 * ms(*d) / (*n).max(1) as f64
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
}
