//! The kernel cache's key, entry layout and file handling, on the local disk.

use super::*;
use crate::test_util::temp_path;
use std::path::Path;

fn options() -> Vec<String> {
    vec!["--fmad=false".into(), "--gpu-architecture=sm_90".into()]
}

fn key<'a>(options: &'a [String]) -> KernelKey<'a> {
    KernelKey { source: "__global__ void k() {}", options, arch: "sm_90", nvrtc: (12, 8) }
}

/// An image that looks like nothing in particular, `len` bytes long.
fn image(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// The temporary files a writer left in `dir`.
fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect()
}

#[test]
fn the_key_changes_with_each_input() {
    let opts = options();
    let base = key(&opts);
    let other_opts = vec!["--fmad=true".to_owned(), "--gpu-architecture=sm_90".to_owned()];
    let variants = [
        KernelKey { source: "__global__ void k() { }", ..base.clone() },
        KernelKey { options: &other_opts, ..base.clone() },
        KernelKey { options: &opts[..1], ..base.clone() },
        KernelKey { arch: "sm_80", ..base.clone() },
        KernelKey { nvrtc: (13, 8), ..base.clone() },
        KernelKey { nvrtc: (12, 9), ..base.clone() },
    ];
    let mut names = vec![base.file_name()];
    for v in &variants {
        assert_ne!(v.text(), base.text(), "{v:?}");
        names.push(v.file_name());
    }
    let mut unique = names.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), names.len(), "{names:?}");
    // The same inputs give the same name in every process (no random hasher seed).
    assert_eq!(key(&opts).file_name(), base.file_name());
    assert!(base.file_name().starts_with("sm_90-") && base.file_name().ends_with(".cubin"));
    assert_eq!(base.file_name().len(), "sm_90-".len() + 16 + ".cubin".len());
}

#[test]
fn a_written_entry_reads_back() {
    let cache = KernelCache::at(temp_path("kernel-cache-read-back"));
    let opts = options();
    let key = key(&opts);
    assert_eq!(cache.read(&key), Lookup::Miss);
    let img = image(5000, 7);
    let path = cache.write(&key, &img).unwrap();
    assert_eq!(path, cache.dir().join(key.file_name()));
    assert_eq!(cache.read(&key), Lookup::Hit(img.clone()));
    // Another key does not see it.
    let other = KernelKey { arch: "sm_80", ..key.clone() };
    assert_eq!(cache.read(&other), Lookup::Miss);
    // Written again (a rebuild), it is replaced whole.
    let img2 = image(300, 9);
    cache.write(&key, &img2).unwrap();
    assert_eq!(cache.read(&key), Lookup::Hit(img2));
    assert!(leftovers(cache.dir()).is_empty(), "{:?}", leftovers(cache.dir()));
    std::fs::remove_dir_all(cache.dir()).unwrap();
}

#[test]
fn a_truncated_or_corrupt_entry_is_a_miss_and_is_replaced() {
    let opts = options();
    let key = key(&opts);
    let img = image(200, 3);
    let whole = encode_entry(&key, &img);
    assert_eq!(decode_entry(&key, &whole), Ok(img.clone()));
    // Every shorter prefix, the empty file included, is refused.
    for n in 0..whole.len() {
        assert!(decode_entry(&key, &whole[..n]).is_err(), "a prefix of {n} bytes was accepted");
    }
    // A flipped bit anywhere (magic, header, length, checksum, image) is refused.
    for at in (0..whole.len()).step_by(7) {
        let mut bad = whole.clone();
        bad[at] ^= 0x10;
        assert!(decode_entry(&key, &bad).is_err(), "a flipped byte at {at} was accepted");
    }
    // As is a byte past the end, and another key's entry.
    let mut long = whole.clone();
    long.push(0);
    assert!(decode_entry(&key, &long).unwrap_err().contains("past the image"));
    let other = KernelKey { nvrtc: (13, 0), ..key.clone() };
    assert!(decode_entry(&other, &whole).unwrap_err().contains("other source"));

    // On disk: a truncated entry reads as unusable (with why), and a write replaces it.
    let cache = KernelCache::at(temp_path("kernel-cache-corrupt"));
    let path = cache.write(&key, &img).unwrap();
    std::fs::write(&path, &whole[..whole.len() - 1]).unwrap();
    let Lookup::Unusable(why) = cache.read(&key) else { panic!("a truncated entry was used") };
    assert!(why.contains("cut short"), "{why}");
    std::fs::write(&path, b"garbage").unwrap();
    assert!(matches!(cache.read(&key), Lookup::Unusable(_)));
    cache.write(&key, &img).unwrap();
    assert_eq!(cache.read(&key), Lookup::Hit(img));
    std::fs::remove_dir_all(cache.dir()).unwrap();
}

#[test]
fn racing_writers_leave_a_whole_entry() {
    let cache = KernelCache::at(temp_path("kernel-cache-race"));
    let opts = options();
    let key = key(&opts);
    // Images of different lengths, so a mix of two writes could not pass for either.
    let images: Vec<Vec<u8>> = (0..4).map(|i| image(20_000 + 7_919 * i, i as u8)).collect();
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut seen = 0;
            while !done.load(Ordering::Relaxed) {
                match cache.read(&key) {
                    Lookup::Miss => {}
                    Lookup::Hit(got) => {
                        assert!(images.contains(&got), "read an image nobody wrote");
                        seen += 1;
                    }
                    Lookup::Unusable(why) => panic!("a reader saw a partial entry: {why}"),
                }
            }
            seen
        });
        let writers: Vec<_> = images
            .iter()
            .map(|img| {
                s.spawn(|| {
                    for _ in 0..25 {
                        cache.write(&key, img).unwrap();
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        reader.join().unwrap();
    });
    let Lookup::Hit(last) = cache.read(&key) else { panic!("no whole entry after the race") };
    assert!(images.contains(&last));
    assert!(leftovers(cache.dir()).is_empty(), "{:?}", leftovers(cache.dir()));
    std::fs::remove_dir_all(cache.dir()).unwrap();
}

#[test]
fn a_write_that_cannot_happen_is_an_error_not_a_panic() {
    // The cache folder's place is taken by a file.
    let blocker = temp_path("kernel-cache-blocked");
    std::fs::write(&blocker, b"not a folder").unwrap();
    let cache = KernelCache::at(blocker.join("kernels"));
    let opts = options();
    assert!(cache.write(&key(&opts), b"image").is_err());
    // Nor can a read: that is an unusable entry with the reason, not a miss or a panic.
    let Lookup::Unusable(why) = cache.read(&key(&opts)) else { panic!("read through a file") };
    assert!(why.starts_with("reading it: "), "{why}");
    std::fs::remove_file(&blocker).unwrap();
}

#[test]
fn the_folder_follows_the_environment() {
    // The folder chosen in an environment of `pairs`.
    let dir = |pairs: &[(&str, &str)]| {
        let var = |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| OsString::from(v));
        KernelCache::from_vars(var).map(|c| c.dir().to_path_buf())
    };
    let default = Some(PathBuf::from("/home/u/.cache/tpctl/kernels"));
    assert_eq!(dir(&[("HOME", "/home/u")]), default);
    assert_eq!(
        dir(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/c")]),
        Some(PathBuf::from("/c/tpctl/kernels"))
    );
    assert_eq!(dir(&[("HOME", "/home/u"), (CACHE_VAR, "/k")]), Some(PathBuf::from("/k")));
    assert_eq!(dir(&[("HOME", "/home/u"), (CACHE_VAR, "off")]), None);
    assert_eq!(dir(&[("HOME", "/home/u"), (CACHE_VAR, "")]), default);
    assert_eq!(dir(&[]), None);
}
