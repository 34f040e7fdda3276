//! `serve`'s image flags (vLLM's names where vLLM has one): how many images a prompt may hold,
//! which domains image URLs may name, and the fetch limits.

use std::time::Duration;

use anyhow::{Context, bail};

/// The flags; each also reads from the config file under the same kebab-case name.
#[derive(clap::Args, Debug, Default, Clone)]
pub struct MediaArgs {
    /// Most images one prompt may hold, as vLLM takes it: JSON such as `{"image": 4}`
    /// [default: {"image": 8}].
    #[arg(long, value_name = "JSON")]
    pub limit_mm_per_prompt: Option<String>,
    /// Hosts `http(s)` image URLs may name (exact names; repeat or separate by commas)
    /// [default: none, so images come as data: URLs or base64 only].
    #[arg(long, value_name = "DOMAIN", num_args = 1.., value_delimiter = ',')]
    pub allowed_media_domains: Vec<String>,
    /// Seconds an image URL fetch may take, redirects included [default: 10].
    #[arg(long, value_name = "SECS")]
    pub media_fetch_timeout: Option<f64>,
    /// Largest encoded image in bytes, from a data: URL or a fetch [default: 20 MiB].
    #[arg(long, value_name = "BYTES")]
    pub max_image_bytes: Option<usize>,
    /// The media stage: a plugin name (`NAME_media.wasm` in the plugin directory) or a path
    /// [default: kimi_k3].
    #[arg(long, value_name = "NAME|PATH")]
    pub media_plugin: Option<String>,
}

/// The same settings from the config file.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct MediaFile {
    pub limit_mm_per_prompt: Option<toml::Value>,
    pub allowed_media_domains: Option<Vec<String>>,
    pub media_fetch_timeout: Option<f64>,
    pub max_image_bytes: Option<usize>,
    pub media_plugin: Option<String>,
}

/// Resolved image settings.
#[derive(Debug, Clone, PartialEq)]
pub struct MediaConfig {
    pub max_images_per_prompt: usize,
    pub allowed_domains: Vec<String>,
    pub fetch_timeout: Duration,
    pub max_image_bytes: usize,
    pub media_plugin: String,
}

impl MediaConfig {
    pub fn resolve(args: MediaArgs, file: MediaFile) -> anyhow::Result<MediaConfig> {
        let limit = match (args.limit_mm_per_prompt, file.limit_mm_per_prompt) {
            (Some(json), _) => Some(
                serde_json::from_str::<serde_json::Value>(&json)
                    .context("--limit-mm-per-prompt must be JSON such as {\"image\": 4}")?,
            ),
            (None, Some(v)) => {
                Some(serde_json::to_value(v).context("limit-mm-per-prompt in the config file")?)
            }
            (None, None) => None,
        };
        let max_images_per_prompt = match limit {
            None => 8,
            Some(serde_json::Value::Object(m)) => {
                for (k, v) in &m {
                    // vLLM's other modalities: this model has images only, and 0 of them is
                    // what it accepts anyway.
                    if k != "image" && v.as_u64() != Some(0) {
                        bail!("--limit-mm-per-prompt: this model reads images only (got \"{k}\")");
                    }
                }
                match m.get("image") {
                    None => 8,
                    Some(v) => v.as_u64().context(
                        "--limit-mm-per-prompt: \"image\" must be a non-negative integer",
                    )? as usize,
                }
            }
            Some(_) => {
                bail!("--limit-mm-per-prompt must be a JSON object such as {{\"image\": 4}}")
            }
        };
        let allowed_domains: Vec<String> = if args.allowed_media_domains.is_empty() {
            file.allowed_media_domains.unwrap_or_default()
        } else {
            args.allowed_media_domains
        };
        for d in &allowed_domains {
            if d.is_empty() || d.contains(['/', ':', ' ']) {
                bail!("--allowed-media-domains takes host names (got \"{d}\")");
            }
        }
        let timeout = args
            .media_fetch_timeout
            .or(file.media_fetch_timeout)
            .unwrap_or(10.0);
        if !(timeout.is_finite() && timeout > 0.0) {
            bail!("--media-fetch-timeout must be a positive number of seconds");
        }
        let max_image_bytes = args
            .max_image_bytes
            .or(file.max_image_bytes)
            .unwrap_or(20 << 20);
        if max_image_bytes == 0 {
            bail!("--max-image-bytes must be at least 1");
        }
        Ok(MediaConfig {
            media_plugin: args
                .media_plugin
                .or(file.media_plugin)
                .unwrap_or_else(|| "kimi_k3".into()),
            max_images_per_prompt,
            allowed_domains,
            fetch_timeout: Duration::from_secs_f64(timeout),
            max_image_bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(limit: Option<&str>, domains: &[&str]) -> MediaArgs {
        MediaArgs {
            limit_mm_per_prompt: limit.map(str::to_string),
            allowed_media_domains: domains.iter().map(|d| d.to_string()).collect(),
            ..MediaArgs::default()
        }
    }

    #[test]
    fn limits_and_domains_resolve() {
        let c = MediaConfig::resolve(
            args(Some(r#"{"image": 2, "video": 0}"#), &["a.example"]),
            MediaFile::default(),
        )
        .unwrap();
        assert_eq!(c.max_images_per_prompt, 2);
        assert_eq!(c.allowed_domains, vec!["a.example"]);
        let c = MediaConfig::resolve(MediaArgs::default(), MediaFile::default()).unwrap();
        assert_eq!((c.max_images_per_prompt, c.allowed_domains.len()), (8, 0));
        for bad in [r#"{"image": -1}"#, r#"{"video": 2}"#, "[1]", "nope"] {
            assert!(
                MediaConfig::resolve(args(Some(bad), &[]), MediaFile::default()).is_err(),
                "{bad}"
            );
        }
        assert!(MediaConfig::resolve(args(None, &["http://x"]), MediaFile::default()).is_err());
        let file = MediaFile {
            limit_mm_per_prompt: Some(toml::Value::Table(
                [("image".to_string(), toml::Value::Integer(3))]
                    .into_iter()
                    .collect(),
            )),
            ..MediaFile::default()
        };
        assert_eq!(
            MediaConfig::resolve(MediaArgs::default(), file)
                .unwrap()
                .max_images_per_prompt,
            3
        );
    }
}
