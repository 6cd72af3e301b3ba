//! What a wakeup does once a rank's weights are back, before its receipt: the model runner
//! registers how its model makes its device copies ([`ModelMemory::set_device_preparation`]),
//! so the first request after the wakeup does not pay for uploading them.

use super::ModelMemory;
use std::sync::{Arc, Mutex, PoisonError};

/// Makes the device copies of the engine's model's weights (`Err`: why not, in words).
pub type Prepare = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// The registered [`Prepare`], shared by a [`ModelMemory`]'s clones.
#[derive(Clone, Default)]
pub(super) struct Preparation(Arc<Mutex<Option<Prepare>>>);

impl std::fmt::Debug for Preparation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = self.0.lock().unwrap_or_else(PoisonError::into_inner).is_some();
        f.write_str(if set { "Preparation(set)" } else { "Preparation(none)" })
    }
}

impl ModelMemory {
    /// Registers what a wakeup that restored the weights runs before its receipt: the model's
    /// device copies made again (`None`: nothing, as on the CPU). The latest registration
    /// wins, so a session's new model replaces the last one's.
    pub fn set_device_preparation(&self, prepare: Option<Prepare>) {
        *self.prepare.0.lock().unwrap_or_else(PoisonError::into_inner) = prepare;
    }

    /// The registered preparation, if any.
    pub(super) fn device_preparation(&self) -> Option<Prepare> {
        self.prepare.0.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}
