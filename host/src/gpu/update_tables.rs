//! The optimizer kernels' tables (descriptors and tasks) of the parameter groups stepped last,
//! kept in the engine's own memory by the groups' parameters, for every rule alike: an update
//! re-plans and uploads a group's only when its tensors change (its descriptors alone when only
//! its gradients are new).

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use gradclip_kernels::abi::{ChunkTask, UpdateTensorDesc, update_chunk_elems};

use super::capture::{self, Capture};
use super::launch::UpdateTables;
use super::words::as_words;
use crate::error::{Error, Result};
use crate::optim::{Parts, StepList};
use crate::plan::MAX_TASKS;

/// The optimizer tables of the parameter groups stepped last, in the engine's own memory
/// (counter word, tensor table, task table), found by the group's parameters: a step over
/// hundreds of groups finds each group's in one lookup, and uploads nothing when its tensors
/// came back (its descriptors alone when only its gradients are new).
#[derive(Debug, Default)]
pub(crate) struct UpdateUpload {
    slots: Vec<Uploaded>,
    /// Each slot's place, by [`params_key`].
    by_params: HashMap<(usize, u64), usize>,
    /// Advances with every lookup; a slot's `used` is its last.
    clock: u64,
}

#[derive(Debug)]
struct Uploaded {
    /// [`params_key`] of `parts`.
    key: (usize, u64),
    parts: Vec<Parts>,
    buf: CudaSlice<u64>,
    num_tasks: u64,
    used: u64,
}

/// Groups' tables kept at least (a step keeps every group's: up to twice its group count).
const KEPT_LISTS: usize = 8;

/// What finds a group's slot: its parameter count and its first parameter's address (a
/// parameter belongs to one group, and a group keeps its parameters from step to step).
fn params_key(parts: &[Parts]) -> (usize, u64) {
    (parts.len(), parts.first().map_or(0, |p| p.param.addr))
}

/// The kernel's tables for `parts` (checked by the caller).
fn plan(parts: &[Parts]) -> Result<(Vec<UpdateTensorDesc>, Vec<ChunkTask>)> {
    let mut tasks = Vec::new();
    for (i, p) in parts.iter().enumerate() {
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
/// kernel unpacks them. The task table depends only on the parameters' lengths and dtypes: a
/// parameter whose gradient is absent keeps its tasks, with a length of 0 (they do nothing)
/// and no step count to advance.
fn descriptors(parts: &[Parts]) -> Vec<UpdateTensorDesc> {
    parts
        .iter()
        .map(|p| UpdateTensorDesc {
            param: p.param.addr,
            grad: p.grad.addr,
            states: p.states.map(|s| s.map_or(0, |s| s.addr)),
            len: p.grad.len, // the parameter's (checked), or 0 for an absent gradient
            dtypes: p.param.dtype.code() | p.grad.dtype.code() << 4 | p.states[0].map_or(p.param.dtype, |s| s.dtype).code() << 8,
            reserved: 0,
            step: if p.grad_absent() { 0 } else { p.step.map_or(0, |s| s.addr) },
        })
        .collect()
}

/// True when `b` is `a` with other gradient addresses (the same tasks, new descriptors).
fn same_but_grads(a: &[Parts], b: &[Parts]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| Parts { grad: b.grad, ..*a } == *b)
}

/// `parts`' tables uploaded on `stream` into `reuse` when it is large enough (its counter word
/// is zero: every launch leaves it so, and the copies never touch it), else into a new buffer;
/// and their task count. Every copy is ordered after the launches that read `reuse`.
fn upload(stream: &Arc<CudaStream>, parts: &[Parts], reuse: Option<CudaSlice<u64>>) -> Result<(CudaSlice<u64>, u64)> {
    let (descs, tasks) = plan(parts)?;
    let (dw, tw) = (as_words(&descs), as_words(&tasks));
    let words = 1 + dw.len() + tw.len();
    let mut buf = match reuse.filter(|b| b.len() >= words) {
        Some(b) => b,
        None => stream.alloc_zeros::<u64>(words)?,
    };
    let mut at = 1;
    for words in [dw, tw] {
        if !words.is_empty() {
            stream.memcpy_htod(words, &mut buf.slice_mut(at..at + words.len()))?;
        }
        at += words.len();
    }
    Ok((buf, tasks.len() as u64))
}

impl UpdateUpload {
    /// The optimizer tables of group `group` of `list` in device memory and their task count:
    /// under CUDA-graph capture, fresh ones that the graph owns (as the norm's, [`capture`]);
    /// otherwise the group's slot (found by its parameters), uploaded again when its tensors
    /// changed. A new group takes a new slot, or the least recently used one's buffer once a
    /// step's groups fill twice the slots (every copy is ordered after the launches that read
    /// it on this stream).
    pub(crate) fn tables(&mut self, stream: &Arc<CudaStream>, list: &StepList, group: usize) -> Result<(UpdateTables, u64)> {
        let parts = list.group(group).0;
        match capture::status(stream)? {
            Capture::Active(graph) => {
                let (descs, tasks) = plan(parts)?;
                let (dw, tw) = (as_words(&descs), as_words(&tasks));
                let tasks_at = 8 + 8 * dw.len();
                let base = capture::upload_words_owned_by(stream, graph, tasks_at + 8 * tw.len(), 8, &[(8, dw), (tasks_at, tw)])?;
                let tables = UpdateTables {
                    counter: base,
                    tensors: base + 8,
                    tasks: base + tasks_at as u64,
                };
                return Ok((tables, tasks.len() as u64));
            }
            Capture::None => capture::free_released(stream),
        }
        self.clock += 1;
        let key = params_key(parts);
        let at = match self.by_params.get(&key) {
            Some(&i) => {
                let u = &mut self.slots[i];
                if u.parts != parts {
                    if same_but_grads(&u.parts, parts) {
                        // New gradients of the same parameters (a training loop's every step):
                        // only the tensor table, ordered after the launches that read it.
                        let descs = descriptors(parts);
                        let dw = as_words(&descs);
                        stream.memcpy_htod(dw, &mut u.buf.slice_mut(1..1 + dw.len()))?;
                    } else {
                        let old = std::mem::replace(&mut u.buf, stream.alloc_zeros::<u64>(1)?);
                        let (buf, num_tasks) = upload(stream, parts, Some(old))?;
                        (u.buf, u.num_tasks) = (buf, num_tasks);
                    }
                    u.parts = parts.to_vec();
                }
                i
            }
            None => {
                let keep = KEPT_LISTS.max(2 * list.groups());
                // The least recently used slot's buffer, when full (reused if large enough).
                let oldest = (self.slots.len() >= keep)
                    .then(|| (0..self.slots.len()).min_by_key(|&i| self.slots[i].used))
                    .flatten();
                match oldest {
                    Some(i) => {
                        let u = &mut self.slots[i];
                        self.by_params.remove(&u.key);
                        let old = std::mem::replace(&mut u.buf, stream.alloc_zeros::<u64>(1)?);
                        let (buf, num_tasks) = upload(stream, parts, Some(old))?;
                        *u = Uploaded {
                            key,
                            parts: parts.to_vec(),
                            buf,
                            num_tasks,
                            used: 0,
                        };
                        self.by_params.insert(key, i);
                        i
                    }
                    None => {
                        let (buf, num_tasks) = upload(stream, parts, None)?;
                        self.slots.push(Uploaded {
                            key,
                            parts: parts.to_vec(),
                            buf,
                            num_tasks,
                            used: 0,
                        });
                        self.by_params.insert(key, self.slots.len() - 1);
                        self.slots.len() - 1
                    }
                }
            }
        };
        let u = &mut self.slots[at];
        u.used = self.clock;
        let (base, _g) = u.buf.device_ptr(stream);
        let descs_bytes = (u.parts.len() * size_of::<UpdateTensorDesc>()) as u64;
        Ok((
            UpdateTables {
                counter: base,
                tensors: base + 8,
                tasks: base + 8 + descs_bytes,
            },
            u.num_tasks,
        ))
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
        let (descs, tasks) = plan(&list).unwrap();
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
