//! NVRTC, loaded at run time (so nothing links against CUDA), and compilation of many files at
//! once: NVRTC takes seconds per file (kda_chunk.cu ~10 s on one core), and the files are
//! independent, so they compile on as many threads as there are cores.

use crate::error::{KernelError, Result};
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

type Program = *mut c_void;
type Status = c_int;

/// The NVRTC entry points this crate calls (the C API of `nvrtc.h`).
struct Api {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status,
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Status,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    log: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    cubin_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    cubin: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    destroy: unsafe extern "C" fn(*mut Program) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
}

/// A loaded libnvrtc. The function pointers stay valid while the libraries are held here.
pub struct Nvrtc {
    api: Api,
    path: String,
    _lib: libloading::Library,
    _builtins: Option<libloading::Library>,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc").field("path", &self.path).finish()
    }
}

/// One file to compile for one target.
#[derive(Debug, Clone)]
pub struct CompileJob {
    /// The file's name, for errors and NVRTC's messages (`mla.cu`).
    pub file: String,
    /// The expanded, self-contained source (`sources::expand`).
    pub source: String,
    /// The NVRTC target, e.g. `sm_90a`.
    pub arch: String,
}

/// Names tried, in order, when `K3_NVRTC_LIB` is unset: the dynamic loader's own search
/// (`LD_LIBRARY_PATH`, the system's library directories).
const LIBRARY_NAMES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

impl Nvrtc {
    /// `$K3_NVRTC_LIB` (the library file, or a directory holding it) when set, else the first
    /// of `libnvrtc.so.13`, `.12` or `libnvrtc.so` that the dynamic loader finds.
    pub fn load() -> Result<Self> {
        match std::env::var_os("K3_NVRTC_LIB") {
            Some(p) if !p.is_empty() => Self::load_path(Path::new(&p)),
            _ => {
                let mut errors = Vec::new();
                for name in LIBRARY_NAMES {
                    // SAFETY: loading libnvrtc runs only its initialisers, which have no
                    // preconditions.
                    match unsafe { libloading::Library::new(name) } {
                        Ok(lib) => return Self::from_library(lib, None, name.to_string()),
                        Err(e) => errors.push(format!("{name}: {e}")),
                    }
                }
                Err(KernelError::NoNvrtc(format!(
                    "{} (set K3_NVRTC_LIB to libnvrtc's path or add its directory to \
                     LD_LIBRARY_PATH)",
                    errors.join("; ")
                )))
            }
        }
    }

    /// The library at `path` (a file, or a directory holding `libnvrtc.so*`). Its builtins
    /// library, which libnvrtc opens by name, is loaded from the same directory first so that
    /// no `LD_LIBRARY_PATH` is needed (as pip's `nvidia-cuda-nvrtc` wheel installs it).
    pub fn load_path(path: &Path) -> Result<Self> {
        let file = if path.is_dir() {
            find_in(path, "libnvrtc.so").ok_or_else(|| {
                KernelError::NoNvrtc(format!("no libnvrtc.so* in {}", path.display()))
            })?
        } else {
            path.to_path_buf()
        };
        let dir = file.parent().unwrap_or(Path::new("."));
        let builtins = match find_in(dir, "libnvrtc-builtins.so") {
            // SAFETY: as in `load`; global so that libnvrtc's own dlopen finds it.
            Some(b) => Some(unsafe { load_global(&b) }?),
            None => None,
        };
        // SAFETY: as in `load`.
        let lib = unsafe { libloading::Library::new(&file) }
            .map_err(|e| KernelError::NoNvrtc(format!("{}: {e}", file.display())))?;
        Self::from_library(lib, builtins, file.display().to_string())
    }

    fn from_library(
        lib: libloading::Library,
        builtins: Option<libloading::Library>,
        path: String,
    ) -> Result<Self> {
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol's type is the one `nvrtc.h` declares for it.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| KernelError::NoNvrtc(format!("{path}: {}: {e}", $name)))?
            };
        }
        let api = Api {
            version: sym!("nvrtcVersion"),
            create: sym!("nvrtcCreateProgram"),
            compile: sym!("nvrtcCompileProgram"),
            log_size: sym!("nvrtcGetProgramLogSize"),
            log: sym!("nvrtcGetProgramLog"),
            cubin_size: sym!("nvrtcGetCUBINSize"),
            cubin: sym!("nvrtcGetCUBIN"),
            destroy: sym!("nvrtcDestroyProgram"),
            error_string: sym!("nvrtcGetErrorString"),
        };
        Ok(Self {
            api,
            path,
            _lib: lib,
            _builtins: builtins,
        })
    }

    /// Where the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// NVRTC's (major, minor) version: part of a cubin's cache key.
    pub fn version(&self) -> Result<(i32, i32)> {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two out-pointers to live locals.
        let rc = unsafe { (self.api.version)(&mut major, &mut minor) };
        self.check(rc, "nvrtcVersion", "")?;
        Ok((major, minor))
    }

    fn check(&self, rc: Status, what: &str, file: &str) -> Result<()> {
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: NVRTC returns a static string for any status.
        let text = unsafe { CStr::from_ptr((self.api.error_string)(rc)) };
        Err(KernelError::Compile {
            file: file.into(),
            message: format!("{what}: {}", text.to_string_lossy()),
            log: String::new(),
        })
    }

    /// NVRTC → CUBIN for `job.arch` (machine code: no driver JIT at load, and no PTX-version
    /// mismatch between a newer NVRTC and an older driver).
    pub fn compile_cubin(&self, job: &CompileJob, options: &[String]) -> Result<Vec<u8>> {
        let fail = |message: String, log: String| KernelError::Compile {
            file: job.file.clone(),
            message,
            log,
        };
        let src = CString::new(job.source.as_str())
            .map_err(|e| fail(format!("NUL in source: {e}"), String::new()))?;
        let name = CString::new(job.file.as_str())
            .map_err(|e| fail(format!("NUL in name: {e}"), String::new()))?;
        let mut opts: Vec<CString> = Vec::with_capacity(options.len() + 1);
        for o in options
            .iter()
            .cloned()
            .chain([format!("--gpu-architecture={}", job.arch)])
        {
            opts.push(CString::new(o).map_err(|e| fail(format!("NUL in option: {e}"), "".into()))?);
        }
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: `src` and `name` outlive the call; no headers are passed.
        let rc = unsafe {
            (self.api.create)(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        self.check(rc, "nvrtcCreateProgram", &job.file)?;
        // SAFETY: `prog` is live until the destroy below; every buffer is sized by NVRTC first.
        let out = unsafe {
            let compiled = (self.api.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr());
            let log = self.program_log(prog);
            if compiled != 0 {
                let text = CStr::from_ptr((self.api.error_string)(compiled));
                Err(fail(text.to_string_lossy().into_owned(), log))
            } else {
                let mut size = 0usize;
                let rc = (self.api.cubin_size)(prog, &mut size);
                self.check(rc, "nvrtcGetCUBINSize", &job.file)?;
                let mut bin = vec![0u8; size];
                let rc = (self.api.cubin)(prog, bin.as_mut_ptr().cast());
                self.check(rc, "nvrtcGetCUBIN", &job.file)?;
                Ok(bin)
            }
        };
        // SAFETY: destroyed exactly once.
        unsafe { (self.api.destroy)(&mut prog) };
        out.and_then(|b| {
            if b.is_empty() {
                Err(fail("empty cubin".into(), String::new()))
            } else {
                Ok(b)
            }
        })
    }

    /// The program's compile log ("" when there is none).
    ///
    /// # Safety
    /// `prog` must be a live program of this library.
    unsafe fn program_log(&self, prog: Program) -> String {
        let mut size = 0usize;
        // SAFETY: the caller's contract; the buffer is the size NVRTC asked for.
        unsafe {
            if (self.api.log_size)(prog, &mut size) != 0 || size <= 1 {
                return String::new();
            }
            let mut buf = vec![0u8; size];
            if (self.api.log)(prog, buf.as_mut_ptr().cast()) != 0 {
                return String::new();
            }
            CStr::from_bytes_until_nul(&buf)
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_default()
        }
    }

    /// Compile every job on up to `threads` threads (largest sources first, so the longest
    /// compile starts at once). Results come back in the jobs' order.
    pub fn compile_all(
        &self,
        jobs: &[CompileJob],
        options: &[String],
        threads: usize,
    ) -> Vec<Result<Vec<u8>>> {
        let mut order: Vec<usize> = (0..jobs.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(jobs[i].source.len()));
        let next = AtomicUsize::new(0);
        let threads = threads.clamp(1, jobs.len().max(1));
        // Each thread returns what it compiled; a thread that panicked leaves its jobs unfilled.
        let done: Vec<(usize, Result<Vec<u8>>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut mine = Vec::new();
                        while let Some(&i) = order.get(next.fetch_add(1, Ordering::Relaxed)) {
                            mine.push((i, self.compile_cubin(&jobs[i], options)));
                        }
                        mine
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        });
        let mut results: Vec<Option<Result<Vec<u8>>>> = jobs.iter().map(|_| None).collect();
        for (i, r) in done {
            results[i] = Some(r);
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(KernelError::Compile {
                        file: String::new(),
                        message: "a compile thread stopped early".into(),
                        log: String::new(),
                    })
                })
            })
            .collect()
    }
}

/// The cores to compile on: all of them.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The lexically first file in `dir` whose name starts with `prefix` (`libnvrtc.so.13` before
/// `libnvrtc.so.13.0.88`, which name the same library).
fn find_in(dir: &Path, prefix: &str) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix) && !n.contains(".alt."))
        })
        .collect();
    found.sort();
    found.into_iter().next()
}

/// dlopen with RTLD_GLOBAL, so later dlopens by name resolve to this library.
///
/// # Safety
/// As for `libloading::Library::new`: the library's initialisers run.
unsafe fn load_global(path: &Path) -> Result<libloading::Library> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: the caller's contract.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .map(libloading::Library::from)
        .map_err(|e| KernelError::NoNvrtc(format!("{}: {e}", path.display())))
}
