//! `cargo xtask bench <what> [--json]`: benchmarks next to the reference they are judged by.

mod collectives;
mod model;
mod session;
mod sleep;
mod vmm;

use anyhow::{bail, Result};

pub(crate) fn run(args: &[String]) -> Result<()> {
    let json = args.iter().any(|a| a == "--json");
    let what: Vec<&str> =
        args.iter().map(String::as_str).filter(|a| !a.starts_with("--")).collect();
    let what = if what.is_empty() { vec!["all"] } else { what };
    for w in what {
        match w {
            "collectives" => collectives::run(json)?,
            "vmm" => vmm::run(json)?,
            "session" => session::run(json)?,
            "model" => model::run(json)?,
            "sleep" => sleep::run(json)?,
            "all" => {
                collectives::run(json)?;
                vmm::run(json)?;
                session::run(json)?;
                model::run(json)?;
            }
            other => {
                bail!(
                    "unknown benchmark `{other}`: expected collectives, vmm, session, model or all"
                )
            }
        }
    }
    Ok(())
}
