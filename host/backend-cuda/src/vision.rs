//! The vision tower's ops (kernels/vision.cu, docs/vision.md): bias add, tanh-GELU, the 2-D
//! RoPE attention over one image's patches and the patch merge. The tower's matmuls and norms
//! are the dense ones.

use crate::device::{CudaBackend, DeviceMat};
use crate::error::{CudaError, Result};
use crate::geometry::{self, Launch};
use crate::launch::i32_of;
use cudarc::driver::CudaSlice;
use k3_model::backend::{VisionAttnGeom, merge_patches_shape};

/// kernels/vision.cu: the widest head `vision_attention_f32` holds in registers, and its warps
/// (queries) per block.
pub const VISION_MAX_HEAD_DIM: usize = 256;
const VISION_WARPS: usize = 4;

/// A shape check of k3-model's as this crate's error.
fn invalid(e: k3_model::BackendError) -> CudaError {
    CudaError::InvalidArg(e.to_string())
}

impl CudaBackend {
    pub(crate) fn upload_act(&self, rows: usize, cols: usize, data: &[f32]) -> Result<DeviceMat> {
        if data.len() != rows * cols {
            return Err(CudaError::InvalidArg(format!(
                "{} values for a {rows}x{cols} activation",
                data.len()
            )));
        }
        Ok(DeviceMat::new(rows, cols, self.upload_slice(data)?))
    }

    pub(crate) fn add_bias(&self, x: &mut DeviceMat, b: &CudaSlice<f32>) -> Result<()> {
        let x = x.written();
        if b.len() != x.cols {
            return Err(CudaError::InvalidArg(format!(
                "add_bias: bias {} for width {}",
                b.len(),
                x.cols
            )));
        }
        let n = (x.rows * x.cols) as i64;
        if n == 0 {
            return Ok(());
        }
        let cols = i32_of(x.cols, "cols")?;
        launch!(self, "add_bias_f32", geometry::elementwise(n as usize)?; &mut x.buf, b, &n, &cols)
    }

    pub(crate) fn gelu_tanh(&self, x: &mut DeviceMat) -> Result<()> {
        let x = x.written();
        let n = (x.rows * x.cols) as i64;
        if n == 0 {
            return Ok(());
        }
        launch!(self, "gelu_tanh_f32", geometry::elementwise(n as usize)?; &mut x.buf, &n)
    }

    pub(crate) fn vision_attention(&self, qkv: &DeviceMat, g: VisionAttnGeom) -> Result<DeviceMat> {
        g.check(qkv.rows, qkv.cols).map_err(invalid)?;
        if g.head_dim > VISION_MAX_HEAD_DIM {
            return Err(CudaError::Unsupported(format!(
                "vision attention head_dim {} (<= {VISION_MAX_HEAD_DIM})",
                g.head_dim
            )));
        }
        let n = qkv.rows;
        // Rotated q and k, head-major; every element is written by the RoPE kernel.
        let qk = self.uninit::<f32>(2 * n * g.heads * g.head_dim)?;
        let out = self.output(n, g.heads * g.head_dim)?;
        let (ni, hi, hd, gw) = (
            i32_of(n, "patches")?,
            i32_of(g.heads, "heads")?,
            i32_of(g.head_dim, "head_dim")?,
            i32_of(g.grid_w, "grid_w")?,
        );
        launch!(self, "vision_rope_f32", geometry::elementwise(qk.len())?;
            &qkv.buf, &qk, &ni, &hi, &hd, &gw, &g.rope_theta)?;
        let l = Launch::new(
            (n.div_ceil(VISION_WARPS), g.heads, 1),
            (VISION_WARPS * 32) as u32,
        )?;
        launch!(self, "vision_attention_f32", l; &qk, &qkv.buf, &out.buf, &ni, &hi, &hd)?;
        Ok(out)
    }

    pub(crate) fn merge_patches(
        &self,
        x: &DeviceMat,
        grid_h: usize,
        grid_w: usize,
        merge: usize,
    ) -> Result<DeviceMat> {
        let (rows, cols) =
            merge_patches_shape(x.rows, x.cols, grid_h, grid_w, merge).map_err(invalid)?;
        let y = self.output(rows, cols)?;
        if rows * cols == 0 {
            return Ok(y);
        }
        let (gh, gw, c, m) = (
            i32_of(grid_h, "grid_h")?,
            i32_of(grid_w, "grid_w")?,
            i32_of(x.cols, "cols")?,
            i32_of(merge, "merge")?,
        );
        launch!(self, "merge_patches_f32", geometry::elementwise(rows * cols)?;
            &x.buf, &y.buf, &gh, &gw, &c, &m)?;
        Ok(y)
    }
}
