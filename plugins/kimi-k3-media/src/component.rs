//! The component glue: WIT `media-plugin` (0.3) over [`crate::process()`].

wit_bindgen::generate!({
    path: "../../wit/v0.3",
    world: "media-plugin",
});

use exports::k3serve::plugin::media::{
    Guest as MediaGuest, ImagePart, MediaItem, MediaLayout, MediaOptions,
};
use k3serve::plugin::types::{PluginError, Stage};

use crate::{MediaError, Options};

struct Media;

impl Guest for Media {
    fn metadata() -> PluginMetadata {
        PluginMetadata {
            name: crate::NAME.into(),
            version: crate::VERSION.into(),
            stage: Stage::Media,
            wit_version: crate::WIT_VERSION.into(),
            description: "Kimi K3 images: PNG/JPEG/WebP/GIF decode, EXIF orientation, resize to \
                          32-px units within max-pixels, CHW f32 x/127.5-1, <|media_pad|> per token"
                .into(),
        }
    }

    fn self_test() -> Result<(), String> {
        crate::self_test()
    }
}

impl MediaGuest for Media {
    fn process(images: Vec<ImagePart>, options: MediaOptions) -> Result<MediaLayout, PluginError> {
        let opts = Options::from_wit(
            options.patch_size,
            options.max_pixels,
            options.extra_json.as_deref(),
        )
        .map_err(wit_error)?;
        let mut items = Vec::with_capacity(images.len());
        let mut placeholders = Vec::with_capacity(images.len());
        for part in images {
            let index = part.index;
            let out = crate::process(
                index,
                &part.data,
                part.mime_type.as_deref(),
                part.detail.as_deref(),
                &opts,
            )
            .map_err(wit_error)?;
            // The encoded bytes are all that is kept of this image from here on.
            drop(part.data);
            placeholders.push(out.placeholder());
            items.push(MediaItem {
                index,
                width: out.width,
                height: out.height,
                pixel_values: out.pixel_bytes(),
                placeholder_tokens: out.tokens,
            });
        }
        Ok(MediaLayout {
            items,
            placeholders,
        })
    }
}

fn wit_error(e: MediaError) -> PluginError {
    match e {
        MediaError::Image { .. } => PluginError::InvalidInput(e.to_string()),
        MediaError::Options(_) => PluginError::Unsupported(e.to_string()),
    }
}

export!(Media);
