//! How a rank process leaves: at a signal (the engine stops at its next step boundary, on
//! every rank) or on a failure (its error at once, then the process exits without teardown).
//! Shared by the rank entry point ([`crate::rank`]) and rank 0's HTTP server ([`crate::serve`]).

use session::Leader;
use std::io::Write;

/// The exit code of a rank whose failure follows another rank's (the launcher reports the
/// original failure instead).
pub const EXIT_PEER_FAILED: i32 = 3;

/// Whether `e` is only the consequence of another rank's failure.
pub fn caused_by_peer(e: &anyhow::Error) -> bool {
    let blames_peer = |ce: &collectives::Error| {
        matches!(
            ce,
            collectives::Error::PeerFailed { .. }
                | collectives::Error::PeerDied { .. }
                | collectives::Error::PeerClosed { .. }
                | collectives::Error::Poisoned { .. }
        )
    };
    e.chain().any(|c| {
        c.downcast_ref::<session::Error>()
            .is_some_and(|s| s.caused_by_peer() || matches!(s, session::Error::PeerFailed { .. }))
            || c.downcast_ref::<collectives::Error>().is_some_and(blames_peer)
            || c.downcast_ref::<layers::Error>().and_then(layers::Error::collective).is_some_and(blames_peer)
            || matches!(c.downcast_ref::<tensor::Error>(), Some(tensor::Error::Collective(ce)) if blames_peer(ce))
    })
}

/// Ends a failed rank at once: rank 0's output so far, then the error on standard error (the
/// engine's errors name the rank, epoch and step), then the control socket goes and the
/// process exits with 1, or [`EXIT_PEER_FAILED`] when the failure follows another rank's.
/// Nothing else is torn down (the failed session's model, device memory, the groups' buffers:
/// the OS frees them), so the launcher sees the original error before it decides whom to stop.
pub fn exit_failed(e: &anyhow::Error, control: Option<crate::control::Server>) -> ! {
    let code = if caused_by_peer(e) { EXIT_PEER_FAILED } else { 1 };
    let _ = std::io::stdout().flush();
    eprintln!("error: {}", crate::output::describe(e));
    drop(control);
    leave(code)
}

/// The exit code of a rank that panicked where no engine turned the panic into its error
/// (Rust's own code for a panic that ends `main`).
pub const EXIT_PANICKED: i32 = 101;

/// Runs a rank's body; a panic that escapes it (the engine turns a panic in model code into
/// the rank's error; one in start-up, teardown or the control plane reaches here) ends the
/// rank at once as a failure: its message as the rank's last line, then [`leave`] with
/// [`EXIT_PANICKED`]. Unwinding out of `main` instead would run the exit handlers, and under
/// `mpirun` one of them is `MPI_Finalize`, which waits for every peer: the peers would then
/// fail on their own deadlines and the user would read their errors instead of this one.
pub fn failing_on_panic<T>(body: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(value) => value,
        Err(payload) => {
            let _ = std::io::stdout().flush();
            eprintln!("error: panicked: {}", session::panic_message(&*payload));
            leave(EXIT_PANICKED)
        }
    }
}

/// Where a rank started by tpctl's mpirun shim leaves its exit code (see [`leave`]).
pub const EXIT_FILE_ENV: &str = "TPCTL_RANK_EXIT_FILE";

/// Exits with `code`. Under tpctl's mpirun ([`EXIT_FILE_ENV`] set) the process writes the code
/// for its shim and ends itself with SIGKILL instead, skipping its exit handlers: one of them
/// is `MPI_Finalize`, which waits for every other rank to finalize too, so a failed rank would
/// wait for peers still busy in their calls instead of leaving; this way mpirun sees it leave
/// and ends the job at once, and the shim reports the code.
pub fn leave(code: i32) -> ! {
    if let Some(path) = std::env::var_os(EXIT_FILE_ENV) {
        let _ = std::io::stdout().flush();
        if std::fs::write(&path, format!("{code}\n")).is_ok() {
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        }
    }
    std::process::exit(code)
}

/// Leaves a failed engine to the process's exit: after a failure it still holds the failed
/// session's model ([`Leader::run`]), whose teardown can block, and the rank is about to exit
/// on the error ([`exit_failed`]) with the OS freeing what it held.
pub(crate) fn abandon(leader: Leader) {
    std::mem::forget(leader);
}

/// SIGINT or SIGTERM (forwarded by the launcher) stops the engine at the next step boundary.
pub(crate) fn stop_on_signal(stop: session::StopHandle) {
    if let Err(e) = ctrlc::set_handler(move || stop.request_stop()) {
        tracing::warn!("cannot install the stop handler: {e}");
    }
}
