//! The engine hook: how the control plane brings a rank's engine to a step boundary before its
//! memory goes away, and lets it run again afterwards.
//!
//! The session engine implements [`Quiesce`]; until then, [`Idle`] stands for an engine with
//! nothing to stop. What an implementation must do, per [`QuiesceMode`]:
//!
//! - `Wait`: stop admitting requests, let the running ones finish, return at a step boundary.
//! - `Abort`: fail the running requests with the reason "aborted: the deployment is going to
//!   sleep", return at a step boundary.
//! - `Keep`: pause the running requests at a step boundary, keeping their state; [`Quiesce::resume`]
//!   continues them. With `kv_cache` restored by a backup, a paused generation continues
//!   identically after wakeup; with `Discard`, the engine must recompute paused sequences
//!   from their tokens (prefill again) before continuing.
//!
//! While the deployment is asleep, new requests wait for the wakeup (or are refused with HTTP
//! 503 when configured so); weights restored by a backup or a reload give the same logits as
//! before.

pub use super::message::QuiesceMode;
use std::time::Duration;

/// Why an engine could not be quiesced; the operation is then aborted with nothing changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QuiesceError {
    /// The running step did not end in time.
    #[error("the engine did not reach a step boundary within {:.1} s (mode {mode:?})", waited.as_secs_f64())]
    Timeout {
        /// The mode asked for.
        mode: QuiesceMode,
        /// How long the engine was waited for.
        waited: Duration,
    },
    /// The engine's own reason, for engines outside this crate.
    #[error(transparent)]
    Engine(Box<dyn std::error::Error + Send + Sync>),
}

/// The engine as the control plane sees it. Calls come from the control plane's thread, one
/// at a time (the sleep/wakeup lock serializes them).
pub trait Quiesce: Send + Sync {
    /// Brings the engine to a step boundary per `mode`; no step runs until [`Quiesce::resume`].
    ///
    /// # Errors
    /// A [`QuiesceError`]; the operation is then aborted with nothing changed.
    fn quiesce(&self, mode: QuiesceMode) -> Result<(), QuiesceError>;

    /// Told after this rank released the memory of `tags` (while quiesced), so the engine
    /// knows which state a wakeup may not bring back (a discarded KV cache).
    fn released(&self, tags: &[String]) {
        let _ = tags;
    }

    /// Told after this rank's weights were replaced (while quiesced): every KV cache was
    /// computed with the old ones, so paused sequences must be computed again.
    fn weights_changed(&self) {}

    /// Lets the engine run again (after a wakeup, or after an aborted sleep).
    fn resume(&self);
}

/// An engine with nothing to quiesce.
#[derive(Clone, Copy, Debug, Default)]
pub struct Idle;

impl Quiesce for Idle {
    fn quiesce(&self, _mode: QuiesceMode) -> Result<(), QuiesceError> {
        Ok(())
    }
    fn resume(&self) {}
}
