//! Test support: checks that a CPU fast path returns the model's partial for every chunk of a
//! host slice, and the random bit patterns those checks draw from.

use gradclip_kernels::abi::Partial;
use gradclip_kernels::accum::Accumulator;
use gradclip_kernels::dtype::Element;
use gradclip_kernels::geometry::Frame;
use gradclip_kernels::model;
use proptest::prelude::*;

use super::HostTensor;

/// Fails unless `fast(addr, frame, chunk)` encodes like the model's `A` partial for every chunk
/// of `t` (partials that `both_nan` accepts as NaN on both sides count as equal).
pub fn same_partials<E: Element, A: Accumulator>(
    t: &[E::Bits],
    p: f64,
    fast: impl Fn(u64, &Frame, u64) -> Partial,
    both_nan: impl Fn(&Partial, &Partial) -> bool,
) -> Result<(), TestCaseError> {
    let addr = t.as_ptr() as u64;
    let frame = Frame::new(addr, t.len() as u64, E::SIZE);
    let src = HostTensor::<E>::new(addr, frame);
    for chunk in 0..frame.num_chunks() {
        // SAFETY: t is a live slice that frame describes; chunk is in range.
        let want = unsafe { model::chunk_partial::<E, A, _>(&src, &frame, chunk, p) }.encode();
        let got = fast(addr, &frame, chunk);
        prop_assert!(
            got.words == want.words || both_nan(&got, &want),
            "chunk {}: {:?} vs {:?}",
            chunk,
            got,
            want
        );
    }
    Ok(())
}

/// 16-bit patterns across the whole range: anything, subnormals, +inf (f16), -inf (bf16), and
/// ordinary magnitudes.
pub fn bits16() -> impl Strategy<Value = u16> {
    prop_oneof![any::<u16>(), (0u16..0x400), Just(0x7C00u16), Just(0xFF80u16), (0x3000u16..0x4400)]
}
