//! The router against fake replicas (tests/common): routing, streaming, disconnects, retries,
//! ejection, policy fallbacks, error shapes, admin auth and cache-event resync.

mod common;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use common::{BLOCK, Chat, EVENTS_TOKEN, Fake, snapshot, until};
use futures::StreamExt;
use k3_cache_events::{BlockRecord, CacheEvent, block_hashes};
use k3_router::{
    AdminError, ApiRoute, PolicyAdmin, PromptTokens, ReplicaView, RouteChoice, RoutePolicy,
    RouteRequest, RouterConfig, RouterDeps, RouterHandle, build_router,
};
use serde_json::{Value, json};

/// Picks the largest usable hit; ties go to the first replica.
struct MaxHit;

impl RoutePolicy for MaxHit {
    fn choose(&self, _: &RouteRequest, replicas: &[ReplicaView]) -> Result<RouteChoice, String> {
        let best = replicas
            .iter()
            .rev()
            .max_by_key(|r| r.prefix_hit_blocks)
            .ok_or("no replicas")?;
        Ok(RouteChoice {
            replica_id: best.id.clone(),
            reason: format!("hit {} blocks\nok", best.prefix_hit_blocks),
        })
    }

    fn name(&self) -> String {
        "max-hit".into()
    }
}

/// Always fails, names a replica that does not exist, or takes too long.
enum Broken {
    Error,
    Unknown,
    Slow,
}

impl RoutePolicy for Broken {
    fn choose(&self, _: &RouteRequest, _: &[ReplicaView]) -> Result<RouteChoice, String> {
        match self {
            Broken::Error => Err("boom".into()),
            Broken::Unknown => Ok(RouteChoice {
                replica_id: "nope".into(),
                reason: String::new(),
            }),
            Broken::Slow => {
                std::thread::sleep(Duration::from_millis(300));
                Err("late".into())
            }
        }
    }

    fn name(&self) -> String {
        "broken".into()
    }
}

/// The prompt is the request's `prompt_ids` field.
struct BodyTokens;

impl PromptTokens for BodyTokens {
    fn tokens(&self, _: ApiRoute, body: &Value) -> Option<Vec<u32>> {
        body.get("prompt_ids")?
            .as_array()?
            .iter()
            .map(|v| v.as_u64().map(|n| n as u32))
            .collect()
    }
}

struct Router {
    url: String,
    handle: RouterHandle,
    http: reqwest::Client,
}

async fn router(
    fakes: &[&Fake],
    policy: Arc<dyn RoutePolicy>,
    admin: Option<Arc<dyn PolicyAdmin>>,
    tweak: impl FnOnce(&mut RouterConfig),
) -> Router {
    let mut config = RouterConfig::with_replicas(fakes.iter().map(|f| f.url.clone()));
    config.health_interval = Duration::from_millis(50);
    config.events_token = Some(EVENTS_TOKEN.into());
    tweak(&mut config);
    let deps = RouterDeps {
        policy,
        tokens: Arc::new(BodyTokens),
        admin,
    };
    let (app, handle) = build_router(config, deps).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    Router {
        url,
        handle,
        http: reqwest::Client::builder().no_proxy().build().unwrap(),
    }
}

impl Router {
    async fn chat(&self, body: &Value) -> reqwest::Response {
        self.http
            .post(format!("{}/v1/chat/completions", self.url))
            .bearer_auth("client-key")
            .json(body)
            .send()
            .await
            .unwrap()
    }

    async fn synced(&self) {
        until("every replica synced", || {
            self.handle
                .replicas()
                .iter()
                .all(|r| r.healthy && r.events_synced)
        })
        .await;
    }

    fn metric(&self, line_start: &str) -> Option<f64> {
        self.handle
            .metrics()
            .lines()
            .find_map(|l| l.strip_prefix(line_start)?.trim().parse().ok())
    }
}

fn header(resp: &reqwest::Response, name: &str) -> String {
    resp.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default()
}

fn prompt(blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK) as u32).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_by_usable_hit() -> Result<()> {
    let p = prompt(4);
    let fakes = [
        Fake::start("a").await,
        Fake::start("b").await,
        Fake::start("c").await,
    ];
    // r0 holds the whole prompt but no checkpoint in it: nothing usable.
    *fakes[0].state.snapshot.lock() = snapshot(&p, None);
    *fakes[1].state.snapshot.lock() = snapshot(&p[..2 * BLOCK], Some(1));
    let r = router(
        &[&fakes[0], &fakes[1], &fakes[2]],
        Arc::new(MaxHit),
        None,
        |_| {},
    )
    .await;
    r.synced().await;

    let body = json!({"model": "m", "messages": [], "prompt_ids": p});
    let resp = r.chat(&body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-k3-replica"), "r1");
    assert_eq!(header(&resp, "x-k3-route-reason"), "hit 2 blocks?ok");
    assert_eq!(resp.json::<Value>().await?["replica"], "b");
    let (headers, got) = fakes[1].state.received.lock()[0].clone();
    assert_eq!(
        got,
        serde_json::to_vec(&body)?,
        "the original body is forwarded"
    );
    assert_eq!(headers["authorization"], "Bearer client-key");
    assert!(headers.contains_key("x-request-id"));

    // r2 now stores all four blocks with a checkpoint at the end: it wins.
    let blocks = block_hashes(&p, BLOCK)
        .into_iter()
        .enumerate()
        .map(|(i, hash)| BlockRecord {
            hash,
            checkpoint: i == 3,
        })
        .collect();
    assert!(fakes[2].push_event(&CacheEvent::Stored { blocks }));
    until("r2's index", || r.handle.replicas()[2].index_blocks == 4).await;
    let resp = r.chat(&body).await;
    assert_eq!(header(&resp, "x-k3-replica"), "r2");

    // A body that is not JSON still reaches a replica (which answers the protocol's 4xx).
    let resp = r
        .http
        .post(format!("{}/v1/chat/completions", r.url))
        .body("{not json")
        .send()
        .await?;
    assert_eq!(resp.status(), 200);

    assert_eq!(
        r.metric("k3router_prefix_blocks_requested_total"),
        Some(8.0)
    );
    assert_eq!(r.metric("k3router_prefix_blocks_hit_total"), Some(6.0));
    assert_eq!(r.metric("k3router_estimated_prefix_hit_rate"), Some(0.75));
    assert_eq!(
        r.metric(r#"k3router_decisions_total{replica="r1",policy="max-hit",outcome="policy"}"#),
        Some(1.0)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_chunk_by_chunk() -> Result<()> {
    let fake = Fake::start("a").await;
    fake.set_chat(Chat::Stream);
    let r = router(&[&fake], Arc::new(MaxHit), None, |_| {}).await;
    let req = json!({"stream": true});
    let (resp, tx) = tokio::join!(r.chat(&req), fake.next_stream());
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "content-type"), "text/event-stream");
    let mut body = resp.bytes_stream();
    tx.send(Ok("data: one\n\n".into())).await?;
    // The first chunk arrives while the replica has not sent the second: nothing buffers.
    let first = tokio::time::timeout(Duration::from_secs(5), body.next()).await?;
    assert_eq!(first.unwrap()?, "data: one\n\n");
    tx.send(Ok("data: two\n\n".into())).await?;
    let second = tokio::time::timeout(Duration::from_secs(5), body.next()).await?;
    assert_eq!(second.unwrap()?, "data: two\n\n");
    drop(tx);
    assert!(body.next().await.is_none());
    until("in-flight back to 0", || {
        r.handle.replicas()[0].in_flight == 0
    })
    .await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_reaches_the_replica() -> Result<()> {
    let fake = Fake::start("a").await;
    fake.set_chat(Chat::Stream);
    let r = router(&[&fake], Arc::new(MaxHit), None, |_| {}).await;
    let req = json!({"stream": true});
    let (resp, tx) = tokio::join!(r.chat(&req), fake.next_stream());
    let mut body = resp.bytes_stream();
    tx.send(Ok("data: one\n\n".into())).await?;
    body.next().await.unwrap()?;
    assert_eq!(r.handle.replicas()[0].in_flight, 1);
    drop(body);
    // The replica's stream sees its receiver go once the router drops the upstream connection.
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            tokio::select! {
                () = tx.closed() => break,
                () = tokio::time::sleep(Duration::from_millis(20)) => {
                    let _ = tx.try_send(Ok("data: more\n\n".into()));
                }
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the replica never saw the client go");
    until("in-flight back to 0", || {
        r.handle.replicas()[0].in_flight == 0
    })
    .await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_before_the_response_reaches_the_replica() -> Result<()> {
    let fake = Fake::start("a").await;
    fake.set_chat(Chat::Hang);
    let r = router(&[&fake], Arc::new(MaxHit), None, |_| {}).await;
    let url = format!("{}/v1/chat/completions", r.url);
    let request = r
        .http
        .post(&url)
        .body("{}")
        .timeout(Duration::from_millis(300));
    let (sent, tx) = tokio::join!(request.send(), fake.next_stream());
    assert!(sent.is_err(), "the replica never answers");
    let closed = tokio::time::timeout(Duration::from_secs(5), tx.closed()).await;
    assert!(closed.is_ok(), "the replica's handler outlived the client");
    until("in-flight back to 0", || {
        r.handle.replicas()[0].in_flight == 0
    })
    .await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_a_request_that_has_not_started() -> Result<()> {
    let fakes = [Fake::start("a").await, Fake::start("b").await];
    fakes[0].set_chat(Chat::Drop);
    let r = router(&[&fakes[0], &fakes[1]], Arc::new(MaxHit), None, |_| {}).await;
    // No hits anywhere: the policy picks r0, which drops the connection.
    let resp = r.chat(&json!({"model": "m"})).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-k3-replica"), "r1");
    assert_eq!(fakes[0].received(), 1);
    assert_eq!(
        r.metric(r#"k3router_errors_total{replica="r0",kind="transport"}"#),
        Some(1.0)
    );
    assert_eq!(
        r.metric(r#"k3router_decisions_total{replica="r1",policy="max-hit",outcome="retry"}"#),
        Some(1.0)
    );
    // A 503 before any body is retried the same way.
    fakes[0].set_chat(Chat::Unavailable);
    until("r0 healthy", || r.handle.replicas()[0].healthy).await;
    let resp = r.chat(&json!({"model": "m"})).await;
    assert_eq!(header(&resp, "x-k3-replica"), "r1");
    assert_eq!(
        r.metric(r#"k3router_errors_total{replica="r0",kind="unavailable"}"#),
        Some(1.0)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_and_body_size_are_bounded() -> Result<()> {
    let fakes = [Fake::start("a").await, Fake::start("b").await];
    fakes[0].set_chat(Chat::Drop);
    let r = router(&[&fakes[0], &fakes[1]], Arc::new(MaxHit), None, |c| {
        c.max_attempts = Some(1);
        c.max_request_body_bytes = 1024;
    })
    .await;
    let resp = r.chat(&json!({"model": "m"})).await;
    assert_eq!(resp.status(), 503);
    let v: Value = resp.json().await?;
    assert_eq!(v["error"]["code"], "replicas_failed");
    assert_eq!(fakes[1].received(), 0, "one attempt only");
    let resp = r
        .http
        .post(format!("{}/v1/messages", r.url))
        .body(vec![b' '; 4096])
        .send()
        .await?;
    assert_eq!(resp.status(), 413);
    let v: Value = resp.json().await?;
    assert_eq!(
        v["error"]["type"], "request_too_large",
        "Anthropic shape: {v}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ejects_and_readmits_a_replica() -> Result<()> {
    let fakes = [Fake::start("a").await, Fake::start("b").await];
    let r = router(&[&fakes[0], &fakes[1]], Arc::new(MaxHit), None, |_| {}).await;
    r.synced().await;
    fakes[0].stop();
    until("r0 ejected", || !r.handle.replicas()[0].healthy).await;
    assert!(
        !r.handle.replicas()[0].events_synced,
        "its index is dropped"
    );
    let resp = r.chat(&json!({})).await;
    assert_eq!(header(&resp, "x-k3-replica"), "r1");
    let health: Value = r
        .http
        .get(format!("{}/health", r.url))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(health["status"], "ok");
    assert_eq!(health["replicas"][0]["healthy"], false);
    fakes[0].restart().await;
    r.synced().await;
    let resp = r.chat(&json!({})).await;
    assert_eq!(header(&resp, "x-k3-replica"), "r0");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_policy_falls_back_and_is_counted() -> Result<()> {
    let fakes = [Fake::start("a").await, Fake::start("b").await];
    let r = router(
        &[&fakes[0], &fakes[1]],
        Arc::new(Broken::Error),
        None,
        |c| {
            c.policy_timeout = Duration::from_millis(50);
        },
    )
    .await;
    let resp = r.chat(&json!({})).await;
    assert_eq!(resp.status(), 200);
    assert!(header(&resp, "x-k3-route-reason").starts_with("fallback (error)"));
    r.handle.set_policy(Arc::new(Broken::Unknown));
    assert_eq!(r.chat(&json!({})).await.status(), 200);
    r.handle.set_policy(Arc::new(Broken::Slow));
    assert_eq!(r.chat(&json!({})).await.status(), 200);
    for kind in ["error", "unknown_replica", "timeout"] {
        let line = format!(r#"k3router_policy_errors_total{{policy="broken",kind="{kind}"}}"#);
        assert_eq!(r.metric(&line), Some(1.0), "{kind}");
    }
    assert_eq!(
        r.metric(r#"k3router_decisions_total{replica="r0",policy="broken",outcome="fallback"}"#),
        Some(3.0)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_replica_is_a_503_in_each_protocol() -> Result<()> {
    // Ports nothing listens on.
    let mut urls = Vec::new();
    for _ in 0..2 {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        urls.push(format!("http://{}", l.local_addr()?));
    }
    let mut config = RouterConfig::with_replicas(urls);
    config.connect_timeout = Duration::from_millis(200);
    let deps = RouterDeps {
        policy: Arc::new(MaxHit),
        tokens: Arc::new(BodyTokens),
        admin: None,
    };
    let (app, _handle) = build_router(config, deps).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    let http = reqwest::Client::builder().no_proxy().build()?;

    assert_eq!(
        http.get(format!("{url}/health")).send().await?.status(),
        503
    );
    let resp = http
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({}))
        .send()
        .await?;
    assert_eq!(resp.status(), 503);
    let v: Value = resp.json().await?;
    assert_eq!(v["error"]["type"], "overloaded_error");
    assert_eq!(v["error"]["code"], "no_replica");
    assert!(v["error"]["param"].is_null() && v["error"]["message"].is_string());
    let resp = http
        .post(format!("{url}/v1/messages"))
        .json(&json!({}))
        .send()
        .await?;
    assert_eq!(resp.status(), 503);
    let v: Value = resp.json().await?;
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "overloaded_error");
    assert!(v["error"]["message"].is_string());

    // Healthy replicas that all fail the request: the same 503, naming what failed.
    let fakes = [Fake::start("a").await, Fake::start("b").await];
    for f in &fakes {
        f.set_chat(Chat::Unavailable);
    }
    let r = router(&[&fakes[0], &fakes[1]], Arc::new(MaxHit), None, |_| {}).await;
    let resp = r
        .http
        .post(format!("{}/v1/messages", r.url))
        .json(&json!({}))
        .send()
        .await?;
    assert_eq!(resp.status(), 503);
    let v: Value = resp.json().await?;
    assert_eq!(v["error"]["type"], "overloaded_error");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("r0: answered 503") && message.contains("r1"),
        "{message}"
    );
    Ok(())
}

struct FakeAdmin;

impl PolicyAdmin for FakeAdmin {
    fn list(&self) -> Value {
        json!([{"stage": "router", "active": "1"}])
    }

    fn install(&self, component: bytes::Bytes) -> Result<Value, AdminError> {
        if component.starts_with(b"\0asm") {
            Ok(json!({"id": "2", "active": true}))
        } else {
            Err(AdminError::Rejected("not a component".into()))
        }
    }

    fn rollback(&self) -> Result<Value, AdminError> {
        Err(AdminError::InvalidRequest("nothing to roll back".into()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_need_the_token() -> Result<()> {
    let fake = Fake::start("a").await;
    let r = router(&[&fake], Arc::new(MaxHit), Some(Arc::new(FakeAdmin)), |c| {
        c.admin_token = Some("adm".into());
    })
    .await;
    let list = format!("{}/admin/plugins", r.url);
    assert_eq!(r.http.get(&list).send().await?.status(), 401);
    let resp = r.http.get(&list).bearer_auth("wrong").send().await?;
    assert_eq!(resp.status(), 401);
    assert_eq!(
        resp.json::<Value>().await?["error"]["code"],
        "invalid_admin_token"
    );
    let v: Value = r
        .http
        .get(&list)
        .bearer_auth("adm")
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(v["stages"][0]["stage"], "router");

    let put = format!("{}/admin/plugins/router", r.url);
    assert_eq!(r.http.put(&put).body("x").send().await?.status(), 401);
    let resp = r
        .http
        .put(&put)
        .bearer_auth("adm")
        .body("\0asm....")
        .send()
        .await?;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await?;
    assert_eq!(
        (v["stage"].as_str(), v["activated"]["id"].as_str()),
        (Some("router"), Some("2"))
    );
    let resp = r
        .http
        .put(&put)
        .bearer_auth("adm")
        .body("junk")
        .send()
        .await?;
    assert_eq!(resp.status(), 400);
    assert_eq!(
        resp.json::<Value>().await?["error"]["code"],
        "plugin_rejected"
    );
    let other = format!("{}/admin/plugins/chat-template", r.url);
    let resp = r
        .http
        .put(&other)
        .bearer_auth("adm")
        .body("\0asm")
        .send()
        .await?;
    assert_eq!(resp.status(), 404);
    let rollback = format!("{}/admin/plugins/router/rollback", r.url);
    assert_eq!(r.http.post(&rollback).send().await?.status(), 401);
    let resp = r.http.post(&rollback).bearer_auth("adm").send().await?;
    assert_eq!(resp.status(), 400);

    // Without an admin token the admin API is off.
    let off = router(
        &[&fake],
        Arc::new(MaxHit),
        Some(Arc::new(FakeAdmin)),
        |_| {},
    )
    .await;
    let resp = off
        .http
        .get(format!("{}/admin/plugins", off.url))
        .bearer_auth("adm")
        .send()
        .await?;
    assert_eq!(resp.status(), 403);
    assert_eq!(
        resp.json::<Value>().await?["error"]["code"],
        "admin_disabled"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_events_resync_after_the_stream_restarts() -> Result<()> {
    let fake = Fake::start("a").await;
    *fake.state.snapshot.lock() = snapshot(&prompt(2), Some(1));
    let r = router(&[&fake], Arc::new(MaxHit), None, |_| {}).await;
    r.synced().await;
    let status = &r.handle.replicas()[0];
    assert_eq!((status.index_blocks, status.index_checkpoints), (2, 1));
    assert_eq!(status.block_tokens, Some(BLOCK));
    assert!(fake.push_event(&CacheEvent::Removed {
        hashes: block_hashes(&prompt(2), BLOCK)[1..].to_vec()
    }));
    until("the removal", || r.handle.replicas()[0].index_blocks == 1).await;

    // The replica ends its stream; its next one starts from a different snapshot.
    fake.restart_events(snapshot(&prompt(5), Some(4)));
    until("the new snapshot", || {
        let s = &r.handle.replicas()[0];
        s.events_synced && s.index_blocks == 5 && s.index_checkpoints == 1
    })
    .await;
    assert_eq!(
        fake.state
            .event_connects
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
    assert_eq!(
        r.metric(r#"k3router_cache_events_connects_total{replica="r0"}"#),
        Some(2.0)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_routes_go_to_a_healthy_replica() -> Result<()> {
    let fake = Fake::start("a").await;
    let r = router(&[&fake], Arc::new(MaxHit), None, |_| {}).await;
    // The fake has no /v1/models: its 404 passes through, from the replica.
    let resp = r
        .http
        .get(format!("{}/v1/models/a/b?x=1", r.url))
        .send()
        .await?;
    assert_eq!(resp.status(), 404);
    assert_eq!(header(&resp, "x-k3-replica"), "r0");
    // An unknown route is the router's own 404.
    let resp = r.http.get(format!("{}/nope", r.url)).send().await?;
    assert_eq!(resp.status(), 404);
    assert_eq!(
        resp.json::<Value>().await?["error"]["code"],
        "unknown_route"
    );
    let metrics = r
        .http
        .get(format!("{}/metrics", r.url))
        .send()
        .await?
        .text()
        .await?;
    assert!(
        metrics.contains("k3router_replica_healthy{replica=\"r0\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("k3router_requests_total{replica=\"r0\"} 1"),
        "{metrics}"
    );
    Ok(())
}

#[test]
fn config_reads_toml() {
    let c: RouterConfig = toml::from_str(
        r#"
        replicas = ["http://a:8000", "http://b:8000/"]
        health_interval = 0.5
        eject_after = 3
        events_token = "t"
        policy_timeout = 0.02
        "#,
    )
    .unwrap();
    assert_eq!(c.health_interval, Duration::from_millis(500));
    assert_eq!(c.policy_timeout, Duration::from_millis(20));
    assert_eq!(c.eject_after, 3);
    assert_eq!(c.attempts(), 2);
    assert_eq!(c.validate().unwrap()[1], "http://b:8000");
    assert!(toml::from_str::<RouterConfig>("replicas = []\nhealth_intervl = 1").is_err());
    assert!(toml::from_str::<RouterConfig>("health_interval = -1").is_err());
}
