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
            c.all_reduce_f64(&mut self.partial, op, &stream)?;
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
