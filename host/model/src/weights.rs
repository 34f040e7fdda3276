//! Memory-mapped safetensors access with checked names, shapes and dtypes.

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error("cannot open {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a valid safetensors file: {msg}")]
    Format { path: String, msg: String },
    #[error("tensor `{0}` is missing from the checkpoint")]
    Missing(String),
    #[error("tensor `{name}` has shape {got:?}, expected {want:?}")]
    Shape {
        name: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    #[error("tensor `{name}` has dtype {got}, expected {want}")]
    Dtype {
        name: String,
        got: String,
        want: String,
    },
    /// The backend could not take a weight (device memory, a failed copy).
    #[error("uploading weights: {0}")]
    Upload(#[from] crate::error::BackendError),
}

/// A memory-mapped safetensors file.
pub struct WeightFile {
    mmap: Mmap,
}

impl WeightFile {
    pub fn open(path: &Path) -> Result<Self, WeightError> {
        let p = path.display().to_string();
        let file = std::fs::File::open(path).map_err(|source| WeightError::Io {
            path: p.clone(),
            source,
        })?;
        // SAFETY: the file is opened read-only; we never write through the map. Concurrent
        // truncation by another process would be a bug outside this program's control.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|source| WeightError::Io {
            path: p.clone(),
            source,
        })?;
        SafeTensors::deserialize(&mmap).map_err(|e| WeightError::Format {
            path: p.clone(),
            msg: e.to_string(),
        })?;
        Ok(Self { mmap })
    }

    pub fn tensors(&self) -> Tensors<'_> {
        // Validated in `open`.
        Tensors {
            src: Source::File(SafeTensors::deserialize(&self.mmap).expect("validated at open")),
        }
    }
}

/// Named tensors: a safetensors file, or seeded random weights (`--load-format dummy`).
pub struct Tensors<'a> {
    src: Source<'a>,
}

enum Source<'a> {
    File(SafeTensors<'a>),
    Dummy(u64),
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}").to_lowercase()
}

impl Tensors<'static> {
    /// Seeded random weights of whatever shape the loader asks for: benchmarking K3's real
    /// per-layer shapes (`models/k3-slice`) without a checkpoint. Deterministic per (seed, name).
    pub fn dummy(seed: u64) -> Self {
        Tensors {
            src: Source::Dummy(seed),
        }
    }
}

impl<'a> Tensors<'a> {
    fn st(&self, name: &str) -> Result<&SafeTensors<'a>, WeightError> {
        match &self.src {
            Source::File(st) => Ok(st),
            Source::Dummy(_) => Err(WeightError::Missing(format!("{name} (dummy weights)"))),
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        match &self.src {
            Source::File(st) => st.tensor(name).is_ok(),
            Source::Dummy(_) => true,
        }
    }

    /// Tensor names of a file (none for dummy weights).
    pub fn names(&self) -> Vec<String> {
        match &self.src {
            Source::File(st) => st.names().into_iter().map(str::to_string).collect(),
            Source::Dummy(_) => Vec::new(),
        }
    }

    fn raw(
        &self,
        name: &str,
        shape: &[usize],
        dtypes: &[Dtype],
    ) -> Result<(Dtype, &'a [u8]), WeightError> {
        let t = self
            .st(name)?
            .tensor(name)
            .map_err(|_| WeightError::Missing(name.to_string()))?;
        if !dtypes.contains(&t.dtype()) {
            let want = dtypes
                .iter()
                .map(|d| dtype_name(*d))
                .collect::<Vec<_>>()
                .join(" or ");
            return Err(WeightError::Dtype {
                name: name.to_string(),
                got: dtype_name(t.dtype()),
                want,
            });
        }
        if t.shape() != shape {
            return Err(WeightError::Shape {
                name: name.to_string(),
                got: t.shape().to_vec(),
                want: shape.to_vec(),
            });
        }
        Ok((t.dtype(), t.data()))
    }

    /// A float tensor (bf16, f16 or f32 on disk) converted to f32.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, WeightError> {
        if let Source::Dummy(seed) = self.src {
            return Ok(crate::dummy::floats(seed, name, shape));
        }
        let (dt, data) = self.raw(name, shape, &[Dtype::BF16, Dtype::F32, Dtype::F16])?;
        Ok(match dt {
            Dtype::BF16 => data
                .chunks_exact(2)
                .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
                .collect(),
            Dtype::F16 => data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            _ => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        })
    }

    /// A u8 tensor (MXFP4 codes or E8M0 scales).
    pub fn u8(&self, name: &str, shape: &[usize]) -> Result<Vec<u8>, WeightError> {
        if let Source::Dummy(seed) = self.src {
            return Ok(crate::dummy::bytes(seed, name, shape));
        }
        Ok(self.raw(name, shape, &[Dtype::U8])?.1.to_vec())
    }

    /// An integer tensor (i64 or i32 on disk), e.g. golden token ids.
    pub fn ints(&self, name: &str) -> Result<Vec<i64>, WeightError> {
        let t = self
            .st(name)?
            .tensor(name)
            .map_err(|_| WeightError::Missing(name.to_string()))?;
        let data = t.data();
        match t.dtype() {
            Dtype::I64 => Ok(data
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                .collect()),
            Dtype::I32 => Ok(data
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as i64)
                .collect()),
            d => Err(WeightError::Dtype {
                name: name.to_string(),
                got: dtype_name(d),
                want: "i64 or i32".into(),
            }),
        }
    }

    /// Any float tensor with its shape (tests / golden files).
    pub fn any_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), WeightError> {
        let t = self
            .st(name)?
            .tensor(name)
            .map_err(|_| WeightError::Missing(name.to_string()))?;
        let shape = t.shape().to_vec();
        Ok((shape.clone(), self.f32(name, &shape)?))
    }
}
