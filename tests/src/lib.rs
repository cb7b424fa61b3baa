//! Shared pieces of gradclip's integration tests: random gradient lists of every dtype at every
//! 16-byte phase, the exact reference norm, and the clip rule written independently of the
//! library (through the `half` crate).

pub mod gpu;

use gradclip::DType;
use gradclip::cpu::{HostGrad, HostGradMut};
use half::{bf16, f16};
use rand::{Rng, SeedableRng, rngs::StdRng};

/// A host gradient: `data[start..]` is the tensor; `start` sets its 16-byte phase.
#[derive(Clone, Debug, PartialEq)]
pub enum Grad {
    /// bfloat16 values
    Bf16(Vec<bf16>, usize),
    /// f16 values
    F16(Vec<f16>, usize),
    /// f32 values
    F32(Vec<f32>, usize),
    /// f64 values
    F64(Vec<f64>, usize),
}

/// What the tests need of each Rust element type (their values written independently of
/// gradclip's kernels, through the `half` crate), for [`gradclip::with_host_type!`].
trait TestElement: Copy + Default {
    fn from_f64(x: f64) -> Self;
    fn from_bits64(b: u64) -> Self;
    fn wrap(v: Vec<Self>, start: usize) -> Grad;
    /// PyTorch's `_foreach_mul_` of the element with bits `bits` by `coef`, as bits (f32 math
    /// for the 16- and 32-bit types, f64 for f64), NaN as CUDA's canonical one.
    fn torch_scaled(bits: u64, coef: f64) -> u64;
}

macro_rules! half_element {
    ($($t:ident => $variant:ident),*) => {$(
        impl TestElement for $t {
            fn from_f64(x: f64) -> Self {
                $t::from_f64(x)
            }
            fn from_bits64(b: u64) -> Self {
                $t::from_bits(b as u16)
            }
            fn wrap(v: Vec<Self>, start: usize) -> Grad {
                Grad::$variant(v, start)
            }
            fn torch_scaled(bits: u64, coef: f64) -> u64 {
                let r = $t::from_bits(bits as u16).to_f32() * coef as f32;
                if r.is_nan() { 0x7FFF } else { $t::from_f32(r).to_bits() as u64 }
            }
        }
    )*};
}
half_element!(bf16 => Bf16, f16 => F16);

impl TestElement for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn from_bits64(b: u64) -> Self {
        f32::from_bits(b as u32)
    }
    fn wrap(v: Vec<Self>, start: usize) -> Grad {
        Grad::F32(v, start)
    }
    fn torch_scaled(bits: u64, coef: f64) -> u64 {
        let r = f32::from_bits(bits as u32) * coef as f32;
        if r.is_nan() { 0x7FFF_FFFF } else { r.to_bits() as u64 }
    }
}

impl TestElement for f64 {
    fn from_f64(x: f64) -> Self {
        x
    }
    fn from_bits64(b: u64) -> Self {
        f64::from_bits(b)
    }
    fn wrap(v: Vec<Self>, start: usize) -> Grad {
        Grad::F64(v, start)
    }
    fn torch_scaled(bits: u64, coef: f64) -> u64 {
        let r = f64::from_bits(bits) * coef;
        if r.is_nan() { 0x7FFF_FFFF_FFFF_FFFF } else { r.to_bits() }
    }
}

impl Grad {
    /// Builds a tensor of `dtype` from f64 values (rounded once), starting `start` elements into
    /// its storage.
    pub fn from_f64(dtype: DType, values: &[f64], start: usize) -> Grad {
        gradclip::with_host_type!(dtype, T => {
            let mut v = vec![T::default(); values.len() + start];
            v[start..].iter_mut().zip(values).for_each(|(d, &x)| *d = T::from_f64(x));
            T::wrap(v, start)
        })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Grad::Bf16(..) => DType::Bf16,
            Grad::F16(..) => DType::F16,
            Grad::F32(..) => DType::F32,
            Grad::F64(..) => DType::F64,
        }
    }

    /// Element offset of the tensor inside its storage.
    pub fn start(&self) -> usize {
        match self {
            Grad::Bf16(_, s) | Grad::F16(_, s) | Grad::F32(_, s) | Grad::F64(_, s) => *s,
        }
    }

    /// The tensor's values, widened exactly.
    pub fn values(&self) -> Vec<f64> {
        match self {
            Grad::Bf16(v, s) => v[*s..].iter().map(|x| x.to_f64()).collect(),
            Grad::F16(v, s) => v[*s..].iter().map(|x| x.to_f64()).collect(),
            Grad::F32(v, s) => v[*s..].iter().map(|&x| x as f64).collect(),
            Grad::F64(v, s) => v[*s..].to_vec(),
        }
    }

    /// The raw bits of every element, for bitwise comparison.
    pub fn bits(&self) -> Vec<u64> {
        match self {
            Grad::Bf16(v, s) => v[*s..].iter().map(|x| x.to_bits() as u64).collect(),
            Grad::F16(v, s) => v[*s..].iter().map(|x| x.to_bits() as u64).collect(),
            Grad::F32(v, s) => v[*s..].iter().map(|x| x.to_bits() as u64).collect(),
            Grad::F64(v, s) => v[*s..].iter().map(|x| x.to_bits()).collect(),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Grad::Bf16(v, s) => v.len() - s,
            Grad::F16(v, s) => v.len() - s,
            Grad::F32(v, s) => v.len() - s,
            Grad::F64(v, s) => v.len() - s,
        }
    }

    /// True for an empty tensor.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Read view for the CPU backend.
    pub fn host(&self) -> HostGrad<'_> {
        match self {
            Grad::Bf16(v, s) => HostGrad::from(&v[*s..]),
            Grad::F16(v, s) => HostGrad::from(&v[*s..]),
            Grad::F32(v, s) => HostGrad::from(&v[*s..]),
            Grad::F64(v, s) => HostGrad::from(&v[*s..]),
        }
    }

    /// Write view for the CPU backend.
    pub fn host_mut(&mut self) -> HostGradMut<'_> {
        match self {
            Grad::Bf16(v, s) => HostGradMut::from(&mut v[*s..]),
            Grad::F16(v, s) => HostGradMut::from(&mut v[*s..]),
            Grad::F32(v, s) => HostGradMut::from(&mut v[*s..]),
            Grad::F64(v, s) => HostGradMut::from(&mut v[*s..]),
        }
    }

    /// Byte offset of element 0 from the previous 16-byte boundary, in host memory.
    pub fn host_phase_bytes(&self) -> u64 {
        let addr = match self {
            Grad::Bf16(v, s) => v[*s..].as_ptr() as u64,
            Grad::F16(v, s) => v[*s..].as_ptr() as u64,
            Grad::F32(v, s) => v[*s..].as_ptr() as u64,
            Grad::F64(v, s) => v[*s..].as_ptr() as u64,
        };
        addr % 16
    }

    /// The same values stored so that element 0 sits `phase_bytes` after a 16-byte boundary
    /// (to run the CPU model at the phase a device buffer has).
    pub fn with_host_phase(&self, phase_bytes: u64) -> Grad {
        if self.is_empty() {
            // An empty tensor has no elements to order: any phase computes the same.
            return self.clone();
        }
        let size = self.dtype().size();
        for extra in 0..16 / size as usize {
            let g = Grad::from_f64_bits(self.dtype(), &self.bits(), extra);
            if g.host_phase_bytes() == phase_bytes {
                return g;
            }
        }
        panic!("no host offset gives phase {phase_bytes}");
    }

    fn from_f64_bits(dtype: DType, bits: &[u64], start: usize) -> Grad {
        gradclip::with_host_type!(dtype, T => {
            let mut v = vec![T::default(); bits.len() + start];
            v[start..].iter_mut().zip(bits).for_each(|(d, &b)| *d = T::from_bits64(b));
            T::wrap(v, start)
        })
    }
}

/// A random gradient list: lengths mixing empty, tiny, odd and multi-block sizes, every dtype,
/// random 16-byte phases, magnitudes spread over six decades per tensor.
/// The CPU backend's clip of `grads` in place: the bits every GPU clip is checked against.
pub fn cpu_clip(grads: &mut [Grad], max_norm: f64, opts: &gradclip::ClipOptions) -> gradclip::Result<gradclip::NormReport> {
    let mut views: Vec<HostGradMut> = grads.iter_mut().map(Grad::host_mut).collect();
    gradclip::cpu::Cpu::new().clip_grad_norm(&mut views, max_norm, opts)
}

pub fn random_grads(seed: u64, count: usize, max_len: usize) -> Vec<Grad> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..count)
        .map(|_| {
            let dtype = DType::ALL[rng.random_range(0..4)];
            let len = match rng.random_range(0..6) {
                0 => rng.random_range(0..3),
                1 => rng.random_range(0..64),
                2 => rng.random_range(0..4096),
                _ => rng.random_range(0..max_len.max(1)),
            };
            let scale = 10f64.powf(rng.random_range(-3.0..3.0));
            let values: Vec<f64> = (0..len).map(|_| scale * (2.0 * rng.random::<f64>() - 1.0)).collect();
            let start = rng.random_range(0..8);
            Grad::from_f64(dtype, &values, start)
        })
        .collect()
}

/// Neumaier's compensated sum.
pub fn compensated_sum(xs: impl Iterator<Item = f64>) -> f64 {
    let (mut s, mut c) = (0.0f64, 0.0f64);
    for x in xs {
        let t = s + x;
        c += if s.abs() >= x.abs() { (s - t) + x } else { (x - t) + s };
        s = t;
    }
    s + c
}

/// The exact reference norm of all values: scaled by the largest |x| (no overflow), summed with
/// compensation, with `powf` from the platform libm.
pub fn reference_norm(grads: &[Grad], p: f64) -> f64 {
    let values: Vec<f64> = grads.iter().flat_map(|g| g.values()).collect();
    reference_norm_of(&values, p)
}

/// [`reference_norm`] of a flat list.
pub fn reference_norm_of(values: &[f64], p: f64) -> f64 {
    if values.iter().any(|x| x.is_nan()) {
        return f64::NAN;
    }
    let m = values.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    if m == f64::INFINITY || p == f64::INFINITY || m == 0.0 {
        return m;
    }
    let s = compensated_sum(values.iter().map(|x| (x.abs() / m).powf(p)));
    m * s.powf(1.0 / p)
}

/// Relative error, with NaN == NaN and inf == inf counted as exact.
pub fn rel_err(got: f64, want: f64) -> f64 {
    if (got.is_nan() && want.is_nan()) || got == want {
        0.0
    } else {
        ((got - want) / want).abs()
    }
}

/// The tolerance gradclip promises for norm order p.
pub fn tolerance(p: f64) -> f64 {
    if p == 1.0 || p == 2.0 || p == f64::INFINITY { 1e-12 } else { 1e-10 }
}

/// What PyTorch's `_foreach_mul_` gives for one element and coefficient, computed through the
/// `half` crate (independent of gradclip's own rounding code); NaN as CUDA's canonical NaN.
pub fn torch_scaled_bits(dtype: DType, bits: u64, coef: f64) -> u64 {
    gradclip::with_host_type!(dtype, T => T::torch_scaled(bits, coef))
}

/// The norm orders every test covers.
pub const NORM_ORDERS: [f64; 5] = [1.0, 2.0, 3.0, 7.5, f64::INFINITY];

/// The optimizer settings every optimizer test runs: AdamW's defaults, amsgrad with maximize,
/// and Adam with L2 weight decay.
pub fn adam_configs() -> Vec<gradclip::optim::AdamConfig> {
    use gradclip::optim::AdamConfig;
    vec![
        AdamConfig::adamw(1e-2),
        AdamConfig {
            amsgrad: true,
            maximize: true,
            ..AdamConfig::adamw(3e-3)
        },
        AdamConfig {
            weight_decay: 0.1,
            ..AdamConfig::adam(1e-2)
        },
    ]
}

/// The SGD and Lion settings both backends' tests step through (plain SGD, momentum, dampening
/// with weight decay, Nesterov with maximize with and without weight decay; Lion with decoupled
/// weight decay, and maximizing), SGD at learning rate `lr`.
pub fn sgd_and_lion_rules(lr: f64) -> Vec<gradclip::optim::Rule> {
    use gradclip::optim::{LionConfig, Rule, SgdConfig};
    let sgd = SgdConfig::new(lr);
    vec![
        Rule::Sgd(sgd),
        Rule::Sgd(SgdConfig { momentum: 0.9, ..sgd }),
        Rule::Sgd(SgdConfig {
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 1e-2,
            ..sgd
        }),
        Rule::Sgd(SgdConfig {
            momentum: 0.5,
            nesterov: true,
            weight_decay: 1e-2,
            maximize: true,
            ..sgd
        }),
        Rule::Sgd(SgdConfig {
            momentum: 0.5,
            nesterov: true,
            maximize: true,
            ..sgd
        }),
        Rule::Lion(LionConfig {
            weight_decay: 0.1,
            ..LionConfig::new(1e-3)
        }),
        Rule::Lion(LionConfig {
            maximize: true,
            ..LionConfig::new(1e-3)
        }),
    ]
}
