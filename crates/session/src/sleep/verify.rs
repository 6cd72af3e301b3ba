//! Whether a sleep really gave its memory back, rank by rank and device by device.
//!
//! Host memory is read per process (resident bytes), so each rank is checked alone. A device
//! reading is per process where the driver lists the process; where it does not (most
//! containers), the probe reads the whole device and says so ([`Probe::is_device_wide`]).
//! Such readings cannot tell the ranks on one device apart, and their commits run at once:
//! one rank's release could hide another's leak in its own before/after. So the ranks with
//! device-wide readings of one physical device (matched by [`Probe::device_id`]) are checked
//! together: the bytes they released against the device's drop from the highest reading
//! before to the lowest after, and a shortfall fails every one of them.

use super::coordinator::{VERIFY_FRACTION, VERIFY_SLACK};
use super::error::RankFailure;
use super::message::{Action, Phase, Probe, RankReceipt};
use std::collections::BTreeMap;

/// The least drop that passes for `bytes` released.
fn need(bytes: u64) -> i64 {
    (bytes as f64 * VERIFY_FRACTION) as i64 - VERIFY_SLACK as i64
}

/// The ranks whose memory dropped by less than [`VERIFY_FRACTION`] of the bytes they
/// released (see the module docs), each with why, in rank order.
pub(super) fn verify(receipts: &[RankReceipt]) -> Vec<RankFailure> {
    let pct = VERIFY_FRACTION * 100.0;
    let mut short: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    // Device-wide readings, by device: the receipts and the index they read it under.
    let mut shared: BTreeMap<String, Vec<(&RankReceipt, u32)>> = BTreeMap::new();
    for r in receipts {
        let device = r.device_bytes();
        let host = r.bytes() - device;
        let freed = r.host_delta(Action::Sleep);
        if freed < need(host) {
            short.entry(r.rank).or_default().push(format!(
                "released {host} tagged host bytes but its resident memory dropped by only {freed} bytes (less than {pct:.0}%: a leak)"
            ));
        }
        if device == 0 {
            continue;
        }
        let wide = r
            .before
            .devices
            .first()
            .map(|&(i, _)| i)
            .filter(|&i| r.before.is_device_wide(i) || r.after.is_device_wide(i));
        if let Some(index) = wide {
            shared.entry(r.before.device_id(index)).or_default().push((r, index));
            continue;
        }
        match r.device_delta(Action::Sleep) {
            Some(freed) if freed < need(device) => short.entry(r.rank).or_default().push(format!(
                "released {device} tagged device bytes but its device memory dropped by only {freed} bytes (less than {pct:.0}%: a leak)"
            )),
            Some(_) => {}
            None => short.entry(r.rank).or_default().push(format!(
                "released {device} tagged device bytes but cannot read its device memory (NVML did not load)"
            )),
        }
    }
    for (id, group) in shared {
        let reading = |p: &Probe, index: u32| {
            p.devices.iter().find(|(i, _)| *i == index).map_or(0, |&(_, b)| b as i64)
        };
        let released: u64 = group.iter().map(|(r, _)| r.device_bytes()).sum();
        let before = group.iter().map(|&(r, i)| reading(&r.before, i)).max().unwrap_or(0);
        let after = group.iter().map(|&(r, i)| reading(&r.after, i)).min().unwrap_or(0);
        let dropped = before - after;
        if dropped >= need(released) {
            continue;
        }
        let ranks: Vec<String> = group.iter().map(|(r, _)| r.rank.to_string()).collect();
        let message = format!(
            "the ranks on device {id} (ranks {}; the driver does not list their processes, so \
             they are read as the whole device) released {released} tagged device bytes together \
             but the device's memory dropped by only {dropped} bytes (less than {pct:.0}%: a leak)",
            ranks.join(", ")
        );
        for (r, _) in &group {
            short.entry(r.rank).or_default().push(message.clone());
        }
    }
    short
        .into_iter()
        .map(|(rank, why)| RankFailure { rank, phase: Phase::Commit, message: why.join("; ") })
        .collect()
}
