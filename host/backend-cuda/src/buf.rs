//! Device buffers of activations and scratch: an owned `CudaSlice`, or, inside a graph's dry pass
//! (graph.rs), an alias of one small preallocated buffer that is never freed. A dry pass runs the
//! model's host code and queues no device work, so its ops need buffers of the right type and
//! length, not memory; an allocation and a free through the driver for each of them was most of
//! the pass's host time, with the GPU idle (docs/performance.md, "Host time per decode step"). Buffers kept beyond an op (workspaces,
//! step uploads, a weight's f32 copy) stay plain `CudaSlice`s of real memory
//! (`CudaBackend::alloc_kept`), so an alias cannot outlive its pass. A `Buf` needs a CUDA stream,
//! so its tests are the device tests: every decode step's dry pass and graph replay against eager
//! launches, bit for bit (tests/device/model.rs).

use cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs, PushKernelArg,
    SyncOnDrop, sys,
};
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// A device buffer of `T`s (see the module doc). Derefs to its `CudaSlice`.
pub struct Buf<T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    /// An alias of the dry-pass buffer: dropped without a free.
    alias: bool,
}

impl<T> Buf<T> {
    /// A buffer that owns its memory (freed on drop).
    pub fn owned(slice: CudaSlice<T>) -> Self {
        Buf {
            slice: ManuallyDrop::new(slice),
            alias: false,
        }
    }

    /// `len` elements "at" `ptr`, owning nothing: in a dry pass, where no device work reads or
    /// writes them, or as a step upload's view of the staging mirror (graph.rs).
    ///
    /// # Safety
    /// `ptr` must stay a live device allocation for as long as the result exists and any device
    /// work queued on it runs, and work queued on it must not overlap other live views.
    pub(crate) unsafe fn alias(
        stream: &Arc<CudaStream>,
        ptr: sys::CUdeviceptr,
        len: usize,
    ) -> Self {
        // SAFETY: the caller's contract; with event tracking off (device.rs) this is a plain
        // struct, no driver call.
        let slice = unsafe { stream.upgrade_device_ptr::<T>(ptr, len) };
        Buf {
            slice: ManuallyDrop::new(slice),
            alias: true,
        }
    }
}

impl<T> Drop for Buf<T> {
    fn drop(&mut self) {
        // SAFETY: `slice` is taken exactly once, here.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        if self.alias {
            // Releases the stream handle without freeing the memory it does not own.
            let _ = slice.leak();
        }
    }
}

impl<T> std::ops::Deref for Buf<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> std::ops::DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T> From<CudaSlice<T>> for Buf<T> {
    fn from(slice: CudaSlice<T>) -> Self {
        Buf::owned(slice)
    }
}

impl<T> DeviceSlice<T> for Buf<T> {
    fn len(&self) -> usize {
        self.slice.len()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        DeviceSlice::stream(&*self.slice)
    }
}

impl<T> DevicePtr<T> for Buf<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.slice.device_ptr(stream)
    }
}

impl<T> DevicePtrMut<T> for Buf<T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.slice.device_ptr_mut(stream)
    }
}

// SAFETY: forwards to the `CudaSlice` implementations (the pointer of the slice this derefs to).
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b Buf<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b Buf<T>) -> &mut Self {
        self.arg(&*arg.slice)
    }
}

// SAFETY: as above.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut Buf<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut Buf<T>) -> &mut Self {
        self.arg(&mut *arg.slice)
    }
}
