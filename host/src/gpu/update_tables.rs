//! The optimizer kernels' tables (descriptors, tasks and the group table) of the step lists
//! used last, kept in the engine's own memory by the list's identity, for every rule alike: an
//! update re-plans and uploads its tensor tables only when its list changes, and its group table
//! (hyperparameters: an LR schedule changes them every step) only when its values change.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use gradclip_kernels::abi::{ChunkTask, UpdateGroup, UpdateTensorDesc, update_chunk_elems};

use super::capture::{self, Capture};
use super::launch::UpdateTables;
use super::words::as_words;
use crate::error::{Error, Result};
use crate::optim::{Parts, StepList};
use crate::plan::MAX_TASKS;

/// The optimizer tables of the launches uploaded last, in the engine's own memory: counter word,
/// tensor table, task table, group table.
#[derive(Debug, Default)]
pub(crate) struct UpdateUpload {
    lists: Vec<Uploaded>,
}

#[derive(Debug)]
struct Uploaded {
    /// The [`StepList`] and its groups (in launch order) these tables were uploaded for.
    key: (u64, Vec<usize>),
    /// The launch's parameters, group after group, each with its place in the group table.
    parts: Vec<(u32, Parts)>,
    /// The group table as uploaded.
    table: Vec<UpdateGroup>,
    buf: CudaSlice<u64>,
    num_tasks: u64,
}

/// Launches kept uploaded (the most recently used first).
const KEPT_LISTS: usize = 8;

/// A launch's parameters: those of `list`'s groups `groups`, each with the group's place in the
/// launch.
fn launch_parts(list: &StepList, groups: &[usize]) -> Vec<(u32, Parts)> {
    let mut out = Vec::with_capacity(groups.iter().map(|&g| list.group(g).0.len()).sum());
    for (at, &g) in groups.iter().enumerate() {
        out.extend(list.group(g).0.iter().map(|p| (at as u32, *p)));
    }
    out
}

/// The kernel's tables for `parts` (checked by the caller).
fn plan(parts: &[(u32, Parts)]) -> Result<(Vec<UpdateTensorDesc>, Vec<ChunkTask>)> {
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
    Ok((descriptors(parts), tasks))
}

/// The tensor table of `parts`: every part's address, the length, the dtypes packed as the
/// kernel unpacks them, the group. The task table depends only on the parameters' lengths and
/// dtypes: a parameter whose gradient is absent keeps its tasks, with a length of 0 (they do
/// nothing) and no step count to advance.
fn descriptors(parts: &[(u32, Parts)]) -> Vec<UpdateTensorDesc> {
    parts
        .iter()
        .map(|&(group, p)| UpdateTensorDesc {
            param: p.param.addr,
            grad: p.grad.addr,
            states: p.states.map(|s| s.map_or(0, |s| s.addr)),
            len: p.grad.len, // the parameter's (checked), or 0 for an absent gradient
            dtypes: p.param.dtype.code() | p.grad.dtype.code() << 4 | p.states[0].map_or(p.param.dtype, |s| s.dtype).code() << 8,
            group,
            step: if p.grad_absent() { 0 } else { p.step.map_or(0, |s| s.addr) },
        })
        .collect()
}

/// True when `b` is `a` with other gradient addresses (the same tasks, new descriptors).
fn same_but_grads(a: &[(u32, Parts)], b: &[(u32, Parts)]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| a.0 == b.0 && Parts { grad: b.1.grad, ..a.1 } == b.1)
}

/// Word offsets of a buffer's tables: `(tensors, tasks, groups, total)` (the counter is word 0).
fn offsets(tensors: usize, tasks: usize, groups: usize) -> (usize, usize, usize, usize) {
    let dw = tensors * size_of::<UpdateTensorDesc>() / 8;
    let tw = (tasks * size_of::<ChunkTask>()).div_ceil(8);
    let gw = groups * size_of::<UpdateGroup>() / 8;
    (1, 1 + dw, 1 + dw + tw, 1 + dw + tw + gw)
}

impl UpdateUpload {
    /// The optimizer tables of one launch over groups `groups` of `list` (`table`: their group
    /// entries, in that order) in device memory, their task and tensor counts: under CUDA-graph
    /// capture, fresh ones that the graph owns (as the norm's, [`capture`]); otherwise uploaded
    /// unless a launch kept is this one or has the same parts (its group table uploaded again
    /// when its values differ). A new upload reuses the least recently used buffer when it is
    /// large enough (every copy is ordered after the launches that read it on this stream).
    pub(crate) fn tables(
        &mut self,
        stream: &Arc<CudaStream>,
        list: &StepList,
        groups: &[usize],
        table: &[UpdateGroup],
    ) -> Result<(UpdateTables, u64, u64)> {
        let parts = launch_parts(list, groups);
        let tables_at = |base: u64, n: usize, tasks: usize| {
            let (dw, tw, gw, _) = offsets(n, tasks, table.len());
            UpdateTables {
                counter: base,
                tensors: base + 8 * dw as u64,
                tasks: base + 8 * tw as u64,
                groups: base + 8 * gw as u64,
            }
        };
        if let Capture::Active(graph) = capture::status(stream)? {
            let (descs, tasks) = plan(&parts)?;
            let (dw, tw, gw, total) = offsets(descs.len(), tasks.len(), table.len());
            let copies = [(8 * dw, as_words(&descs)), (8 * tw, as_words(&tasks)), (8 * gw, as_words(table))];
            let base = capture::upload_words_owned_by(stream, graph, 8 * total, 8, &copies)?;
            return Ok((tables_at(base, descs.len(), tasks.len()), tasks.len() as u64, descs.len() as u64));
        }
        capture::free_released(stream);
        let key = (list.id(), groups.to_vec());
        let lists = &mut self.lists;
        let fits = |u: &Uploaded| u.table.len() == table.len();
        let same = lists.iter().position(|u| fits(u) && (u.key == key || u.parts == parts));
        // New gradients of the same parameters (a training loop's every step): only the tensor
        // table is uploaded again, into the tables of the last such launch.
        let moved = same
            .is_none()
            .then(|| lists.iter().position(|u| fits(u) && same_but_grads(&u.parts, &parts)))
            .flatten();
        match (same, moved) {
            (Some(i), _) => {
                let mut u = lists.remove(i);
                u.key = key;
                lists.insert(0, u);
            }
            (None, Some(i)) => {
                let mut u = lists.remove(i);
                let descs = descriptors(&parts);
                let dw = as_words(&descs);
                stream.memcpy_htod(dw, &mut u.buf.slice_mut(1..1 + dw.len()))?;
                u.key = key;
                u.parts = parts;
                lists.insert(0, u);
            }
            (None, None) => {
                let (descs, tasks) = plan(&parts)?;
                let (_, tw, gw, total) = offsets(descs.len(), tasks.len(), table.len());
                // The oldest buffer, when full and large enough; its counter word is zero (every
                // launch leaves it so), and the copies below never touch it.
                let reuse = (lists.len() >= KEPT_LISTS)
                    .then(|| lists.pop())
                    .flatten()
                    .filter(|u| u.buf.len() >= total);
                let mut buf = match reuse {
                    Some(u) => u.buf,
                    None => {
                        lists.truncate(KEPT_LISTS - 1);
                        stream.alloc_zeros::<u64>(total)?
                    }
                };
                for (at, words) in [(1, as_words(&descs)), (tw, as_words(&tasks)), (gw, as_words(table))] {
                    if !words.is_empty() {
                        stream.memcpy_htod(words, &mut buf.slice_mut(at..at + words.len()))?;
                    }
                }
                lists.insert(
                    0,
                    Uploaded {
                        key,
                        parts,
                        table: table.to_vec(),
                        buf,
                        num_tasks: tasks.len() as u64,
                    },
                );
            }
        }
        let u = &mut lists[0];
        let (n, num_tasks) = (u.parts.len(), u.num_tasks as usize);
        let (_, _, gw, _) = offsets(n, num_tasks, table.len());
        if u.table != table {
            // An LR schedule's new rate, say: only the group table, ordered after the launches
            // that read the old one on this stream.
            let words = as_words(table);
            stream.memcpy_htod(words, &mut u.buf.slice_mut(gw..gw + words.len()))?;
            u.table = table.to_vec();
        }
        let (base, _g) = u.buf.device_ptr(stream);
        Ok((tables_at(base, n, num_tasks), u.num_tasks, n as u64))
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
        // Two groups: the first two parameters, then the others.
        let grouped: Vec<(u32, Parts)> = list.iter().enumerate().map(|(i, p)| ((i >= 2) as u32, *p)).collect();
        let (descs, tasks) = plan(&grouped).unwrap();
        assert_eq!(descs.iter().map(|d| d.group).collect::<Vec<_>>(), [0, 0, 1, 1]);
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
        assert_eq!((descs[0].states[2], descs[1].states[2]), (list[0].states[2].unwrap().addr, 0));
        assert_eq!((descs[2].grad, descs[2].len), (list[2].grad.addr, wide));
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
