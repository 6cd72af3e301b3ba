//! Weight updates from memory, as an RL trainer pushes them: `start_weight_update`, any number
//! of buckets (each a safetensors file of named tensors, e.g. in `/dev/shm`), then
//! `finish_weight_update`, which commits them all on every rank at once through the two-phase
//! weight update (`abort_weight_update`, or a failure anywhere, leaves the old weights).
//!
//! Rank 0 checks each bucket against the live model when it arrives (names, shapes, dtypes;
//! [`checkpoint::Bucket`]), so a bad one is the trainer's mistake at once, and keeps it: a hard
//! link next to it (or a copy in the temporary directory where no link can be made), so the
//! trainer may delete or overwrite its file as soon as the call returns. The live weights then
//! are the checkpoint with the kept buckets laid over it, which a reload (a level-2 sleep's
//! wakeup, a rollback) reads again; kept files go when no live update names them any more.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// The open update and the files kept for the live weights. Cheap to clone; the last clone
/// removes every file it kept.
#[derive(Clone, Debug, Default)]
pub struct Staging(Arc<Mutex<State>>);

#[derive(Debug, Default)]
struct State {
    /// The update between its start and its finish.
    open: Option<Open>,
    /// Files kept for the live weights (the latest committed update's buckets).
    live: Vec<PathBuf>,
}

/// An update between `start_weight_update` and `finish_weight_update`.
#[derive(Debug, Default)]
struct Open {
    /// The kept copies of its buckets, in order.
    buckets: Vec<PathBuf>,
    /// The version given at the start.
    version: Option<String>,
}

/// Why a staging call is refused (the caller's mistake).
#[derive(Debug, thiserror::Error)]
pub enum StagingError {
    /// `start` while an update is open.
    #[error(
        "a weight update is already open ({0} bucket(s) staged): finish_weight_update or \
         abort_weight_update it first"
    )]
    AlreadyOpen(usize),
    /// A bucket or a finish without a start.
    #[error("no weight update is open: start_weight_update first")]
    NotOpen,
    /// The bucket could not be kept.
    #[error("keeping bucket {path}: {source}")]
    Keep {
        /// The bucket.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl Staging {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens an update, whose weights will have `version` unless the finish names another.
    ///
    /// # Errors
    /// [`StagingError::AlreadyOpen`].
    pub fn start(&self, version: Option<String>) -> Result<(), StagingError> {
        let mut s = self.lock();
        if let Some(open) = &s.open {
            return Err(StagingError::AlreadyOpen(open.buckets.len()));
        }
        s.open = Some(Open { buckets: Vec::new(), version });
        Ok(())
    }

    /// Whether an update is open.
    pub fn is_open(&self) -> bool {
        self.lock().open.is_some()
    }

    /// Keeps the bucket at `path` (already checked) for the open update; the number of
    /// buckets staged.
    ///
    /// # Errors
    /// No update is open, or the file cannot be linked or copied.
    pub fn add(&self, path: &Path) -> Result<usize, StagingError> {
        if !self.is_open() {
            return Err(StagingError::NotOpen);
        }
        let kept = keep(path)
            .map_err(|source| StagingError::Keep { path: path.display().to_string(), source })?;
        let mut s = self.lock();
        match &mut s.open {
            Some(open) => {
                open.buckets.push(kept);
                Ok(open.buckets.len())
            }
            // Aborted meanwhile.
            None => {
                let _ = std::fs::remove_file(&kept);
                Err(StagingError::NotOpen)
            }
        }
    }

    /// Closes the open update for its commit: its kept buckets, in order, and its version.
    ///
    /// # Errors
    /// [`StagingError::NotOpen`].
    pub fn take(&self) -> Result<(Vec<PathBuf>, Option<String>), StagingError> {
        let open = self.lock().open.take().ok_or(StagingError::NotOpen)?;
        Ok((open.buckets, open.version))
    }

    /// Drops the open update and its kept files; the number of buckets it had.
    ///
    /// # Errors
    /// [`StagingError::NotOpen`].
    pub fn abort(&self) -> Result<usize, StagingError> {
        let (buckets, _) = self.take()?;
        remove(&buckets);
        Ok(buckets.len())
    }

    /// Records what the live weights read after a committed update (`live`: every kept file
    /// its overlay names) and removes the kept files nothing live names any more; a failed
    /// update gives back the `staged` files it took.
    pub fn settle(&self, staged: &[PathBuf], committed: bool, live: &[String]) {
        let mut s = self.lock();
        if !committed {
            remove(staged);
            return;
        }
        let live: Vec<PathBuf> = live.iter().map(PathBuf::from).collect();
        let stale: Vec<PathBuf> = s.live.iter().filter(|p| !live.contains(p)).cloned().collect();
        remove(&stale);
        s.live = live;
    }
}

impl Drop for State {
    fn drop(&mut self) {
        remove(&self.live);
        if let Some(open) = &self.open {
            remove(&open.buckets);
        }
    }
}

fn remove(paths: &[PathBuf]) {
    for p in paths {
        let _ = std::fs::remove_file(p);
    }
}

/// A name no other file of this process has: `.tpctl-PID-N-{suffix}`.
fn unique(suffix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!(".tpctl-{}-{n}-{suffix}", std::process::id())
}

/// A path for a bucket this process writes itself (tensors read from a trainer's GPU): in
/// `/dev/shm` (memory, like the trainers' own buckets) where there is one, else in the
/// temporary directory. Nothing is created.
pub fn scratch_file(suffix: &str) -> PathBuf {
    let shm = Path::new("/dev/shm");
    let dir = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
    dir.join(unique(suffix))
}

/// A file of this process with the contents of `path`: a hard link next to it (no copy; the
/// trainer's file may go), else a copy in the temporary directory.
fn keep(path: &Path) -> std::io::Result<PathBuf> {
    let name = unique(&path.file_name().map_or_else(|| "bucket".into(), |f| f.to_string_lossy()));
    let beside = path.parent().unwrap_or(Path::new(".")).join(&name);
    if std::fs::hard_link(path, &beside).is_ok() {
        return Ok(beside);
    }
    let copy = std::env::temp_dir().join(name);
    std::fs::copy(path, &copy)?;
    Ok(copy)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, name).unwrap();
        p
    }

    #[test]
    fn kept_buckets_outlive_the_trainers_files_until_nothing_live_names_them() {
        let dir = std::env::temp_dir().join(format!("tpctl-staging-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let staging = Staging::default();
        assert!(matches!(staging.add(&bucket(&dir, "a")), Err(StagingError::NotOpen)));
        staging.start(Some("v1".into())).unwrap();
        assert!(matches!(staging.start(None), Err(StagingError::AlreadyOpen(0))));
        let a = bucket(&dir, "a");
        assert_eq!(staging.add(&a).unwrap(), 1);
        assert_eq!(staging.add(&bucket(&dir, "b")).unwrap(), 2);
        // The trainer frees its memory at once.
        std::fs::remove_file(&a).unwrap();
        let (kept, version) = staging.take().unwrap();
        assert_eq!(version.as_deref(), Some("v1"));
        assert_eq!(std::fs::read_to_string(&kept[0]).unwrap(), "a");
        let live: Vec<String> = kept.iter().map(|p| p.display().to_string()).collect();
        staging.settle(&kept, true, &live);
        assert!(kept.iter().all(|p| p.exists()));
        // A checkpoint reload: nothing live names them.
        staging.settle(&[], true, &[]);
        assert!(kept.iter().all(|p| !p.exists()));

        // An aborted update, and a failed one, give their files back.
        staging.start(None).unwrap();
        staging.add(&bucket(&dir, "c")).unwrap();
        let (failed, _) = staging.take().unwrap();
        staging.settle(&failed, false, &[]);
        assert!(!failed[0].exists());
        staging.start(None).unwrap();
        staging.add(&bucket(&dir, "d")).unwrap();
        assert_eq!(staging.abort().unwrap(), 1);
        assert!(matches!(staging.abort(), Err(StagingError::NotOpen)));
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".tpctl-"))
            .collect();
        assert!(left.is_empty(), "kept files left behind: {left:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
