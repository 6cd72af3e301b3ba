//! Tests of the procfs and NVML probes.

use super::*;

const ROLLUP: &str =
    "55d4c2a1e000-7ffd5e1f2000 ---p 00000000 00:00 0                          [rollup]
Rss:              538128 kB
Pss:              536000 kB
Shared_Clean:       1200 kB
Shared_Dirty:         16 kB
Private_Clean:       100 kB
Private_Dirty:    536812 kB
Anonymous:          9000 kB
";

const STATUS: &str = "Name:\tvmm\nVmRSS:\t  538128 kB\nRssAnon:\t    9000 kB\nRssFile:\t    1216 kB\nRssShmem:\t  527912 kB\n";

#[test]
fn parses_smaps_rollup_and_status() {
    let p = std::path::Path::new("/proc/1/x");
    let m = ProcessMemory::parse(7, Some(ROLLUP), STATUS, p, p).unwrap();
    assert_eq!(
        m,
        ProcessMemory {
            pid: 7,
            resident: 538_128 * 1024,
            anonymous: 9000 * 1024,
            shared: 1216 * 1024,
            shmem: 527_912 * 1024
        }
    );
    let fallback = ProcessMemory::parse(7, None, STATUS, p, p).unwrap();
    assert_eq!(fallback.resident, m.resident);
    assert_eq!(fallback.shared, (1216 + 527_912) * 1024);
}

#[test]
fn a_missing_field_is_named() {
    let p = std::path::Path::new("/proc/1/status");
    let err =
        ProcessMemory::parse(1, None, "Name: x\nRssShmem: 1 kB\n", p, p).unwrap_err().to_string();
    assert!(err.contains("VmRSS") && err.contains("/proc/1/status"), "{err}");
}

#[test]
fn reads_this_process_and_names_a_missing_one() {
    let me = ProcessMemory::current().unwrap();
    assert!(me.resident > 0 && me.resident >= me.anonymous);
    let err = ProcessMemory::of(u32::MAX).unwrap_err().to_string();
    assert!(err.contains(&format!("/proc/{}/status", u32::MAX)), "{err}");
}

#[test]
fn device_memory_is_unavailable_without_nvml_and_never_panics() {
    let require = std::env::var("TPCTL_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match NvmlMemory::new() {
        Ok(nvml) => {
            let devices = nvml.devices().unwrap();
            assert!(!devices.is_empty() || !require, "NVML loaded but sees no device");
            for d in devices {
                assert!(d.used <= d.total, "{d:?}");
            }
        }
        Err(e) => {
            if cfg!(feature = "cuda") {
                assert!(matches!(e, Error::BackendUnavailable { backend: "nvml", .. }), "{e}");
            } else {
                assert!(matches!(e, Error::NotCompiledWith { feature: "cuda" }), "{e}");
            }
            assert!(!require, "TPCTL_REQUIRE_GPU=1 but NVML is unusable: {e}");
        }
    }
}

#[test]
fn bytes_of_a_process_the_driver_does_not_list_are_unknown() {
    let usage =
        DeviceUsage { processes: vec![(10, Some(5)), (11, None)], ..DeviceUsage::default() };
    assert_eq!(usage.bytes_of(10), Some(5));
    assert_eq!(usage.bytes_of(11), None);
    // Not listed: in a PID namespace NVML may list the host's PIDs, or no process at all.
    assert_eq!(usage.bytes_of(12), None);
    assert_eq!(DeviceUsage::default().bytes_of(12), None);
}

#[test]
fn the_fast_resident_reading_agrees_with_the_full_one_and_sees_new_pages() {
    let full = ProcessMemory::current().unwrap().resident;
    let fast = ProcessMemory::resident_now().unwrap();
    // Both are the kernel's RSS counters, read at slightly different moments.
    assert!(fast.abs_diff(full) < 16 << 20, "fast {fast} vs full {full}");
    let touched = vec![1u8; 64 << 20];
    let grown = ProcessMemory::resident_now().unwrap();
    assert!(grown >= fast + (60 << 20), "{fast} -> {grown} after touching 64 MiB");
    drop(touched);
}

#[test]
fn cuda_ordinals_map_to_nvml_devices_through_cuda_visible_devices() {
    let of = nvml_device_of_cuda_ordinal;
    assert_eq!(of(1, None), Some(NvmlDevice::Index(1)));
    assert_eq!(of(0, Some("2,3")), Some(NvmlDevice::Index(2)));
    assert_eq!(of(1, Some("2, 3")), Some(NvmlDevice::Index(3)));
    assert_eq!(of(2, Some("2,3")), None);
    let uuid = "GPU-8a1e2f3c-0000-1111-2222-333344445555";
    assert_eq!(of(1, Some(&format!("0,{uuid}"))), Some(NvmlDevice::Uuid(uuid.to_owned())));
    // As CUDA reads it, the list ends at the first entry that is neither an index nor a UUID.
    assert_eq!(of(1, Some("4,bogus,5")), None);
    assert_eq!(of(0, Some("")), None);
}

/// The driver's UUID of the device decides, whatever the numbering; without it the ordinal is
/// mapped through `CUDA_VISIBLE_DEVICES`, which is only sure in PCI bus order or when one
/// device is visible, and otherwise comes with a warning.
#[test]
fn a_rank_reads_its_gpu_by_uuid_and_says_when_the_ordinal_is_a_guess() {
    let uuid = "GPU-8a1e2f3c-0000-1111-2222-333344445555";
    let (device, warning) = nvml_device_for(1, Some(uuid), Some("3,2"), None);
    assert_eq!(device, Some(NvmlDevice::Uuid(uuid.to_owned())));
    assert_eq!(warning, None);

    // CUDA's default order (fastest first) and two devices to choose from: a guess.
    let (device, warning) = nvml_device_for(1, None, Some("3,2"), None);
    assert_eq!(device, Some(NvmlDevice::Index(2)));
    let warning = warning.expect("a warning");
    assert!(warning.contains("NVML device 2 for cuda:1"), "{warning}");
    assert!(warning.contains("CUDA_DEVICE_ORDER=PCI_BUS_ID"), "{warning}");
    let (_, warning) = nvml_device_for(0, Some(""), None, Some("FASTEST_FIRST"));
    assert!(warning.is_some(), "an empty UUID is no UUID");

    // PCI bus order, or a single visible device: the mapping holds.
    assert_eq!(nvml_device_for(1, None, Some("3,2"), Some("PCI_BUS_ID")).1, None);
    assert_eq!(nvml_device_for(0, None, Some("5"), None), (Some(NvmlDevice::Index(5)), None));
    // A UUID in the list names the device itself.
    let (device, warning) = nvml_device_for(0, None, Some(uuid), None);
    assert_eq!((device, warning), (Some(NvmlDevice::Uuid(uuid.to_owned())), None));
}
