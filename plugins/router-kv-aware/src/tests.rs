use super::*;

/// A fresh policy's choice: the average is this request's length.
fn pick(req: &RouteRequest, replicas: &[Replica]) -> RouteChoice {
    KvAware::default().choose(req, replicas).unwrap()
}

/// A policy that has seen `count` prompts of `blocks` blocks.
fn trained(blocks: u64, count: usize) -> KvAware {
    let mut p = KvAware::default();
    let r = [replica("a", 0, 0, 0)];
    for _ in 0..count {
        p.choose(&request(blocks), &r).unwrap();
    }
    p
}

#[test]
fn prefers_the_usable_hit() {
    let r = [
        replica("a", 0, 1, 0),
        replica("b", 0, 1, 12),
        replica("c", 0, 1, 4),
    ];
    let c = pick(&request(16), &r);
    assert_eq!(c.replica_id, "b");
    assert_eq!(
        c.reason,
        "hit 12/16 blocks, load 1 (queued 0, running 1), pool 0% used, avg prompt 16.0 blocks, score 2.00"
    );
}

#[test]
fn a_hit_beats_a_small_load_gap() {
    // A hit as long as the average prompt is worth HIT_WEIGHT requests: a gap of 3 is worth
    // waiting for.
    let r = [replica("a", 0, 0, 0), replica("b", 2, 1, 16)];
    assert_eq!(pick(&request(16), &r).replica_id, "b");
}

#[test]
fn load_wins_past_the_gap() {
    // The best-hit replica's queue is LOAD_GAP_WINS + 1 longer: load wins, however good the
    // hit (here the most a hit can count: twice the average prompt), and with the pool
    // pressure in the hit replica's favour.
    let gap = LOAD_GAP_WINS as u32 + 1;
    let mut idle = replica("a", 0, 0, 0);
    idle.kv_free_blocks = 0;
    let r = [idle, replica("b", gap, 0, 64)];
    let mut p = trained(8, 200);
    let c = p.choose(&request(64), &r).unwrap();
    assert_eq!(c.replica_id, "a", "{}", c.reason);
    // Exactly at the boundary the arithmetic is as documented.
    let s = score(&replica("b", gap, 0, 64), 64, 8.0);
    assert_eq!(s.hit, MAX_HIT);
    assert!(s.score < -PRESSURE_WEIGHT, "{s:?}");
    // A gap of LOAD_GAP_WINS - 1 and the capped hit wins (at LOAD_GAP_WINS it ties with the
    // idle replica's full pool, and ties go to the lower load).
    let r = [r[0].clone(), replica("b", gap - 2, 0, 64)];
    assert_eq!(p.choose(&request(64), &r).unwrap().replica_id, "b");
}

#[test]
fn no_piling_up_on_one_replica() {
    // Every request shares a 16-block prefix cached only on `a`; each choice adds one queued
    // request to the chosen replica. `a` takes the first few, then the others get work.
    let mut r = vec![
        replica("a", 0, 0, 16),
        replica("b", 0, 0, 0),
        replica("c", 0, 0, 0),
    ];
    for _ in 0..30 {
        let id = pick(&request(16), &r).replica_id;
        r.iter_mut().find(|x| x.id == id).unwrap().queued += 1;
    }
    let queued: Vec<u32> = r.iter().map(|x| x.queued).collect();
    assert!(queued.iter().all(|&q| q >= 6), "{queued:?}");
    let spread = queued.iter().max().unwrap() - queued.iter().min().unwrap();
    assert!(spread as f64 <= LOAD_GAP_WINS, "{queued:?}");
}

#[test]
fn cold_goes_to_least_load() {
    let mut r = [
        replica("a", 2, 1, 0),
        replica("b", 0, 2, 0),
        replica("c", 2, 1, 0),
    ];
    r[1].kv_free_blocks = 5; // pressure is not what decides a cold request
    let c = pick(&request(16), &r);
    assert_eq!(c.replica_id, "b");
    assert!(c.reason.starts_with("cold"), "{}", c.reason);
    // Ties: most free blocks, then the smallest id.
    let mut r = [
        replica("b", 1, 0, 0),
        replica("a", 0, 1, 0),
        replica("c", 1, 0, 0),
    ];
    r[2].kv_free_blocks = 100;
    r[0].kv_free_blocks = 40;
    r[1].kv_free_blocks = 40;
    assert_eq!(pick(&request(16), &r).replica_id, "c");
    r[2].kv_free_blocks = 40;
    assert_eq!(pick(&request(16), &r).replica_id, "a");
    // No hashes (a prompt shorter than a block) is cold too.
    let r = [replica("a", 1, 0, 0), replica("b", 0, 0, 0)];
    assert_eq!(pick(&request(0), &r).replica_id, "b");
}

#[test]
fn ties_are_deterministic() {
    let r = [replica("b", 1, 0, 8), replica("a", 1, 0, 8)];
    assert_eq!(pick(&request(16), &r).replica_id, "a");
    // Same score, different load: the lower load wins (hit 8 more blocks = 2 more load).
    let r = [replica("a", 2, 0, 16), replica("b", 0, 0, 8)];
    let (sa, sb) = (score(&r[0], 16, 16.0), score(&r[1], 16, 16.0));
    assert_eq!(sa.score, sb.score);
    assert_eq!(pick(&request(16), &r).replica_id, "b");
}

#[test]
fn pool_pressure_breaks_near_ties() {
    let mut full = replica("a", 0, 1, 16);
    full.kv_free_blocks = 0;
    let r = [full, replica("b", 0, 1, 14)];
    // a: 4 - 1 - 1 = 2; b: 3.5 - 1 - 0 = 2.5.
    assert_eq!(pick(&request(16), &r).replica_id, "b");
}

#[test]
fn short_prompts_earn_little_and_hits_are_capped() {
    // A 2-block prompt fully cached, where prompts are short, is worth 2/8 of a whole hit: not
    // a queued request.
    let r = [replica("a", 1, 0, 2), replica("b", 0, 0, 0)];
    assert_eq!(pick(&request(2), &r).replica_id, "b");
    // A hit longer than the prompt (a host that over-reports) counts as the whole prompt.
    let s = score(&replica("a", 0, 0, 99), 16, 16.0);
    assert_eq!((s.hit_blocks, s.hit), (16, 1.0));
    // A hit is worth at most MAX_HIT average prompts, and the average at least MIN_AVG_BLOCKS.
    let s = score(&replica("a", 0, 0, 640), 640, 16.0);
    assert_eq!(s.hit, MAX_HIT);
    let s = score(&replica("a", 0, 0, 4), 4, 1.0);
    assert_eq!(s.hit, 4.0 / MIN_AVG_BLOCKS);
}

#[test]
fn a_long_prompts_hit_is_worth_more() {
    // Where prompts average 8 blocks, 16 cached blocks save about two average prefills: worth
    // a queue of 5 even though they are only half of this 32-block prompt.
    let r = [replica("a", 0, 0, 0), replica("b", 5, 0, 16)];
    let mut p = trained(8, 50);
    let c = p.choose(&request(32), &r).unwrap();
    assert_eq!(c.replica_id, "b", "{}", c.reason);
    // An 8-block prompt's whole hit saves one average prefill: not worth that queue.
    let r = [replica("a", 0, 0, 0), replica("b", 5, 0, 8)];
    assert_eq!(p.choose(&request(8), &r).unwrap().replica_id, "a");
}

#[test]
fn the_average_prompt_moves_slowly() {
    let mut p = KvAware::default();
    assert_eq!(p.avg_blocks(), None);
    let r = [replica("a", 0, 0, 0)];
    p.choose(&request(40), &r).unwrap();
    assert_eq!(p.avg_blocks(), Some(40.0));
    p.choose(&request(8), &r).unwrap();
    assert_eq!(p.avg_blocks(), Some(40.0 - 32.0 * AVG_WEIGHT));
    // A request whose prompt is unknown (no tokens, no hashes) leaves it alone.
    p.choose(&RouteRequest::default(), &r).unwrap();
    assert_eq!(p.avg_blocks(), Some(39.0));
    // Long enough on one length, it settles there.
    let p = trained(8, 400);
    assert!((p.avg_blocks().unwrap() - 8.0).abs() < 1e-3);
}

#[test]
fn unhealthy_replicas_are_skipped() {
    let mut r = [replica("a", 0, 0, 16), replica("b", 9, 9, 0)];
    r[0].healthy = false;
    assert_eq!(pick(&request(16), &r).replica_id, "b");
}

#[test]
fn no_healthy_replica_is_invalid_input() {
    let mut r = [replica("a", 0, 0, 16)];
    r[0].healthy = false;
    let mut p = KvAware::default();
    let e = p.choose(&request(16), &r).unwrap_err();
    assert!(matches!(e, PluginError::InvalidInput(m) if m.contains("no healthy")));
    assert!(p.choose(&request(16), &[]).is_err());
}

#[test]
fn zero_sized_pools_do_not_divide_by_zero() {
    let mut r = replica("a", 0, 0, 4);
    r.kv_total_blocks = 0;
    r.kv_free_blocks = 7;
    let s = score(&r, 16, 16.0);
    assert_eq!(s.pressure, 0.0);
    assert!(s.score.is_finite());
}

#[test]
fn self_test_passes() {
    KvAware::self_test().unwrap();
}
