//! cudarc's typed device buffers as gradients: `CudaSlice<T>`, `CudaView<T>` and, for clipping,
//! `CudaViewMut<T>`, for `T` in `half::bf16`, `half::f16`, `f32`, `f64`.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use crate::dtype::GradElement;
use crate::plan::RawTensor;

/// A device buffer a norm can read.
pub trait DeviceGrad {
    /// The context the buffer lives in.
    fn context(&self) -> &Arc<CudaContext>;
    /// Its address, length and type, plus cudarc's guard that orders the read after the
    /// buffer's last write and records the read when dropped (after the launch).
    fn as_raw<'a>(&'a self, stream: &'a CudaStream) -> (RawTensor, SyncOnDrop<'a>);
}

/// A device buffer a clip can rewrite.
pub trait DeviceGradMut {
    /// The context the buffer lives in.
    fn context(&self) -> &Arc<CudaContext>;
    /// As [`DeviceGrad::as_raw`], for a write.
    fn as_raw_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (RawTensor, SyncOnDrop<'a>);
}

macro_rules! impl_read {
    ($ty:ty) => {
        impl<T: GradElement> DeviceGrad for $ty {
            fn context(&self) -> &Arc<CudaContext> {
                DeviceSlice::stream(self).context()
            }
            fn as_raw<'a>(&'a self, stream: &'a CudaStream) -> (RawTensor, SyncOnDrop<'a>) {
                let (ptr, guard) = self.device_ptr(stream);
                (RawTensor::of::<T>(ptr, DeviceSlice::len(self)), guard)
            }
        }
    };
}

macro_rules! impl_write {
    ($ty:ty) => {
        impl<T: GradElement> DeviceGradMut for $ty {
            fn context(&self) -> &Arc<CudaContext> {
                DeviceSlice::stream(self).context()
            }
            fn as_raw_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (RawTensor, SyncOnDrop<'a>) {
                let len = DeviceSlice::len(self);
                let (ptr, guard) = self.device_ptr_mut(stream);
                (RawTensor::of::<T>(ptr, len), guard)
            }
        }
    };
}

impl_read!(CudaSlice<T>);
impl_read!(CudaView<'_, T>);
impl_write!(CudaSlice<T>);
impl_write!(CudaViewMut<'_, T>);
