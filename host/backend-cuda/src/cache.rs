//! On-disk cache of compiled kernels: NVRTC takes seconds per file (kda_chunk.cu ~10 s on one
//! core), so a cubin is kept per (expanded source, target arch, options, NVRTC version), named by
//! `k3_kernels::cache_key`.

use crate::error::{CudaError, Result};
use std::path::{Path, PathBuf};

/// The cache directory: `$K3_KERNEL_CACHE`, else `$XDG_CACHE_HOME/k3serve/kernels`, else
/// `$HOME/.cache/k3serve/kernels`, else a directory under the system temp dir.
pub fn default_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("K3_KERNEL_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("k3serve/kernels");
    }
    if let Some(d) = std::env::var_os("HOME") {
        return PathBuf::from(d).join(".cache/k3serve/kernels");
    }
    std::env::temp_dir().join("k3serve-kernels")
}

#[derive(Debug, Clone)]
pub struct KernelCache {
    dir: PathBuf,
}

impl KernelCache {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of the cubin for `key` (whether or not it exists).
    pub fn path(&self, key: &str, file: &str) -> PathBuf {
        let stem = file.trim_end_matches(".cu");
        self.dir
            .join(format!("{stem}-{}.cubin", &key[..key.len().min(24)]))
    }

    /// The cached bytes, or None when absent or empty (a torn write is never renamed into place).
    pub fn get(&self, key: &str, file: &str) -> Option<Vec<u8>> {
        std::fs::read(self.path(key, file))
            .ok()
            .filter(|b| !b.is_empty())
    }

    /// The cubin's path when it is cached (present and not empty), without reading it.
    pub fn find(&self, key: &str, file: &str) -> Option<PathBuf> {
        let path = self.path(key, file);
        let len = std::fs::metadata(&path).ok()?.len();
        (len > 0).then_some(path)
    }

    /// Store atomically: write a temp file in the same directory, then rename over the target,
    /// so concurrent servers never read half a cubin.
    pub fn put(&self, key: &str, file: &str, bytes: &[u8]) -> Result<PathBuf> {
        let io = |path: &Path, source| CudaError::Cache {
            path: path.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(&self.dir).map_err(|e| io(&self.dir, e))?;
        let path = self.path(key, file);
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, bytes).map_err(|e| io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| io(&path, e))?;
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_kernels::cache_key;

    #[test]
    fn put_then_get_round_trips_and_missing_is_none() {
        let dir = std::env::temp_dir().join(format!("k3-cache-test-{}", std::process::id()));
        let cache = KernelCache::new(&dir);
        let key = cache_key("x", "sm_90a", &[], (13, 0));
        assert!(cache.get(&key, "norm.cu").is_none());
        assert!(cache.find(&key, "norm.cu").is_none());
        let p = cache.put(&key, "norm.cu", b"\x7fELF...").unwrap();
        assert!(p.starts_with(&dir) && p.to_string_lossy().ends_with(".cubin"));
        assert_eq!(cache.get(&key, "norm.cu").unwrap(), b"\x7fELF...");
        assert_eq!(cache.find(&key, "norm.cu"), Some(p.clone()));
        cache.put(&key, "norm.cu", b"v2").unwrap();
        assert_eq!(cache.get(&key, "norm.cu").unwrap(), b"v2");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
