//! Where each kernel module's cubin comes from at start-up, fastest first: built into the
//! binary (`K3_KERNEL_ARCHS` at build time, see build.rs), the on-disk cache, or NVRTC at run
//! time — every missing file at once, on all cores. libnvrtc is loaded only when something
//! must be compiled, so a binary built with its GPU's target needs none.

use crate::cache::KernelCache;
use crate::error::{CudaError, Result};
use k3_kernels::{CompileJob, EmbeddedCubin, Nvrtc, cache_key, embed, expand};
use std::path::PathBuf;
use std::time::Instant;

mod generated {
    include!(concat!(env!("OUT_DIR"), "/embedded_kernels.rs"));
}

/// The cubins this binary was built with (empty unless built with `K3_KERNEL_ARCHS`).
pub fn embedded() -> &'static [EmbeddedCubin] {
    generated::EMBEDDED
}

/// Where one file's cubin came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Embedded,
    Cached,
    Compiled,
}

/// How start-up got its kernels, for the progress line.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KernelStats {
    pub embedded: usize,
    pub cached: usize,
    pub compiled: usize,
    /// Threads NVRTC ran on (0: nothing was compiled).
    pub compile_threads: usize,
    /// Wall time finding, compiling and writing the cubins.
    pub seconds: f64,
}

impl std::fmt::Display for KernelStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} built in, {} from the disk cache, {} compiled",
            self.embedded, self.cached, self.compiled
        )?;
        if self.compiled > 0 {
            write!(f, " with NVRTC on {} threads", self.compile_threads)?;
        }
        write!(f, " in {:.2} s", self.seconds)
    }
}

/// One file's cubin on disk, ready for `load_module` (in the order of the files asked for).
#[derive(Debug, Clone)]
pub struct CubinFile {
    pub path: PathBuf,
    pub origin: Origin,
}

/// The cubin of every file of `files` for `arch`, as files in `cache` (built-in ones are written
/// there: the driver loads modules from a path).
pub fn cubins(
    files: &[k3_kernels::KernelFile],
    arch: &str,
    cache: &KernelCache,
    table: &[EmbeddedCubin],
) -> Result<(Vec<CubinFile>, KernelStats)> {
    let started = Instant::now();
    let options = k3_kernels::key::nvrtc_options();
    let mut stats = KernelStats::default();
    let mut out: Vec<Option<CubinFile>> = vec![None; files.len()];
    let mut missing = Vec::new();
    for (i, f) in files.iter().enumerate() {
        let source = expand(f.name, f.text)?;
        match embed::find(table, f.name, arch, &source, &options) {
            Some(e) => {
                let path = match cache.find(e.key, f.name) {
                    Some(path) => path,
                    None => cache.put(e.key, f.name, e.cubin)?,
                };
                out[i] = Some(CubinFile {
                    path,
                    origin: Origin::Embedded,
                });
                stats.embedded += 1;
            }
            None => missing.push((i, source)),
        }
    }
    if !missing.is_empty() {
        let nvrtc = Nvrtc::load().map_err(|e| {
            CudaError::NoNvrtc(format!(
                "{e} ({} kernel files are not built into this binary for {arch})",
                missing.len()
            ))
        })?;
        let version = nvrtc.version()?;
        let mut jobs = Vec::new();
        for (i, source) in missing {
            let f = &files[i];
            let key = cache_key(&source, arch, &options, version);
            if let Some(path) = cache.find(&key, f.name) {
                out[i] = Some(CubinFile {
                    path,
                    origin: Origin::Cached,
                });
                stats.cached += 1;
            } else {
                jobs.push((
                    i,
                    key,
                    CompileJob {
                        file: f.name.into(),
                        source,
                        arch: arch.into(),
                    },
                ));
            }
        }
        if !jobs.is_empty() {
            let threads = k3_kernels::nvrtc::default_threads().min(jobs.len());
            let only: Vec<CompileJob> = jobs.iter().map(|(_, _, j)| j.clone()).collect();
            let compiled = nvrtc.compile_all(&only, &options, threads);
            for ((i, key, _), cubin) in jobs.into_iter().zip(compiled) {
                let f = &files[i];
                out[i] = Some(CubinFile {
                    path: cache.put(&key, f.name, &cubin?)?,
                    origin: Origin::Compiled,
                });
                stats.compiled += 1;
            }
            stats.compile_threads = threads;
        }
    }
    stats.seconds = started.elapsed().as_secs_f64();
    let files = out.into_iter().flatten().collect();
    Ok((files, stats))
}

/// Compile one file now, bypassing the built-in table: for a built-in cubin the driver refused
/// (a driver older than the NVRTC that built it).
pub fn recompile(f: &k3_kernels::KernelFile, arch: &str, cache: &KernelCache) -> Result<PathBuf> {
    let (files, _) = cubins(std::slice::from_ref(f), arch, cache, &[])?;
    files
        .into_iter()
        .next()
        .map(|c| c.path)
        .ok_or_else(|| CudaError::MissingKernel(f.name.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_cache(tag: &str) -> KernelCache {
        KernelCache::new(
            std::env::temp_dir().join(format!("k3-kernels-{tag}-{}", std::process::id())),
        )
    }

    #[test]
    fn built_in_cubins_need_no_nvrtc_and_land_in_the_cache() {
        let f = *k3_kernels::FILES
            .iter()
            .find(|f| f.name == "elementwise.cu")
            .unwrap();
        let source = expand(f.name, f.text).unwrap();
        let key = cache_key(
            &source,
            "sm_90a",
            &k3_kernels::key::nvrtc_options(),
            (13, 0),
        );
        let table = [EmbeddedCubin {
            file: f.name,
            arch: "sm_90a",
            key: Box::leak(key.clone().into_boxed_str()),
            nvrtc_version: (13, 0),
            cubin: b"\x7fELF-test",
        }];
        let cache = temp_cache("embedded");
        let (files, stats) = cubins(&[f], "sm_90a", &cache, &table).unwrap();
        assert_eq!((stats.embedded, stats.cached, stats.compiled), (1, 0, 0));
        assert_eq!(files[0].origin, Origin::Embedded);
        assert_eq!(std::fs::read(&files[0].path).unwrap(), b"\x7fELF-test");
        assert_eq!(cache.get(&key, f.name).unwrap(), b"\x7fELF-test");
        // Another target is not served from the table: it needs NVRTC (an error, not a panic,
        // where there is none; compiled where there is).
        match cubins(&[f], "sm_89", &cache, &table) {
            Ok((files, stats)) => {
                assert_eq!(stats.compiled + stats.cached, 1);
                assert_ne!(files[0].origin, Origin::Embedded);
            }
            Err(e) => assert!(matches!(e, CudaError::NoNvrtc(_)), "{e}"),
        }
        std::fs::remove_dir_all(cache.dir()).unwrap();
    }

    #[test]
    fn this_build_embeds_only_current_sources() {
        // Whatever K3_KERNEL_ARCHS this crate was built with, every entry must match today's
        // sources: a stale cubin is dead weight the lookup would never pick.
        let options = k3_kernels::key::nvrtc_options();
        for e in embedded() {
            let f = k3_kernels::FILES.iter().find(|f| f.name == e.file).unwrap();
            let source = expand(f.name, f.text).unwrap();
            assert!(embed::find(embedded(), e.file, e.arch, &source, &options).is_some());
        }
    }
}
