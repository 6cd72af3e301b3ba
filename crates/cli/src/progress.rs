//! Shard loading of every rank on one progress bar.
//!
//! A rank started by the launcher reports `(done, total)` steps of its load as a marker line on
//! its standard error ([`report`]); the launcher takes these lines out of the rank's stream and
//! shows the sum over its ranks on one `indicatif` bar ([`LoadBar`]), drawn only when standard
//! error is a terminal. Rank processes started by another launcher (torchrun, mpirun, Slurm)
//! print nothing.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::{Mutex, PoisonError};

/// Starts a progress line; the byte 0x01 never begins a log line.
const MARKER: &str = "\u{1}tpctl-progress ";

/// Reports this rank's load progress to its launcher (nothing when not started by `tpctl`).
pub fn report(done: usize, total: usize) {
    if std::env::var_os("TPCTL_LAUNCHER_PID").is_some() {
        eprintln!("{MARKER}{done} {total}");
    }
}

/// The `(done, total)` of a progress line; `None` for any other line.
pub fn parse(line: &str) -> Option<(usize, usize)> {
    let (done, total) = line.strip_prefix(MARKER)?.split_once(' ')?;
    Some((done.trim().parse().ok()?, total.trim().parse().ok()?))
}

/// The launcher's bar over its ranks' loads.
#[derive(Debug)]
pub struct LoadBar {
    bar: ProgressBar,
    /// `(done, total)` per local rank; total 0 until the rank reports.
    ranks: Mutex<Vec<(usize, usize)>>,
}

impl LoadBar {
    /// A bar for `ranks` local ranks, drawn on standard error when it is a terminal.
    pub fn new(ranks: usize) -> LoadBar {
        let target = if std::io::stderr().is_terminal() {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        LoadBar::with_target(ranks, target)
    }

    fn with_target(ranks: usize, target: ProgressDrawTarget) -> LoadBar {
        let bar = ProgressBar::with_draw_target(Some(0), target);
        bar.set_style(
            ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} [{elapsed}]")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_message(format!("loading shards (0/{ranks} ranks ready)"));
        LoadBar { bar, ranks: Mutex::new(vec![(0, 0); ranks]) }
    }

    /// Rank `local` (its index among this launcher's ranks) reached `done` of `total` steps.
    pub fn update(&self, local: usize, done: usize, total: usize) {
        let mut ranks = self.ranks.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(slot) = ranks.get_mut(local) else { return };
        *slot = (done.min(total), total);
        let (done, total) = ranks.iter().fold((0, 0), |(d, t), &(rd, rt)| (d + rd, t + rt));
        let ready = ranks.iter().filter(|&&(d, t)| t > 0 && d == t).count();
        self.bar.set_length(total as u64);
        self.bar.set_position(done as u64);
        self.bar.set_message(format!("loading shards ({ready}/{} ranks ready)", ranks.len()));
        if ready == ranks.len() {
            self.bar.finish_and_clear();
        }
    }

    /// Prints a line on standard error without tearing the bar.
    pub fn println(&self, line: &str) {
        if self.bar.is_hidden() || self.bar.is_finished() {
            eprintln!("{line}");
        } else {
            self.bar.suspend(|| eprintln!("{line}"));
        }
    }

    /// Removes the bar (a rank failed, or the launch ends).
    pub fn clear(&self) {
        if !self.bar.is_finished() {
            self.bar.finish_and_clear();
        }
    }

    /// `(done, total)` over all ranks, as drawn.
    pub fn position(&self) -> (u64, u64) {
        (self.bar.position(), self.bar.length().unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines_parse_and_other_lines_do_not() {
        assert_eq!(parse(&format!("{MARKER}3 32")), Some((3, 32)));
        assert_eq!(parse("3 32"), None);
        assert_eq!(parse(&format!("{MARKER}three 32")), None);
        assert_eq!(parse("[rank 1] loading"), None);
    }

    #[test]
    fn the_bar_sums_the_ranks_and_finishes_when_all_are_ready() {
        let bar = LoadBar::with_target(2, ProgressDrawTarget::hidden());
        bar.update(0, 3, 10);
        assert_eq!(bar.position(), (3, 10), "rank 1 has not reported yet");
        bar.update(1, 5, 10);
        assert_eq!(bar.position(), (8, 20));
        bar.update(0, 10, 10);
        assert!(!bar.bar.is_finished());
        bar.update(1, 12, 10);
        assert_eq!(bar.position(), (20, 20), "a step past the total counts as done");
        assert!(bar.bar.is_finished());
        bar.update(7, 1, 1);
        assert_eq!(bar.position(), (20, 20), "an unknown rank is ignored");
    }
}
