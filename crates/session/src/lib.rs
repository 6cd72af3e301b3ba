//! The per-rank engine: step agreement, session lifecycle and the sleep/wakeup protocol.
//!
//! Not built yet: see the session issue.
#![forbid(unsafe_code)]
