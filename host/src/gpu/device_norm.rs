//! [`DeviceNorm`]: a norm computed on the GPU, kept in device memory until it is read.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut, SyncOnDrop};
use gradclip_kernels::abi::NormOutput;

use super::capture::{self, Capture};
use super::words::from_words;
use crate::error::{Error, Result};
use crate::norm::NormReport;

/// Where a call writes: the [`NormOutput`]'s address, the per-tensor norms' (if any), and the
/// guards that keep cudarc's ordering until the launches are enqueued.
pub(crate) struct Addresses<'a> {
    pub norm: u64,
    pub per_tensor: Option<u64>,
    _guards: (SyncOnDrop<'a>, Option<SyncOnDrop<'a>>),
}

/// Words of one [`NormOutput`].
pub(crate) const OUT_WORDS: usize = size_of::<NormOutput>() / 8;

/// A norm computed on the GPU, still in device memory. Nothing waits for it until [`read`].
///
/// [`read`]: DeviceNorm::read
#[derive(Debug)]
pub struct DeviceNorm {
    out: CudaSlice<u64>,
    per_tensor: Option<CudaSlice<f64>>,
    /// Per-tensor norms were asked for a list of no tensors: `read` reports an empty list.
    empty_per_tensor: bool,
}

impl DeviceNorm {
    /// Storage for one result on `stream`, with room for `per_tensor` norms (0: none). Reuse it
    /// as the output of engine calls (`&mut`) to avoid an allocation per call and to capture calls in a CUDA
    /// graph.
    pub fn new(stream: &Arc<CudaStream>, per_tensor: usize) -> Result<Self> {
        // SAFETY: u64/f64 accept any bits; the norm kernel writes every word before a read.
        let out = unsafe { stream.alloc::<u64>(OUT_WORDS) }?;
        let per_tensor = if per_tensor > 0 {
            // SAFETY: as above: the per-tensor kernel writes every entry before a read.
            Some(unsafe { stream.alloc::<f64>(per_tensor) }?)
        } else {
            None
        };
        Ok(DeviceNorm {
            out,
            per_tensor,
            empty_per_tensor: false,
        })
    }

    /// Storage for a call that may ask per-tensor norms of `num_tensors` tensors (none: `None`).
    /// Refused under capture: a captured allocation would be the graph's, freed at replay's end.
    pub(crate) fn for_call(stream: &Arc<CudaStream>, per_tensor: bool, num_tensors: usize) -> Result<Self> {
        if let Capture::Active(_) = capture::status(stream)? {
            return Err(Error::NotCapturable {
                what: "a call that allocates its result (the NewNorm output)",
                instead: "allocate a DeviceNorm before the capture and pass &mut it as the output",
            });
        }
        let mut d = Self::new(stream, if per_tensor { num_tensors } else { 0 })?;
        d.empty_per_tensor = per_tensor && num_tensors == 0;
        Ok(d)
    }

    /// The device addresses of the result and of the per-tensor norms, with cudarc's guards that
    /// order the call's writes (dropped after the launches); fails when the per-tensor room is
    /// not one norm per tensor.
    pub(crate) fn addresses<'a>(&'a mut self, stream: &'a CudaStream, num_tensors: usize) -> Result<Addresses<'a>> {
        if let Some(p) = &self.per_tensor
            && p.len() != num_tensors
        {
            return Err(Error::LengthMismatch {
                what: "the DeviceNorm's per-tensor buffer",
                expected: num_tensors,
                found: p.len(),
            });
        }
        let (norm, g1) = self.out.device_ptr_mut(stream);
        let (per_tensor, g2) = match self.per_tensor.as_mut() {
            Some(p) => {
                let (a, g) = p.device_ptr_mut(stream);
                (Some(a), Some(g))
            }
            None => (None, None),
        };
        Ok(Addresses {
            norm,
            per_tensor,
            _guards: (g1, g2),
        })
    }

    /// Waits for the result and copies it to the host.
    pub fn read(&self) -> Result<NormReport> {
        let stream = self.out.stream();
        let words = stream.clone_dtoh(&self.out)?;
        let out: NormOutput = from_words(&words);
        let per_tensor = match &self.per_tensor {
            Some(p) => Some(stream.clone_dtoh(p)?),
            None if self.empty_per_tensor => Some(Vec::new()),
            None => None,
        };
        Ok(NormReport {
            norm: out.norm,
            coef: out.coef,
            nonfinite: out.nonfinite != 0,
            per_tensor,
        })
    }

    /// The device buffer holding the result: word 0 is the norm's f64 bits, word 1 the clip
    /// coefficient's, word 2 the non-finite flag (low 32 bits). Use it in later kernels to skip
    /// a step without a host synchronization.
    pub fn device_words(&self) -> &CudaSlice<u64> {
        &self.out
    }

    /// Per-tensor norms in device memory, when asked for.
    pub fn device_per_tensor(&self) -> Option<&CudaSlice<f64>> {
        self.per_tensor.as_ref()
    }
}
