//! Cubins compiled ahead of time and built into the binary: `k3-backend-cuda`'s build script
//! calls [`write_table`] when `K3_KERNEL_ARCHS` names targets (e.g. `sm_90a`), and the backend
//! looks its kernels up with [`find`] before it reaches for the disk cache or NVRTC. A fresh
//! machine then starts without compiling anything, and needs no libnvrtc at all.

use crate::error::{KernelError, Result};
use crate::key::cache_key;
use crate::nvrtc::{CompileJob, Nvrtc};
use crate::sources::{KernelFile, expand};
use std::fmt::Write as _;
use std::path::Path;

/// One file's cubin for one target, as compiled at build time.
#[derive(Debug, Clone, Copy)]
pub struct EmbeddedCubin {
    pub file: &'static str,
    pub arch: &'static str,
    /// [`cache_key`] of the source it was compiled from, so a stale table is never used.
    pub key: &'static str,
    /// The NVRTC that compiled it (part of the key).
    pub nvrtc_version: (i32, i32),
    pub cubin: &'static [u8],
}

/// The cubin of `file` for `arch` in `table`, when it was compiled from exactly `source` with
/// `options` (its key says so); else None, and the caller compiles.
pub fn find<'a>(
    table: &'a [EmbeddedCubin],
    file: &str,
    arch: &str,
    source: &str,
    options: &[String],
) -> Option<&'a EmbeddedCubin> {
    table.iter().find(|e| {
        e.file == file
            && e.arch == arch
            && e.key == cache_key(source, arch, options, e.nvrtc_version)
    })
}

/// `K3_KERNEL_ARCHS` split into targets: `sm_90a,sm_89` or `sm_90a sm_89`; empty → none.
pub fn parse_archs(value: &str) -> Result<Vec<String>> {
    let archs: Vec<String> = value
        .split([',', ' ', ';'])
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(str::to_string)
        .collect();
    for a in &archs {
        let digits = a.strip_prefix("sm_").map(|r| r.trim_end_matches('a'));
        if !digits.is_some_and(|d| !d.is_empty() && d.chars().all(|c| c.is_ascii_digit())) {
            return Err(KernelError::Source {
                file: "K3_KERNEL_ARCHS".into(),
                message: format!("{a:?} is not a target such as sm_90a or sm_89"),
            });
        }
    }
    Ok(archs)
}

/// Compile every file of `files` for every target of `archs` (in parallel), write the cubins
/// into `out_dir`, and return Rust source for a `&[EmbeddedCubin]` expression that includes
/// them. No targets: an empty table, without loading NVRTC.
pub fn write_table(
    out_dir: &Path,
    archs: &[String],
    files: &[KernelFile],
    options: &[String],
    nvrtc: Option<&Nvrtc>,
    threads: usize,
) -> Result<String> {
    if archs.is_empty() {
        return Ok("&[]".into());
    }
    let nvrtc = nvrtc.ok_or_else(|| {
        KernelError::NoNvrtc("kernel targets were asked for but NVRTC is not loaded".into())
    })?;
    let version = nvrtc.version()?;
    let mut jobs = Vec::new();
    for arch in archs {
        for f in files {
            jobs.push(CompileJob {
                file: f.name.into(),
                source: expand(f.name, f.text)?,
                arch: arch.clone(),
            });
        }
    }
    let mut table = String::from("&[\n");
    for (job, cubin) in jobs.iter().zip(nvrtc.compile_all(&jobs, options, threads)) {
        let cubin = cubin?;
        let name = format!("{}-{}.cubin", job.file.trim_end_matches(".cu"), job.arch);
        let path = out_dir.join(&name);
        std::fs::write(&path, &cubin).map_err(|source| KernelError::Io {
            path: path.clone(),
            source,
        })?;
        let key = cache_key(&job.source, &job.arch, options, version);
        let _ = writeln!(
            table,
            "    k3_kernels::EmbeddedCubin {{ file: {:?}, arch: {:?}, key: {key:?}, \
             nvrtc_version: ({}, {}), cubin: include_bytes!({:?}) }},",
            job.file,
            job.arch,
            version.0,
            version.1,
            path.display().to_string(),
        );
    }
    table.push(']');
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::nvrtc_options;
    use crate::sources::FILES;

    fn entry(key: &'static str) -> EmbeddedCubin {
        EmbeddedCubin {
            file: "a.cu",
            arch: "sm_90a",
            key,
            nvrtc_version: (13, 0),
            cubin: b"\x7fELF",
        }
    }

    #[test]
    fn a_cubin_is_found_only_for_its_own_source_target_and_options() {
        let opts = nvrtc_options();
        let key: &'static str =
            Box::leak(cache_key("int x;", "sm_90a", &opts, (13, 0)).into_boxed_str());
        let table = [entry(key)];
        assert!(find(&table, "a.cu", "sm_90a", "int x;", &opts).is_some());
        assert!(
            find(&table, "a.cu", "sm_90a", "int y;", &opts).is_none(),
            "stale"
        );
        assert!(find(&table, "a.cu", "sm_89", "int x;", &opts).is_none());
        assert!(find(&table, "b.cu", "sm_90a", "int x;", &opts).is_none());
        assert!(find(&table, "a.cu", "sm_90a", "int x;", &[]).is_none());
    }

    #[test]
    fn targets_parse_and_bad_ones_are_refused() {
        assert_eq!(parse_archs("").unwrap(), Vec::<String>::new());
        assert_eq!(
            parse_archs("sm_90a, sm_89").unwrap(),
            vec!["sm_90a".to_string(), "sm_89".to_string()]
        );
        assert!(parse_archs("compute_90").is_err());
        assert!(parse_archs("sm_").is_err());
        assert!(parse_archs("sm_9x").is_err());
    }

    #[test]
    fn no_targets_make_an_empty_table_without_nvrtc() {
        let dir = std::env::temp_dir();
        assert_eq!(
            write_table(&dir, &[], FILES, &nvrtc_options(), None, 1).unwrap(),
            "&[]"
        );
        assert!(write_table(&dir, &["sm_90a".into()], FILES, &nvrtc_options(), None, 1).is_err());
    }

    /// The build-time path for real, on two small files: needs libnvrtc (no GPU). It skips only
    /// when `K3_NVRTC_LIB` is unset; `scripts/test` sets it, so in CI it cannot skip.
    #[test]
    fn nvrtc_compiles_a_table_that_find_accepts() {
        let nvrtc = match Nvrtc::load() {
            Ok(n) => n,
            Err(e) if std::env::var_os("K3_NVRTC_LIB").is_none() => {
                eprintln!("skipped: {e}");
                return;
            }
            Err(e) => panic!("K3_NVRTC_LIB is set but {e}"),
        };
        let files: Vec<KernelFile> = FILES
            .iter()
            .filter(|f| f.name == "elementwise.cu" || f.name == "attnres.cu")
            .copied()
            .collect();
        assert_eq!(files.len(), 2);
        let dir = std::env::temp_dir().join(format!("k3-embed-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let opts = nvrtc_options();
        let table = write_table(&dir, &["sm_90a".into()], &files, &opts, Some(&nvrtc), 2).unwrap();
        let version = nvrtc.version().unwrap();
        for f in &files {
            let cubin =
                std::fs::read(dir.join(format!("{}-sm_90a.cubin", f.name.trim_end_matches(".cu"))))
                    .unwrap();
            assert_eq!(&cubin[..4], b"\x7fELF", "{}", f.name);
            let key = cache_key(&expand(f.name, f.text).unwrap(), "sm_90a", &opts, version);
            assert!(table.contains(&key), "{} keyed as at run time", f.name);
        }
        // A source error is reported with its file and NVRTC's log, not a panic.
        let bad = CompileJob {
            file: "bad.cu".into(),
            source: "extern \"C\" __global__ void k() { undefined_name; }".into(),
            arch: "sm_90a".into(),
        };
        let err = nvrtc.compile_all(&[bad], &opts, 1).remove(0).unwrap_err();
        assert!(err.to_string().contains("bad.cu") && err.to_string().contains("undefined_name"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
