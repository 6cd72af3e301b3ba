//! Process-shared futex wait and wake on a 32-bit word in shared memory.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps while `word` holds `expected`, at most `timeout`; spurious wake-ups are possible.
pub(crate) fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: `word` is a valid, aligned 32-bit atomic for the duration of the call; FUTEX_WAIT
    // (not PRIVATE: the word lives in memory shared between processes) only reads it, and the
    // timespec outlives the call. Errors (EAGAIN when the word already changed, EINTR,
    // ETIMEDOUT) all mean "look again", which every caller does.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every process sleeping on `word`.
pub(crate) fn wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE does not access memory through the pointer beyond using its address as
    // the key; `word` is valid and aligned.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}
