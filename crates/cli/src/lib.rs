//! The `tpctl` command's library half: configuration and the process launcher, kept apart
//! from `main` so they can be tested directly.
#![forbid(unsafe_code)]

pub mod config;
pub mod launcher;
