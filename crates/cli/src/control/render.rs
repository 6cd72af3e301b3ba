//! Control replies as people read them: a receipt table per rank and tag, a status table per
//! rank, bytes in binary units and times in the unit that fits.

use super::{HostWire, OpWire, StatusWire};
use session::model_memory::runtime::NOTHING_HELD;
use session::sleep::{Probe, TagReceipt};

/// `n` bytes in binary units: `512 B`, `1.5 KiB`, `3.0 GiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// `us` microseconds as `250 us`, `12.5 ms` or `3.20 s`.
pub fn micros(us: u64) -> String {
    if us < 1_000 {
        format!("{us} us")
    } else if us < 1_000_000 {
        format!("{:.1} ms", us as f64 / 1e3)
    } else {
        format!("{:.2} s", us as f64 / 1e6)
    }
}

/// The devices of a probe: `cpu`, or `cuda:N` per device the rank uses.
pub fn device(probe: &Probe) -> String {
    if probe.devices.is_empty() {
        "cpu".to_owned()
    } else {
        let names: Vec<String> = probe.devices.iter().map(|(i, _)| format!("cuda:{i}")).collect();
        names.join(",")
    }
}

/// Rows as columns padded to their widest cell, two spaces apart, one line each.
fn table(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| rows.iter().filter_map(|r| r.get(c)).map(|s| s.chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            line.push_str(&format!("{cell:<w$}  ", w = widths[c]));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// A tag's bytes, with the part in device memory when there is one.
fn tag_bytes(t: &TagReceipt) -> String {
    if t.device_bytes == 0 {
        bytes(t.bytes)
    } else {
        format!("{} ({} on device)", bytes(t.bytes), bytes(t.device_bytes))
    }
}

/// How a tag comes back, and the bytes copied to (sleep) or from (wakeup) its backup or
/// checkpoint when there were any: `reload`, `backup (1.0 GiB copied)`; `nothing held` for
/// what the runtime holds where a rank holds none of it (graphs on a CPU).
fn restore(t: &TagReceipt) -> String {
    match (t.restore.as_str(), t.copied_bytes) {
        ("", _) => "-".into(),
        (NOTHING_HELD, _) => "nothing held".into(),
        (r, 0) => r.to_owned(),
        (r, n) => format!("{r} ({} copied)", bytes(n)),
    }
}

/// A sleep or wakeup receipt: one row per rank and tag (the rank's probe, before -> after, on
/// its first row; device bytes on a GPU, resident bytes on CPU; how the tag comes back, with
/// the bytes copied to or from its backup or checkpoint), then a total line.
pub fn receipt(op: &OpWire) -> String {
    let header = ["rank", "device", "tag", "bytes", "probe before -> after", "time", "restore"];
    let mut rows = vec![header.map(str::to_owned).to_vec()];
    for r in &op.ranks {
        let probe = format!("{} -> {}", bytes(r.before.measure()), bytes(r.after.measure()));
        let dev = device(&r.after);
        if r.tags.is_empty() {
            rows.push(vec![
                r.rank.to_string(),
                dev.clone(),
                "-".into(),
                bytes(0),
                probe.clone(),
                micros(r.elapsed_us),
                "-".into(),
            ]);
        }
        for (i, t) in r.tags.iter().enumerate() {
            rows.push(vec![
                r.rank.to_string(),
                dev.clone(),
                t.tag.clone(),
                tag_bytes(t),
                if i == 0 { probe.clone() } else { String::new() },
                micros(t.elapsed_us),
                restore(t),
            ]);
        }
    }
    let verb = match op.action.as_str() {
        "sleep" => "released",
        "update_weights" => "loaded",
        _ => "restored",
    };
    let mut out = table(&rows);
    let total = if op.op_id == 0 {
        format!(
            "total: {} {} on {} rank(s): nothing to do (already {})",
            op.action,
            op.tags.join(","),
            op.ranks.len(),
            if op.action == "sleep" { "asleep" } else { "awake" }
        )
    } else {
        format!(
            "total: {} {} on {} rank(s): {} {verb} in {} (op {})",
            op.action,
            op.tags.join(","),
            op.ranks.len(),
            bytes(op.bytes),
            micros(op.elapsed_us),
            op.op_id
        )
    };
    out.push_str(&total);
    out.push('\n');
    if let Some(version) = &op.weight_version {
        out.push_str(&format!("weight version: {version}\n"));
    }
    if op.kv_cache_dropped {
        out.push_str(
            "the KV caches and the prefix cache held the old weights' values: dropped (running \
             requests are computed again)\n",
        );
    }
    out
}

/// A status: the state, one row per rank (asleep tags, resident host bytes, device bytes),
/// and the ranks that did not answer.
pub fn status(s: &StatusWire) -> String {
    let mut out = match (s.state.as_str(), &s.reason) {
        (state, Some(reason)) => format!("state: {state} ({reason})\n"),
        (state, None) if !s.tags.is_empty() => format!("state: {state} ({})\n", s.tags.join(",")),
        (state, None) => format!("state: {state}\n"),
    };
    if s.paused {
        out.push_str("generation: paused (tpctl resume continues it)\n");
    }
    if !s.weight_version.is_empty() {
        out.push_str(&format!("weight version: {}\n", s.weight_version));
    }
    if let Some(op) = &s.in_progress {
        out.push_str(&format!("in progress: {op} (only rank 0 answered; ask again after it)\n"));
    }
    let mut rows =
        vec![["rank", "device", "asleep", "resident", "device memory"].map(str::to_owned).to_vec()];
    for r in &s.ranks {
        let asleep = if r.asleep.is_empty() { "-".to_owned() } else { r.asleep.join(",") };
        let device_bytes = if r.after.devices.is_empty() {
            "-".to_owned()
        } else {
            bytes(r.after.devices.iter().map(|(_, b)| b).sum())
        };
        rows.push(vec![
            r.rank.to_string(),
            device(&r.after),
            asleep,
            bytes(r.after.resident),
            device_bytes,
        ]);
    }
    out.push_str(&table(&rows));
    for f in &s.failures {
        out.push_str(&format!("rank {} did not answer ({}): {}\n", f.rank, f.phase, f.message));
    }
    out
}

/// A model host's table: the budget, then one row per model (its deployment, state, resident
/// bytes, live checkpoint, requests in flight and queued).
pub fn host(h: &HostWire) -> String {
    let mut out = format!(
        "model host {}: memory budget {}, {} resident\n",
        h.deployment,
        bytes(h.memory_budget_bytes),
        bytes(h.resident_bytes)
    );
    let header = ["model", "deployment", "state", "resident", "in flight", "queued", "checkpoint"];
    let mut rows = vec![header.map(str::to_owned).to_vec()];
    let mut failures = Vec::new();
    for m in &h.models {
        let state = match (m.state.as_str(), m.sleep_level) {
            ("asleep", Some(level)) => format!("asleep (level {level})"),
            ("asleep", None) => "asleep (put to sleep outside the host)".to_owned(),
            ("awake", _) if m.pinned => "awake (pinned)".to_owned(),
            (state, _) => state.to_owned(),
        };
        if let Some(why) = &m.failure {
            failures.push(format!("model {} failed: {why}\n", m.name));
        }
        rows.push(vec![
            m.name.clone(),
            m.deployment.clone(),
            state,
            bytes(m.resident_bytes),
            m.in_flight.to_string(),
            m.queued.to_string(),
            m.checkpoint.clone(),
        ]);
    }
    out.push_str(&table(&rows));
    out.extend(failures);
    out
}
