//! The router's settings (`[router]` in the TOML file of `k3serve router`, or flags).

use std::time::Duration;

use serde::{Deserialize, Deserializer};

use crate::RouterError;

/// Everything the router process is configured with. Durations are seconds in TOML
/// (`health_interval = 0.5`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// Base URLs of the replicas (`http://10.0.0.5:8000`); they get ids `r0`, `r1`, ... in
    /// this order.
    pub replicas: Vec<String>,
    /// How often each replica's `/health` is probed.
    #[serde(deserialize_with = "seconds")]
    pub health_interval: Duration,
    /// How long one probe may take before it counts as a failure.
    #[serde(deserialize_with = "seconds")]
    pub health_timeout: Duration,
    /// Consecutive failures (probes or proxied requests that could not reach the replica)
    /// that eject a replica; the first successful probe re-admits it.
    pub eject_after: u32,
    /// Bearer token for the replicas' `/internal/cache-events` (their admin token).
    pub events_token: Option<String>,
    /// When set, `/admin/*` needs `Authorization: Bearer TOKEN`; unset disables the admin API.
    pub admin_token: Option<String>,
    /// TCP connect timeout towards a replica.
    #[serde(deserialize_with = "seconds")]
    pub connect_timeout: Duration,
    /// Replicas one request may be tried on (default: all of them).
    pub max_attempts: Option<u32>,
    /// How long the policy may take to choose; past it the built-in least-load decides.
    #[serde(deserialize_with = "seconds")]
    pub policy_timeout: Duration,
    /// Largest request body taken on the proxied routes.
    pub max_request_body_bytes: usize,
    /// Largest plugin component taken by `PUT /admin/plugins/router`.
    pub max_plugin_bytes: usize,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            replicas: Vec::new(),
            health_interval: Duration::from_secs(1),
            health_timeout: Duration::from_secs(1),
            eject_after: 2,
            events_token: None,
            admin_token: None,
            connect_timeout: Duration::from_secs(2),
            max_attempts: None,
            policy_timeout: Duration::from_millis(100),
            max_request_body_bytes: 8 * 1024 * 1024,
            max_plugin_bytes: 64 * 1024 * 1024,
        }
    }
}

impl RouterConfig {
    /// A configuration for these replicas with every other setting at its default.
    pub fn with_replicas(replicas: impl IntoIterator<Item = impl Into<String>>) -> Self {
        RouterConfig {
            replicas: replicas.into_iter().map(Into::into).collect(),
            ..RouterConfig::default()
        }
    }

    /// Check the settings; returns the replicas' base URLs without a trailing `/`.
    pub fn validate(&self) -> Result<Vec<String>, RouterError> {
        if self.replicas.is_empty() {
            return Err(RouterError::NoReplicas);
        }
        let mut urls: Vec<String> = Vec::new();
        for raw in &self.replicas {
            let url = reqwest::Url::parse(raw.trim()).map_err(|e| RouterError::BadReplicaUrl {
                url: raw.clone(),
                reason: e.to_string(),
            })?;
            if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
                return Err(RouterError::BadReplicaUrl {
                    url: raw.clone(),
                    reason: "expected http://HOST:PORT or https://HOST:PORT".into(),
                });
            }
            if url.query().is_some() || url.fragment().is_some() {
                return Err(RouterError::BadReplicaUrl {
                    url: raw.clone(),
                    reason: "a replica URL takes no query or fragment".into(),
                });
            }
            let base = url.as_str().trim_end_matches('/').to_string();
            if urls.contains(&base) {
                return Err(RouterError::DuplicateReplica(base));
            }
            urls.push(base);
        }
        let positive = [
            ("health_interval", self.health_interval),
            ("health_timeout", self.health_timeout),
            ("connect_timeout", self.connect_timeout),
            ("policy_timeout", self.policy_timeout),
        ];
        for (name, d) in positive {
            if d.is_zero() {
                return Err(RouterError::Invalid(format!("{name} must be above 0")));
            }
        }
        if self.eject_after == 0 {
            return Err(RouterError::Invalid(
                "eject_after must be at least 1".into(),
            ));
        }
        if self.max_attempts == Some(0) {
            return Err(RouterError::Invalid(
                "max_attempts must be at least 1".into(),
            ));
        }
        Ok(urls)
    }

    /// Attempts per request: `max_attempts`, or one per replica.
    pub fn attempts(&self) -> usize {
        self.max_attempts
            .map_or(self.replicas.len(), |n| n as usize)
            .max(1)
    }
}

fn seconds<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = f64::deserialize(d)?;
    Duration::try_from_secs_f64(s)
        .map_err(|e| serde::de::Error::custom(format!("{s} is not a duration in seconds: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_problem() {
        assert!(matches!(
            RouterConfig::default().validate(),
            Err(RouterError::NoReplicas)
        ));
        let bad = RouterConfig::with_replicas(["localhost:8000"]);
        assert!(matches!(
            bad.validate(),
            Err(RouterError::BadReplicaUrl { .. })
        ));
        let dup = RouterConfig::with_replicas(["http://a:1/", "http://a:1"]);
        assert!(matches!(
            dup.validate(),
            Err(RouterError::DuplicateReplica(_))
        ));
        let ok = RouterConfig::with_replicas(["http://a:1/", "http://b:2"]);
        assert_eq!(ok.validate().unwrap(), ["http://a:1", "http://b:2"]);
        assert_eq!(ok.attempts(), 2);
        let zero = RouterConfig {
            eject_after: 0,
            ..ok
        };
        assert!(matches!(zero.validate(), Err(RouterError::Invalid(_))));
    }
}
