//! Progress of the ranks on the launcher's terminal: shard loading of every rank on one bar,
//! then the generation of a `tpctl run` whose text is not streamed (several prompts, JSON
//! lines).
//!
//! A rank started by the launcher reports `(done, total)` steps as a marker line on its
//! standard error ([`report`], [`report_generation`]); the launcher takes these lines out of
//! the rank's stream and draws them with `indicatif` ([`ProgressBars`]) only when its
//! standard error is a terminal. Rank processes started by another launcher (torchrun, mpirun,
//! Slurm) print nothing.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::{Mutex, PoisonError};

/// Starts a progress line; the byte 0x01 never begins a log line.
const MARKER: &str = "\u{1}tpctl-progress ";

/// What a progress line counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Steps of a rank's shard load.
    Load,
    /// Tokens of a run's generation (rank 0).
    Generate,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Load => "load",
            Kind::Generate => "generate",
        }
    }
}

fn report_kind(kind: Kind, done: usize, total: usize) {
    if std::env::var_os("TPCTL_LAUNCHER_PID").is_some() {
        eprintln!("{MARKER}{} {done} {total}", kind.name());
    }
}

/// Reports this rank's load progress to its launcher (nothing when not started by `tpctl`).
pub fn report(done: usize, total: usize) {
    report_kind(Kind::Load, done, total);
}

/// Reports rank 0's generation progress (tokens) to its launcher.
pub fn report_generation(done: usize, total: usize) {
    report_kind(Kind::Generate, done, total);
}

/// The kind and `(done, total)` of a progress line; `None` for any other line.
pub fn parse(line: &str) -> Option<(Kind, usize, usize)> {
    let mut words = line.strip_prefix(MARKER)?.split(' ');
    let kind = match words.next()? {
        "load" => Kind::Load,
        "generate" => Kind::Generate,
        _ => return None,
    };
    let done = words.next()?.trim().parse().ok()?;
    let total = words.next()?.trim().parse().ok()?;
    Some((kind, done, total))
}

/// The launcher's bars: its ranks' loads, then a run's generation.
#[derive(Debug)]
pub struct ProgressBars {
    bar: ProgressBar,
    /// `(done, total)` per local rank; total 0 until the rank reports.
    ranks: Mutex<Vec<(usize, usize)>>,
    /// The generation bar, once rank 0 reports one.
    generation: Mutex<Option<ProgressBar>>,
    draw: bool,
}

impl ProgressBars {
    /// A bar for `ranks` local ranks, drawn on standard error when it is a terminal.
    pub fn new(ranks: usize) -> ProgressBars {
        ProgressBars::with_target(ranks, std::io::stderr().is_terminal())
    }

    fn target(draw: bool) -> ProgressDrawTarget {
        if draw {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        }
    }

    fn with_target(ranks: usize, draw: bool) -> ProgressBars {
        let bar = ProgressBar::with_draw_target(Some(0), ProgressBars::target(draw));
        bar.set_style(
            ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} [{elapsed}]")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_message(format!("loading shards (0/{ranks} ranks ready)"));
        ProgressBars {
            bar,
            ranks: Mutex::new(vec![(0, 0); ranks]),
            generation: Mutex::new(None),
            draw,
        }
    }

    /// Takes one progress line of rank `local`.
    pub fn take(&self, local: usize, kind: Kind, done: usize, total: usize) {
        match kind {
            Kind::Load => self.update(local, done, total),
            Kind::Generate => self.generated(done, total),
        }
    }

    /// Rank 0 generated `done` of at most `total` tokens.
    pub fn generated(&self, done: usize, total: usize) {
        let mut slot = self.generation.lock().unwrap_or_else(PoisonError::into_inner);
        let bar = slot.get_or_insert_with(|| {
            let bar =
                ProgressBar::with_draw_target(Some(total as u64), ProgressBars::target(self.draw));
            bar.set_style(
                ProgressStyle::with_template(
                    "generating [{bar:30}] {pos}/{len} tokens [{elapsed}]",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar
        });
        bar.set_length(total as u64);
        bar.set_position(done.min(total) as u64);
        if done >= total {
            bar.finish_and_clear();
        }
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

    /// Prints a line on standard error without tearing a bar.
    pub fn println(&self, line: &str) {
        let generation = self.generation.lock().unwrap_or_else(PoisonError::into_inner);
        let active = [Some(&self.bar), generation.as_ref()]
            .into_iter()
            .flatten()
            .find(|b| !b.is_hidden() && !b.is_finished());
        match active {
            Some(bar) => bar.suspend(|| eprintln!("{line}")),
            None => eprintln!("{line}"),
        }
    }

    /// Removes the bars (a rank failed, or the launch ends).
    pub fn clear(&self) {
        if !self.bar.is_finished() {
            self.bar.finish_and_clear();
        }
        let generation = self.generation.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(bar) = generation.as_ref().filter(|b| !b.is_finished()) {
            bar.finish_and_clear();
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
        assert_eq!(parse(&format!("{MARKER}load 3 32")), Some((Kind::Load, 3, 32)));
        assert_eq!(parse(&format!("{MARKER}generate 7 64")), Some((Kind::Generate, 7, 64)));
        assert_eq!(parse("load 3 32"), None);
        assert_eq!(parse(&format!("{MARKER}load three 32")), None);
        assert_eq!(parse(&format!("{MARKER}unload 3 32")), None);
        assert_eq!(parse("[rank 1] loading"), None);
    }

    #[test]
    fn the_bar_sums_the_ranks_and_finishes_when_all_are_ready() {
        let bar = ProgressBars::with_target(2, false);
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

    #[test]
    fn the_generation_bar_follows_rank_0_and_finishes_at_its_total() {
        let bar = ProgressBars::with_target(1, false);
        bar.take(0, Kind::Generate, 5, 64);
        let position = |b: &ProgressBars| {
            let g = b.generation.lock().unwrap();
            let g = g.as_ref().unwrap();
            (g.position(), g.length(), g.is_finished())
        };
        assert_eq!(position(&bar), (5, Some(64), false));
        bar.take(0, Kind::Generate, 64, 64);
        assert_eq!(position(&bar), (64, Some(64), true));
    }
}
