//! The unit-wise clips (AGC and AdaGC, [`crate::units`]) on the GPU engine: launches over
//! tables the caller keeps in device memory, on the engine's stream, capturable.

use super::{GpuEngine, launch};
use crate::error::{Error, Result};
use crate::units::{Agc, UnitTables};

impl GpuEngine {
    /// AGC over the tables at `tables` (device memory): every unit's gradient clipped to
    /// `clip_factor * max(||W_i||, eps)` ([`crate::units`]), on the stream, no host sync.
    ///
    /// # Safety
    /// `tables` holds the words of a [`crate::units::UnitPlan`] and room for its partials, device
    /// memory of this context written before on the stream and used by nothing else until the
    /// launches complete; the plan's gradients (writable) and parameters are device memory of
    /// this context, as checked when the plan was made; `loss_scale` (not 0) one f32 of it
    /// written before on the stream: the scale the gradients carry (their unit norms are divided
    /// by it).
    pub unsafe fn agc_raw(&mut self, tables: &UnitTables, agc: &Agc, loss_scale: u64) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.agc_pass(tables, agc, loss_scale, false) }
    }

    /// AGC's decision without its scale: each unit's factor written to the tables
    /// ([`UnitTables::grad_factors`]) for an update that multiplies the gradients by them as it
    /// reads them ([`crate::optim::StepAddresses::grad_factors`]); no gradient is written.
    ///
    /// # Safety
    /// As [`GpuEngine::agc_raw`] (the gradients are only read).
    pub unsafe fn agc_factors_raw(&mut self, tables: &UnitTables, agc: &Agc, loss_scale: u64) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.agc_pass(tables, agc, loss_scale, true) }
    }

    /// [`GpuEngine::agc_raw`], or with `factors` [`GpuEngine::agc_factors_raw`].
    ///
    /// # Safety
    /// As [`GpuEngine::agc_raw`].
    unsafe fn agc_pass(&mut self, tables: &UnitTables, agc: &Agc, loss_scale: u64, factors: bool) -> Result<()> {
        agc.check()?;
        tables.check()?;
        crate::units::check_loss_scale(loss_scale)?;
        if tables.tasks > i32::MAX as usize {
            return Err(Error::TooManyTasks {
                tasks: tables.tasks as u64,
                max: i32::MAX as u64,
            });
        }
        if tables.tasks == 0 {
            return Ok(());
        }
        let stream = self.stream().clone();
        // SAFETY: the caller's contract; at least one task.
        unsafe { launch::agc(&stream, self.kernels(), tables, agc, loss_scale, factors) }
    }

    /// AdaGC ([`crate::units::AdaGc`]) over the per-tensor tables at `tables` (device memory) with
    /// its state (`state_words` f64 of device memory at `state`), the whole clip or one half of
    /// a sharded one (`pass`, [`crate::units::AdagcPass`]): up to three launches (the norms, the
    /// one-block decision, the per-tensor scale), on the stream, no host sync. The state's header
    /// is read on the device: a state that is not a whole AdaGC state gives every factor NaN
    /// (the gradients become NaN, never a silent clip), as does a slot past its end.
    ///
    /// # Safety
    /// As [`GpuEngine::agc_raw`], for a plan of [`crate::units::UnitPair::per_tensor`] pairs whose
    /// slots are inside the state; the state written before on the stream and used by nothing else
    /// until the launches complete; for [`crate::units::AdagcPass::Given`], the tables' sums
    /// written before on the stream; `found_inf` (not 0) one f32 of it written before on the
    /// stream: GradScaler's overflow flag, whose non-zero value leaves the gradients and the state
    /// as they were (the step will be skipped).
    pub unsafe fn adagc_raw(
        &mut self,
        tables: &UnitTables,
        state: u64,
        state_words: usize,
        (loss_scale, found_inf): (u64, u64),
        pass: crate::units::AdagcPass,
    ) -> Result<()> {
        tables.check()?;
        crate::units::check_loss_scale(loss_scale)?;
        crate::units::check_loss_scale(found_inf)?;
        crate::units::check_state(state, state_words)?;
        if tables.tasks > i32::MAX as usize {
            return Err(Error::TooManyTasks {
                tasks: tables.tasks as u64,
                max: i32::MAX as u64,
            });
        }
        let stream = self.stream().clone();
        // SAFETY: the caller's contract.
        unsafe {
            launch::adagc(
                &stream,
                self.kernels(),
                tables,
                state,
                state_words as u64,
                (loss_scale, found_inf),
                pass,
            )
        }
    }
}
