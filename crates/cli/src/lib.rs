//! The `tpctl` command's library half: configuration, the process launcher, the rank entry
//! point and rank 0's output, kept apart from `main` so they can be tested directly.
#![forbid(unsafe_code)]

pub mod config;
pub mod launcher;
pub mod output;
pub mod rank;
pub mod spec;
