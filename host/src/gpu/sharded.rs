//! The sharded clip on the GPU ([`GpuEngine::clip_grad_norm_sharded`],
//! [`GpuEngine::clip_grad_norm_sharded_groups`]): gradients whose shards live on several ranks,
//! clipped by their global norm, as [`crate::sharded`] (the one algorithm, Python's too) orders
//! it. The local norm kernel, one-thread kernels that turn norms into the partials the ranks
//! combine (their p-th powers, or the norms for inf), one all-reduce per process group through
//! a [`Communicator`], a one-thread kernel that writes the global norm, the clip coefficient and
//! the flags, and the scale kernel: all enqueued on the engine's stream, no host
//! synchronization, capturable when the communicator is (NCCL is; one set of groups). The same
//! combine steps on caller memory (`*_raw`) serve callers whose collectives are their own.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

use super::buffers::DeviceGradMut;
use super::comm::{Communicator, Reduce};
use super::device_norm::DeviceNorm;
use super::engine::GpuEngine;
use super::launch;
use super::output::Dest;
use crate::error::Result;
use crate::norm::{ClipOptions, NormType, validate_max_norm};
use crate::plan::RawTensor;
use crate::sharded::Reduction;
use crate::tensor_list::TensorList;

impl GpuEngine {
    /// Clips this rank's shards `grads` by the global norm of the gradients they are shards of:
    /// the local norms are combined over every group of `over` (the process groups the shards
    /// are split over, in the same order on every rank; groups of one rank are skipped), as
    /// `torch.nn.utils.clip_grad_norm_` on the whole gradients would, and the norm, coefficient
    /// and flags go to `out` (a [`DeviceNorm`] of this stream without per-tensor room). Every
    /// rank of every group must make this call with the same `norm_type` and `max_norm`.
    ///
    /// Replicated gradients (the same values on every rank of a group) must not be passed with a
    /// group they are replicated over: their norm would be counted once per rank.
    pub fn clip_grad_norm_sharded(
        &mut self,
        grads: &mut [&mut (dyn DeviceGradMut + '_)],
        max_norm: f64,
        norm_type: NormType,
        over: &[&dyn Communicator],
        out: &mut DeviceNorm,
    ) -> Result<()> {
        validate_max_norm(max_norm)?;
        let norm_type = norm_type.validated()?;
        let reduce: Vec<&dyn Communicator> = over.iter().copied().filter(|c| c.size() > 1).collect();
        if reduce.is_empty() {
            let opts = ClipOptions {
                norm_type,
                ..Default::default()
            };
            self.clip_grad_norm(grads, max_norm, &opts, &mut *out)?;
            return Ok(());
        }
        self.check_contexts(grads.iter().map(|g| g.context()))?;
        let stream = self.stream().clone();
        let (raws, _guards): (Vec<RawTensor>, Vec<SyncOnDrop<'_>>) = grads.iter_mut().map(|g| g.as_raw_mut(&stream)).unzip();
        let prepared = self.prepare(&TensorList::unchecked(&raws), true)?;
        let addrs = out.addresses(&stream, 0)?;
        let o = addrs.norm;
        let op = if norm_type == NormType::Inf { Reduce::Max } else { Reduce::Sum };
        // SAFETY: the gradients are live cudarc allocations of this context (checked above),
        // borrowed until the launches are enqueued, pairwise disjoint (prepare); `o` is the
        // DeviceNorm's NormOutput; the partial is the engine's own f64. Every launch is ordered
        // on the engine's stream, and so are the all-reduces (each communicator checks it).
        let ks = self.kernel_set();
        unsafe {
            self.run(norm_type, &prepared, 0.0, 0, Dest::at(o))?;
            let (partial, _g) = self.partial.device_ptr_mut(&stream);
            launch::norm_to_partial(&stream, &ks, o, partial, norm_type)?;
        }
        let reduction = Reduction::new(&[(0..reduce.len()).collect()], reduce.len())?;
        all_reduce(&reduction, &reduce, &mut self.partial, op, &stream)?;
        // SAFETY: as above; the partial now holds the combined value (stream-ordered).
        unsafe {
            let (partial, _g) = self.partial.device_ptr(&stream);
            launch::norm_from_partial(&stream, &ks, partial, o, norm_type, max_norm)?;
            self.scale_prepared(&prepared, o)?;
        }
        drop(addrs);
        Ok(())
    }
}

/// One group of this rank's gradients for [`GpuEngine::clip_grad_norm_sharded_groups`], and the
/// process groups their norm is summed over (none: gradients replicated on every rank, or held
/// by this rank alone, counted once).
pub struct ShardGroup<'a, 'b, 'c> {
    /// The gradients (this rank's shards).
    pub grads: &'a mut [&'b mut (dyn DeviceGradMut + 'c)],
    /// The process groups they are split over.
    pub over: &'a [&'a dyn Communicator],
}

/// Every all-reduce of `reduction` on `partials` (one f64 per slot) through the communicators of
/// its groups, in its order, on `stream`. A group whose slots are apart reduces them gathered
/// into one buffer (device copies, stream-ordered): one collective per group.
fn all_reduce(
    reduction: &Reduction,
    comms: &[&dyn Communicator],
    partials: &mut CudaSlice<f64>,
    op: Reduce,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    for a in reduction.all_reduces() {
        let comm = comms[a.group];
        if let [run] = &a.runs[..] {
            comm.all_reduce_f64(&mut partials.slice_mut(run.clone()), op, stream)?;
            continue;
        }
        let mut gathered = stream.alloc_zeros::<f64>(a.len())?;
        let mut at = 0;
        for run in &a.runs {
            stream.memcpy_dtod(&partials.slice(run.clone()), &mut gathered.slice_mut(at..at + run.len()))?;
            at += run.len();
        }
        comm.all_reduce_f64(&mut gathered.slice_mut(..), op, stream)?;
        at = 0;
        for run in &a.runs {
            stream.memcpy_dtod(&gathered.slice(at..at + run.len()), &mut partials.slice_mut(run.clone()))?;
            at += run.len();
        }
    }
    Ok(())
}

/// A communicator's identity within one call: its address.
fn identity(c: &dyn Communicator) -> usize {
    (c as *const dyn Communicator).cast::<()>() as usize
}

impl GpuEngine {
    /// [`GpuEngine::clip_grad_norm_sharded`] for gradients split over different process groups in
    /// one call (tensor-parallel shards and replicated norms, experts on their own groups): each
    /// group's norm is summed over its own process groups only, then all are combined into the
    /// global norm, and every gradient is scaled by its coefficient. The per-tensor norms are
    /// grouped by the set of process groups (one key per distinct set) and combined as
    /// [`crate::sharded::Reduction`] orders them, the process groups taken in the order they
    /// first appear in `groups`, which must be the same on every rank. A rank holding no
    /// gradients of some group passes it with an empty list. Not capturable
    /// ([`crate::Error::NotCapturable`]; one group of process groups is).
    pub fn clip_grad_norm_sharded_groups(
        &mut self,
        groups: &mut [ShardGroup<'_, '_, '_>],
        max_norm: f64,
        norm_type: NormType,
        out: &mut DeviceNorm,
    ) -> Result<()> {
        validate_max_norm(max_norm)?;
        let norm_type = norm_type.validated()?;
        // The process groups in first-appearance order (groups of one rank have nothing to add).
        let mut comms: Vec<&dyn Communicator> = Vec::new();
        for g in groups.iter() {
            for &c in g.over {
                if c.size() > 1 && !comms.iter().any(|&x| identity(x) == identity(c)) {
                    comms.push(c);
                }
            }
        }
        let keys: Vec<Vec<usize>> = groups
            .iter()
            .map(|g| {
                (0..comms.len())
                    .filter(|&i| g.over.iter().any(|c| identity(*c) == identity(comms[i])))
                    .collect()
            })
            .collect();
        let reduction = Reduction::new(&keys, comms.len())?;
        if reduction.num_slots() == 1 {
            // One set for everything: the one-key path (norm kernel partials, capturable).
            let over: Vec<&dyn Communicator> = keys[0].iter().map(|&i| comms[i]).collect();
            let mut all: Vec<&mut (dyn DeviceGradMut + '_)> = Vec::new();
            for g in groups.iter_mut() {
                for x in g.grads.iter_mut() {
                    all.push(&mut **x);
                }
            }
            return self.clip_grad_norm_sharded(&mut all, max_norm, norm_type, &over, out);
        }
        if let super::capture::Capture::Active(_) = super::capture::status(self.stream())? {
            return Err(crate::Error::NotCapturable {
                what: "a sharded clip over several sets of process groups",
                instead: "capture a clip whose gradients are all split over the same process groups",
            });
        }
        let ctxs: Vec<_> = groups.iter().flat_map(|g| g.grads.iter().map(|x| x.context().clone())).collect();
        self.check_contexts(ctxs.iter())?;
        let stream = self.stream().clone();
        let mut raws = Vec::new();
        let mut key_of = Vec::new();
        let mut guards: Vec<SyncOnDrop<'_>> = Vec::new();
        for (k, g) in groups.iter_mut().enumerate() {
            for x in g.grads.iter_mut() {
                let (r, gd) = x.as_raw_mut(&stream);
                raws.push(r);
                guards.push(gd);
                key_of.push(Some(k));
            }
        }
        let n = raws.len();
        let num_slots = reduction.num_slots();
        let tables = reduction.key_tables(&key_of)?;
        let prepared = self.prepare(&TensorList::unchecked(&raws), true)?;
        let per_tensor = stream.alloc_zeros::<f64>(n.max(1))?;
        let tables = stream.clone_htod(&tables)?;
        let mut partials = stream.alloc_zeros::<f64>(num_slots)?;
        let addrs = out.addresses(&stream, 0)?;
        let o = addrs.norm;
        let ks = self.kernel_set();
        let op = if norm_type == NormType::Inf { Reduce::Max } else { Reduce::Sum };
        // SAFETY: the gradients are live cudarc allocations of this context (checked above),
        // borrowed until the launches are enqueued and pairwise disjoint (prepare); `o` is the
        // DeviceNorm's NormOutput; `per_tensor` has one f64 per tensor, `tables` the index list
        // (n entries) then the key offsets (keys + 1, ending at n), `partials` one f64 per key;
        // every launch and all-reduce is ordered on the engine's stream.
        unsafe {
            let (pt, _g1) = per_tensor.device_ptr(&stream);
            self.run(
                norm_type,
                &prepared,
                0.0,
                0,
                Dest {
                    per_tensor: Some(pt),
                    ..Dest::at(o)
                },
            )?;
            let (tb, _g2) = tables.device_ptr(&stream);
            let (pp, _g3) = partials.device_ptr_mut(&stream);
            let kt = launch::KeyTables {
                idx: tb,
                offsets: tb + 4 * n as u64,
                num_keys: num_slots as u32,
            };
            launch::key_partials(&stream, &ks, pt, &kt, pp, norm_type)?;
        }
        all_reduce(&reduction, &comms, &mut partials, op, &stream)?;
        // SAFETY: as above; the partials are combined (stream-ordered).
        unsafe {
            let (pp, _g) = partials.device_ptr(&stream);
            launch::keys_total(&stream, &ks, pp, num_slots as u32, o, norm_type, max_norm)?;
            self.scale_prepared(&prepared, o)?;
        }
        drop(addrs);
        drop(guards);
        Ok(())
    }
}

/// The combine kernels on caller-owned device memory, for callers whose collectives are their
/// own (`gradclip.torch` over torch.distributed): the steps of [`crate::sharded`] around the
/// all-reduces, each one launch on the engine's stream.
impl GpuEngine {
    /// Launches `partial[0]` = the partial of the f64 norm at `norm` (a NormOutput's first
    /// field, or any f64 norm).
    ///
    /// # Safety
    /// `norm` is one f64 written before on the engine's stream (or ordered before it), `partial`
    /// one f64; both 8-aligned device memory of the engine's context, live until the launch
    /// completes.
    pub unsafe fn to_partial_raw(&mut self, norm: u64, partial: u64, norm_type: NormType) -> Result<()> {
        let norm_type = norm_type.validated()?;
        let ks = self.kernel_set();
        // SAFETY: the caller's contract.
        unsafe { launch::norm_to_partial(self.stream(), &ks, norm, partial, norm_type) }
    }

    /// Launches `gradclip_key_partials`: `partials[s]` for each of `num_slots` slots from the
    /// f64 norms at `per_tensor` and the key tables at `tables` (`num_indexed` u32 indices, then
    /// `num_slots + 1` offsets: [`crate::sharded::Reduction::key_tables`], uploaded).
    ///
    /// # Safety
    /// The tables are those of `Reduction::key_tables` for a list of at most as many tensors as
    /// `per_tensor` holds norms; `per_tensor`, `tables` and `partials` (`num_slots` f64s) are
    /// device memory of the engine's context written before on its stream, live until the
    /// launch completes.
    pub unsafe fn key_partials_raw(
        &mut self,
        per_tensor: u64,
        tables: u64,
        num_indexed: usize,
        num_slots: usize,
        partials: u64,
        norm_type: NormType,
    ) -> Result<()> {
        let norm_type = norm_type.validated()?;
        if num_slots == 0 || num_slots > crate::sharded::MAX_KEYS {
            return Err(crate::Error::ShardedLayout {
                detail: format!("{num_slots} slots for the key partials; 1 to {}", crate::sharded::MAX_KEYS),
            });
        }
        let ks = self.kernel_set();
        let kt = launch::KeyTables {
            idx: tables,
            offsets: tables + 4 * num_indexed as u64,
            num_keys: num_slots as u32,
        };
        // SAFETY: the caller's contract; the block fits the slots (checked above).
        unsafe { launch::key_partials(self.stream(), &ks, per_tensor, &kt, partials, norm_type) }
    }

    /// Launches `gradclip_keys_total`: the NormOutput at `out` gets the global norm of the
    /// `num_slots` combined partials at `partials` and its clip coefficient for `max_norm`.
    ///
    /// # Safety
    /// `partials` (`num_slots` f64s, all-reduced before on the engine's stream) and `out` (a
    /// NormOutput) are device memory of the engine's context, live until the launch completes.
    pub unsafe fn keys_total_raw(&mut self, partials: u64, num_slots: usize, out: u64, norm_type: NormType, max_norm: f64) -> Result<()> {
        validate_max_norm(max_norm)?;
        let norm_type = norm_type.validated()?;
        let ks = self.kernel_set();
        // SAFETY: the caller's contract.
        unsafe { launch::keys_total(self.stream(), &ks, partials, num_slots as u32, out, norm_type, max_norm) }
    }
}
