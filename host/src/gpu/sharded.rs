//! The sharded clip ([`GpuEngine::clip_grad_norm_sharded`]): gradients whose shards live on
//! several ranks, clipped by their global norm. The local norm kernel, a one-thread kernel that
//! turns the norm into the quantity the ranks combine (its p-th power, or the norm for inf), one
//! all-reduce per process group through a [`Communicator`], a one-thread kernel that writes the
//! global norm, the clip coefficient and the flags, and the scale kernel: all enqueued on the
//! engine's stream, no host synchronization, capturable when the communicator is (NCCL is).

use cudarc::driver::{DevicePtr, DevicePtrMut, SyncOnDrop};

use super::buffers::DeviceGradMut;
use super::comm::{Communicator, Reduce};
use super::device_norm::DeviceNorm;
use super::engine::GpuEngine;
use super::launch;
use crate::error::Result;
use crate::norm::{ClipOptions, NormType, validate_max_norm};
use crate::plan::RawTensor;
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
            self.run(norm_type, &prepared, 0.0, 0, o, None)?;
            let (partial, _g) = self.partial.device_ptr_mut(&stream);
            launch::norm_to_partial(&stream, &ks, o, partial, norm_type)?;
        }
        for c in &reduce {
            c.all_reduce_f64(&mut self.partial.slice_mut(..), op, &stream)?;
        }
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

/// The most distinct sets of process groups one call takes (threads of one block).
const MAX_KEYS: usize = 1024;

/// The position of `g` in the Gray-code sequence (the inverse of `i ^ (i >> 1)`).
fn inverse_gray(g: u64) -> u64 {
    let (mut b, mut s) = (g, g >> 1);
    while s != 0 {
        b ^= s;
        s >>= 1;
    }
    b
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
    /// grouped by the set of process groups (one key per distinct set), the keys of a process
    /// group are all-reduced together (one all-reduce per process group when its keys are
    /// adjacent, as they are with up to two process groups; else one per key), in the order the
    /// groups first appear in `groups`, which must be the same on every rank. A rank holding no
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
        if comms.len() > 64 {
            return Err(crate::Error::LengthMismatch {
                what: "the process groups of one sharded clip (at most 64)",
                expected: 64,
                found: comms.len(),
            });
        }
        let mask_of = |over: &[&dyn Communicator]| -> u64 {
            comms
                .iter()
                .enumerate()
                .filter(|(_, x)| over.iter().any(|c| identity(*c) == identity(**x)))
                .map(|(i, _)| 1u64 << i)
                .sum()
        };
        let masks: Vec<u64> = groups.iter().map(|g| mask_of(g.over)).collect();
        // Keys (distinct sets) in Gray-code order of their membership masks, so that each process
        // group's keys are adjacent whenever the groups allow it (always with two: {}, {A},
        // {A, B}, {B}): then one all-reduce per process group covers them.
        let mut keys: Vec<u64> = masks.clone();
        keys.sort_unstable_by_key(|&m| inverse_gray(m));
        keys.dedup();
        if keys.len() > MAX_KEYS {
            return Err(crate::Error::LengthMismatch {
                what: "the distinct sets of process groups of one sharded clip",
                expected: MAX_KEYS,
                found: keys.len(),
            });
        }
        if keys.len() == 1 {
            // One set for everything: the one-key path (norm kernel partials, capturable).
            let over: Vec<&dyn Communicator> = comms
                .iter()
                .enumerate()
                .filter(|(i, _)| keys[0] & (1 << i) != 0)
                .map(|(_, &c)| c)
                .collect();
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
        for (g, &m) in groups.iter_mut().zip(&masks) {
            let k = keys.iter().position(|&x| x == m).expect("every mask is a key") as u32;
            for x in g.grads.iter_mut() {
                let (r, gd) = x.as_raw_mut(&stream);
                raws.push(r);
                guards.push(gd);
                key_of.push(k);
            }
        }
        let n = raws.len();
        let mut idx: Vec<u32> = Vec::with_capacity(n);
        let mut offsets: Vec<u32> = vec![0];
        for k in 0..keys.len() as u32 {
            idx.extend((0..n as u32).filter(|&t| key_of[t as usize] == k));
            offsets.push(idx.len() as u32);
        }
        let prepared = self.prepare(&TensorList::unchecked(&raws), true)?;
        let per_tensor = stream.alloc_zeros::<f64>(n.max(1))?;
        let tables = stream.clone_htod(&[idx, offsets].concat())?;
        let mut partials = stream.alloc_zeros::<f64>(keys.len())?;
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
            self.run(norm_type, &prepared, 0.0, 0, o, Some(pt))?;
            let (tb, _g2) = tables.device_ptr(&stream);
            let (pp, _g3) = partials.device_ptr_mut(&stream);
            let kt = launch::KeyTables {
                idx: tb,
                offsets: tb + 4 * n as u64,
                num_keys: keys.len() as u32,
            };
            launch::key_partials(&stream, &ks, pt, &kt, pp, norm_type)?;
        }
        for (ci, c) in comms.iter().enumerate() {
            let members: Vec<usize> = (0..keys.len()).filter(|&k| keys[k] & (1 << ci) != 0).collect();
            let (first, last) = (members[0], members[members.len() - 1]);
            if last + 1 - first == members.len() {
                c.all_reduce_f64(&mut partials.slice_mut(first..last + 1), op, &stream)?;
            } else {
                for &k in &members {
                    c.all_reduce_f64(&mut partials.slice_mut(k..k + 1), op, &stream)?;
                }
            }
        }
        // SAFETY: as above; the partials are combined (stream-ordered).
        unsafe {
            let (pp, _g) = partials.device_ptr(&stream);
            launch::keys_total(&stream, &ks, pp, keys.len() as u32, o, norm_type, max_norm)?;
            self.scale_prepared(&prepared, o)?;
        }
        drop(addrs);
        drop(guards);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::inverse_gray;

    #[test]
    fn two_process_groups_get_adjacent_keys() {
        let mut keys = vec![0b11u64, 0b01, 0b10, 0b00];
        keys.sort_unstable_by_key(|&m| inverse_gray(m));
        assert_eq!(keys, [0b00, 0b01, 0b11, 0b10]);
        for bit in [0b01, 0b10] {
            let at: Vec<usize> = (0..4).filter(|&k| keys[k] & bit != 0).collect();
            assert_eq!(at.len(), 2);
            assert_eq!(at[1], at[0] + 1, "group {bit:b}'s keys are adjacent");
        }
        assert_eq!(
            (0..16u64).map(|i| inverse_gray(i ^ (i >> 1))).collect::<Vec<_>>(),
            (0..16).collect::<Vec<_>>()
        );
    }
}
