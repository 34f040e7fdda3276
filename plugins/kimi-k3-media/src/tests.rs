//! Native tests of the pipeline on images generated here (no binary fixtures).

use std::io::Cursor;

use image::codecs::gif::GifEncoder;
use image::codecs::png::PngEncoder;
use image::{Delay, Frame, ImageEncoder, ImageFormat, Rgb, RgbImage, Rgba, RgbaImage};

use super::*;

fn encode(img: &RgbImage, format: ImageFormat) -> Vec<u8> {
    let mut out = Vec::new();
    img.write_to(&mut Cursor::new(&mut out), format).unwrap();
    out
}

/// Deterministic "noise": every pixel different, so layout mistakes cannot cancel out.
fn noise(w: u32, h: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        let v = x.wrapping_mul(2_654_435_761) ^ y.wrapping_mul(40_503);
        Rgb([v as u8, (v >> 8) as u8, (x * 7 + y * 3) as u8])
    })
}

fn norm(v: u8) -> f32 {
    (f64::from(v) / 127.5 - 1.0) as f32
}

/// The CHW value at (c, y, x).
fn at(p: &Prepared, c: u32, y: u32, x: u32) -> f32 {
    p.pixels[((c * p.height + y) * p.width + x) as usize]
}

fn run(data: &[u8], mime: Option<&str>) -> Result<Prepared, MediaError> {
    process(3, data, mime, None, &Options::default())
}

fn problem(data: &[u8], mime: Option<&str>) -> ImageProblem {
    match run(data, mime) {
        Err(MediaError::Image { index: 3, problem }) => problem,
        other => panic!("expected an image error, got {other:?}"),
    }
}

/// A PNG header (signature + IHDR) claiming `w x h`, with nothing after it.
fn png_header(w: u32, h: u32) -> Vec<u8> {
    let mut d = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
    d.extend_from_slice(&w.to_be_bytes());
    d.extend_from_slice(&h.to_be_bytes());
    d.extend_from_slice(&[8, 2, 0, 0, 0, 0, 0, 0, 0]);
    d
}

/// A minimal little-endian EXIF block with one Orientation entry.
fn exif_orientation(value: u16) -> Vec<u8> {
    let mut e = b"II*\0".to_vec();
    e.extend_from_slice(&8u32.to_le_bytes());
    e.extend_from_slice(&1u16.to_le_bytes());
    e.extend_from_slice(&0x0112u16.to_le_bytes());
    e.extend_from_slice(&3u16.to_le_bytes());
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&value.to_le_bytes());
    e.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    e
}

#[test]
fn png_without_resize_is_exact_chw() {
    let img = noise(64, 96);
    let out = run(&encode(&img, ImageFormat::Png), Some("image/png")).unwrap();
    assert_eq!((out.width, out.height, out.tokens), (64, 96, 6));
    assert_eq!(out.pixels.len(), 3 * 64 * 96);
    for (x, y, px) in img.enumerate_pixels() {
        for c in 0..3 {
            assert_eq!(at(&out, c, y, x), norm(px[c as usize]), "({c},{y},{x})");
        }
    }
    assert_eq!(out.placeholder(), PAD.repeat(6));
    let bytes = out.pixel_bytes();
    assert_eq!(bytes.len(), 4 * out.pixels.len());
    assert_eq!(
        f32::from_le_bytes(bytes[4..8].try_into().unwrap()),
        out.pixels[1]
    );
}

#[test]
fn normalisation_spans_minus_one_to_one() {
    let img = RgbImage::from_fn(32, 32, |x, _| Rgb([0, 255, (x * 8) as u8]));
    let out = run(&encode(&img, ImageFormat::Png), None).unwrap();
    assert_eq!(at(&out, 0, 5, 5), -1.0);
    assert_eq!(at(&out, 1, 5, 5), 1.0);
    assert_eq!(at(&out, 2, 0, 16), norm(128));
}

#[test]
fn jpeg_decodes_close_to_the_source() {
    // Flat colour blocks survive JPEG nearly unchanged.
    let img = RgbImage::from_fn(96, 64, |x, _| {
        if x < 48 {
            Rgb([200, 30, 30])
        } else {
            Rgb([20, 40, 220])
        }
    });
    let out = run(&encode(&img, ImageFormat::Jpeg), Some("image/jpeg")).unwrap();
    assert_eq!((out.width, out.height, out.tokens), (96, 64, 6));
    for (x, want) in [(10, [200, 30, 30]), (80, [20, 40, 220])] {
        for c in 0..3 {
            let got = at(&out, c, 30, x);
            assert!((got - norm(want[c as usize])).abs() < 0.05, "{x} {c} {got}");
        }
    }
}

#[test]
fn webp_lossless_is_exact() {
    let img = noise(32, 64);
    let out = run(&encode(&img, ImageFormat::WebP), Some("image/webp")).unwrap();
    assert_eq!((out.width, out.height), (32, 64));
    for (x, y, px) in img.enumerate_pixels() {
        assert_eq!(at(&out, 1, y, x), norm(px[1]));
    }
}

#[test]
fn gif_takes_the_first_frame() {
    let red = RgbaImage::from_pixel(32, 32, Rgba([255, 0, 0, 255]));
    let blue = RgbaImage::from_pixel(32, 32, Rgba([0, 0, 255, 255]));
    let mut data = Vec::new();
    {
        let mut enc = GifEncoder::new(&mut data);
        for f in [red, blue] {
            enc.encode_frame(Frame::from_parts(
                f,
                0,
                0,
                Delay::from_numer_denom_ms(100, 1),
            ))
            .unwrap();
        }
    }
    let out = run(&data, Some("image/gif")).unwrap();
    assert_eq!((out.width, out.height), (32, 32));
    assert_eq!(
        (at(&out, 0, 3, 3), at(&out, 1, 3, 3), at(&out, 2, 3, 3)),
        (1.0, -1.0, -1.0)
    );
}

#[test]
fn alpha_is_composited_over_white() {
    let img = RgbaImage::from_fn(32, 32, |x, _| match x {
        0..=9 => Rgba([0, 0, 0, 0]),
        10..=19 => Rgba([10, 20, 30, 255]),
        _ => Rgba([0, 100, 255, 128]),
    });
    let mut data = Vec::new();
    img.write_to(&mut Cursor::new(&mut data), ImageFormat::Png)
        .unwrap();
    let out = run(&data, None).unwrap();
    assert_eq!(at(&out, 0, 0, 0), 1.0, "transparent is white");
    assert_eq!(at(&out, 2, 0, 15), norm(30), "opaque keeps its colour");
    // c*a + 255*(255-a), /255 rounded: 0 -> 127, 100 -> 177, 255 -> 255
    let mixed: Vec<f32> = (0..3).map(|c| at(&out, c, 0, 25)).collect();
    assert_eq!(mixed, vec![norm(127), norm(177), norm(255)]);
}

fn png_with_exif(img: &RgbImage, orientation: u16) -> Vec<u8> {
    let mut data = Vec::new();
    let mut enc = PngEncoder::new(&mut data);
    enc.set_exif_metadata(exif_orientation(orientation))
        .unwrap();
    enc.write_image(
        img.as_raw(),
        img.width(),
        img.height(),
        image::ExtendedColorType::Rgb8,
    )
    .unwrap();
    data
}

#[test]
fn exif_orientation_is_applied() {
    let (w, h) = (64u32, 32u32);
    let img = noise(w, h);
    let src = |x: u32, y: u32| norm(img.get_pixel(x, y)[0]);
    // EXIF value -> (output size, where output (x, y) comes from in the source)
    type Map = Box<dyn Fn(u32, u32) -> (u32, u32)>;
    let cases: [(u16, (u32, u32), Map); 4] = [
        (2, (w, h), Box::new(move |x, y| (w - 1 - x, y))), // mirrored
        (3, (w, h), Box::new(move |x, y| (w - 1 - x, h - 1 - y))), // 180
        (6, (h, w), Box::new(move |x, y| (y, h - 1 - x))), // rotate 90 clockwise
        (8, (h, w), Box::new(move |x, y| (w - 1 - y, x))), // rotate 270 clockwise
    ];
    for (value, size, from) in cases {
        let out = run(&png_with_exif(&img, value), None).unwrap();
        assert_eq!((out.width, out.height), size, "orientation {value}");
        for y in 0..out.height {
            for x in 0..out.width {
                let (sx, sy) = from(x, y);
                assert_eq!(
                    at(&out, 0, y, x),
                    src(sx, sy),
                    "orientation {value} ({x},{y})"
                );
            }
        }
    }
    // Orientation 1 (and no EXIF at all) leave the pixels alone.
    let out = run(&png_with_exif(&img, 1), None).unwrap();
    assert_eq!(at(&out, 0, 1, 2), src(2, 1));
}

#[test]
fn resize_rule() {
    let o = Options::default();
    let cases = [
        ((64, 96), (64, 96)),     // training size: untouched
        ((40, 24), (32, 32)),     // rounded, at least one unit
        ((1, 1), (32, 32)),       // tiny images grow to one unit
        ((48, 80), (64, 96)),     // ties round up
        ((512, 512), (256, 256)), // scaled by sqrt(65536 / 262144) = 0.5
        ((4000, 3000), (288, 224)),
        ((1000, 10), (992, 32)),
        ((200, 345), (192, 320)), // rounding overshoots: the longer side shrinks by 32
    ];
    for ((w, h), want) in cases {
        assert_eq!(target_size(w, h, &o), want, "{w}x{h}");
    }
    // Every size: sides are units, area within max_pixels, and sizes already fitting stay.
    for w in (1..3000).step_by(37) {
        for h in (1..3000).step_by(41) {
            let (tw, th) = target_size(w, h, &o);
            assert!(
                tw % 32 == 0 && th % 32 == 0 && tw >= 32 && th >= 32,
                "{w}x{h}"
            );
            assert!(u64::from(tw) * u64::from(th) <= o.max_pixels, "{w}x{h}");
        }
    }
    assert_eq!(target_size(160, 192, &o), (160, 192));
    let small = Options {
        max_pixels: 32 * 32 * 4,
        ..Options::default()
    };
    assert_eq!(target_size(1000, 1000, &small), (64, 64));
}

#[test]
fn resized_images_are_resampled_not_cropped() {
    // 512x256 -> 320x192 (scale 0.707, rounded, then shrunk): a flat image stays flat, and a left/right
    // split stays split at the middle.
    let img = RgbImage::from_fn(512, 256, |x, _| {
        if x < 256 {
            Rgb([255, 0, 0])
        } else {
            Rgb([0, 0, 255])
        }
    });
    let out = run(&encode(&img, ImageFormat::Png), None).unwrap();
    assert_eq!((out.width, out.height, out.tokens), (320, 192, 60));
    assert_eq!(at(&out, 0, 100, 10), 1.0);
    assert_eq!(at(&out, 2, 100, 310), 1.0);
    assert_eq!(at(&out, 0, 100, 310), -1.0);
}

#[test]
fn bad_images_name_the_problem() {
    let good = encode(&noise(64, 64), ImageFormat::Png);
    let jpeg = encode(&noise(64, 64), ImageFormat::Jpeg);

    let truncated = problem(&good[..good.len() / 2], Some("image/png"));
    assert!(
        matches!(truncated, ImageProblem::Truncated { format: "PNG", .. }),
        "{truncated}"
    );
    assert!(matches!(
        problem(&jpeg[..20], None),
        ImageProblem::Truncated { format: "JPEG", .. }
    ));

    assert!(matches!(
        problem(&png_header(100_000, 100_000), None),
        ImageProblem::SideTooLarge {
            width: 100_000,
            limit: 16384,
            ..
        }
    ));
    assert!(matches!(
        problem(&png_header(16000, 16000), None),
        ImageProblem::TooManyPixels {
            pixels: 256_000_000,
            ..
        }
    ));
    assert!(matches!(
        problem(&png_header(1, 100_000), None),
        ImageProblem::SideTooLarge { .. }
    ));
    assert!(matches!(
        problem(&png_header(1, 300), None),
        ImageProblem::AspectRatio { .. }
    ));
    assert_eq!(
        problem(&png_header(0, 10), None),
        ImageProblem::ZeroSized {
            width: 0,
            height: 10
        }
    );

    let lie = problem(&jpeg, Some("image/png"));
    assert_eq!(lie.to_string(), "declared image/png but the data is JPEG");
    assert!(matches!(
        problem(&good, Some("application/pdf")),
        ImageProblem::NotImageMime(_)
    ));
    assert!(matches!(
        problem(b"{\"hello\": \"world\"}", Some("image/png")),
        ImageProblem::NotAnImage { .. }
    ));
    assert_eq!(problem(b"", None), ImageProblem::Empty);

    let e = process(7, &good, None, Some("ultra"), &Options::default()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "image 7: detail must be \"low\", \"high\" or \"auto\", got \"ultra\""
    );
    assert!(e.is_invalid_input());
    let msg = run(&png_header(100_000, 100_000), None)
        .unwrap_err()
        .to_string();
    assert_eq!(
        msg,
        "image 3: image is 100000x100000: a side exceeds the limit of 16384 pixels"
    );
}

#[test]
fn options_from_wit() {
    let o = Options::from_wit(
        16,
        65536,
        Some(r#"{"merge_size": 2, "min_pixels": 1024, "max_image_side": 16384, "max_decoded_pixels": 50000000, "max_aspect_ratio": 200, "future": true}"#),
    )
    .unwrap();
    assert_eq!(o, Options::default());
    assert_eq!(Options::from_wit(16, 65536, None).unwrap(), o);
    assert_eq!(
        Options::from_wit(14, 1000, Some(r#"{"merge_size": 1}"#))
            .unwrap()
            .unit(),
        14
    );
    for (patch, max, extra) in [
        (0, 65536, None),
        (16, 512, None),
        (16, 65536, Some("{\"min_pixels\": 5000}")),
        (16, 65536, Some("{\"max_aspect_ratio\": 0.5}")),
        (16, 65536, Some("[1]")),
        (16, 65536, Some("{\"merge_size\": \"2\"}")),
    ] {
        let e = Options::from_wit(patch, max, extra).unwrap_err();
        assert!(!e.is_invalid_input(), "{e}");
    }
}

#[test]
fn the_self_test_passes() {
    self_test().unwrap();
}
