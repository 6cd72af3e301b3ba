//! The staleness rules of the device weight cache, without a GPU: the values are names.

use super::{WeightKey, WeightStamps};
use crate::kernels::GemmDtype;

fn key(addr: usize, len: usize) -> WeightKey {
    WeightKey { addr, len, dtype: GemmDtype::F32, packed: false }
}

#[test]
fn a_copy_is_current_until_the_generation_moves_on() {
    let mut stamps = WeightStamps::default();
    stamps.insert(key(0x1000, 64), 7, "q_proj");
    assert_eq!(stamps.current(&key(0x1000, 64), 7), Some(&"q_proj"));
    assert_eq!(stamps.current(&key(0x1000, 64), 7), Some(&"q_proj"), "a hit leaves it current");
    assert_eq!(stamps.current(&key(0x1000, 64), 8), None, "stale after a bump");
    // Another length or element type at the same address is another key.
    assert_eq!(stamps.current(&key(0x1000, 32), 7), None);
    let bf16 = WeightKey { dtype: GemmDtype::Bf16, ..key(0x1000, 64) };
    assert_eq!(stamps.current(&bf16, 7), None);
}

#[test]
fn another_buffer_at_a_reused_address_after_a_bump_is_a_miss_that_reuses_the_slot() {
    let mut stamps = WeightStamps::default();
    stamps.insert(key(0x2000, 128), 3, "old weight's slot");
    // The old buffer is freed (or rewritten) and the generation moves on; a new buffer of the
    // same length lands at the same address.
    let now = 4;
    assert_eq!(stamps.current(&key(0x2000, 128), now), None);
    let slot = stamps.take(&key(0x2000, 128));
    assert_eq!(slot, Some("old weight's slot"), "the stale slot is handed back to be refilled");
    assert_eq!(stamps.len(), 0);
    stamps.insert(key(0x2000, 128), now, "refilled");
    assert_eq!(stamps.current(&key(0x2000, 128), now), Some(&"refilled"));
}

#[test]
fn marking_stale_keeps_the_chosen_slots_and_drops_the_rest() {
    let mut stamps = WeightStamps::default();
    stamps.insert(key(0x10, 4), 1, "arena region");
    stamps.insert(key(0x20, 4), 1, "pool buffer");
    stamps.mark_stale(|v| v.starts_with("arena"));
    assert_eq!(stamps.len(), 1);
    assert_eq!(stamps.values().collect::<Vec<_>>(), [&"arena region"]);
    // Stale even at the generation it was made at: its device memory was lost (a sleep).
    assert_eq!(stamps.current(&key(0x10, 4), 1), None);
    assert_eq!(stamps.take(&key(0x10, 4)), Some("arena region"));
    stamps.insert(key(0x10, 4), 1, "arena region");
    stamps.clear();
    assert_eq!(stamps.len(), 0);
}
