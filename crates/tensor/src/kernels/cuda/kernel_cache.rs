//! The on-disk cache of compiled kernels: where it lives, what an entry is keyed by, and how
//! an entry is written and read back. No CUDA here, so all of it is tested on every machine;
//! the CUDA backend (`device/kernel_image.rs`) only compiles and loads.
//!
//! An entry is one file, `<arch>-<16 hex digits>.cubin`, the digits a hash of everything the
//! machine code depends on ([`KernelKey`]). The file holds a header (a magic, the key's full
//! text, the image's length and checksum) before the image, so an entry that was cut short,
//! overwritten, or made for other inputs under a colliding name is noticed before the driver
//! sees a byte of it, and compiled again. Writers write a temporary file and rename it over
//! the entry, so two processes racing leave one whole entry, never a mix.

use std::ffi::OsString;
use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The first bytes of an entry; bumped when the layout changes.
const MAGIC: &[u8; 8] = b"TPCTLKC1";

/// Everything the machine code of the kernels depends on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct KernelKey<'a> {
    /// The CUDA C source.
    pub(crate) source: &'a str,
    /// NVRTC's options, the architecture's among them.
    pub(crate) options: &'a [String],
    /// The architecture compiled for (`sm_90`).
    pub(crate) arch: &'a str,
    /// NVRTC's version, major and minor.
    pub(crate) nvrtc: (i32, i32),
}

/// 64-bit FNV-1a: stable across Rust versions and processes, unlike the standard hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

impl KernelKey<'_> {
    /// The key spelled out: what an entry's header must hold to be this key's.
    pub(crate) fn text(&self) -> String {
        let mut text = format!(
            "source {:016x} ({} bytes)\narch {}\nnvrtc {}.{}\n",
            fnv1a(self.source.as_bytes()),
            self.source.len(),
            self.arch,
            self.nvrtc.0,
            self.nvrtc.1
        );
        for o in self.options {
            text.push_str("option ");
            text.push_str(o);
            text.push('\n');
        }
        text
    }

    /// The entry's file name: the architecture, for a person reading the folder, and a hash
    /// of the whole key.
    pub(crate) fn file_name(&self) -> String {
        let arch: String =
            self.arch.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        format!("{arch}-{:016x}.cubin", fnv1a(self.text().as_bytes()))
    }
}

/// `image` as an entry of `key`.
pub(crate) fn encode_entry(key: &KernelKey<'_>, image: &[u8]) -> Vec<u8> {
    let header = key.text();
    let mut out = Vec::with_capacity(MAGIC.len() + 4 + header.len() + 16 + image.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&(image.len() as u64).to_le_bytes());
    out.extend_from_slice(&fnv1a(image).to_le_bytes());
    out.extend_from_slice(image);
    out
}

/// The image in `entry` when it is a whole entry of `key`, else why not.
pub(crate) fn decode_entry(key: &KernelKey<'_>, entry: &[u8]) -> Result<Vec<u8>, String> {
    let mut rest = entry;
    let mut take = |n: usize, what: &str| -> Result<&[u8], String> {
        if rest.len() < n {
            return Err(format!("cut short in its {what} ({} bytes in all)", entry.len()));
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Ok(head)
    };
    if take(MAGIC.len(), "magic")? != MAGIC {
        return Err("not a tpctl kernel cache entry (or an older layout)".into());
    }
    let header_len = u32::from_le_bytes(take(4, "header")?.try_into().unwrap_or_default());
    let header = take(header_len as usize, "header")?;
    if header != key.text().as_bytes() {
        return Err("made for other source, options, architecture or NVRTC".into());
    }
    let len = u64::from_le_bytes(take(8, "length")?.try_into().unwrap_or_default());
    let sum = u64::from_le_bytes(take(8, "checksum")?.try_into().unwrap_or_default());
    let image = take(usize::try_from(len).unwrap_or(usize::MAX), "image")?;
    if fnv1a(image) != sum {
        return Err("the image does not match its checksum".into());
    }
    if !rest.is_empty() {
        return Err(format!("{} bytes past the image", rest.len()));
    }
    Ok(image.to_vec())
}

/// What the cache holds for a key.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// The image, whole.
    Hit(Vec<u8>),
    /// No entry.
    Miss,
    /// An entry that cannot be used (unreadable, cut short, corrupt, another key's), and why:
    /// a miss that deserves a log line.
    Unusable(String),
}

/// A folder of kernel cache entries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct KernelCache {
    dir: PathBuf,
}

/// The variable that names the kernel cache folder, or turns the cache off with `off`.
pub(crate) const CACHE_VAR: &str = "TPCTL_KERNEL_CACHE";

impl KernelCache {
    /// The cache in `dir` (made at the first write).
    pub(crate) fn at(dir: impl Into<PathBuf>) -> KernelCache {
        KernelCache { dir: dir.into() }
    }

    /// The cache this process uses: [`KernelCache::from_vars`] over the environment.
    #[cfg(feature = "cuda")]
    pub(crate) fn from_env() -> Option<KernelCache> {
        KernelCache::from_vars(|k| std::env::var_os(k))
    }

    /// The cache folder `var` (an environment) names: `$TPCTL_KERNEL_CACHE` (none when it is
    /// `off`), else `kernels` beside the model cache: `$XDG_CACHE_HOME/tpctl/kernels`, else
    /// `~/.cache/tpctl/kernels`; `None` when none is set.
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Option<KernelCache> {
        let var = |k: &str| var(k).filter(|v| !v.is_empty());
        if let Some(dir) = var(CACHE_VAR) {
            return (dir != "off").then(|| KernelCache::at(dir));
        }
        var("XDG_CACHE_HOME")
            .map(|d| PathBuf::from(d).join("tpctl"))
            .or_else(|| var("HOME").map(|d| PathBuf::from(d).join(".cache").join("tpctl")))
            .map(|d| KernelCache::at(d.join("kernels")))
    }

    /// The folder.
    #[cfg(test)]
    pub(crate) fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Where `key`'s entry lives.
    pub(crate) fn path(&self, key: &KernelKey<'_>) -> PathBuf {
        self.dir.join(key.file_name())
    }

    /// `key`'s image, if the cache holds a whole one.
    pub(crate) fn read(&self, key: &KernelKey<'_>) -> Lookup {
        match std::fs::read(self.path(key)) {
            Ok(entry) => match decode_entry(key, &entry) {
                Ok(image) => Lookup::Hit(image),
                Err(why) => Lookup::Unusable(why),
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => Lookup::Miss,
            Err(e) => Lookup::Unusable(format!("reading it: {e}")),
        }
    }

    /// Stores `image` as `key`'s entry, replacing what was there, and returns its path. The
    /// entry appears whole or not at all: it is written to a temporary file of this process
    /// and call, then renamed over the entry's name.
    ///
    /// # Errors
    /// The folder cannot be made, or the file written or renamed; the temporary file is
    /// removed then.
    pub(crate) fn write(&self, key: &KernelKey<'_>, image: &[u8]) -> io::Result<PathBuf> {
        static N: AtomicUsize = AtomicUsize::new(0);
        std::fs::create_dir_all(&self.dir)?;
        let path = self.path(key);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let tmp = self.dir.join(format!(".{}.{}-{n}.tmp", key.file_name(), std::process::id()));
        let written = (|| {
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(&encode_entry(key, image))?;
            file.sync_all()?;
            std::fs::rename(&tmp, &path)
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written.map(|()| path)
    }
}

#[cfg(test)]
mod tests;
