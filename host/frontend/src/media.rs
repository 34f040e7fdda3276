//! Images in a chat request (docs/http-api.md, "Images"; docs/vision.md):
//!
//! 1. [`take_images`] lifts every `image_url` part out of the messages, leaving a bare
//!    `{"type": "image_url"}` part, so the chat template renders its placeholder markup without
//!    seeing (or copying) megabytes of image data;
//! 2. [`MediaFetcher::fetch`] turns each URL into bytes: `data:` URLs are decoded, `http(s)` URLs
//!    are fetched only from the domains the operator allows, within a size and a time limit;
//! 3. the media stage (a sandboxed plugin: image bytes are untrusted input) decodes, resizes and
//!    normalises them;
//! 4. [`expand_placeholders`] replaces the i-th placeholder token of the rendered prompt with image
//!    i's `<|media_pad|>` tokens and records where they sit, for the engine and the model.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use k3_engine::{ImagePixels, MediaInput};
use k3_plugin_host::{ImagePart, MediaOptions, PluginError, PluginHost};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::error::BackendError;
use crate::tokenizer::Tokenizer;

/// The vision tower's geometry, from the model's config (`vision_config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VisionGeometry {
    pub patch_size: u32,
    pub merge_size: u32,
    /// Pixels of one image after resizing, at most / at least.
    pub max_pixels: u64,
    pub min_pixels: u64,
    /// The token the chat template renders for an image, and the one its rows are held by.
    pub placeholder_token: u32,
    pub pad_token: u32,
}

/// How a server takes images (`serve` flags `--limit-mm-per-prompt`, `--allowed-media-domains`,
/// `--media-fetch-timeout`, `--max-image-bytes`).
#[derive(Debug, Clone)]
pub struct MediaSettings {
    /// `None`: the model reads no images, and an image part is a 400.
    pub vision: Option<VisionGeometry>,
    pub max_images_per_prompt: usize,
    /// Hosts `http(s)` image URLs may name (exact, case-insensitive); empty: `data:` URLs only.
    pub allowed_domains: Vec<String>,
    pub fetch_timeout: Duration,
    /// Bytes of one encoded image (decoded `data:` URL or fetched body), at most.
    pub max_image_bytes: usize,
}

impl Default for MediaSettings {
    fn default() -> Self {
        Self {
            vision: None,
            max_images_per_prompt: 8,
            allowed_domains: Vec::new(),
            fetch_timeout: Duration::from_secs(10),
            max_image_bytes: 20 << 20,
        }
    }
}

/// One image part lifted out of a request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ImageRef {
    pub url: String,
    pub detail: Option<String>,
    /// Where it was, for error messages: `messages[i].content[j]`.
    pub param: String,
}

/// An image's encoded bytes and declared MIME type.
#[derive(Debug, Clone)]
pub(crate) struct ImageBytes {
    pub data: Vec<u8>,
    pub mime_type: Option<String>,
    pub detail: Option<String>,
    pub param: String,
}

/// Lift the image parts out of `messages` in prompt order (see the module docs).
pub(crate) fn take_images(messages: &mut [Value]) -> Vec<ImageRef> {
    let mut out = Vec::new();
    for (i, m) in messages.iter_mut().enumerate() {
        let Some(Value::Array(parts)) = m.get_mut("content") else {
            continue;
        };
        for (j, part) in parts.iter_mut().enumerate() {
            if part.get("type").and_then(Value::as_str) != Some("image_url") {
                continue;
            }
            let image = part.get("image_url");
            let url = match image {
                Some(Value::String(u)) => u.clone(),
                Some(o) => o
                    .get("url")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                None => String::new(),
            };
            let detail = image
                .and_then(|o| o.get("detail"))
                .and_then(Value::as_str)
                .map(str::to_string);
            out.push(ImageRef {
                url,
                detail,
                param: format!("messages[{i}].content[{j}]"),
            });
            *part = json!({"type": "image_url"});
        }
    }
    out
}

fn invalid(param: &str, message: String) -> BackendError {
    BackendError::InvalidRequest {
        message,
        param: Some(param.to_string()),
    }
}

/// Resolves image URLs to bytes (see the module docs).
#[derive(Clone)]
pub struct MediaFetcher {
    settings: Arc<MediaSettings>,
    client: Option<reqwest::Client>,
}

impl MediaFetcher {
    pub fn new(settings: MediaSettings) -> Result<Self, BackendError> {
        let client = if settings.allowed_domains.is_empty() {
            None
        } else {
            let allowed = settings.allowed_domains.clone();
            // A redirect may not leave the allowed domains (or the fetch would reach any host).
            let policy = reqwest::redirect::Policy::custom(move |attempt| {
                let ok = attempt
                    .url()
                    .host_str()
                    .is_some_and(|h| domain_allowed(&allowed, h));
                if attempt.previous().len() >= 3 {
                    attempt.error("too many redirects")
                } else if ok {
                    attempt.follow()
                } else {
                    attempt.error("redirected to a domain that is not allowed")
                }
            });
            Some(
                reqwest::Client::builder()
                    .timeout(settings.fetch_timeout)
                    .redirect(policy)
                    .build()
                    .map_err(|e| BackendError::Internal(format!("image URL client: {e}")))?,
            )
        };
        Ok(Self {
            settings: Arc::new(settings),
            client,
        })
    }

    pub fn settings(&self) -> &MediaSettings {
        &self.settings
    }

    /// Check the count and resolve every image (in order).
    pub(crate) async fn fetch(&self, refs: Vec<ImageRef>) -> Result<Vec<ImageBytes>, BackendError> {
        let s = &self.settings;
        let Some(first) = refs.first() else {
            return Ok(Vec::new());
        };
        if s.vision.is_none() {
            return Err(BackendError::NotSupported {
                message: "this model does not read images".into(),
                param: Some(format!("{}.type", first.param)),
            });
        }
        if refs.len() > s.max_images_per_prompt {
            return Err(invalid(
                &refs[s.max_images_per_prompt].param,
                format!(
                    "the request has {} images; this server takes at most {} per prompt \
                     (--limit-mm-per-prompt)",
                    refs.len(),
                    s.max_images_per_prompt
                ),
            ));
        }
        let mut out = Vec::with_capacity(refs.len());
        for r in refs {
            let (data, mime_type) = self.resolve(&r).await?;
            out.push(ImageBytes {
                data,
                mime_type,
                detail: r.detail,
                param: r.param,
            });
        }
        Ok(out)
    }

    async fn resolve(&self, r: &ImageRef) -> Result<(Vec<u8>, Option<String>), BackendError> {
        let param = format!("{}.image_url.url", r.param);
        let max = self.settings.max_image_bytes;
        if let Some(rest) = r.url.strip_prefix("data:") {
            return decode_data_url(rest, max).map_err(|m| invalid(&param, m));
        }
        let scheme_ok = r.url.starts_with("http://") || r.url.starts_with("https://");
        if !scheme_ok {
            return Err(invalid(
                &param,
                "an image URL must be a data: URL or an http(s) URL".into(),
            ));
        }
        let url = reqwest::Url::parse(&r.url)
            .map_err(|e| invalid(&param, format!("the image URL is not valid: {e}")))?;
        let host = url.host_str().unwrap_or("");
        let client = match &self.client {
            Some(c) if domain_allowed(&self.settings.allowed_domains, host) => c,
            _ => {
                return Err(invalid(
                    &param,
                    format!(
                        "image URLs from \"{host}\" are not allowed on this server: send the image \
                         as a data: URL, or ask the operator to allow the domain \
                         (--allowed-media-domains)"
                    ),
                ));
            }
        };
        let fail = |e: String| invalid(&param, format!("fetching the image failed: {e}"));
        let mut resp = client
            .get(url)
            .send()
            .await
            .map_err(|e| fail(e.to_string()))?;
        if !resp.status().is_success() {
            return Err(fail(format!("the server answered {}", resp.status())));
        }
        if resp.content_length().is_some_and(|n| n > max as u64) {
            return Err(too_large(&param, max));
        }
        let mime = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or("").trim().to_string())
            .filter(|v| !v.is_empty());
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| fail(e.to_string()))? {
            if body.len() + chunk.len() > max {
                return Err(too_large(&param, max));
            }
            body.extend_from_slice(&chunk);
        }
        Ok((body, mime))
    }
}

fn too_large(param: &str, max: usize) -> BackendError {
    BackendError::InputTooLarge {
        message: format!("the image is larger than this server's limit of {max} bytes"),
        param: param.to_string(),
    }
}

fn domain_allowed(allowed: &[String], host: &str) -> bool {
    allowed.iter().any(|d| d.eq_ignore_ascii_case(host))
}

/// `rest` is a data URL after `data:`: `[<mime>][;param...];base64,<data>`.
fn decode_data_url(rest: &str, max: usize) -> Result<(Vec<u8>, Option<String>), String> {
    let (meta, data) = rest
        .split_once(',')
        .ok_or("the data: URL has no ',' before its data")?;
    let mut fields = meta.split(';');
    let mime = fields.next().filter(|m| !m.is_empty()).map(str::to_string);
    if !fields.any(|f| f.eq_ignore_ascii_case("base64")) {
        return Err("an image data: URL must be base64-encoded (';base64,')".into());
    }
    // Base64 holds 3 bytes per 4 characters: refuse before decoding what would be too large.
    if data.len() / 4 * 3 > max + 3 {
        return Err(format!(
            "the image is larger than this server's limit of {max} bytes"
        ));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| format!("the data: URL's base64 is not valid: {e}"))?;
    if bytes.len() > max {
        return Err(format!(
            "the image is larger than this server's limit of {max} bytes"
        ));
    }
    Ok((bytes, mime))
}

/// What the media stage made of one image: its pixels and the text standing for it.
#[derive(Debug, Clone)]
pub(crate) struct PreparedImage {
    pub pixels: Arc<ImagePixels>,
    pub tokens: usize,
    /// The placeholder text (special tokens) the image's placeholder token becomes.
    pub placeholder: String,
    pub param: String,
}

/// The content hash [`ImagePixels`] carries: SHA-256 of the size and the pixel values.
pub(crate) fn pixels_hash(height: usize, width: usize, pixels: &[f32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update((height as u64).to_le_bytes());
    h.update((width as u64).to_le_bytes());
    // In blocks: one digest update per value would cost more than the hashing itself.
    let mut bytes = Vec::with_capacity(4 * 4096);
    for block in pixels.chunks(4096) {
        bytes.clear();
        bytes.extend(block.iter().flat_map(|v| v.to_le_bytes()));
        h.update(&bytes);
    }
    h.finalize().into()
}

/// Replace the placeholder tokens of `ids` by each image's tokens, in order; the images' spans.
pub(crate) fn expand_placeholders(
    ids: &[u32],
    images: &[PreparedImage],
    vision: &VisionGeometry,
    tokenizer: &Tokenizer,
) -> Result<(Vec<u32>, Vec<MediaInput>), BackendError> {
    let placeholders = ids
        .iter()
        .filter(|&&t| t == vision.placeholder_token)
        .count();
    if placeholders != images.len() {
        return Err(BackendError::Template(format!(
            "the chat template rendered {placeholders} image placeholders for {} images",
            images.len()
        )));
    }
    let mut out = Vec::with_capacity(ids.len() + images.iter().map(|i| i.tokens).sum::<usize>());
    let mut media = Vec::with_capacity(images.len());
    let mut next = images.iter();
    for &t in ids {
        if t != vision.placeholder_token {
            out.push(t);
            continue;
        }
        let image = next.next().expect("counted above");
        let expansion = tokenizer
            .encode(&image.placeholder)
            .map_err(|e| BackendError::Internal(format!("tokenizing an image placeholder: {e}")))?;
        let pads: Vec<usize> = (0..expansion.len())
            .filter(|&k| expansion[k] == vision.pad_token)
            .collect();
        let contiguous = pads.windows(2).all(|w| w[1] == w[0] + 1);
        if pads.len() != image.tokens || !contiguous {
            return Err(BackendError::Plugin(format!(
                "the media stage's placeholder for {} holds {} pad tokens (contiguous: \
                 {contiguous}) for an image of {} tokens",
                image.param,
                pads.len(),
                image.tokens
            )));
        }
        media.push(MediaInput {
            position: out.len() + pads.first().copied().unwrap_or(0),
            tokens: image.tokens,
            image: image.pixels.clone(),
        });
        out.extend_from_slice(&expansion);
    }
    Ok((out, media))
}

/// Run the media stage over the fetched images (blocking: a plugin call). A problem with an
/// image (not an image, truncated, too large, ...) is the client's 400, naming the part.
pub(crate) fn prepare_images(
    plugins: &PluginHost,
    vision: &VisionGeometry,
    images: Vec<ImageBytes>,
) -> Result<Vec<PreparedImage>, BackendError> {
    let params: Vec<String> = images.iter().map(|i| i.param.clone()).collect();
    let parts: Vec<ImagePart> = images
        .into_iter()
        .enumerate()
        .map(|(index, i)| ImagePart {
            index: index as u32,
            data: i.data,
            mime_type: i.mime_type,
            detail: i.detail,
        })
        .collect();
    let options = MediaOptions {
        patch_size: vision.patch_size,
        merge_size: vision.merge_size,
        max_pixels: vision.max_pixels,
        min_pixels: vision.min_pixels,
        ..MediaOptions::default()
    };
    let prepared = plugins
        .media()
        .process(&parts, &options)
        .map_err(|e| match e {
            PluginError::Media(m) if m.is_client_error() => {
                let message = m.to_string();
                let param = image_param(&message, &params);
                BackendError::InvalidRequest { message, param }
            }
            other => crate::error::plugin_failure(other),
        })?;
    // The plugin host has checked each answer (sides, pixel count, token count, placeholder).
    Ok(prepared
        .into_iter()
        .map(|p| {
            let (h, w) = (p.height as usize, p.width as usize);
            PreparedImage {
                pixels: Arc::new(ImagePixels {
                    height: h,
                    width: w,
                    content_hash: pixels_hash(h, w, &p.pixels),
                    pixels: p.pixels,
                }),
                tokens: p.placeholder_tokens as usize,
                placeholder: p.placeholder,
                param: params.get(p.index as usize).cloned().unwrap_or_default(),
            }
        })
        .collect())
}

/// The request field a media-stage message is about: its "image {index}" prefix.
fn image_param(message: &str, params: &[String]) -> Option<String> {
    let rest = message.strip_prefix("image ")?;
    let index: usize = rest
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    params.get(index).cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_lifted_out_in_order() {
        let mut m = vec![
            json!({"role": "user", "content": [{"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "low"}}]}),
            json!({"role": "assistant", "content": "x"}),
            json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://h/i.png"}}]}),
        ];
        let refs = take_images(&mut m);
        assert_eq!(refs.len(), 2);
        assert_eq!(refs[0].detail.as_deref(), Some("low"));
        assert_eq!(refs[1].url, "http://h/i.png");
        assert_eq!(refs[1].param, "messages[2].content[0]");
        assert_eq!(m[0]["content"][1], json!({"type": "image_url"}));
    }

    #[test]
    fn data_urls_decode_within_the_limit() {
        let (b, mime) = decode_data_url("image/png;base64,aGVsbG8=", 100).unwrap();
        assert_eq!(
            (b.as_slice(), mime.as_deref()),
            (&b"hello"[..], Some("image/png"))
        );
        assert!(
            decode_data_url("image/png,hello", 100)
                .unwrap_err()
                .contains("base64")
        );
        assert!(
            decode_data_url("image/png;base64,!!!", 100)
                .unwrap_err()
                .contains("not valid")
        );
        assert!(
            decode_data_url("image/png;base64,aGVsbG8=", 3)
                .unwrap_err()
                .contains("limit")
        );
        assert!(decode_data_url("nocomma", 3).is_err());
    }

    #[test]
    fn the_hash_covers_every_value_and_the_size() {
        let px = vec![0.5f32; 3 * 64 * 96];
        let base = pixels_hash(64, 96, &px);
        assert_eq!(base, pixels_hash(64, 96, &px));
        assert_ne!(base, pixels_hash(96, 64, &px));
        for i in [0, 4095, 4096, px.len() - 1] {
            let mut q = px.clone();
            q[i] = -0.5;
            assert_ne!(base, pixels_hash(64, 96, &q), "value {i}");
        }
    }

    #[test]
    fn domains_match_exactly() {
        let allowed = vec!["Images.Example.com".to_string()];
        assert!(domain_allowed(&allowed, "images.example.com"));
        assert!(!domain_allowed(
            &allowed,
            "evil.images.example.com.attacker.net"
        ));
        assert!(!domain_allowed(&allowed, "example.com"));
    }

    #[tokio::test]
    async fn urls_from_other_domains_and_schemes_are_refused() {
        let fetcher = MediaFetcher::new(MediaSettings {
            vision: Some(VisionGeometry {
                patch_size: 16,
                merge_size: 2,
                max_pixels: 65536,
                min_pixels: 1024,
                placeholder_token: 6,
                pad_token: 7,
            }),
            allowed_domains: vec!["allowed.invalid".into()],
            max_images_per_prompt: 1,
            ..MediaSettings::default()
        })
        .unwrap();
        let r = |url: &str| ImageRef {
            url: url.into(),
            detail: None,
            param: "messages[0].content[0]".into(),
        };
        for url in [
            "http://other.invalid/x.png",
            "file:///etc/passwd",
            "ftp://allowed.invalid/x",
        ] {
            let e = fetcher.fetch(vec![r(url)]).await.unwrap_err();
            assert!(
                matches!(e, BackendError::InvalidRequest { .. }),
                "{url}: {e:?}"
            );
        }
        let e = fetcher
            .fetch(vec![
                r("data:image/png;base64,AA"),
                r("data:image/png;base64,AA"),
            ])
            .await
            .unwrap_err();
        assert!(e.to_string().contains("at most 1"), "{e}");
    }
}
