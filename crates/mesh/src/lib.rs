//! Device mesh arithmetic, rendezvous, the TCP key-value store and device ownership.
//!
//! Everything here is agreed on by every rank without communication (pure arithmetic over the
//! world size and the layout) or exchanged once at start-up through the store.
#![forbid(unsafe_code)]

pub mod failpoint;
