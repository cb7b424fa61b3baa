//! Where a tensor lives, as far as the binding cares: what every reader of tensors tells apart
//! and every step and plan keeps (its own module: the readers sit below the plans).

/// The device kind and index of a tensor the engine takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    Cpu,
    Cuda(i64),
}
