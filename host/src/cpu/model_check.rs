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
fn finite_bits16(exp_mask: u16) -> impl Strategy<Value = u16> {
    let lowest = exp_mask & exp_mask.wrapping_neg();
    bits16().prop_map(move |b| if b & exp_mask == exp_mask { b ^ lowest } else { b })
}

/// Finite f32 bit patterns of every binade, subnormals included (as [`finite_bits16`]).
fn finite_bits32() -> impl Strategy<Value = u32> {
    any::<u32>().prop_map(|b| if b & 0x7F80_0000 == 0x7F80_0000 { b ^ 0x0080_0000 } else { b })
}

/// Bit patterns of a binary format with `mant` mantissa bits and exponent bias `bias` (sign bit
/// above the exponent): either sign, a random mantissa, a binary exponent in `e..e + width`.
fn near_bits(mant: u32, bias: i64, e: i64, width: i64) -> impl Strategy<Value = u64> {
    let sign = 1u64 << (mant + if bias == 1023 { 11 } else { 8 });
    (any::<bool>(), 0..width, any::<u64>())
        .prop_map(move |(neg, de, m)| if neg { sign } else { 0 } | (((bias + e + de) as u64) << mant) | (m & ((1 << mant) - 1)))
}

/// bf16 values spread over 24 binades around 1: their squares' sum rounds (the terms span more
/// than f64's 53 bits), so the order of the additions shows in the bits.
fn bf16_spread() -> impl Strategy<Value = u16> {
    near_bits(7, 127, -12, 24).prop_map(|b| b as u16)
}

/// f32 values of like magnitude (16 binades around 1): every few additions of their squares
/// round.
fn f32_near_one() -> impl Strategy<Value = u32> {
    near_bits(23, 127, -8, 16).prop_map(|b| b as u32)
}

/// bf16 lists for the fast paths' property tests: any 16-bit patterns (NaN, infinities: nearly
/// every partial NaN), finite patterns of every binade (no partial NaN, so no comparison is
/// excused), and values whose sums round at many additions (so the order of the additions shows).
pub fn bf16_lists(len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<u16>> {
    use proptest::collection::vec;
    prop_oneof![
        vec(bits16(), len.clone()),
        vec(finite_bits16(0x7F80), len.clone()),
        vec(bf16_spread(), len)
    ]
}

/// f16 lists, as [`bf16_lists`] (f16's 31 binades already make its sums round).
pub fn f16_lists(len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<u16>> {
    use proptest::collection::vec;
    prop_oneof![vec(bits16(), len.clone()), vec(finite_bits16(0x7C00), len)]
}

/// f32 lists, as [`bf16_lists`].
pub fn f32_lists(len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<u32>> {
    use proptest::collection::vec;
    prop_oneof![
        vec(any::<u32>(), len.clone()),
        vec(finite_bits32(), len.clone()),
        vec(f32_near_one(), len)
    ]
}

/// f64 values of either sign with a random mantissa and a binary exponent in `e..e + 16`.
fn f64_near(e: i64) -> impl Strategy<Value = u64> {
    near_bits(52, 1023, e, 16)
}

/// f64 lists whose sums round at every addition: values of like magnitude near 1, near 2^-530
/// (Blue's small accumulator), near 2^500 (the big one), those three mixed, and (rarely) any
/// bits. Random bits alone make the largest term swamp the rest, so a reordered or misrouted
/// addition would go unseen.
pub fn f64_lists(len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<u64>> {
    use proptest::collection::vec;
    let mixed = prop_oneof![f64_near(-4), f64_near(-530), f64_near(500)];
    prop_oneof![
        vec(f64_near(-4), len.clone()),
        vec(f64_near(-530), len.clone()),
        vec(f64_near(500), len.clone()),
        vec(mixed, len.clone()),
        vec(any::<u64>(), len),
    ]
}
