//! What the first bytes of an image say, read before any decoder runs: the format (by magic
//! number, never by the declared MIME type) and the declared dimensions. Checking dimensions
//! from the header first is what stops decompression bombs: a 100-byte PNG may claim
//! 100000x100000 pixels, and no decoder should be asked to allocate for it.

use crate::error::ImageProblem;

/// The formats this stage decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Png,
    Jpeg,
    WebP,
    Gif,
}

impl Format {
    pub const ALL: [Format; 4] = [Format::Png, Format::Jpeg, Format::WebP, Format::Gif];

    pub fn name(self) -> &'static str {
        match self {
            Format::Png => "PNG",
            Format::Jpeg => "JPEG",
            Format::WebP => "WebP",
            Format::Gif => "GIF",
        }
    }

    pub fn mime(self) -> &'static str {
        match self {
            Format::Png => "image/png",
            Format::Jpeg => "image/jpeg",
            Format::WebP => "image/webp",
            Format::Gif => "image/gif",
        }
    }

    pub(crate) fn image_format(self) -> image::ImageFormat {
        match self {
            Format::Png => image::ImageFormat::Png,
            Format::Jpeg => image::ImageFormat::Jpeg,
            Format::WebP => image::ImageFormat::WebP,
            Format::Gif => image::ImageFormat::Gif,
        }
    }

    /// The format a (normalised) MIME type names, with the common aliases.
    fn from_mime(mime: &str) -> Option<Format> {
        match mime {
            "image/png" | "image/apng" => Some(Format::Png),
            "image/jpeg" | "image/jpg" | "image/pjpeg" => Some(Format::Jpeg),
            "image/webp" => Some(Format::WebP),
            "image/gif" => Some(Format::Gif),
            _ => None,
        }
    }
}

/// The format of `data` by its magic number, checked against the declared MIME type.
pub fn detect(data: &[u8], declared: Option<&str>) -> Result<Format, ImageProblem> {
    // "image/PNG; charset=binary" and friends: compare the bare, lower-cased type.
    let declared = declared
        .map(|m| {
            m.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .filter(|m| !m.is_empty());
    if let Some(m) = &declared
        && !m.starts_with("image/")
    {
        return Err(ImageProblem::NotImageMime(m.clone()));
    }
    if data.is_empty() {
        return Err(ImageProblem::Empty);
    }
    let format = match image::guess_format(data) {
        Ok(f) => match Format::ALL.into_iter().find(|s| s.image_format() == f) {
            Some(f) => f,
            None => {
                return Err(ImageProblem::UnsupportedFormat(
                    format!("{f:?}").to_uppercase(),
                ));
            }
        },
        Err(_) => return Err(ImageProblem::NotAnImage { declared }),
    };
    match declared {
        // `image/*` says only "some image".
        Some(m) if m != "image/*" && Format::from_mime(&m) != Some(format) => {
            Err(ImageProblem::MimeMismatch {
                declared: m,
                actual: format.name(),
            })
        }
        _ => Ok(format),
    }
}

/// The largest extent the header declares, (width, height): for GIF the larger of the logical
/// screen and the first frame (a small screen may carry a huge frame).
pub fn dimensions(format: Format, data: &[u8]) -> Result<(u32, u32), ImageProblem> {
    let found = match format {
        Format::Png => png(data),
        Format::Jpeg => jpeg(data),
        Format::WebP => webp(data),
        Format::Gif => gif(data),
    };
    found.ok_or(ImageProblem::Truncated {
        format: format.name(),
        detail: "the header ends before the image dimensions".into(),
    })
}

fn be16(d: &[u8], at: usize) -> Option<u32> {
    Some(u32::from(u16::from_be_bytes(
        d.get(at..at + 2)?.try_into().ok()?,
    )))
}

fn le16(d: &[u8], at: usize) -> Option<u32> {
    Some(u32::from(u16::from_le_bytes(
        d.get(at..at + 2)?.try_into().ok()?,
    )))
}

fn le24(d: &[u8], at: usize) -> Option<u32> {
    let b = d.get(at..at + 3)?;
    Some(u32::from(b[0]) | u32::from(b[1]) << 8 | u32::from(b[2]) << 16)
}

/// IHDR is the first chunk: 8-byte signature, length, "IHDR", width, height (big-endian).
fn png(d: &[u8]) -> Option<(u32, u32)> {
    if d.get(12..16)? != b"IHDR" {
        return None;
    }
    let w = u32::from_be_bytes(d.get(16..20)?.try_into().ok()?);
    let h = u32::from_be_bytes(d.get(20..24)?.try_into().ok()?);
    Some((w, h))
}

/// The first start-of-frame segment (SOF0..SOF15 less DHT, JPG and DAC) holds the size.
fn jpeg(d: &[u8]) -> Option<(u32, u32)> {
    let mut at = 2; // after SOI
    loop {
        // Markers may be preceded by any number of 0xFF fill bytes.
        while *d.get(at)? == 0xFF && *d.get(at + 1)? == 0xFF {
            at += 1;
        }
        if *d.get(at)? != 0xFF {
            return None;
        }
        let marker = *d.get(at + 1)?;
        match marker {
            // Stand-alone markers: no length.
            0x01 | 0xD0..=0xD8 => at += 2,
            // Start of scan or end of image before any frame header: no size to find.
            0xDA | 0xD9 => return None,
            0xC0..=0xCF if !matches!(marker, 0xC4 | 0xC8 | 0xCC) => {
                // FF Cn, length(2), precision(1), height(2), width(2)
                return Some((be16(d, at + 7)?, be16(d, at + 5)?));
            }
            _ => at += 2 + usize::try_from(be16(d, at + 2)?).ok()?,
        }
    }
}

/// RIFF container; the first chunk is VP8 (lossy), VP8L (lossless) or VP8X (extended).
fn webp(d: &[u8]) -> Option<(u32, u32)> {
    match d.get(12..16)? {
        b"VP8 " => {
            // frame tag (3 bytes) and start code 9d 01 2a, then 14-bit width and height
            if d.get(23..26)? != [0x9d, 0x01, 0x2a] {
                return None;
            }
            Some((le16(d, 26)? & 0x3fff, le16(d, 28)? & 0x3fff))
        }
        b"VP8L" => {
            if *d.get(20)? != 0x2f {
                return None;
            }
            let bits = u32::from_le_bytes(d.get(21..25)?.try_into().ok()?);
            Some(((bits & 0x3fff) + 1, ((bits >> 14) & 0x3fff) + 1))
        }
        // flags (1), reserved (3), then canvas width - 1 and height - 1 in 24 bits each
        b"VP8X" => Some((le24(d, 24)? + 1, le24(d, 27)? + 1)),
        _ => None,
    }
}

/// Logical screen size, then the blocks up to the first image descriptor for the frame size.
fn gif(d: &[u8]) -> Option<(u32, u32)> {
    let (sw, sh) = (le16(d, 6)?, le16(d, 8)?);
    let flags = *d.get(10)?;
    let mut at = 13;
    if flags & 0x80 != 0 {
        at += 3 << ((flags & 7) + 1);
    }
    loop {
        match *d.get(at)? {
            // extension: label, then data sub-blocks up to an empty one
            0x21 => {
                at += 2;
                loop {
                    let len = usize::from(*d.get(at)?);
                    at += 1 + len;
                    if len == 0 {
                        break;
                    }
                }
            }
            // image descriptor: left, top, width, height
            0x2C => {
                let (fw, fh) = (le16(d, at + 5)?, le16(d, at + 7)?);
                return Some((sw.max(fw), sh.max(fh)));
            }
            _ => return None, // trailer or garbage before any frame
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mime_checks() {
        let png = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR\0\0\0\x01\0\0\0\x02";
        assert_eq!(detect(png, Some("image/png")), Ok(Format::Png));
        assert_eq!(detect(png, Some(" Image/PNG ; x=y")), Ok(Format::Png));
        assert_eq!(detect(png, Some("image/*")), Ok(Format::Png));
        assert_eq!(detect(png, None), Ok(Format::Png));
        assert_eq!(
            detect(png, Some("image/jpeg")),
            Err(ImageProblem::MimeMismatch {
                declared: "image/jpeg".into(),
                actual: "PNG"
            })
        );
        assert_eq!(
            detect(png, Some("text/plain")),
            Err(ImageProblem::NotImageMime("text/plain".into()))
        );
        assert_eq!(dimensions(Format::Png, png), Ok((1, 2)));
        assert!(matches!(
            dimensions(Format::Png, &png[..20]),
            Err(ImageProblem::Truncated { .. })
        ));
        assert_eq!(detect(b"", None), Err(ImageProblem::Empty));
        assert_eq!(
            detect(b"BM\0\0\0\0\0\0\0\0\0\0\0\0", None),
            Err(ImageProblem::UnsupportedFormat("BMP".into()))
        );
        assert!(matches!(
            detect(b"hello, world", Some("image/png")),
            Err(ImageProblem::NotAnImage { .. })
        ));
    }

    #[test]
    fn gif_frame_larger_than_screen_counts() {
        // 1x1 screen, no colour table, then a 60000x60000 frame descriptor
        let mut g = b"GIF89a\x01\0\x01\0\0\0\0".to_vec();
        g.extend_from_slice(b"\x21\xf9\x04\0\0\0\0\0");
        g.extend_from_slice(&[0x2C, 0, 0, 0, 0, 0x60, 0xEA, 0x60, 0xEA, 0]);
        assert_eq!(dimensions(Format::Gif, &g), Ok((60000, 60000)));
    }
}
