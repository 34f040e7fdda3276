//! The media pipeline, plain Rust (the same code runs natively in tests and benchmarks and
//! inside the sandbox): sniff → header limits → decode → EXIF orientation → alpha over white,
//! RGB8 → resize to fit `max_pixels` in multiples of `patch_size * merge_size` → CHW f32,
//! `x / 127.5 - 1`.

use std::io::Cursor;

use image::imageops::FilterType;
use image::metadata::Orientation;
use image::{DynamicImage, ImageDecoder, ImageError, ImageReader, Limits, RgbImage};
use serde::Deserialize;

use crate::error::{ImageProblem, MediaError};
use crate::header::{self, Format};

/// The text one image token stands for in the prompt.
pub const PAD: &str = "<|media_pad|>";

/// The stage's settings: WIT `media-options` plus its `extra-json` object.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    pub patch_size: u32,
    pub merge_size: u32,
    /// Upper bound on W*H after resizing.
    pub max_pixels: u64,
    /// Lower bound on W*H after resizing; at most one unit squared (the at-least-one-unit
    /// rule meets it).
    pub min_pixels: u64,
    /// Refused from the header: a side longer than this...
    pub max_image_side: u32,
    /// ...or more pixels than this (decompression bombs)...
    pub max_decoded_pixels: u64,
    /// ...or a longer:shorter side ratio above this.
    pub max_aspect_ratio: f64,
}

impl Default for Options {
    /// The vision contract's values for k3-mini.
    fn default() -> Self {
        Self {
            patch_size: 16,
            merge_size: 2,
            max_pixels: 65536,
            min_pixels: 1024,
            max_image_side: 16384,
            max_decoded_pixels: 50_000_000,
            max_aspect_ratio: 200.0,
        }
    }
}

/// `extra-json`: every key optional, unknown keys ignored (newer hosts may send more).
#[derive(Deserialize)]
struct Extra {
    merge_size: Option<u32>,
    min_pixels: Option<u64>,
    max_image_side: Option<u32>,
    max_decoded_pixels: Option<u64>,
    max_aspect_ratio: Option<f64>,
}

impl Options {
    /// Build from the WIT record's fields; missing extras take the defaults.
    pub fn from_wit(
        patch_size: u32,
        max_pixels: u64,
        extra_json: Option<&str>,
    ) -> Result<Self, MediaError> {
        let d = Options::default();
        let extra: Extra = match extra_json.map(str::trim).filter(|s| !s.is_empty()) {
            Some(s) => serde_json::from_str(s)
                .map_err(|e| MediaError::Options(format!("extra-json: {e}")))?,
            None => Extra {
                merge_size: None,
                min_pixels: None,
                max_image_side: None,
                max_decoded_pixels: None,
                max_aspect_ratio: None,
            },
        };
        let merge_size = extra.merge_size.unwrap_or(d.merge_size);
        let unit = u64::from(patch_size.saturating_mul(merge_size));
        let o = Options {
            patch_size,
            max_pixels,
            merge_size,
            // Absent: one unit, which the at-least-one-unit rule always meets.
            min_pixels: extra.min_pixels.unwrap_or(unit * unit),
            max_image_side: extra.max_image_side.unwrap_or(d.max_image_side),
            max_decoded_pixels: extra.max_decoded_pixels.unwrap_or(d.max_decoded_pixels),
            max_aspect_ratio: extra.max_aspect_ratio.unwrap_or(d.max_aspect_ratio),
        };
        o.validate()?;
        Ok(o)
    }

    /// The side granularity: one image token covers `unit x unit` pixels.
    pub fn unit(&self) -> u32 {
        self.patch_size.saturating_mul(self.merge_size)
    }

    fn validate(&self) -> Result<(), MediaError> {
        let bad = |m: String| Err(MediaError::Options(m));
        let unit = u64::from(self.unit());
        if self.patch_size == 0 || self.merge_size == 0 || unit > 4096 {
            return bad(format!(
                "patch-size {} x merge_size {} must be between 1 and 4096",
                self.patch_size, self.merge_size
            ));
        }
        if self.max_pixels < unit * unit {
            return bad(format!(
                "max-pixels {} is less than one {unit}x{unit} unit",
                self.max_pixels
            ));
        }
        if self.min_pixels > unit * unit {
            return bad(format!(
                "min_pixels {} above one {unit}x{unit} unit is not supported",
                self.min_pixels
            ));
        }
        if self.max_image_side == 0 || self.max_decoded_pixels == 0 {
            return bad("max_image_side and max_decoded_pixels must be positive".into());
        }
        if self.max_aspect_ratio.is_nan() || self.max_aspect_ratio < 1.0 {
            return bad(format!(
                "max_aspect_ratio {} must be at least 1",
                self.max_aspect_ratio
            ));
        }
        Ok(())
    }
}

/// One image ready for the vision tower.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    pub width: u32,
    pub height: u32,
    /// CHW: `pixels[(c * height + y) * width + x]`, normalised `x / 127.5 - 1`.
    pub pixels: Vec<f32>,
    /// Image tokens: `(width / unit) * (height / unit)`.
    pub tokens: u32,
}

impl Prepared {
    /// The prompt text for this image: [`PAD`] once per token.
    pub fn placeholder(&self) -> String {
        PAD.repeat(self.tokens as usize)
    }

    /// The pixels as little-endian f32 bytes (WIT `pixel-values`).
    pub fn pixel_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.pixels.len() * 4);
        for v in &self.pixels {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }
}

/// The whole pipeline for one image part.
pub fn process(
    index: u32,
    data: &[u8],
    mime_type: Option<&str>,
    detail: Option<&str>,
    options: &Options,
) -> Result<Prepared, MediaError> {
    let image = |problem| MediaError::Image { index, problem };
    // `detail` is accepted for OpenAI compatibility; every image is sized by `max_pixels`.
    if let Some(d) = detail
        && !matches!(d, "low" | "high" | "auto")
    {
        return Err(image(ImageProblem::BadDetail(d.to_string())));
    }
    let rgb = decode_rgb(data, mime_type, options).map_err(image)?;
    let (w, h) = rgb.dimensions();
    let (tw, th) = target_size(w, h, options);
    let rgb = if (tw, th) == (w, h) {
        rgb
    } else {
        image::imageops::resize(&rgb, tw, th, FilterType::CatmullRom)
    };
    let unit = options.unit();
    Ok(Prepared {
        width: tw,
        height: th,
        pixels: to_chw(&rgb),
        tokens: (tw / unit) * (th / unit),
    })
}

/// The size an image of `width x height` is resized to: scale by `sqrt(max_pixels / (W*H))`
/// when larger than `max_pixels`, round each side to the nearest multiple of the unit (ties
/// up, at least one unit), then shrink the longer side (the width when square) by one unit
/// while the area still exceeds `max_pixels`.
pub fn target_size(width: u32, height: u32, options: &Options) -> (u32, u32) {
    let unit = u64::from(options.unit());
    let (mut w, mut h) = (f64::from(width), f64::from(height));
    let area = w * h;
    let max = options.max_pixels as f64;
    if area > max {
        let s = (max / area).sqrt();
        w *= s;
        h *= s;
    }
    let round = |x: f64| ((x / unit as f64).round() as u64).max(1) * unit;
    let (mut tw, mut th) = (round(w), round(h));
    // Terminates with both sides >= unit: `validate` guarantees unit^2 <= max_pixels.
    while tw * th > options.max_pixels {
        if tw >= th {
            tw -= unit;
        } else {
            th -= unit;
        }
    }
    // Sides fit in u32: at most max(original side, one unit) after rounding.
    (tw as u32, th as u32)
}

/// Decode to RGB8 at the decoded size: header checks first, EXIF orientation applied, alpha
/// composited over white.
pub fn decode_rgb(
    data: &[u8],
    mime_type: Option<&str>,
    options: &Options,
) -> Result<RgbImage, ImageProblem> {
    let format = header::detect(data, mime_type)?;
    let (w, h) = header::dimensions(format, data)?;
    check_dimensions(w, h, options)?;

    let mut reader = ImageReader::with_format(Cursor::new(data), format.image_format());
    let mut limits = Limits::default();
    limits.max_image_width = Some(options.max_image_side);
    limits.max_image_height = Some(options.max_image_side);
    // Up to 8 bytes a pixel (16-bit RGBA) for the largest image allowed; the sandbox's memory
    // cap is the real bound, this makes decoders refuse early rather than trap.
    limits.max_alloc = Some(options.max_decoded_pixels.saturating_mul(8));
    reader.limits(limits);
    let mut decoder = reader.into_decoder().map_err(|e| decode_error(format, e))?;
    let (w, h) = decoder.dimensions();
    check_dimensions(w, h, options)?;
    // An unreadable EXIF block is not worth refusing the image for: no rotation then.
    let orientation = decoder.orientation().unwrap_or(Orientation::NoTransforms);
    let mut img = DynamicImage::from_decoder(decoder).map_err(|e| decode_error(format, e))?;
    img.apply_orientation(orientation);
    Ok(to_rgb8_over_white(img))
}

fn check_dimensions(w: u32, h: u32, o: &Options) -> Result<(), ImageProblem> {
    if w == 0 || h == 0 {
        return Err(ImageProblem::ZeroSized {
            width: w,
            height: h,
        });
    }
    if w > o.max_image_side || h > o.max_image_side {
        return Err(ImageProblem::SideTooLarge {
            width: w,
            height: h,
            limit: o.max_image_side,
        });
    }
    let pixels = u64::from(w) * u64::from(h);
    if pixels > o.max_decoded_pixels {
        return Err(ImageProblem::TooManyPixels {
            width: w,
            height: h,
            pixels,
            limit: o.max_decoded_pixels,
        });
    }
    let ratio = f64::from(w.max(h)) / f64::from(w.min(h));
    if ratio > o.max_aspect_ratio {
        return Err(ImageProblem::AspectRatio {
            width: w,
            height: h,
            ratio,
            limit: o.max_aspect_ratio,
        });
    }
    Ok(())
}

fn decode_error(format: Format, e: ImageError) -> ImageProblem {
    let format = format.name();
    match e {
        ImageError::Limits(e) => ImageProblem::DecodeLimit(e.to_string()),
        ImageError::Unsupported(e) => ImageProblem::UnsupportedFeature {
            format,
            detail: e.to_string(),
        },
        ImageError::IoError(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            ImageProblem::Truncated {
                format,
                detail: "unexpected end of data".into(),
            }
        }
        e => ImageProblem::Truncated {
            format,
            detail: e.to_string(),
        },
    }
}

/// RGB8; pixels with alpha are composited over white (`c*a + 255*(255-a)`, rounded), in place
/// so a large RGBA image never needs a second full-size buffer.
fn to_rgb8_over_white(img: DynamicImage) -> RgbImage {
    if !img.color().has_alpha() {
        return img.into_rgb8();
    }
    let rgba = img.into_rgba8();
    let (w, h) = rgba.dimensions();
    let mut buf = rgba.into_raw();
    let n = buf.len() / 4;
    for i in 0..n {
        let a = u32::from(buf[4 * i + 3]);
        for c in 0..3 {
            let v = u32::from(buf[4 * i + c]);
            // Writes at 3i+c never pass the reads at 4i.., which are ahead of them.
            buf[3 * i + c] = ((v * a + 255 * (255 - a) + 127) / 255) as u8;
        }
    }
    buf.truncate(3 * n);
    RgbImage::from_raw(w, h, buf).expect("3 bytes per pixel by construction")
}

/// `x / 127.5 - 1` for every u8, rounded once from the exact value.
fn lut() -> [f32; 256] {
    std::array::from_fn(|x| (x as f64 / 127.5 - 1.0) as f32)
}

/// RGB8 (HWC) to normalised CHW f32.
pub fn to_chw(img: &RgbImage) -> Vec<f32> {
    let table = lut();
    let n = img.as_raw().len() / 3;
    let mut out = vec![0f32; 3 * n];
    let (r, rest) = out.split_at_mut(n);
    let (g, b) = rest.split_at_mut(n);
    for (i, px) in img.as_raw().chunks_exact(3).enumerate() {
        r[i] = table[usize::from(px[0])];
        g[i] = table[usize::from(px[1])];
        b[i] = table[usize::from(px[2])];
    }
    out
}
