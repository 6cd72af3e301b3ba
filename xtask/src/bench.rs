//! `cargo xtask bench <what> [--json]`: benchmarks next to the reference they are judged by.

mod agree;
mod agree_random;
mod coldstart;
mod collectives;
mod concurrency;
mod cycles;
mod large;
mod model;
mod roofline;
mod serve;
mod session;
mod sleep;
mod structured;
mod swap;
mod update;
mod vmm;

use anyhow::{bail, Result};

/// The value of `key` in a flat JSON object line as the bench binaries print it (no nesting,
/// no commas inside values), without its quotes.
pub(crate) fn field<'a>(json: &'a str, key: &str) -> Option<&'a str> {
    let key = format!("\"{key}\":");
    let start = json.find(&key)? + key.len();
    let rest = &json[start..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    Some(rest[..end].trim().trim_matches('"'))
}

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
            "serve" => serve::run(json)?,
            "concurrency" => concurrency::run(json)?,
            "structured" => structured::run(json)?,
            "update" => update::run(json)?,
            "cycles" => cycles::run(json)?,
            "swap" => swap::run(json)?,
            "agree" => agree::run(json)?,
            "coldstart" => coldstart::run(json)?,
            "large" => large::run(json)?,
            "agree-random" => agree_random::run(json)?,
            "all" => {
                collectives::run(json)?;
                vmm::run(json)?;
                session::run(json)?;
                model::run(json)?;
            }
            other => {
                bail!(
                    "unknown benchmark `{other}`: expected collectives, vmm, session, model, serve, concurrency, structured, update, sleep, cycles, swap, agree, agree-random, coldstart, large or all"
                )
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn fields_of_a_bench_line() {
        let line = r#"{"backend":"shm","ranks":2,"time_us":0.28,"note":"x"}"#;
        assert_eq!(super::field(line, "backend"), Some("shm"));
        assert_eq!(super::field(line, "ranks"), Some("2"));
        assert_eq!(super::field(line, "note"), Some("x"));
        assert_eq!(super::field(line, "missing"), None);
    }
}
