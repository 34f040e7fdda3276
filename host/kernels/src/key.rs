//! The name of a compiled kernel: every input that changes the cubin, hashed.

use sha2::{Digest, Sha256};

/// NVRTC options, identical to scripts/nvrtc-check and the device harness (device_check.py
/// NVRTC_OPTIONS; precise math: the checks compare with f64
/// references at 1e-5; the kernels use fast intrinsics explicitly where they are safe).
pub const NVRTC_OPTIONS: &[&str] = &["--std=c++17", "-default-device"];

/// Hex SHA-256 over every input that changes the compiled binary. Fields are length-prefixed so
/// that no two different inputs hash the same byte stream.
pub fn cache_key(
    source: &str,
    arch: &str,
    options: &[String],
    nvrtc_version: (i32, i32),
) -> String {
    let mut h = Sha256::new();
    let mut field = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    field(b"k3-kernel-cache-v1");
    field(source.as_bytes());
    field(arch.as_bytes());
    for o in options {
        field(o.as_bytes());
    }
    field(format!("{}.{}", nvrtc_version.0, nvrtc_version.1).as_bytes());
    hex::encode(h.finalize())
}

/// [`NVRTC_OPTIONS`] as owned strings, the form [`cache_key`] and the compiler take.
pub fn nvrtc_options() -> Vec<String> {
    NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_changes_with_every_input() {
        let opts = vec!["--std=c++17".to_string()];
        let base = cache_key("src", "sm_90a", &opts, (13, 0));
        assert_eq!(base.len(), 64);
        assert_eq!(base, cache_key("src", "sm_90a", &opts, (13, 0)));
        assert_ne!(base, cache_key("src2", "sm_90a", &opts, (13, 0)));
        assert_ne!(base, cache_key("src", "sm_90", &opts, (13, 0)));
        assert_ne!(base, cache_key("src", "sm_90a", &[], (13, 0)));
        assert_ne!(base, cache_key("src", "sm_90a", &opts, (13, 1)));
        // Length prefixes: moving a byte between fields changes the key.
        assert_ne!(
            cache_key("ab", "c", &[], (1, 0)),
            cache_key("a", "bc", &[], (1, 0))
        );
    }
}
