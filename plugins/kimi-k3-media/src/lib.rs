//! Kimi K3's media stage (world `media-plugin`, WIT `k3serve:plugin@0.3.0`): decodes PNG, JPEG,
//! WebP and GIF (first frame) inside the sandbox, applies EXIF orientation, composites alpha
//! over white, resizes to the model's limits and normalises to CHW f32; each image occupies
//! `(W/32)*(H/32)` `<|media_pad|>` tokens. See `docs/plugins.md`, "The media stage".
//!
//! The pipeline ([`process()`]) is plain Rust: `cargo test` runs it natively and benchmarks call
//! the same code natively and in the sandbox. Built for `wasm32-wasip2` the crate is the
//! component.

mod error;
pub mod header;
pub mod process;

#[cfg(target_arch = "wasm32")]
mod component;

pub use error::{ImageProblem, MediaError};
pub use header::Format;
pub use process::{Options, PAD, Prepared, decode_rgb, process, target_size, to_chw};

/// The plugin's identity (WIT `plugin-metadata`).
pub const NAME: &str = "kimi-k3-media";
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const WIT_VERSION: &str = "0.3.0";

/// The plugin's self-test: a tiny generated PNG goes through the whole pipeline, and garbage
/// is refused as invalid input.
pub fn self_test() -> Result<(), String> {
    let probe = probe_png();
    let out = process(0, &probe, Some("image/png"), None, &Options::default())
        .map_err(|e| format!("a 40x24 PNG was refused: {e}"))?;
    if (out.width, out.height, out.tokens, out.pixels.len()) != (32, 32, 1, 3 * 32 * 32) {
        return Err(format!(
            "a 40x24 PNG came out {}x{} with {} tokens and {} values",
            out.width,
            out.height,
            out.tokens,
            out.pixels.len()
        ));
    }
    match process(0, b"not an image", None, None, &Options::default()) {
        Err(e) if e.is_invalid_input() => Ok(()),
        other => Err(format!(
            "garbage was not refused as invalid input: {other:?}"
        )),
    }
}

/// A 40x24 grey gradient PNG, encoded on the spot.
fn probe_png() -> Vec<u8> {
    let img = image::GrayImage::from_fn(40, 24, |x, y| image::Luma([(x * 6 + y) as u8]));
    let mut out = Vec::new();
    img.write_to(&mut std::io::Cursor::new(&mut out), image::ImageFormat::Png)
        .expect("encoding a small PNG in memory cannot fail");
    out
}

#[cfg(test)]
mod tests;
