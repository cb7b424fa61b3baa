//! The PTX built from `kernels-gpu` and the single table of its entry-point names.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;

use gradclip_kernels::norms::NormKind;

use crate::error::{Error, Result};

/// The kernels' PTX, compiled from Rust by this crate's build script (rustc's nvptx64 target).
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gradclip_kernels.ptx"));

/// Every kernel the host launches. Names live here and in the kernels' norm table
/// ([`gradclip_kernels::norm_table!`], the norm kernels' names) and nowhere else.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum Kernel {
    /// A norm kernel of the table.
    Norm(NormKind),
    /// A per-tensor-norm kernel of the table.
    TensorNorms(NormKind),
    Scale,
    Adam,
    Sgd,
    Lion,
    /// The optimizer kernels with the step's telemetry ([`gradclip_kernels::tally`]).
    AdamStats,
    SgdStats,
    LionStats,
    LossScale,
    NormToPartial,
    NormFromPartial,
    KeyPartials,
    KeysTotal,
    /// The clip policies' one-block launch ([`gradclip_kernels::policy`]).
    ClipPolicy,
    /// The unit-wise passes ([`gradclip_kernels::units`]): the norms, AGC's scale, AdaGC's
    /// decision and the per-tensor scale.
    UnitNorms,
    AgcScale,
    AdagcDecide,
    TensorScale,
    #[cfg(feature = "bench-kernels")]
    Fill,
    #[cfg(feature = "bench-kernels")]
    StreamRead,
    #[cfg(feature = "bench-kernels")]
    BaselineMax,
    #[cfg(feature = "bench-kernels")]
    BaselineSumsq,
}

impl Kernel {
    /// The kernels that are not the norm table's, in table order (the benchmark kernels only
    /// with the `bench-kernels` feature).
    const OTHERS: &[Kernel] = &[
        Kernel::Scale,
        Kernel::Adam,
        Kernel::Sgd,
        Kernel::Lion,
        Kernel::AdamStats,
        Kernel::SgdStats,
        Kernel::LionStats,
        Kernel::LossScale,
        Kernel::NormToPartial,
        Kernel::NormFromPartial,
        Kernel::KeyPartials,
        Kernel::KeysTotal,
        Kernel::ClipPolicy,
        Kernel::UnitNorms,
        Kernel::AgcScale,
        Kernel::AdagcDecide,
        Kernel::TensorScale,
        #[cfg(feature = "bench-kernels")]
        Kernel::Fill,
        #[cfg(feature = "bench-kernels")]
        Kernel::StreamRead,
        #[cfg(feature = "bench-kernels")]
        Kernel::BaselineMax,
        #[cfg(feature = "bench-kernels")]
        Kernel::BaselineSumsq,
    ];

    /// How many kernels there are.
    pub const COUNT: usize = 2 * NormKind::ALL.len() + Kernel::OTHERS.len();

    /// All kernels, in table order: the norm kernels, the per-tensor ones, the rest.
    pub fn all() -> impl Iterator<Item = Kernel> {
        let norms = NormKind::ALL.iter().map(|&k| Kernel::Norm(k));
        norms
            .chain(NormKind::ALL.iter().map(|&k| Kernel::TensorNorms(k)))
            .chain(Kernel::OTHERS.iter().copied())
    }

    /// The kernel's place in [`Kernel::all`].
    fn index(self) -> usize {
        let n = NormKind::ALL.len();
        match self {
            Kernel::Norm(k) => k as usize,
            Kernel::TensorNorms(k) => n + k as usize,
            other => 2 * n + Kernel::OTHERS.iter().position(|&x| x == other).unwrap_or(0),
        }
    }

    /// The optimizer kernel `self` with the step's telemetry (itself for any other kernel).
    pub const fn with_stats(self) -> Kernel {
        match self {
            Kernel::Adam => Kernel::AdamStats,
            Kernel::Sgd => Kernel::SgdStats,
            Kernel::Lion => Kernel::LionStats,
            other => other,
        }
    }

    /// The PTX entry-point name.
    pub const fn name(self) -> &'static str {
        match self {
            Kernel::Norm(k) => k.norm_kernel(),
            Kernel::TensorNorms(k) => k.tensor_norms_kernel(),
            Kernel::Scale => "gradclip_scale",
            Kernel::Adam => "gradclip_adam",
            Kernel::Sgd => "gradclip_sgd",
            Kernel::Lion => "gradclip_lion",
            Kernel::AdamStats => "gradclip_adam_stats",
            Kernel::SgdStats => "gradclip_sgd_stats",
            Kernel::LionStats => "gradclip_lion_stats",
            Kernel::LossScale => "gradclip_loss_scale",
            Kernel::NormToPartial => "gradclip_norm_to_partial",
            Kernel::NormFromPartial => "gradclip_norm_from_partial",
            Kernel::KeyPartials => "gradclip_key_partials",
            Kernel::KeysTotal => "gradclip_keys_total",
            Kernel::ClipPolicy => "gradclip_clip_policy",
            Kernel::UnitNorms => "gradclip_unit_norms",
            Kernel::AgcScale => "gradclip_agc_scale",
            Kernel::AdagcDecide => "gradclip_adagc_decide",
            Kernel::TensorScale => "gradclip_tensor_scale",
            #[cfg(feature = "bench-kernels")]
            Kernel::Fill => "gradclip_fill",
            #[cfg(feature = "bench-kernels")]
            Kernel::StreamRead => "gradclip_stream_read",
            #[cfg(feature = "bench-kernels")]
            Kernel::BaselineMax => "gradclip_baseline_max",
            #[cfg(feature = "bench-kernels")]
            Kernel::BaselineSumsq => "gradclip_baseline_sumsq",
        }
    }
}

/// The loaded module of one context.
#[derive(Debug)]
pub struct KernelSet {
    functions: Vec<CudaFunction>,
}

impl KernelSet {
    /// The function of `k`.
    pub fn get(&self, k: Kernel) -> &CudaFunction {
        &self.functions[k.index()]
    }
}

type Cache = Mutex<Vec<(usize, Arc<KernelSet>)>>;
static LOADED: Cache = Mutex::new(Vec::new());

/// The kernels of `ctx`, loading (and JIT-compiling) the PTX once per context.
pub fn load(ctx: &Arc<CudaContext>) -> Result<Arc<KernelSet>> {
    let key = ctx.cu_ctx() as usize;
    let mut cache = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, set)) = cache.iter().find(|(k, _)| *k == key) {
        return Ok(set.clone());
    }
    let module = ctx.load_module(Ptx::from_src(PTX))?;
    let functions = Kernel::all()
        .map(|k| {
            module
                .load_function(k.name())
                .map_err(|source| Error::MissingKernel { name: k.name(), source })
        })
        .collect::<Result<Vec<_>>>()?;
    let set = Arc::new(KernelSet { functions });
    cache.push((key, set.clone()));
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every name the host can ask for is an entry point of the embedded PTX, and no entry point
    /// is unknown to the host (checked on the PTX text, so it runs without a GPU).
    #[test]
    fn kernel_table_matches_the_ptx() {
        let entries: Vec<&str> = PTX
            .lines()
            .filter_map(|l| l.strip_prefix(".visible .entry "))
            .map(|l| l.trim_end_matches('(').trim())
            .collect();
        for (i, k) in Kernel::all().enumerate() {
            assert!(entries.contains(&k.name()), "{} missing from PTX", k.name());
            assert_eq!(k.index(), i, "{k:?} is not at its place in the table");
        }
        assert_eq!(entries.len(), Kernel::COUNT, "PTX has entries the host does not know: {entries:?}");
        assert!(!PTX.contains(".extern .func"));
        // No local memory (spills or arrays) in any kernel but the general-p ones, whose
        // per-element log/exp path is allowed a stack.
        let mut kernel = "";
        for line in PTX.lines() {
            if let Some(name) = line.strip_prefix(".visible .entry ") {
                kernel = name.trim_end_matches('(').trim();
            }
            if line.contains(".local") && !kernel.ends_with("_p") {
                panic!("kernel {kernel} uses local memory: {line}");
            }
        }
        assert!(PTX.contains(".target sm_80\n"), "PTX must target sm_80 without debug info");
    }
}
