//! The unit-wise clips (AGC and AdaGC, [`crate::units`]) on the CPU: the kernels' passes over
//! the same tables, each piece's partials from the model of one warp ([`model::warp_partial`],
//! over the lanes the piece uses: `lane_tree::warp_partial_used`),
//! AdaGC's folds and decision as its one-block launch makes them, so the factors and the
//! gradients written are the GPU's bits.

use gradclip_kernels::abi::{Partial, UnitTensor};
use gradclip_kernels::accum::{Accumulator, L2, Reduce};
use gradclip_kernels::dtype::Element;
use gradclip_kernels::geometry::Frame;
use gradclip_kernels::policy::{adagc, kind, kind_of};
use gradclip_kernels::units::{agc_factor, dtype_codes, num_pieces, piece_span, tensor_state, unit_norms};
use gradclip_kernels::{model, with_element};

use super::{Cpu, HostTensor, lane_tree, workers};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::units::{AdagcPass, Agc, UnitTables};

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
        unsafe { lane_tree::warp_partial_used::<E, L2, _>(&HostTensor::<E>::new(at, frame), &frame, 2.0) }
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

/// The pieces of a unit plan's tables in table order, `(tensor, piece)`, and its partials.
struct Pieces<'a> {
    tensors: &'a [UnitTensor],
    order: Vec<(usize, u64)>,
    partials: SharedSlots<Partial>,
}

impl<'a> Pieces<'a> {
    /// The tables at `tables` (checked: a valid address).
    ///
    /// # Safety
    /// As [`Cpu::agc_raw`]'s tables.
    unsafe fn of(tables: &'a UnitTables) -> Self {
        // SAFETY: the caller's contract: the tables' words, then the partials.
        // (The tasks are the GPU's blocks: the CPU walks the pieces themselves.)
        let (tensors, partials) = unsafe {
            (
                std::slice::from_raw_parts(tables.addr as *const UnitTensor, tables.tensors),
                tables.partials_at() as *mut Partial,
            )
        };
        let order = tensors
            .iter()
            .enumerate()
            .flat_map(|(i, t)| (0..num_pieces(t)).map(move |k| (i, k)))
            .collect();
        Pieces {
            tensors,
            order,
            partials: SharedSlots(partials),
        }
    }

    /// The norms pass: every piece's two partials (the parameter's empty where there is none).
    ///
    /// # Safety
    /// The tables' gradients and parameters are live host memory (the plan's checks).
    unsafe fn norms(&self) {
        workers::for_each_index(self.order.len(), |n| {
            let (i, k) = self.order[n];
            let t = &self.tensors[i];
            let (start, len) = piece_span(t, k);
            let (g, p) = dtype_codes(t);
            // SAFETY: the piece lies in both parts (the plan's checks); its two slots are this
            // call's alone.
            unsafe {
                let slot = 2 * (t.first_piece + k) as usize;
                self.partials.write(slot, piece_partial(g, t.grad, start, len).encode());
                let param = if t.param == 0 {
                    L2::identity(2.0)
                } else {
                    piece_partial(p, t.param, start, len)
                };
                self.partials.write(slot + 1, param.encode());
            }
        });
    }

    /// Multiplies each piece of a gradient by `factor(tensor, its unit's first piece)` where that
    /// is not None.
    ///
    /// # Safety
    /// After [`Pieces::norms`]; the gradients writable, disjoint from each other and from the
    /// parameters (the plan's checks).
    unsafe fn scale(&self, factor: impl Fn(usize, u64) -> Option<f64> + Sync) {
        workers::for_each_index(self.order.len(), |n| {
            let (i, k) = self.order[n];
            let t = &self.tensors[i];
            if let (Some(f), Some(dtype)) = (factor(i, k), DType::from_code(dtype_codes(t).0)) {
                let (start, len) = piece_span(t, k);
                // SAFETY: the piece lies in the gradient, which no other piece or parameter
                // overlaps (the plan's checks).
                with_element!(dtype, E => unsafe { scale_piece::<E>(t.grad, start, len, f) });
            }
        });
    }
}

/// The f32 at `addr` as f64, None for 0 (a loss scale or an overflow flag not given).
///
/// # Safety
/// `addr` (not 0) is one f32 of host memory.
unsafe fn f32_at(addr: u64) -> Option<f64> {
    // SAFETY: the caller's contract.
    (addr != 0).then(|| f64::from(unsafe { (addr as *const f32).read() }))
}

/// The f32 loss scale at `addr` as f64 (1 for 0).
///
/// # Safety
/// As [`f32_at`].
unsafe fn loss_scale_at(addr: u64) -> f64 {
    // SAFETY: the caller's contract.
    unsafe { f32_at(addr) }.unwrap_or(1.0)
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
        // SAFETY: the caller's contract.
        unsafe { self.agc_pass(tables, agc, loss_scale, false) }
    }

    /// AGC's decision without its scale, as the GPU engine's `agc_factors_raw`: each unit's
    /// factor (1 where the unit is kept) written to the tables' piece factors
    /// ([`UnitTables::grad_factors`]) for an update that folds them in; no gradient is written.
    ///
    /// # Safety
    /// As [`Cpu::agc_raw`] (the gradients are only read).
    pub unsafe fn agc_factors_raw(&self, tables: &UnitTables, agc: &Agc, loss_scale: u64) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.agc_pass(tables, agc, loss_scale, true) }
    }

    /// [`Cpu::agc_raw`], or with `factors` [`Cpu::agc_factors_raw`].
    ///
    /// # Safety
    /// As [`Cpu::agc_raw`].
    unsafe fn agc_pass(&self, tables: &UnitTables, agc: &Agc, loss_scale: u64, factors: bool) -> Result<()> {
        agc.check()?;
        tables.check()?;
        crate::units::check_loss_scale(loss_scale)?;
        // SAFETY: the caller's contract.
        let (scale, pieces) = unsafe { (loss_scale_at(loss_scale), Pieces::of(tables)) };
        let factor = |i: usize, k: u64| {
            // SAFETY: called after the norms pass below wrote every piece's partials.
            let (g, p) = unsafe { unit_norms(&pieces.tensors[i], k, pieces.partials.base()) };
            agc_factor(g / scale, p, agc.clip_factor, agc.eps)
        };
        // SAFETY: the caller's contract (the plan's tensors); the decisions after the norms; a
        // piece's factor slot written by its own index alone (the tables' room: one a piece).
        unsafe {
            pieces.norms();
            if factors {
                let out = SharedSlots(tables.piece_factors_at() as *mut f64);
                workers::for_each_index(pieces.order.len(), |n| {
                    let (i, k) = pieces.order[n];
                    out.write((pieces.tensors[i].first_piece + k) as usize, factor(i, k).unwrap_or(1.0));
                });
            } else {
                pieces.scale(factor);
            }
        }
        Ok(())
    }

    /// AdaGC ([`crate::units::AdaGc`]) over the per-tensor tables at `tables` in host memory with
    /// its state (`state_words` f64 at `state`), the whole clip or one half of a sharded one
    /// (`pass`): each tensor's norm (or, for [`AdagcPass::Given`], the tables' sums: each
    /// tensor's squared norm over its shards), the global norm, the decision per tensor as
    /// `gradclip_adagc_decide` makes it (the same functions, the same merge order), the state
    /// advanced and every gradient scaled by its tensor's factor: the GPU's bits. With
    /// [`AdagcPass::Fold`] only the sums are written. `loss_scale` as for [`Cpu::agc_raw`];
    /// `found_inf` (not 0) the address of GradScaler's f32 overflow flag: not 0, every gradient
    /// and the state are left as they were (the step will be skipped). A
    /// state that is not a whole AdaGC state, or too short for a tensor's slot, is refused
    /// ([`Error::PolicyState`]) before anything is written.
    ///
    /// # Safety
    /// As [`Cpu::agc_raw`], for a plan of [`crate::units::UnitPair::per_tensor`] pairs; `state` is
    /// `state_words` f64 of host memory used by nothing else during the call.
    pub unsafe fn adagc_raw(
        &self,
        tables: &UnitTables,
        state: u64,
        state_words: usize,
        (loss_scale, found_inf): (u64, u64),
        pass: AdagcPass,
    ) -> Result<()> {
        tables.check()?;
        crate::units::check_loss_scale(loss_scale)?;
        crate::units::check_loss_scale(found_inf)?;
        crate::units::check_state(state, state_words)?;
        // SAFETY: the caller's contract: the state's words, the loss scale, the tables (the sums
        // after the rest, `tables.tensors` of them).
        let (words, scale, pieces, sums) = unsafe {
            (
                std::slice::from_raw_parts_mut(state as *mut f64, state_words),
                loss_scale_at(loss_scale),
                Pieces::of(tables),
                std::slice::from_raw_parts_mut(tables.sums_at() as *mut f64, tables.tensors),
            )
        };
        if kind_of(words) != Some(kind::ADAGC) {
            return Err(Error::PolicyState {
                policy: "AdaGC",
                detail: "its state's header is not a whole AdaGC state".into(),
            });
        }
        if let Some((i, t)) = pieces
            .tensors
            .iter()
            .enumerate()
            .find(|(_, t)| t.slot as usize >= adagc::slots(state_words))
        {
            return Err(Error::PolicyState {
                policy: "AdaGC",
                detail: format!("tensor {i} has slot {} and the state {} slots", t.slot, adagc::slots(state_words)),
            });
        }
        // The factors' words in the tables: written by the decision, read by the scale.
        let factors_at = tables.factors_at() as *mut f64;
        if pass == AdagcPass::Scale {
            // SAFETY: the tables' factors, written by a decision before (the caller's contract).
            let factors = unsafe { std::slice::from_raw_parts(factors_at, tables.tensors) }.to_vec();
            // SAFETY: the plan's checks; the scale reads no partial.
            unsafe { pieces.scale(|i, _| (factors[i] != 1.0).then_some(factors[i])) };
            return Ok(());
        }
        let folds: Vec<L2> = if pass == AdagcPass::Given {
            sums.iter().map(|&s| adagc::fold_of_sum(s)).collect()
        } else {
            // SAFETY: the caller's contract (the plan's tensors).
            unsafe { pieces.norms() };
            let partials = pieces.partials.base();
            // SAFETY: every piece's partials were written above.
            let folds: Vec<L2> = pieces.tensors.iter().map(|t| unsafe { tensor_state(t, partials) }).collect();
            for (s, f) in sums.iter_mut().zip(&folds) {
                *s = adagc::sum_of_fold(*f);
            }
            folds
        };
        if pass == AdagcPass::Fold {
            return Ok(());
        }
        let encoded: Vec<Partial> = folds.iter().map(|f| f.encode()).collect();
        let total: L2 = model::final_reduce(&encoded, 2.0);
        // SAFETY: the caller's contract: a found_inf not 0 is one f32 of host memory.
        let skipped = unsafe { f32_at(found_inf) }.is_some_and(|v| v != 0.0);
        let coef = adagc::global_coefficient(total.norm() / scale, words);
        let m = adagc::begin_call(words, skipped);
        let factors: Vec<f64> = pieces
            .tensors
            .iter()
            .zip(&folds)
            .map(|(t, fold)| match adagc::split_slot(words, t.slot as usize) {
                Some((header, slot)) => adagc::tensor_factor(m, fold.norm() / scale, header, slot, coef),
                None => f64::NAN,
            })
            .collect();
        // SAFETY: the tables' room for one factor per tensor (the caller's contract), which the
        // GPU's decision writes too.
        unsafe { std::ptr::copy_nonoverlapping(factors.as_ptr(), factors_at, factors.len()) };
        if pass == AdagcPass::Decide {
            return Ok(());
        }
        // SAFETY: after the norms pass (or with the sums given: the scale reads no partial); the
        // plan's checks.
        unsafe { pieces.scale(|i, _| (factors[i] != 1.0).then_some(factors[i])) };
        Ok(())
    }
}

/// Slots (the partials, the piece factors) shared by the workers, each writing its own pieces'.
struct SharedSlots<T>(*mut T);

impl<T> SharedSlots<T> {
    fn base(&self) -> *const T {
        self.0
    }

    /// # Safety
    /// `i` is inside the slots and written by no other call.
    unsafe fn write(&self, i: usize, v: T) {
        // SAFETY: the caller's contract.
        unsafe { self.0.add(i).write(v) }
    }
}
// SAFETY: the workers write disjoint slots (one piece each), and read them only after the pass.
unsafe impl<T> Sync for SharedSlots<T> {}
