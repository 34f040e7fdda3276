//! Launching kernels: the `launch!` macro (logged inside a replayable step, graph.rs) and the
//! argument checks every op module shares. Arena offsets are bytes at the `Backend` API (like
//! `k3_model::backend`) and f32 offsets inside the kernels.

use crate::device::DeviceMat;
use crate::error::{CudaError, Result};
use k3_model::backend::SituParams;

/// Push every argument (references that outlive the builder), then launch on the backend's
/// stream, or with `on STREAM,` first on that one (a side stream, lanes.rs). Inside a replayable
/// step (graph.rs) the launch is logged first, and a dry pass stops there.
macro_rules! launch {
    ($be:expr, $name:expr, $l:expr; $($arg:expr),* $(,)?) => {
        launch!(on &$be.stream, $be, $name, $l; $($arg),*)
    };
    (on $stream:expr, $be:expr, $name:expr, $l:expr; $($arg:expr),* $(,)?) => {{
        use cudarc::driver::PushKernelArg as _;
        let l: $crate::geometry::Launch = $l;
        if $be.step.recording() {
            let words = [$( $crate::step::StepArg::step_word(&$arg, &$be.step, &$be.stream) ),*];
            $be.step.log_launch($name, &l, &words);
        }
        if $be.step.dry() {
            Ok(())
        } else {
            let f = $be.function($name)?;
            let stream: &cudarc::driver::CudaStream = $stream;
            let mut b: cudarc::driver::LaunchArgs<'_> = stream.launch_builder(f);
            $( b.arg($arg); )*
            // SAFETY: argument count and types follow the kernel's C signature (checked against
            // the parsed signatures by the device harness), every buffer is live for the launch.
            unsafe { b.launch(l.config()) }.map(|_| ()).map_err($crate::error::CudaError::from)
        }
    }};
}

pub(crate) fn same_shape(a: &DeviceMat, b: &DeviceMat, what: &str) -> Result<()> {
    if (a.rows, a.cols) != (b.rows, b.cols) {
        return Err(CudaError::InvalidArg(format!(
            "{what}: {}x{} vs {}x{}",
            a.rows, a.cols, b.rows, b.cols
        )));
    }
    Ok(())
}

/// SiTU's optional linear branch as kernel arguments: (beta_lin, has_lin), 1.0 / 0 when absent.
pub(crate) fn situ_linear_args(situ: SituParams) -> (f32, i32) {
    (
        situ.linear_beta.unwrap_or(1.0),
        i32::from(situ.linear_beta.is_some()),
    )
}

pub(crate) fn i32_of(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::InvalidArg(format!("{what} = {v} exceeds i32")))
}

/// Byte offset → f32 offset (4-aligned), bounds-checked against the arena.
pub fn float_offset(byte_offset: usize, len_floats: usize, arena_floats: usize) -> Result<i64> {
    if !byte_offset.is_multiple_of(4) {
        return Err(CudaError::InvalidArg(format!(
            "arena offset {byte_offset} is not 4-byte aligned"
        )));
    }
    let f = byte_offset / 4;
    if f + len_floats > arena_floats {
        return Err(CudaError::InvalidArg(format!(
            "arena range {}..{} beyond {} bytes",
            byte_offset,
            byte_offset + 4 * len_floats,
            4 * arena_floats
        )));
    }
    Ok(f as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_offsets_are_aligned_and_bounded() {
        assert_eq!(float_offset(16, 4, 8).unwrap(), 4);
        assert!(float_offset(18, 1, 100).is_err(), "unaligned");
        assert!(float_offset(16, 5, 8).is_err(), "past the end");
        assert!(float_offset(0, 8, 8).is_ok());
    }
}
