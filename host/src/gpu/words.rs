//! The kernel tables travel as `u64` words: the ABI types are defined in the kernel crate, so
//! this crate cannot implement cudarc's `DeviceRepr` for them (orphan rule); viewing them as
//! words is sound because of the invariants of [`TableWords`].

use gradclip_kernels::abi::{ChunkTask, NormOutput, Partial, TallyTensor, TensorDesc, UpdateCount, UpdateGroup, UpdateTensorDesc};

/// # Safety
/// `Self` is `#[repr(C)]`, free of padding, of a size that is a multiple of 8 and an alignment of
/// exactly 8, and every bit pattern is a valid value (the kernel crate asserts the sizes).
pub(crate) unsafe trait TableWords: Copy {}
// SAFETY: see the compile-time size checks in gradclip_kernels::abi; all fields are integers/floats.
unsafe impl TableWords for TensorDesc {}
// SAFETY: as above.
unsafe impl TableWords for ChunkTask {}
// SAFETY: as above.
unsafe impl TableWords for Partial {}
// SAFETY: as above.
unsafe impl TableWords for NormOutput {}
// SAFETY: as above.
unsafe impl TableWords for UpdateTensorDesc {}
// SAFETY: as above.
unsafe impl TableWords for UpdateCount {}
// SAFETY: as above.
unsafe impl TableWords for UpdateGroup {}
// SAFETY: as above.
unsafe impl TableWords for TallyTensor {}

pub(crate) fn as_words<T: TableWords>(items: &[T]) -> &[u64] {
    const { assert!(size_of::<T>().is_multiple_of(8) && align_of::<T>() == 8) };
    let n = size_of_val(items) / 8;
    // SAFETY: TableWords guarantees the layout; T's alignment is 8, the same as u64's, and the
    // length covers exactly the same bytes.
    unsafe { core::slice::from_raw_parts(items.as_ptr() as *const u64, n) }
}

pub(crate) fn from_words<T: TableWords + Default>(words: &[u64]) -> T {
    let mut out = T::default();
    let n = size_of::<T>() / 8;
    assert!(words.len() >= n, "too few words for the type");
    // SAFETY: TableWords: any bit pattern is valid; exactly size_of::<T>() bytes are copied.
    unsafe { core::ptr::copy_nonoverlapping(words.as_ptr(), &mut out as *mut T as *mut u64, n) };
    out
}
