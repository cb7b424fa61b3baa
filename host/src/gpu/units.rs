//! The unit-wise clip (AGC, [`crate::units`]) on the GPU engine: two launches over tables the
//! caller keeps in device memory, on the engine's stream, capturable.

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
        unsafe { launch::agc(&stream, self.kernels(), tables, agc, loss_scale) }
    }
}
