//! What every optimizer's per-element arithmetic looks like to the multi-tensor walk that applies
//! it (the GPU kernels' and the CPU backend's): a parameter, its gradient as stored, up to
//! [`MAX_STATES`] states, all widened to the parameter's opmath (f32 for bf16/f16/f32
//! parameters, f64 for f64 ones). An optimizer's step constants (one value per step and tensor,
//! rounded to opmath once) implement [`ElementUpdate`]; the walk loads, widens, calls it and
//! rounds back, so an optimizer is its arithmetic and nothing else, and both backends run the
//! same function per element (the same bits).

pub use crate::abi::MAX_STATES;

/// One element's update under one step's constants (`Self`) in opmath `T`.
pub trait ElementUpdate<T: Copy> {
    /// The updated parameter from `param` and the gradient as stored (the constants carry the
    /// clip coefficient and the maximize sign); `states` (those past the optimizer's count are
    /// zero on entry and ignored on return) are updated in place.
    fn update(&self, param: T, grad: T, states: &mut [T; MAX_STATES]) -> T;

    /// These constants for a walk that keeps `states` states (the count fixed at compile time):
    /// an optimizer whose arithmetic tests how many states it keeps (Adam's amsgrad) folds the
    /// test away here. The default keeps them as they are.
    #[inline(always)]
    fn for_states(self, _states: usize) -> Self
    where
        Self: Sized,
    {
        self
    }
}

/// `std::max(a, b)` of C++: `b` when `a < b`, else `a` (so a NaN in `a` stays, one in `b` does not).
#[inline(always)]
pub(crate) fn cpp_max<T: PartialOrd>(a: T, b: T) -> T {
    if a < b { b } else { a }
}

/// `torch.sign`: 1 for positive, -1 for negative, the value itself for a zero of either sign and
/// NaN.
#[inline(always)]
pub(crate) fn sign<T: PartialOrd + Copy + From<i8>>(x: T) -> T {
    if x > T::from(0) {
        T::from(1)
    } else if x < T::from(0) {
        T::from(-1)
    } else {
        x
    }
}
