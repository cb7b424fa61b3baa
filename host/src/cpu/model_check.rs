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

/// [`bits16`] with every pattern whose exponent field (`exp_mask`: 0x7F80 for bf16, 0x7C00 for
/// f16) is all ones moved to the largest finite binade: without infinities and NaN every partial
/// stays finite, so a comparison can never be excused as "both NaN". (Random bits hit a NaN
/// every few hundred elements, which turns nearly every chunk's partial into NaN.)
pub fn finite_bits16(exp_mask: u16) -> impl Strategy<Value = u16> {
    let lowest = exp_mask & exp_mask.wrapping_neg();
    bits16().prop_map(move |b| if b & exp_mask == exp_mask { b ^ lowest } else { b })
}

/// Finite f32 bit patterns of every binade, subnormals included (as [`finite_bits16`]).
pub fn finite_bits32() -> impl Strategy<Value = u32> {
    any::<u32>().prop_map(|b| if b & 0x7F80_0000 == 0x7F80_0000 { b ^ 0x0080_0000 } else { b })
}
