//! Media preprocessing per image, in the sandbox vs the same code native (issue 22, "Measure"):
//!   cargo bench -p k3-plugin-host --bench media
//! `wasm` is `PluginHost::media().process` with the default `kimi-k3-media` component (a fresh
//! instance per image, the bytes copied in and the pixels copied out, host validation);
//! `native` is `kimi_k3_media::process` compiled for the host. Images are generated: a smooth
//! gradient with texture, so PNG and JPEG sizes look like real pictures rather than noise.

use std::hint::black_box;
use std::io::Cursor;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use image::{ImageFormat, Rgb, RgbImage};
use k3_plugin_host::*;

fn picture(w: u32, h: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        let t = (x.wrapping_mul(31) ^ y.wrapping_mul(17)) % 23;
        Rgb([
            ((x * 255) / w) as u8,
            ((y * 255) / h) as u8,
            (128 + t * 3) as u8,
        ])
    })
}

fn encode(img: &RgbImage, format: ImageFormat) -> Vec<u8> {
    let mut out = Vec::new();
    img.write_to(&mut Cursor::new(&mut out), format)
        .expect("encode");
    out
}

fn host() -> PluginHost {
    let cache = std::env::temp_dir().join("k3-plugin-bench-cache");
    let host =
        PluginHost::new(PluginHostConfig::default().with_cache_dir(cache)).expect("plugin host");
    let wasm = std::fs::read(default_plugin_dir().join("kimi_k3_media.wasm"))
        .expect("kimi_k3_media.wasm (run scripts/build-plugins)");
    host.install(Stage::Media, &wasm).expect("media plugin");
    host
}

fn media(c: &mut Criterion) {
    let host = host();
    let media = host.media();
    let options = MediaOptions::default();
    let native_options = kimi_k3_media::Options::default();
    let cases = [
        ("png_256x256_no_resize", ImageFormat::Png, 256, 256),
        ("jpeg_1024x768", ImageFormat::Jpeg, 1024, 768),
        ("png_1920x1080", ImageFormat::Png, 1920, 1080),
        ("jpeg_4032x3024", ImageFormat::Jpeg, 4032, 3024),
    ];
    let mut g = c.benchmark_group("media_per_image");
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    for (name, format, w, h) in cases {
        let data = encode(&picture(w, h), format);
        let part = ImagePart {
            index: 0,
            data: data.clone(),
            mime_type: None,
            detail: None,
        };
        g.bench_function(format!("{name}/wasm"), |b| {
            b.iter(|| {
                black_box(
                    media
                        .process(std::slice::from_ref(&part), &options)
                        .unwrap(),
                )
            })
        });
        g.bench_function(format!("{name}/native"), |b| {
            b.iter(|| {
                black_box(kimi_k3_media::process(0, &data, None, None, &native_options).unwrap())
            })
        });
    }
    g.finish();
}

criterion_group!(benches, media);
criterion_main!(benches);
