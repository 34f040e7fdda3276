//! The media stage (world `media-plugin`, any served WIT version): image bytes in, normalised
//! pixels and the placeholder layout out. Image bytes are untrusted, so each image gets its own
//! fresh instance under the media limits (`media_memory_limit`, `media_timeout`): a bomb or a
//! decoder bug costs one image, never the host. The host validates what comes back (sizes,
//! pixel count, token count, placeholder) so a buggy plugin cannot hand the model garbage.

use std::sync::Arc;

use crate::bindings::{v0_1, v0_2, v0_3};
use crate::error::PluginError;
use crate::registry::{PluginVersion, Registry, StagePre};
use crate::runtime::Runtime;
use crate::types::{MediaError, Stage};

/// One image of a request, as the client sent it (bytes already fetched / base64-decoded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImagePart {
    /// Position among the request's media parts (0-based); error messages name it.
    pub index: u32,
    pub data: Vec<u8>,
    /// The declared MIME type, if any (checked against the data).
    pub mime_type: Option<String>,
    /// OpenAI `detail` ("low" | "high" | "auto"), if any.
    pub detail: Option<String>,
}

/// The model's image settings. `Default` is k3-mini's (`docs/plugins.md`, "The media stage").
#[derive(Debug, Clone, PartialEq)]
pub struct MediaOptions {
    /// Patch size of the vision encoder (pixels).
    pub patch_size: u32,
    /// Patches merged per side into one image token.
    pub merge_size: u32,
    /// Most pixels of one image after resizing.
    pub max_pixels: u64,
    /// Fewest pixels of one image after resizing.
    pub min_pixels: u64,
    /// Refused before decoding: a side longer than this...
    pub max_image_side: u32,
    /// ...more pixels than this (decompression bombs)...
    pub max_decoded_pixels: u64,
    /// ...or a longer:shorter side ratio above this.
    pub max_aspect_ratio: f64,
    /// The text of one image token: each placeholder must hold exactly `placeholder_tokens`
    /// of it.
    pub pad_token: String,
}

impl Default for MediaOptions {
    fn default() -> Self {
        Self {
            patch_size: 16,
            merge_size: 2,
            max_pixels: 65536,
            min_pixels: 1024,
            max_image_side: 16384,
            max_decoded_pixels: 50_000_000,
            max_aspect_ratio: 200.0,
            pad_token: "<|media_pad|>".into(),
        }
    }
}

impl MediaOptions {
    /// The side granularity: one image token covers `unit x unit` pixels.
    pub fn unit(&self) -> u32 {
        self.patch_size.saturating_mul(self.merge_size)
    }

    /// WIT `media-options.extra-json`.
    fn extra_json(&self) -> String {
        serde_json::json!({
            "merge_size": self.merge_size,
            "min_pixels": self.min_pixels,
            "max_image_side": self.max_image_side,
            "max_decoded_pixels": self.max_decoded_pixels,
            "max_aspect_ratio": self.max_aspect_ratio,
        })
        .to_string()
    }
}

/// One image, ready for the vision tower.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedImage {
    pub index: u32,
    /// Multiples of [`MediaOptions::unit`].
    pub width: u32,
    pub height: u32,
    /// CHW f32: `pixels[(c * height + y) * width + x]`, `3 * width * height` values.
    pub pixels: Vec<f32>,
    /// `(width / unit) * (height / unit)`.
    pub placeholder_tokens: u32,
    /// The prompt text that stands for this image (holds `placeholder_tokens` pad tokens).
    pub placeholder: String,
}

/// Runs images through the active media plugin. Cheap to clone; `Send + Sync`. Decoding takes
/// milliseconds (more for large photos): call it from `spawn_blocking` in async code.
#[derive(Clone)]
pub struct Media {
    pub(crate) rt: Arc<Runtime>,
    pub(crate) registry: Arc<Registry>,
}

impl Media {
    /// Process a request's images, in order, all on the version active at the call. Stops at
    /// the first failure: [`PluginError::Media`] with [`MediaError::is_client_error`] for a
    /// bad image (HTTP 400, the message names the image and the problem); a trap, time or
    /// memory limit is a plugin fault ([`PluginError::is_fault`]).
    pub fn process(
        &self,
        images: &[ImagePart],
        options: &MediaOptions,
    ) -> Result<Vec<PreparedImage>, PluginError> {
        let version = self.registry.active(Stage::Media)?;
        images
            .iter()
            .map(|image| self.process_on(&version, image, options))
            .collect()
    }

    /// One image on the active version (for callers that spread images over threads).
    pub fn process_one(
        &self,
        image: &ImagePart,
        options: &MediaOptions,
    ) -> Result<PreparedImage, PluginError> {
        let version = self.registry.active(Stage::Media)?;
        self.process_on(&version, image, options)
    }

    fn process_on(
        &self,
        version: &Arc<PluginVersion>,
        image: &ImagePart,
        options: &MediaOptions,
    ) -> Result<PreparedImage, PluginError> {
        self.registry
            .retry_on_capacity(|| process_with(&self.rt, version, image, options))
    }
}

/// The guest's answer for one image, in the host's terms.
struct Answer {
    items: Vec<(u32, u32, u32, Vec<u8>, u32)>,
    placeholders: Vec<String>,
}

/// Each version's `process` call: the records are the same in 0.1, 0.2 and 0.3.
macro_rules! call_process {
    ($rt:expr, $store:expr, $pre:expr, $v:ident, $image:expr, $options:expr) => {{
        use $v::media::exports::k3serve::plugin::media as m;
        let instance = $rt.call_media(&mut $store, |s| $pre.instantiate(s))?;
        let part = m::ImagePart {
            index: $image.index,
            data: $image.data.clone(),
            mime_type: $image.mime_type.clone(),
            detail: $image.detail.clone(),
        };
        let opts = m::MediaOptions {
            patch_size: $options.patch_size,
            max_pixels: $options.max_pixels,
            extra_json: Some($options.extra_json()),
        };
        let api = instance.k3serve_plugin_media();
        let layout = $rt.call_media(&mut $store, |s| {
            api.call_process(s, std::slice::from_ref(&part), &opts)
        })?;
        layout
            .map(|l| Answer {
                items: l
                    .items
                    .into_iter()
                    .map(|i| {
                        (
                            i.index,
                            i.width,
                            i.height,
                            i.pixel_values,
                            i.placeholder_tokens,
                        )
                    })
                    .collect(),
                placeholders: l.placeholders,
            })
            .map_err(|e| {
                use $v::types::PluginError as E;
                PluginError::Media(match e {
                    E::InvalidInput(m) => MediaError::InvalidImage(m),
                    E::Unsupported(m) => MediaError::Unsupported(m),
                    E::Internal(m) => MediaError::Internal(m),
                })
            })
    }};
}

pub(crate) fn process_with(
    rt: &Runtime,
    version: &Arc<PluginVersion>,
    image: &ImagePart,
    options: &MediaOptions,
) -> Result<PreparedImage, PluginError> {
    version.counters.session();
    Runtime::timed(version, || run_once(rt, version, image, options))
}

/// One image in a fresh store, not counted in the version's counters (the load-time smoke
/// test's deliberate refusal is not an error of the plugin).
pub(crate) fn run_once(
    rt: &Runtime,
    version: &PluginVersion,
    image: &ImagePart,
    options: &MediaOptions,
) -> Result<PreparedImage, PluginError> {
    let mut store = rt.media_store(version.label.clone());
    let answer = match &version.pre {
        StagePre::Media(pre) => call_process!(rt, store, pre, v0_1, image, options),
        StagePre::MediaV0_2(pre) => call_process!(rt, store, pre, v0_2, image, options),
        StagePre::MediaV0_3(pre) => call_process!(rt, store, pre, v0_3, image, options),
        _ => return Err(PluginError::NoActivePlugin(Stage::Media)),
    }?;
    validate(image.index, answer, options).map_err(|detail| {
        PluginError::Media(MediaError::BadOutput {
            plugin: version.label.to_string(),
            detail: format!("image {}: {detail}", image.index),
        })
    })
}

/// The stage contract, checked on the host.
fn validate(index: u32, answer: Answer, options: &MediaOptions) -> Result<PreparedImage, String> {
    let Answer {
        mut items,
        mut placeholders,
    } = answer;
    if items.len() != 1 || placeholders.len() != 1 {
        return Err(format!(
            "asked for one image, got {} items and {} placeholders",
            items.len(),
            placeholders.len()
        ));
    }
    let (got_index, width, height, bytes, tokens) = items.remove(0);
    let placeholder = placeholders.remove(0);
    if got_index != index {
        return Err(format!("the item has index {got_index}"));
    }
    let unit = options.unit().max(1);
    if width == 0 || height == 0 || width % unit != 0 || height % unit != 0 {
        return Err(format!(
            "size {width}x{height} is not a positive multiple of {unit}"
        ));
    }
    let pixels = u64::from(width) * u64::from(height);
    if pixels > options.max_pixels {
        return Err(format!(
            "size {width}x{height} exceeds max_pixels {}",
            options.max_pixels
        ));
    }
    if bytes.len() as u64 != 3 * 4 * pixels {
        return Err(format!(
            "{} bytes of pixel values for {width}x{height} (expected 3*W*H f32 = {})",
            bytes.len(),
            3 * 4 * pixels
        ));
    }
    let want_tokens = (width / unit) * (height / unit);
    if tokens != want_tokens {
        return Err(format!(
            "{tokens} placeholder tokens for {width}x{height} (expected {want_tokens})"
        ));
    }
    let pads = placeholder.matches(options.pad_token.as_str()).count();
    if options.pad_token.is_empty() || pads != tokens as usize {
        return Err(format!(
            "the placeholder holds {pads} {:?} for {tokens} tokens",
            options.pad_token
        ));
    }
    let mut values = Vec::with_capacity(bytes.len() / 4);
    for b in bytes.chunks_exact(4) {
        let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if !v.is_finite() {
            return Err("a pixel value is not finite".into());
        }
        values.push(v);
    }
    Ok(PreparedImage {
        index,
        width,
        height,
        pixels: values,
        placeholder_tokens: tokens,
        placeholder,
    })
}
