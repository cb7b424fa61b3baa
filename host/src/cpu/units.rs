//! The unit-wise clip (AGC, [`crate::units`]) on the CPU: the kernels' two passes over the same
//! tables, each piece's partials from the model of one warp ([`model::warp_partial`]), so the
//! factors and the gradients written are the GPU's bits.

use gradclip_kernels::abi::{Partial, UnitTensor};
use gradclip_kernels::accum::{L2, Reduce};
use gradclip_kernels::dtype::Element;
use gradclip_kernels::geometry::Frame;
use gradclip_kernels::units::{agc_factor, dtype_codes, num_pieces, piece_span, unit_norms};
use gradclip_kernels::{model, with_element};

use super::{Cpu, HostTensor, workers};
use crate::dtype::DType;
use crate::error::Result;
use crate::units::{Agc, UnitTables};

/// The partial of the piece of `len` elements from `start` of the tensor of `code` at `addr`.
///
/// # Safety
/// `addr` holds at least `start + len` readable elements of that dtype.
unsafe fn piece_partial(code: u32, addr: u64, start: u64, len: u64) -> L2 {
    let Some(dtype) = DType::from_code(code) else {
        return L2::identity(2.0);
    };
    with_element!(dtype, E => {
        let at = addr + start * E::SIZE;
        let frame = Frame::new(at, len, E::SIZE);
        // SAFETY: the caller's contract: the piece is readable host memory.
        unsafe { model::warp_partial::<E, L2, _>(&HostTensor::<E>::new(at, frame), &frame, 2.0) }
    })
}

/// Multiplies the piece of `len` elements from `start` of the gradient at `addr` by `f`.
///
/// # Safety
/// The piece is writable host memory of `E`, used by nothing else during the call.
unsafe fn scale_piece<E: Element>(addr: u64, start: u64, len: u64, f: f64) {
    let at = (addr + start * E::SIZE) as *mut E::Bits;
    for i in 0..len as usize {
        // SAFETY: i < len: inside the piece (the contract).
        unsafe { at.add(i).write(E::scale(at.add(i).read(), f as f32, f)) };
    }
}

impl Cpu {
    /// AGC ([`crate::units`]) over the tables at `tables` in host memory: every unit's gradient
    /// clipped to `clip_factor * max(||W_i||, eps)`, the GPU's bits. `loss_scale`: the address of
    /// one f32 the gradients carry (GradScaler's), whose unit norms are divided by it, or 0.
    ///
    /// # Safety
    /// `tables` holds the words of a [`crate::units::UnitPlan`] ([`crate::units::UnitPlan::table_words`])
    /// and room for its partials, host memory used by nothing else during the call; the plan's
    /// gradients and parameters are live host memory (the gradients writable), as checked when it
    /// was made; `loss_scale` (not 0) one f32 of host memory.
    pub unsafe fn agc_raw(&self, tables: &UnitTables, agc: &Agc, loss_scale: u64) -> Result<()> {
        agc.check()?;
        tables.check()?;
        crate::units::check_loss_scale(loss_scale)?;
        let scale = if loss_scale == 0 {
            1.0
        } else {
            // SAFETY: the caller's contract: a loss scale not 0 is one f32 of host memory.
            (unsafe { (loss_scale as *const f32).read() }) as f64
        };
        // SAFETY: the caller's contract: the tables' words, then the partials.
        // (The tasks are the GPU's blocks: the CPU walks the pieces themselves.)
        let (tensors, partials) = unsafe {
            (
                std::slice::from_raw_parts(tables.addr as *const UnitTensor, tables.tensors),
                tables.partials_at() as *mut Partial,
            )
        };
        // Pieces in table order: (tensor, piece).
        let order: Vec<(usize, u64)> = tensors
            .iter()
            .enumerate()
            .flat_map(|(i, t)| (0..num_pieces(t)).map(move |k| (i, k)))
            .collect();
        let at = SharedPartials(partials);
        workers::for_each_index(order.len(), |n| {
            let (i, k) = order[n];
            let t = &tensors[i];
            let (start, len) = piece_span(t, k);
            let (g, p) = dtype_codes(t);
            // SAFETY: the piece lies in both parts (the plan's checks); its two slots are this
            // call's alone.
            unsafe {
                let slot = 2 * (t.first_piece + k) as usize;
                at.write(slot, piece_partial(g, t.grad, start, len).encode());
                at.write(slot + 1, piece_partial(p, t.param, start, len).encode());
            }
        });
        workers::for_each_index(order.len(), |n| {
            let (i, k) = order[n];
            let t = &tensors[i];
            // SAFETY: every piece's partials were written by the pass above.
            let (g, p) = unsafe { unit_norms(t, k, at.base()) };
            if let (Some(f), Some(dtype)) = (
                agc_factor(g / scale, p, agc.clip_factor, agc.eps),
                DType::from_code(dtype_codes(t).0),
            ) {
                let (start, len) = piece_span(t, k);
                // SAFETY: the piece lies in the gradient, which no other piece or parameter
                // overlaps (the plan's checks).
                with_element!(dtype, E => unsafe { scale_piece::<E>(t.grad, start, len, f) });
            }
        });
        Ok(())
    }
}

/// The partials' base, shared by the workers, each writing its own pieces' slots.
struct SharedPartials(*mut Partial);

impl SharedPartials {
    fn base(&self) -> *const Partial {
        self.0
    }

    /// # Safety
    /// `i` is inside the partials and written by no other call.
    unsafe fn write(&self, i: usize, v: Partial) {
        // SAFETY: the caller's contract.
        unsafe { self.0.add(i).write(v) }
    }
}
// SAFETY: the workers write disjoint slots (one piece each), and read them only after the pass.
unsafe impl Sync for SharedPartials {}
