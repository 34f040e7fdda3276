//! The media stage through the real wasm components: the default `kimi-k3-media` plugin on
//! generated PNG / JPEG / WebP / GIF images and on the bad-image suite (each a client error
//! naming the problem, the host serving afterwards), its memory and time limits, the host's
//! validation of a plugin's output, a v0.1 media component, and hot swap.

use std::io::Cursor;
use std::time::Duration;

use image::{ImageFormat, Rgb, RgbImage};
use k3_plugin_host::*;

fn config() -> PluginHostConfig {
    PluginHostConfig {
        max_instances: 16,
        ..PluginHostConfig::default()
    }
    .with_cache_dir(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("k3-plugin-cache"))
}

fn wasm(file: &str) -> Vec<u8> {
    let path = default_plugin_dir().join(file);
    std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e} — run scripts/build-plugins", path.display()))
}

fn host_with(cfg: PluginHostConfig) -> (PluginHost, VersionInfo) {
    let host = PluginHost::new(cfg).unwrap();
    let v = host
        .install(Stage::Media, &wasm("kimi_k3_media.wasm"))
        .unwrap();
    (host, v)
}

fn noise(w: u32, h: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        let v = x.wrapping_mul(2_654_435_761) ^ y.wrapping_mul(40_503);
        Rgb([v as u8, (v >> 8) as u8, (x * 7 + y * 3) as u8])
    })
}

fn encode(img: &RgbImage, format: ImageFormat) -> Vec<u8> {
    let mut out = Vec::new();
    img.write_to(&mut Cursor::new(&mut out), format).unwrap();
    out
}

fn part(index: u32, data: Vec<u8>, mime: Option<&str>) -> ImagePart {
    ImagePart {
        index,
        data,
        mime_type: mime.map(str::to_string),
        detail: None,
    }
}

fn one(host: &PluginHost, part: ImagePart) -> Result<PreparedImage, PluginError> {
    host.media()
        .process(&[part], &MediaOptions::default())
        .map(|mut v| v.remove(0))
}

/// The client's error message for a refused image.
fn refused(host: &PluginHost, part: ImagePart) -> String {
    match one(host, part) {
        Err(PluginError::Media(e @ MediaError::InvalidImage(_))) => {
            assert!(e.is_client_error());
            e.to_string()
        }
        other => panic!("expected an invalid-image error, got {other:?}"),
    }
}

fn assert_serving(host: &PluginHost) {
    let out = one(
        host,
        part(0, encode(&noise(64, 32), ImageFormat::Png), None),
    )
    .unwrap();
    assert_eq!((out.width, out.height, out.placeholder_tokens), (64, 32, 2));
}

#[test]
fn good_images_in_every_format() {
    let (host, _) = host_with(config());
    let img = noise(64, 96);
    let png = one(
        &host,
        part(0, encode(&img, ImageFormat::Png), Some("image/png")),
    )
    .unwrap();
    assert_eq!((png.index, png.width, png.height), (0, 64, 96));
    assert_eq!(png.placeholder_tokens, 6);
    assert_eq!(png.placeholder, "<|media_pad|>".repeat(6));
    assert_eq!(png.pixels.len(), 3 * 64 * 96);
    // CHW, x / 127.5 - 1, exactly (no resize needed)
    for (x, y, px) in img.enumerate_pixels() {
        for c in 0..3u32 {
            let got = png.pixels[((c * 96 + y) * 64 + x) as usize];
            assert_eq!(got, (f64::from(px[c as usize]) / 127.5 - 1.0) as f32);
        }
    }
    for (format, mime) in [
        (ImageFormat::Jpeg, "image/jpeg"),
        (ImageFormat::WebP, "image/webp"),
        (ImageFormat::Gif, "image/gif"),
    ] {
        let data = if format == ImageFormat::Gif {
            // GIF is paletted: a few flat colours survive exactly.
            encode(
                &RgbImage::from_fn(96, 64, |x, _| Rgb([(x / 32 * 100) as u8, 0, 0])),
                format,
            )
        } else {
            encode(&noise(96, 64), format)
        };
        let out = one(&host, part(2, data, Some(mime))).unwrap();
        assert_eq!((out.index, out.width, out.height), (2, 96, 64), "{mime}");
        assert_eq!(out.placeholder_tokens, 6, "{mime}");
        assert_eq!(out.pixels.len(), 3 * 96 * 64, "{mime}");
        assert!(
            out.pixels.iter().all(|v| (-1.0..=1.0).contains(v)),
            "{mime}"
        );
    }
}

/// The same pipeline natively and in the sandbox gives the same bits, resizing included.
#[test]
fn the_sandbox_computes_what_the_native_code_computes() {
    let (host, _) = host_with(config());
    let data = encode(&noise(700, 500), ImageFormat::Jpeg);
    let sandboxed = one(&host, part(0, data.clone(), Some("image/jpeg"))).unwrap();
    let native =
        kimi_k3_media::process(0, &data, None, None, &kimi_k3_media::Options::default()).unwrap();
    assert_eq!((sandboxed.width, sandboxed.height), (288, 224));
    assert_eq!((native.width, native.height), (288, 224));
    assert_eq!(sandboxed.placeholder_tokens, native.tokens);
    assert!(sandboxed.pixels == native.pixels, "pixels differ");
}

#[test]
fn several_images_keep_their_order_and_the_first_bad_one_is_named() {
    let (host, v) = host_with(config());
    let a = part(0, encode(&noise(32, 64), ImageFormat::Png), None);
    let b = part(1, encode(&noise(96, 32), ImageFormat::WebP), None);
    let out = host
        .media()
        .process(&[a.clone(), b.clone()], &MediaOptions::default())
        .unwrap();
    let sizes: Vec<_> = out.iter().map(|p| (p.index, p.width, p.height)).collect();
    assert_eq!(sizes, vec![(0, 32, 64), (1, 96, 32)]);

    let bad = part(1, b"GIF89a".to_vec(), None);
    let e = host
        .media()
        .process(&[a, bad], &MediaOptions::default())
        .unwrap_err();
    assert!(e.to_string().starts_with("image 1: "), "{e}");
    let stats = host
        .list()
        .into_iter()
        .find(|i| i.id == v.id)
        .unwrap()
        .stats;
    assert!(stats.errors >= 1 && stats.faults == 0, "{stats:?}");
}

#[test]
fn the_bad_image_suite_is_refused_naming_the_problem() {
    let (host, _) = host_with(config());
    let png = encode(&noise(64, 64), ImageFormat::Png);
    let jpeg = encode(&noise(64, 64), ImageFormat::Jpeg);
    let header = |w: u32, h: u32| {
        let mut d = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        d.extend_from_slice(&w.to_be_bytes());
        d.extend_from_slice(&h.to_be_bytes());
        d.extend_from_slice(&[8, 2, 0, 0, 0, 0, 0, 0, 0]);
        d
    };
    // A real PNG whose IHDR is patched to claim 100000x100000 (a bomb of ~300 bytes).
    let mut bomb = encode(&noise(8, 8), ImageFormat::Png);
    bomb[16..20].copy_from_slice(&100_000u32.to_be_bytes());
    bomb[20..24].copy_from_slice(&100_000u32.to_be_bytes());

    let cases: Vec<(&str, ImagePart, &str)> = vec![
        (
            "truncated PNG",
            part(0, png[..png.len() / 2].to_vec(), Some("image/png")),
            "image 0: truncated or corrupt PNG data",
        ),
        (
            "decompression bomb",
            part(1, bomb, Some("image/png")),
            "image 1: image is 100000x100000: a side exceeds the limit of 16384 pixels",
        ),
        (
            "too many pixels",
            part(2, header(16000, 16000), None),
            "image 2: image is 16000x16000 (256000000 pixels), more than the limit of 50000000",
        ),
        (
            "1x100000",
            part(3, header(1, 100_000), None),
            "image 3: image is 1x100000: a side exceeds the limit of 16384 pixels",
        ),
        (
            "1x1000 aspect",
            part(4, header(1, 1000), None),
            "image 4: image is 1x1000: aspect ratio 1000.0:1 exceeds the limit of 200:1",
        ),
        (
            "zero-sized",
            part(5, header(0, 64), None),
            "image 5: zero-sized image (0x64)",
        ),
        (
            "lying MIME type",
            part(6, jpeg, Some("image/png")),
            "image 6: declared image/png but the data is JPEG",
        ),
        (
            "non-image MIME type",
            part(7, png.clone(), Some("text/html")),
            "image 7: declared MIME type \"text/html\" is not an image type",
        ),
        (
            "non-image bytes",
            part(8, b"<html><body>hello</body></html>".to_vec(), None),
            "image 8: not an image: the data is not PNG, JPEG, WebP or GIF",
        ),
        (
            "unsupported format",
            part(9, b"BM\0\0\0\0\0\0\0\0\0\0\0\0\0\0".to_vec(), None),
            "image 9: unsupported image format BMP",
        ),
        ("empty", part(10, vec![], None), "image 10: empty data"),
    ];
    for (name, case, want) in cases {
        let msg = refused(&host, case);
        assert!(msg.starts_with(want), "{name}: {msg}");
        assert_serving(&host);
    }
}

#[test]
fn the_memory_limit_holds_and_the_host_keeps_serving() {
    let (host, v) = host_with(PluginHostConfig {
        media_memory_limit: 16 << 20,
        ..config()
    });
    // A flat 3000x2000 PNG is a few KB, but 18 MB decoded: past the 16 MiB cap.
    let big = encode(
        &RgbImage::from_pixel(3000, 2000, Rgb([10, 200, 30])),
        ImageFormat::Png,
    );
    assert!(big.len() < 100_000);
    let e = one(&host, part(0, big, None)).unwrap_err();
    assert!(
        matches!(e, PluginError::MemoryLimit { limit_bytes, .. } if limit_bytes == 16 << 20),
        "{e}"
    );
    assert!(e.is_fault() && e.is_resource_limit());
    assert_serving(&host);
    let stats = host
        .list()
        .into_iter()
        .find(|i| i.id == v.id)
        .unwrap()
        .stats;
    assert_eq!(stats.faults, 1);
}

#[test]
fn faults_of_a_media_plugin_stay_calls() {
    let host = PluginHost::new(PluginHostConfig {
        media_timeout: Duration::from_millis(300),
        media_memory_limit: 32 << 20,
        ..config()
    })
    .unwrap();
    let v = host
        .install(Stage::Media, &wasm("testdata_media_v0_1.wasm"))
        .unwrap();
    assert_eq!(v.metadata.wit_version, "0.1.0");
    let png = encode(&noise(8, 8), ImageFormat::Png);
    let with = |detail: &str| ImagePart {
        detail: Some(detail.into()),
        ..part(0, png.clone(), None)
    };
    // A v0.1 media component is served.
    let ok = one(&host, with("fine")).unwrap();
    assert_eq!((ok.width, ok.height, ok.placeholder_tokens), (32, 64, 2));
    assert!(ok.pixels.iter().all(|&p| p == 0.0));

    let e = one(&host, with("trap")).unwrap_err();
    assert!(
        matches!(&e, PluginError::Trap { detail, .. } if detail.contains("deliberate trap")),
        "{e}"
    );
    let e = one(&host, with("loop")).unwrap_err();
    assert!(
        matches!(e, PluginError::Timeout { limit_ms: 300, .. }),
        "{e}"
    );
    let e = one(&host, with("bomb")).unwrap_err();
    assert!(
        matches!(e, PluginError::MemoryLimit { limit_bytes, .. } if limit_bytes == 32 << 20),
        "{e}"
    );
    assert_eq!(one(&host, with("fine")).unwrap(), ok);
    let stats = host
        .list()
        .into_iter()
        .find(|i| i.id == v.id)
        .unwrap()
        .stats;
    assert_eq!(stats.faults, 3);
}

#[test]
fn malformed_output_is_refused_by_the_host() {
    let host = PluginHost::new(config()).unwrap();
    host.install(Stage::Media, &wasm("testdata_media_v0_1.wasm"))
        .unwrap();
    let png = encode(&noise(8, 8), ImageFormat::Png);
    for (mode, says) in [
        ("bad-pixels", "bytes of pixel values for 32x64"),
        ("bad-side", "size 48x64 is not a positive multiple of 32"),
        ("bad-tokens", "3 placeholder tokens for 32x64 (expected 2)"),
        ("bad-index", "the item has index 1"),
        ("nan", "not finite"),
        ("no-placeholder", "got 1 items and 0 placeholders"),
        ("two-items", "got 2 items and 2 placeholders"),
        (
            "bad-placeholder",
            "the placeholder holds 1 \"<|media_pad|>\" for 2 tokens",
        ),
    ] {
        let image = ImagePart {
            detail: Some(mode.into()),
            ..part(0, png.clone(), None)
        };
        match one(&host, image) {
            Err(PluginError::Media(e @ MediaError::BadOutput { .. })) => {
                assert!(!e.is_client_error());
                assert!(e.to_string().contains(says), "{mode}: {e}");
            }
            other => panic!("{mode}: expected BadOutput, got {other:?}"),
        }
    }
}

#[test]
fn options_the_plugin_refuses_are_not_the_clients_fault() {
    let (host, _) = host_with(config());
    let options = MediaOptions {
        max_pixels: 100,
        ..MediaOptions::default()
    };
    let png = encode(&noise(64, 64), ImageFormat::Png);
    match host.media().process(&[part(0, png, None)], &options) {
        Err(PluginError::Media(e @ MediaError::Unsupported(_))) => {
            assert!(!e.is_client_error());
        }
        other => panic!("{other:?}"),
    }
    // Smaller max_pixels: the image shrinks to fit.
    let options = MediaOptions {
        max_pixels: 32 * 32 * 2,
        ..MediaOptions::default()
    };
    let png = encode(&noise(640, 320), ImageFormat::Png);
    let out = host
        .media()
        .process(&[part(0, png, None)], &options)
        .unwrap();
    assert_eq!((out[0].width, out[0].height), (64, 32));
}

#[test]
fn the_media_stage_hot_swaps_and_rolls_back() {
    let host = PluginHost::new(config()).unwrap();
    assert!(matches!(
        one(&host, part(0, vec![1], None)),
        Err(PluginError::NoActivePlugin(Stage::Media))
    ));
    let loaded = host.load_default_plugins().unwrap();
    let kimi = loaded.iter().find(|v| v.stage == Stage::Media).unwrap();
    assert_eq!(kimi.metadata.name, "kimi-k3-media");
    assert_eq!(host.active(Stage::Media).unwrap().id, kimi.id);
    let png = encode(&noise(96, 64), ImageFormat::Png);
    assert_eq!(one(&host, part(0, png.clone(), None)).unwrap().width, 96);

    let other = host
        .install(Stage::Media, &wasm("testdata_media_v0_1.wasm"))
        .unwrap();
    assert_eq!(host.active(Stage::Media).unwrap().id, other.id);
    assert_eq!(one(&host, part(0, png.clone(), None)).unwrap().width, 32);

    host.rollback(Stage::Media).unwrap();
    assert_eq!(host.active(Stage::Media).unwrap().id, kimi.id);
    assert_eq!(one(&host, part(0, png, None)).unwrap().width, 96);

    // A component of another stage is refused for the media slot; the active one stays.
    let e = host
        .install(Stage::Media, &wasm("kimi_k3_tools.wasm"))
        .unwrap_err();
    assert!(matches!(e, PluginError::WrongWorld { .. }), "{e}");
    assert_eq!(host.active(Stage::Media).unwrap().id, kimi.id);
}
