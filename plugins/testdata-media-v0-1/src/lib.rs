//! TEST ONLY. A media plugin built directly against `k3serve:plugin@0.1.0` (proving 0.1 media
//! components are served). It does not decode anything: data that does not start with the PNG
//! signature is invalid input; otherwise the image's `detail` picks the answer — a well-formed
//! 32x64 grey image by default, or a fault (`trap`, `loop`, `bomb`) or one kind of malformed
//! output the host must refuse (`bad-pixels`, `bad-side`, `bad-tokens`, `bad-index`, `nan`,
//! `no-placeholder`, `bad-placeholder`, `two-items`).

#[cfg(target_arch = "wasm32")]
mod component {
    wit_bindgen::generate!({
        path: "../../wit/v0.1",
        world: "media-plugin",
    });

    use exports::k3serve::plugin::media::{
        Guest as MediaGuest, ImagePart, MediaItem, MediaLayout, MediaOptions,
    };
    use k3serve::plugin::types::{PluginError, Stage};

    struct V01;

    const PAD: &str = "<|media_pad|>";

    fn answer(part: &ImagePart) -> Result<MediaLayout, PluginError> {
        if !part.data.starts_with(b"\x89PNG") {
            return Err(PluginError::InvalidInput(format!(
                "image {}: not a PNG",
                part.index
            )));
        }
        let mode = part.detail.as_deref().unwrap_or("");
        match mode {
            "trap" => panic!("deliberate trap requested by the test"),
            "loop" => {
                let mut n: u64 = 0;
                loop {
                    n = std::hint::black_box(n.wrapping_add(1));
                }
            }
            "bomb" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![1u8; 1 << 20]);
                    std::hint::black_box(&hoard);
                }
            }
            _ => {}
        }
        let (mut w, h) = (32u32, 64u32);
        if mode == "bad-side" {
            w = 48;
        }
        let mut values = vec![0f32; (3 * w * h) as usize];
        if mode == "bad-pixels" {
            values.pop();
        }
        if mode == "nan" {
            values[5] = f32::NAN;
        }
        let mut tokens = (w / 32) * (h / 32);
        let mut placeholder = PAD.repeat(tokens as usize);
        match mode {
            "bad-tokens" => tokens += 1,
            "bad-placeholder" => placeholder = PAD.to_string(),
            _ => {}
        }
        let item = MediaItem {
            index: if mode == "bad-index" {
                part.index + 1
            } else {
                part.index
            },
            width: w,
            height: h,
            pixel_values: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            placeholder_tokens: tokens,
        };
        let (items, placeholders) = match mode {
            "no-placeholder" => (vec![item], vec![]),
            "two-items" => (
                vec![item.clone(), item],
                vec![placeholder.clone(), placeholder],
            ),
            _ => (vec![item], vec![placeholder]),
        };
        Ok(MediaLayout {
            items,
            placeholders,
        })
    }

    impl MediaGuest for V01 {
        fn process(
            images: Vec<ImagePart>,
            _options: MediaOptions,
        ) -> Result<MediaLayout, PluginError> {
            let mut out = MediaLayout {
                items: vec![],
                placeholders: vec![],
            };
            for part in &images {
                let one = answer(part)?;
                out.items.extend(one.items);
                out.placeholders.extend(one.placeholders);
            }
            Ok(out)
        }
    }

    impl Guest for V01 {
        fn metadata() -> k3serve::plugin::types::PluginMetadata {
            k3serve::plugin::types::PluginMetadata {
                name: "testdata-media-v0-1".into(),
                version: "0.1.0".into(),
                stage: Stage::Media,
                wit_version: "0.1.0".into(),
                description: "TEST ONLY: a v0.1 media plugin that misbehaves on command".into(),
            }
        }
        fn self_test() -> Result<(), String> {
            Ok(())
        }
    }

    export!(V01);
}
