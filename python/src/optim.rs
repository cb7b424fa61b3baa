//! The optimizer step on PyTorch's tensors: each parameter group's lists of parameters,
//! gradients and Adam states read by the planner's one reader ([`Planner::entry`]) into an
//! [`AdamGroup`] (kept by the optimizer while the same tensors come back), then on CUDA the norm
//! kernel (when clipping) and one Adam launch per group on torch's stream, on the CPU the CPU
//! backend.

use gradclip::NormType;
use gradclip::cpu::Cpu;
use gradclip::optim::{AdamConfig, ClipConfig, NonFinite, Parts, StepCount};
use gradclip::tensor_list::TensorList;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::cuda::with_engine;
use crate::scan::{Place, Planner};
use crate::to_py;

/// Reads one list of tensors: each must be one the engine takes, all where the first one read
/// (by any list) is.
fn read(planner: &Planner, what: &str, list: &Bound<'_, PyList>, place: &mut Option<Place>) -> PyResult<Vec<gradclip::plan::RawTensor>> {
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let e = planner
            .entry(&t)?
            .ok_or_else(|| PyValueError::new_err(format!("{what}[{i}] is not a contiguous bf16/f16/f32/f64 tensor")))?;
        if *place.get_or_insert(e.place) != e.place {
            return Err(PyValueError::new_err(format!(
                "{what}[{i}] is on another device than the first tensor"
            )));
        }
        out.push(e.tensor);
    }
    Ok(out)
}

/// The tensors of one parameter group as the engine reads them (addresses, lengths, dtypes),
/// read once by [`adam_group`] and kept by the optimizer while a validator says the same
/// tensors come back: a repeated step then reads no tensor again.
#[pyclass(frozen, module = "gradclip._native")]
pub struct AdamGroup {
    parts: Vec<Parts>,
    place: Place,
}

#[pymethods]
impl AdamGroup {
    fn __len__(&self) -> usize {
        self.parts.len()
    }
}

/// Reads one parameter group's tensors (`max_exp_avg_sqs` with amsgrad only): each must be one
/// the engine takes, all on one device, every list as long as `params` (ValueError otherwise:
/// the caller then uses torch's step).
#[pyfunction]
#[pyo3(signature = (planner, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs=None))]
pub fn adam_group(
    planner: &Bound<'_, Planner>,
    params: &Bound<'_, PyList>,
    grads: &Bound<'_, PyList>,
    exp_avgs: &Bound<'_, PyList>,
    exp_avg_sqs: &Bound<'_, PyList>,
    max_exp_avg_sqs: Option<&Bound<'_, PyList>>,
) -> PyResult<AdamGroup> {
    let pl = planner.get();
    let mut place = None;
    let p = read(pl, "params", params, &mut place)?;
    let gr = read(pl, "grads", grads, &mut place)?;
    let m = read(pl, "exp_avgs", exp_avgs, &mut place)?;
    let v = read(pl, "exp_avg_sqs", exp_avg_sqs, &mut place)?;
    let vm = match max_exp_avg_sqs {
        Some(l) => Some(read(pl, "max_exp_avg_sqs", l, &mut place)?),
        None => None,
    };
    let n = p.len();
    for (what, len) in [("grads", gr.len()), ("exp_avgs", m.len()), ("exp_avg_sqs", v.len())]
        .into_iter()
        .chain(vm.as_ref().map(|x| ("max_exp_avg_sqs", x.len())))
    {
        if len != n {
            return Err(PyValueError::new_err(format!("{what} has {len} tensors, params {n}")));
        }
    }
    let place = place.ok_or_else(|| PyValueError::new_err("a parameter group without parameters"))?;
    let parts = (0..n)
        .map(|i| Parts {
            param: p[i],
            grad: gr[i],
            exp_avg: m[i],
            exp_avg_sq: v[i],
            max_exp_avg_sq: vm.as_ref().map(|x| x[i]),
        })
        .collect();
    Ok(AdamGroup { parts, place })
}

/// One parameter group of a step: its tensors (an [`AdamGroup`]) and its settings.
struct Group {
    parts: Vec<Parts>,
    cfg: AdamConfig,
    count: u64,
    /// The address of a float64 learning rate on the tensors' device (a tensor `lr`), or 0:
    /// `cfg.lr`.
    lr_in: u64,
}

/// Reads one group: `(AdamGroup, (lr, beta1, beta2, eps, weight_decay), (amsgrad, maximize,
/// decoupled_weight_decay), count, lr_in)`; every group on the place of the first.
fn read_group(g: &Bound<'_, PyAny>, place: &mut Option<Place>) -> PyResult<Group> {
    type Hyper = (f64, f64, f64, f64, f64);
    let (tensors, hyper, options, count, lr_in): (Bound<'_, AdamGroup>, Hyper, (bool, bool, bool), u64, u64) = g.extract()?;
    if !lr_in.is_multiple_of(8) {
        return Err(PyValueError::new_err("a tensor learning rate must be passed as a float64 tensor"));
    }
    let t = tensors.get();
    if *place.get_or_insert(t.place) != t.place {
        return Err(PyValueError::new_err("the parameter groups are on different devices"));
    }
    let (lr, beta1, beta2, eps, weight_decay) = hyper;
    let cfg = AdamConfig {
        lr,
        betas: (beta1, beta2),
        eps,
        weight_decay,
        amsgrad: options.0,
        maximize: options.1,
        decoupled_weight_decay: options.2,
    };
    Ok(Group {
        parts: t.parts.clone(),
        cfg,
        count,
        lr_in,
    })
}

/// One Adam / AdamW step over parameter groups (see [`read_group`] for a group; `count` is the
/// address of two int64, steps and skipped, on the tensors' device), on CUDA on `stream`, on the
/// CPU with the CPU backend. `clip` = (max_norm, p, nonfinite) or None: the norm over every
/// group's gradients (on CUDA to the 3 float64 at `norm_out`), or, when `norm_in` is not 0, the
/// global norm in the float64 at `norm_in` (sharded parameters: combined across ranks), then
/// each group's update reads its coefficient. `loss_scale` and `found_inf`: addresses of one
/// float32 each on the tensors' device, or 0 (GradScaler's scale, which the gradients carry and
/// every update divides out, the clip limiting the unscaled norm; its overflow flag, which skips
/// the step). Returns the norm on the CPU (None on CUDA: it stays on the device). Raises
/// ValueError, before anything is written, for tensors the engine does not take (the caller then
/// uses torch's step).
#[pyfunction]
#[pyo3(signature = (stream, groups, clip, norm_out, norm_in=0, loss_scale=0, found_inf=0))]
#[allow(clippy::too_many_arguments)]
pub fn adam_step(
    py: Python<'_>,
    stream: usize,
    groups: &Bound<'_, PyList>,
    clip: Option<(f64, f64, String)>,
    norm_out: u64,
    norm_in: u64,
    loss_scale: u64,
    found_inf: u64,
) -> PyResult<Option<f64>> {
    let mut place = None;
    let groups: Vec<Group> = groups.iter().map(|g| read_group(&g, &mut place)).collect::<PyResult<_>>()?;
    let clip = match clip {
        None => None,
        Some((max_norm, p, policy)) => Some(ClipConfig {
            max_norm,
            norm_type: NormType::from_p(p).map_err(to_py)?,
            nonfinite: match policy.as_str() {
                "skip" => NonFinite::Skip,
                "error" => NonFinite::Error,
                "propagate" => NonFinite::Propagate,
                other => {
                    return Err(PyValueError::new_err(format!(
                        "nonfinite must be skip, error or propagate; got {other:?}"
                    )));
                }
            },
        }),
    };
    // Every group is checked before anything is enqueued or written.
    for g in &groups {
        g.cfg.params().map_err(to_py)?;
        gradclip::optim::check(&g.parts, g.cfg.amsgrad).map_err(to_py)?;
        if g.count == 0 || !g.count.is_multiple_of(8) {
            return Err(PyValueError::new_err("the step count must be an int64 tensor of two elements"));
        }
    }
    if norm_in != 0 && !norm_in.is_multiple_of(8) {
        return Err(PyValueError::new_err("the global norm must be a float64 tensor"));
    }
    if !loss_scale.is_multiple_of(4) || !found_inf.is_multiple_of(4) {
        return Err(PyValueError::new_err("the loss scale and found_inf must be float32 tensors"));
    }
    let grads: Vec<_> = groups.iter().flat_map(|g| g.parts.iter().map(|p| p.grad)).collect();
    let grads = TensorList::new(&grads).map_err(to_py)?;
    match place {
        Some(Place::Cuda(d)) => {
            let device = usize::try_from(d).map_err(|_| PyValueError::new_err("a negative CUDA device"))?;
            py.detach(|| {
                with_engine(device, stream, None, |e| {
                    // SAFETY: the tensors are live CUDA memory of `device` that the caller holds
                    // (torch's caching allocator orders their reuse after this stream's work);
                    // each `count` and `norm_out` are the caller's device tensors of the stated
                    // sizes.
                    unsafe {
                        if let Some(c) = &clip {
                            if norm_in == 0 {
                                e.clip_norm_raw(&grads, c, norm_out)?;
                            } else {
                                e.clip_from_norm_raw(norm_in, c, norm_out)?;
                            }
                        }
                        let factor = e.update_factor_raw(norm_out, clip.as_ref(), loss_scale)?;
                        for g in &groups {
                            e.adam_update_raw(&g.parts, &g.cfg, g.count, factor, g.lr_in, found_inf)?;
                        }
                        Ok(None)
                    }
                })
            })
        }
        _ => py
            .detach(|| {
                let cpu = Cpu::new();
                // SAFETY: the tensors are live host memory the caller holds for the call; each
                // `count` is the address of the caller's two int64, each input (not 0) of its
                // dtype (checked aligned above).
                unsafe {
                    // The gradients' norm as they are (scaled when they carry a loss scale).
                    let norm = match &clip {
                        None => None,
                        Some(c) if norm_in == 0 => Some(cpu.total_norm_raw(&grads, c.norm_type, false)?.norm),
                        Some(_) => Some((norm_in as *const f64).read()),
                    };
                    let scale = if loss_scale == 0 {
                        1.0
                    } else {
                        (loss_scale as *const f32).read() as f64
                    };
                    let overflow = found_inf != 0 && (found_inf as *const f32).read() != 0.0;
                    // The GPU kernel's factor and skip, on the host.
                    let (verdict, factor) = cpu.step_verdict(norm, clip.as_ref(), scale, overflow)?;
                    // Every group's learning rate (a tensor's read here) checked before any update.
                    let cfgs: Vec<AdamConfig> = groups
                        .iter()
                        .map(|g| AdamConfig {
                            lr: if g.lr_in == 0 { g.cfg.lr } else { (g.lr_in as *const f64).read() },
                            ..g.cfg
                        })
                        .collect();
                    for c in &cfgs {
                        c.params()?;
                    }
                    for (g, cfg) in groups.iter().zip(cfgs) {
                        let words = g.count as *mut u64;
                        let mut count = StepCount {
                            steps: words.read(),
                            skipped: words.add(1).read(),
                        };
                        if verdict.skipped {
                            count.skipped += 1;
                        } else {
                            cpu.adam_update_raw(&g.parts, &cfg, &mut count, factor)?;
                        }
                        words.write(count.steps);
                        words.add(1).write(count.skipped);
                    }
                    Ok(norm)
                }
            })
            .map_err(to_py),
    }
}
