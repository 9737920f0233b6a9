//! Failures planted by tests: with the test-only `fault-injection` feature, a chosen rank
//! fails at a chosen point of a chosen step of a pass — as if an allocation or a
//! computation had failed there — so that the MPI tests can check that every rank returns
//! an error instead of waiting for the failed one. Without the feature [`strike`] is an
//! empty function the compiler removes.

#[cfg(feature = "fault-injection")]
pub use planted::{Fault, FaultPass, FaultPoint, plant};

/// `Err` when a fault is planted at this point of this rank's pass (never without the
/// feature).
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn strike(
    _rank: usize,
    _backward: bool,
    _step: usize,
    _point: Point,
) -> attn_core::Result<()> {
    Ok(())
}

#[cfg(feature = "fault-injection")]
pub(crate) use planted::strike;

/// Where in a pass a fault may strike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
pub(crate) enum Point {
    /// Allocating the rank's states and its own block, before the first step.
    SetUp,
    /// Growing the receive buffer for the next block (`step` is the step that needs it).
    Grow,
    /// The step's engine calls.
    Compute,
    /// Rounding the result, after the last step.
    Finish,
}

#[cfg(feature = "fault-injection")]
mod planted {
    use std::sync::Mutex;

    use super::Point;

    /// The pass a planted fault strikes.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum FaultPass {
        /// [`crate::Ring::forward`].
        Forward,
        /// [`crate::Ring::backward`].
        Backward,
    }

    /// Where in the pass.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum FaultPoint {
        /// Allocating the states and the rank's own block, before the first step.
        SetUp,
        /// Growing the receive buffer for step `step`'s incoming block.
        Grow,
        /// The engine calls of step `step`.
        Compute,
        /// Rounding the result after the last step.
        Finish,
    }

    /// A failure of rank `rank` at `point` of step `step` of `pass`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Fault {
        /// The rank that fails.
        pub rank: usize,
        /// The pass.
        pub pass: FaultPass,
        /// The step (ignored by `SetUp` and `Finish`).
        pub step: usize,
        /// Where.
        pub point: FaultPoint,
    }

    static PLANTED: Mutex<Option<Fault>> = Mutex::new(None);

    /// Plants `fault` for the passes that follow in this process (`None` removes it).
    pub fn plant(fault: Option<Fault>) {
        *PLANTED.lock().unwrap_or_else(|e| e.into_inner()) = fault;
    }

    pub(crate) fn strike(
        rank: usize,
        backward: bool,
        step: usize,
        point: Point,
    ) -> attn_core::Result<()> {
        let Some(f) = *PLANTED.lock().unwrap_or_else(|e| e.into_inner()) else {
            return Ok(());
        };
        let pass = if backward {
            FaultPass::Backward
        } else {
            FaultPass::Forward
        };
        let (point, step_matters) = match point {
            Point::SetUp => (FaultPoint::SetUp, false),
            Point::Grow => (FaultPoint::Grow, true),
            Point::Compute => (FaultPoint::Compute, true),
            Point::Finish => (FaultPoint::Finish, false),
        };
        if f.rank == rank && f.pass == pass && f.point == point && (!step_matters || f.step == step)
        {
            return Err(attn_core::Error::allocation("planted fault", usize::MAX));
        }
        Ok(())
    }
}
