//! The optimizer kernels' tables (descriptors, tasks and the group table, and with telemetry
//! each tensor's row and a partial per task) of the update launches of the steps taken last,
//! kept in the engine's own memory by the launch's parameters, for every rule alike: a launch
//! re-plans and uploads its tensor tables only when its tensors change (its descriptors alone
//! when only its gradients are new), and its group table (learning rates: a schedule changes
//! them every step) only when its values change.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use gradclip_kernels::abi::{ChunkTask, Partial, TallyTensor, UpdateGroup, UpdateTensorDesc, update_chunk_elems};

use super::capture::{self, Capture};
use super::launch::UpdateTables;
use super::words::as_words;
use crate::error::{Error, Result};
use crate::optim::{Parts, StepList};
use crate::plan::MAX_TASKS;
use crate::units::GradFactors;

/// The optimizer tables of the launches of the steps taken last, in the engine's own memory
/// (counter word, tensor table, task table, group table; with telemetry, the rows and the
/// partials), found by the launch's parameters: a step finds each launch's in one lookup, and
/// uploads nothing when its tensors and hyperparameters came back (its descriptors alone when
/// only its gradients are new).
#[derive(Debug, Default)]
pub(crate) struct UpdateUpload {
    slots: Vec<Uploaded>,
    /// Each slot's place, by [`params_key`].
    by_params: HashMap<(usize, usize, u64), usize>,
    /// Advances with every lookup; a slot's `used` is its last.
    clock: u64,
}

#[derive(Debug)]
struct Uploaded {
    /// [`params_key`] of `parts`.
    key: (usize, usize, u64),
    /// The launch's parameters, group after group, each with its group's place in the launch.
    parts: Vec<(u32, Parts)>,
    /// Each parameter's gradient factors (a unit-wise clip folded into the update), or none.
    factors: Vec<GradFactors>,
    /// The group table as uploaded.
    groups: Vec<UpdateGroup>,
    /// Each tensor's row in the step's telemetry records, when the buffer has room for them.
    rows: Option<Vec<u32>>,
    buf: CudaSlice<u64>,
    num_tasks: u64,
    used: u64,
}

/// Launches' tables kept at least (a step keeps every launch's: up to twice its launch count).
const KEPT_LAUNCHES: usize = 8;

/// What finds a launch's slot: its group count, its parameter count and its first parameter's
/// address (a parameter belongs to one group, and a group keeps its parameters from step to
/// step).
fn params_key(groups: usize, parts: &[(u32, Parts)]) -> (usize, usize, u64) {
    (groups, parts.len(), parts.first().map_or(0, |p| p.1.param.addr))
}

/// A launch's parameters: those of `list`'s groups `members`, each with its group's place in the
/// launch (its entry in the group table).
fn launch_parts(list: &StepList, members: &[usize]) -> Vec<(u32, Parts)> {
    let mut out = Vec::with_capacity(members.iter().map(|&g| list.group(g).0.len()).sum());
    for (at, &g) in members.iter().enumerate() {
        out.extend(list.group(g).0.iter().map(|p| (at as u32, *p)));
    }
    out
}

/// Each tensor's place in `list` for a launch over its groups `members`.
fn launch_places(list: &StepList, members: &[usize]) -> impl Iterator<Item = usize> {
    let mut first = Vec::with_capacity(list.groups());
    let mut at = 0;
    for g in 0..list.groups() {
        first.push(at);
        at += list.group(g).0.len();
    }
    members.iter().flat_map(move |&g| {
        let at = first[g];
        (0..list.group(g).0.len()).map(move |i| at + i)
    })
}

/// Each tensor's row of a launch over `list`'s groups `members`: `given[i]` for its place `i` in
/// the list, or `i` when `given` is empty.
fn launch_rows(list: &StepList, members: &[usize], given: &[u32]) -> Vec<u32> {
    launch_places(list, members)
        .map(|i| given.get(i).copied().unwrap_or(i as u32))
        .collect()
}

/// Each tensor's gradient factors in a launch over `list`'s groups `members`: `given[i]` for its
/// place `i` in the list; none when `given` is empty.
fn launch_factors(list: &StepList, members: &[usize], given: &[GradFactors]) -> Vec<GradFactors> {
    if given.is_empty() {
        return Vec::new();
    }
    launch_places(list, members)
        .map(|i| given.get(i).copied().unwrap_or_default())
        .collect()
}

/// The kernel's tables for `parts` with the gradients' `factors` (checked by the caller).
fn plan(parts: &[(u32, Parts)], factors: &[GradFactors]) -> Result<(Vec<UpdateTensorDesc>, Vec<ChunkTask>)> {
    let mut tasks = Vec::new();
    for (i, (_, p)) in parts.iter().enumerate() {
        let n = p.param.len.div_ceil(update_chunk_elems(p.param.dtype.size()));
        if tasks.len() as u64 + n > MAX_TASKS {
            return Err(Error::TooManyTasks {
                tasks: tasks.len() as u64 + n,
                max: MAX_TASKS,
            });
        }
        tasks.extend((0..n).map(|c| ChunkTask {
            tensor: i as u32,
            chunk: c as u32,
        }));
    }
    Ok((descriptors(parts, factors), tasks))
}

/// The tensor table of `parts`: every part's address, the length, the dtypes packed as the
/// kernel unpacks them, the group, the gradient's factors (`factors[i]`, none past its end). The
/// task table depends only on the parameters' lengths and dtypes: a parameter whose gradient is
/// absent keeps its tasks, with a length of 0 (they do nothing) and no step count to advance.
fn descriptors(parts: &[(u32, Parts)], factors: &[GradFactors]) -> Vec<UpdateTensorDesc> {
    parts
        .iter()
        .enumerate()
        .map(|(i, &(group, p))| (group, p, factors.get(i).copied().unwrap_or_default()))
        .map(|(group, p, f)| UpdateTensorDesc {
            param: p.param.addr,
            grad: p.grad.addr,
            states: p.states.map(|s| s.map_or(0, |s| s.addr)),
            len: p.grad.len, // the parameter's (checked), or 0 for an absent gradient
            dtypes: p.param.dtype.code() | p.grad.dtype.code() << 4 | p.states[0].map_or(p.param.dtype, |s| s.dtype).code() << 8,
            group,
            step: if p.grad_absent() { 0 } else { p.step.map_or(0, |s| s.addr) },
            factors: if p.grad_absent() { 0 } else { f.addr },
            unit_len: f.unit_len,
            factor_step: f.step,
        })
        .collect()
}

/// True when `b` is `a` with other gradient addresses (the same tasks, new descriptors).
fn same_but_grads(a: &[(u32, Parts)], b: &[(u32, Parts)]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| a.0 == b.0 && Parts { grad: b.1.grad, ..a.1 } == b.1)
}

/// Word offsets in a launch's buffer (the counter is word 0, the tensor table starts at word 1).
#[derive(Clone, Copy)]
struct Offsets {
    tasks: usize,
    groups: usize,
    /// With telemetry: each tensor's [`TallyTensor`], then a partial per task.
    tally: usize,
    scratch: usize,
    total: usize,
}

fn offsets(tensors: usize, tasks: usize, groups: usize, stats: bool) -> Offsets {
    let dw = tensors * size_of::<UpdateTensorDesc>() / 8;
    let tw = (tasks * size_of::<ChunkTask>()).div_ceil(8);
    let gw = groups * size_of::<UpdateGroup>() / 8;
    let (rw, sw) = if stats {
        (tensors * size_of::<TallyTensor>() / 8, tasks * size_of::<Partial>() / 8)
    } else {
        (0, 0)
    };
    let (tasks, groups) = (1 + dw, 1 + dw + tw);
    let tally = groups + gw;
    Offsets {
        tasks,
        groups,
        tally,
        scratch: tally + rw,
        total: tally + rw + sw,
    }
}

/// The launch's [`TallyTensor`]s: each tensor's row and its task count (as [`plan`] counts
/// them), none of its tasks finished.
fn tally_tensors(parts: &[(u32, Parts)], rows: &[u32]) -> Vec<TallyTensor> {
    parts
        .iter()
        .zip(rows)
        .map(|((_, p), &row)| TallyTensor {
            row,
            tasks: p.param.len.div_ceil(update_chunk_elems(p.param.dtype.size())) as u32,
            ..TallyTensor::default()
        })
        .collect()
}

/// The launch's tables uploaded on `stream` into `reuse` when it is large enough (its counter
/// word is zero: every launch leaves it so, and the copies never touch it), else into a new
/// buffer; and their task count. Every copy is ordered after the launches that read `reuse`.
fn upload(
    stream: &Arc<CudaStream>,
    (parts, factors): (&[(u32, Parts)], &[GradFactors]),
    groups: &[UpdateGroup],
    rows: Option<&[u32]>,
    reuse: Option<CudaSlice<u64>>,
) -> Result<(CudaSlice<u64>, u64)> {
    let (descs, tasks) = plan(parts, factors)?;
    let o = offsets(descs.len(), tasks.len(), groups.len(), rows.is_some());
    let mut buf = match reuse.filter(|b| b.len() >= o.total) {
        Some(b) => b,
        None => stream.alloc_zeros::<u64>(o.total)?,
    };
    let tt = rows.map(|r| tally_tensors(parts, r)).unwrap_or_default();
    for (at, words) in [
        (1, as_words(&descs)),
        (o.tasks, as_words(&tasks)),
        (o.groups, as_words(groups)),
        (o.tally, as_words(&tt)),
    ] {
        if !words.is_empty() {
            stream.memcpy_htod(words, &mut buf.slice_mut(at..at + words.len()))?;
        }
    }
    Ok((buf, tasks.len() as u64))
}

/// A launch's tables as the kernel takes them: its buffer at `base`, and their counts
/// `(tasks, tensors, groups)`.
pub(crate) type LaunchTables = (UpdateTables, (u64, u64, u64));

/// The tables' addresses in a buffer at `base` laid out as `o`.
fn tables_at(base: u64, o: Offsets, stats: bool) -> UpdateTables {
    let at = |words: usize| base + 8 * words as u64;
    UpdateTables {
        counter: base,
        tensors: base + 8,
        tasks: at(o.tasks),
        groups: at(o.groups),
        scratch: if stats { at(o.scratch) } else { 0 },
        tally_tensors: if stats { at(o.tally) } else { 0 },
    }
}

impl UpdateUpload {
    /// The tables of one update launch over `list`'s groups `members` (`groups`: their entries,
    /// in that order; each list tensor's extras: `stats`, with room for the step's telemetry and
    /// its rows as given, empty for the list's order; `factors`, its gradient factors, or empty)
    /// in device memory, and their
    /// counts: under CUDA-graph capture, fresh ones that the graph owns (as the norm's,
    /// [`capture`]); otherwise the launch's slot (found by its parameters), uploaded again in
    /// the parts that changed. A new launch takes a new slot, or the least recently used one's
    /// buffer once the slots number twice the step's `launches` (so no launch of one step takes
    /// another's: every slot used in this step is newer than at least `launches` others; every
    /// copy is ordered after the launches that read the buffer on this stream).
    pub(crate) fn tables(
        &mut self,
        stream: &Arc<CudaStream>,
        list: &StepList,
        members: &[usize],
        groups: &[UpdateGroup],
        launches: usize,
        (stats, factors): (Option<&[u32]>, &[GradFactors]),
    ) -> Result<LaunchTables> {
        let parts = launch_parts(list, members);
        let factors = launch_factors(list, members, factors);
        let rows = stats.map(|given| launch_rows(list, members, given));
        let stats = stats.is_some();
        match capture::status(stream)? {
            Capture::Active(graph) => {
                let (descs, tasks) = plan(&parts, &factors)?;
                let o = offsets(descs.len(), tasks.len(), groups.len(), stats);
                let tt = rows.as_deref().map(|r| tally_tensors(&parts, r)).unwrap_or_default();
                let regions = [
                    (8, as_words(&descs)),
                    (8 * o.tasks, as_words(&tasks)),
                    (8 * o.groups, as_words(groups)),
                    (8 * o.tally, as_words(&tt)),
                ];
                let base = capture::upload_words_owned_by(stream, graph, 8 * o.total, 8, &regions)?;
                let counts = (tasks.len() as u64, descs.len() as u64, groups.len() as u64);
                return Ok((tables_at(base, o, stats), counts));
            }
            Capture::None => capture::free_released(stream),
        }
        self.clock += 1;
        let key = params_key(members.len(), &parts);
        let at = match self.by_params.get(&key) {
            Some(&i) => {
                let u = &mut self.slots[i];
                if u.parts != parts || u.factors != factors || u.rows.is_some() != stats {
                    if same_but_grads(&u.parts, &parts) && u.rows.is_some() == stats {
                        // New gradients of the same parameters (a training loop's every step),
                        // or new factors: only the tensor table, ordered after the launches
                        // that read it.
                        let descs = descriptors(&parts, &factors);
                        let dw = as_words(&descs);
                        stream.memcpy_htod(dw, &mut u.buf.slice_mut(1..1 + dw.len()))?;
                    } else {
                        let old = std::mem::replace(&mut u.buf, stream.alloc_zeros::<u64>(1)?);
                        let (buf, num_tasks) = upload(stream, (&parts, &factors), groups, rows.as_deref(), Some(old))?;
                        (u.buf, u.num_tasks, u.groups, u.rows) = (buf, num_tasks, groups.to_vec(), rows.clone());
                    }
                    u.parts = parts;
                    u.factors = factors;
                }
                let o = offsets(u.parts.len(), u.num_tasks as usize, groups.len(), stats);
                if u.groups != groups {
                    // New hyperparameters (a learning-rate schedule's every step): the group
                    // table alone.
                    let gw = as_words(groups);
                    stream.memcpy_htod(gw, &mut u.buf.slice_mut(o.groups..o.groups + gw.len()))?;
                    u.groups = groups.to_vec();
                }
                if let Some(r) = rows.filter(|r| u.rows.as_ref() != Some(r)) {
                    // The same tensors at other places of the step's list.
                    let tt = tally_tensors(&u.parts, &r);
                    let tw = as_words(&tt);
                    stream.memcpy_htod(tw, &mut u.buf.slice_mut(o.tally..o.tally + tw.len()))?;
                    u.rows = Some(r);
                }
                i
            }
            None => {
                let keep = KEPT_LAUNCHES.max(2 * launches);
                // The least recently used slot's buffer, when full (reused if large enough).
                let oldest = (self.slots.len() >= keep)
                    .then(|| (0..self.slots.len()).min_by_key(|&i| self.slots[i].used))
                    .flatten();
                let reuse = match oldest {
                    Some(i) => {
                        self.by_params.remove(&self.slots[i].key);
                        Some((i, std::mem::replace(&mut self.slots[i].buf, stream.alloc_zeros::<u64>(1)?)))
                    }
                    None => None,
                };
                let (at, old) = match reuse {
                    Some((i, old)) => (i, Some(old)),
                    None => (self.slots.len(), None),
                };
                let (buf, num_tasks) = upload(stream, (&parts, &factors), groups, rows.as_deref(), old)?;
                let slot = Uploaded {
                    key,
                    parts,
                    factors,
                    groups: groups.to_vec(),
                    rows,
                    buf,
                    num_tasks,
                    used: 0,
                };
                if at == self.slots.len() {
                    self.slots.push(slot);
                } else {
                    self.slots[at] = slot;
                }
                self.by_params.insert(key, at);
                at
            }
        };
        let u = &mut self.slots[at];
        u.used = self.clock;
        let (base, _g) = u.buf.device_ptr(stream);
        let (tensors, tasks) = (u.parts.len(), u.num_tasks as usize);
        let o = offsets(tensors, tasks, groups.len(), stats);
        Ok((tables_at(base, o, stats), (u.num_tasks, tensors as u64, groups.len() as u64)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::optim::{AdamConfig, Rule};
    use crate::plan::RawTensor;

    fn raw(addr: u64, len: u64, dtype: DType) -> RawTensor {
        RawTensor { addr, len, dtype }
    }

    fn parts(i: u64, len: u64, p: DType, s: DType, amsgrad: bool) -> Parts {
        let at = |k: u64| (i + 1) << 32 | k << 24;
        Parts::adam(
            raw(at(0), len, p),
            raw(at(1), len, p),
            raw(at(2), len, s),
            raw(at(3), len, s),
            amsgrad.then(|| raw(at(4), len, s)),
        )
    }

    /// Tasks enumerate each parameter's chunks (their length set by the parameter's dtype) in
    /// order; the table carries every part's address and the three dtypes packed as the kernel
    /// unpacks them.
    #[test]
    fn plan_tasks_and_descriptors() {
        let (narrow, wide) = (update_chunk_elems(2), update_chunk_elems(8));
        let list = [
            parts(0, 2 * narrow + 1808, DType::Bf16, DType::F32, true),
            parts(1, 0, DType::F32, DType::F32, false),
            parts(2, wide, DType::F64, DType::F64, false),
            parts(3, narrow, DType::F32, DType::F32, false),
        ];
        let list: Vec<(u32, Parts)> = list.into_iter().map(|p| (0, p)).collect();
        let factors = [
            GradFactors::default(),
            GradFactors::default(),
            GradFactors {
                addr: 4096,
                unit_len: 7,
                step: 16,
            },
        ];
        let (descs, tasks) = plan(&list, &factors).unwrap();
        let f32_chunks = narrow.div_ceil(update_chunk_elems(4)) as u32;
        let want: Vec<(u32, u32)> = [(0, 0), (0, 1), (0, 2), (2, 0)]
            .into_iter()
            .chain((0..f32_chunks).map(|c| (3, c)))
            .collect();
        assert_eq!(tasks.iter().map(|t| (t.tensor, t.chunk)).collect::<Vec<_>>(), want);
        assert_eq!(
            descs[0].dtypes,
            DType::Bf16.code() | DType::Bf16.code() << 4 | DType::F32.code() << 8
        );
        assert_eq!((descs[0].states[2], descs[1].states[2]), (list[0].1.states[2].unwrap().addr, 0));
        assert_eq!((descs[2].grad, descs[2].len), (list[2].1.grad.addr, wide));
        // The gradient factors of the tensors given them, none past the given.
        assert_eq!((descs[2].factors, descs[2].unit_len, descs[2].factor_step), (4096, 7, 16));
        assert_eq!((descs[0].factors, descs[3].factors), (0, 0));
    }

    #[test]
    fn overlapping_parts_are_refused() {
        let mut p = parts(0, 100, DType::F32, DType::F32, false);
        use crate::optim::check;
        let adamw = Rule::Adam(AdamConfig::adamw(1e-3));
        let check = |p: &[Parts], _| check(p, &adamw);
        assert!(check(&[p], false).is_ok());
        p.states[0].as_mut().unwrap().addr = p.param.addr + 8;
        assert!(matches!(check(&[p], false), Err(Error::Overlap { .. })));
        let (a, mut b) = (
            parts(0, 100, DType::F32, DType::F32, false),
            parts(1, 100, DType::F32, DType::F32, false),
        );
        b.grad = a.states[1].unwrap();
        assert!(
            matches!(check(&[a, b], false), Err(Error::Overlap { .. })),
            "a gradient on another parameter's state"
        );
        b = parts(1, 100, DType::F32, DType::F32, false);
        b.param.addr = 0;
        assert!(matches!(check(&[a, b], false), Err(Error::NullPointer { .. })));
    }
}
