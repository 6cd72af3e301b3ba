//! The `tpctl` command's library half: configuration, the process launcher, the rank entry
//! point, rank 0's output, its HTTP API and control socket, kept apart from `main` so they
//! can be tested directly.
#![forbid(unsafe_code)]

pub mod catalog;
pub mod config;
pub mod control;
pub mod doctor;
pub mod exit;
pub mod fetch;
pub mod host;
pub mod launcher;
pub mod output;
pub mod progress;
pub mod rank;
pub mod serve;
pub mod spec;
