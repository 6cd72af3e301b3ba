//! Tests of device naming and selection, with a fake CUDA probe.

use super::*;

struct FakeProbe {
    count: usize,
    current: Option<usize>,
}

impl CudaProbe for FakeProbe {
    fn device_count(&self) -> Result<usize> {
        Ok(self.count)
    }

    fn current_device(&self) -> Result<Option<usize>> {
        Ok(self.current)
    }
}

#[test]
fn names_round_trip() {
    for (device, name) in
        [(Device::Cpu, "cpu"), (Device::Cuda(0), "cuda:0"), (Device::Cuda(12), "cuda:12")]
    {
        assert_eq!(device.to_string(), name);
        assert_eq!(name.parse::<Device>().unwrap(), device);
    }
    for bad in ["cuda", "gpu", "cuda:-1", "cuda:x", ""] {
        let msg = bad.parse::<Device>().unwrap_err().to_string();
        assert_eq!(msg, format!("unknown device {bad:?}: expected cpu or cuda:N"));
    }
}

#[test]
fn selection_table() {
    let rank = |local_rank| Rendezvous { local_rank, ..Rendezvous::single() };
    // (want_cuda, LOCAL_RANK, visible devices, current device, expected)
    let cases = [
        (false, Some(1), 0, None, Device::Cpu),
        (true, Some(1), 2, Some(0), Device::Cuda(1)),
        (true, Some(0), 1, None, Device::Cuda(0)),
        (true, None, 4, Some(3), Device::Cuda(3)),
        (true, None, 4, None, Device::Cuda(0)),
    ];
    for (want_cuda, local, count, current, want) in cases {
        let got =
            Device::select_with(&rank(local), want_cuda, &FakeProbe { count, current }, false);
        assert_eq!(got.unwrap(), want, "LOCAL_RANK={local:?} count={count} current={current:?}");
    }
}

#[test]
fn selection_refusals() {
    let rv = Rendezvous { local_rank: Some(2), ..Rendezvous::single() };
    let msg = Device::select_with(&rv, true, &FakeProbe { count: 2, current: None }, false)
        .unwrap_err()
        .to_string();
    assert_eq!(msg, "LOCAL_RANK=2 selects cuda:2 but rank 0 sees only 2 CUDA devices");
    // The test override shares the devices instead; no device is still no device.
    let shared = Device::select_with(&rv, true, &FakeProbe { count: 2, current: None }, true);
    assert_eq!(shared.unwrap(), Device::Cuda(0));
    let one = Rendezvous { local_rank: Some(1), ..Rendezvous::single() };
    let shared = Device::select_with(&one, true, &FakeProbe { count: 1, current: None }, true);
    assert_eq!(shared.unwrap(), Device::Cuda(0));
    let msg = Device::select_with(&rv, true, &FakeProbe { count: 0, current: None }, true)
        .unwrap_err()
        .to_string();
    assert!(msg.starts_with("cuda is unavailable: rank 0 sees no CUDA device"), "{msg}");
}

#[test]
fn cpu_needs_no_driver() {
    assert_eq!(Device::select(&Rendezvous::single(), false).unwrap(), Device::Cpu);
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_says_so() {
    let msg = Device::select(&Rendezvous::single(), true).unwrap_err().to_string();
    assert_eq!(msg, "tpctl-mesh was built without the feature `cuda`");
}

/// Skips on a machine without a usable GPU, unless `TPCTL_REQUIRE_GPU=1`.
#[cfg(feature = "cuda")]
#[test]
fn cuda_driver_probe() {
    let require = std::env::var("TPCTL_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let rv = Rendezvous { local_rank: Some(0), ..Rendezvous::single() };
    match Device::select(&rv, true) {
        Ok(device) => {
            assert_eq!(device, Device::Cuda(0));
            assert!(DriverProbe.device_count().unwrap() >= 1);
            // Nothing in this test made a context current.
            assert_eq!(DriverProbe.current_device().unwrap(), None);
        }
        Err(e @ Error::BackendUnavailable { .. }) if !require => {
            eprintln!("skipped: {e}");
        }
        Err(e) => panic!("CUDA device selection failed: {e}"),
    }
}

/// Without `LOCAL_RANK`, a caller that made a device current keeps it (issue 16, fault 6: the
/// driver probe used to refuse). Skips without a GPU unless `TPCTL_REQUIRE_GPU=1`.
#[cfg(feature = "cuda")]
#[test]
fn cuda_keeps_the_callers_current_device() {
    let require = std::env::var("TPCTL_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let count = match DriverProbe.device_count() {
        Ok(n) if n > 0 => n,
        Ok(_) | Err(_) if !require => return eprintln!("skipped: no usable CUDA device"),
        other => panic!("no usable CUDA device: {other:?}"),
    };
    // The last device, so the answer is not the default's cuda:0 where there are several.
    let ctx = cudarc::driver::CudaContext::new(count - 1).expect("a context on the last device");
    assert_eq!(DriverProbe.current_device().unwrap(), Some(count - 1));
    let rv = Rendezvous { world_size: 2, ..Rendezvous::single() };
    assert_eq!(Device::select(&rv, true).unwrap(), Device::Cuda(count - 1));
    drop(ctx);
}

/// The one probe of the CUDA driver says why it cannot be used, in words, and answers the same
/// every time (it runs once per process): the build's missing feature, or the missing library
/// or failed `cuInit`; on a GPU machine it succeeds.
#[test]
fn the_cuda_driver_probe_names_why_it_cannot_be_used() {
    let first = cuda_driver();
    match &first {
        Ok(()) => {}
        Err(Error::NotCompiledWith { feature }) => assert_eq!(*feature, "cuda"),
        Err(e @ Error::BackendUnavailable { backend, .. }) => {
            assert_eq!(*backend, "cuda");
            let reason = e.reason();
            assert!(reason.contains("CUDA driver") || reason.contains("cuInit"), "{reason}");
            assert!(!reason.contains("unavailable"), "the reason alone: {reason}");
        }
        Err(other) => panic!("unexpected error: {other}"),
    }
    assert_eq!(cuda_driver().map_err(|e| e.to_string()), first.map_err(|e| e.to_string()));
}
