//! `tpctl doctor`: whether tpctl can compute on this machine's GPUs, and what it would use
//! there. Each device is opened as a rank would open it (driver, the kernels: a CUBIN from
//! the kernel cache or compiled with NVRTC, else the PTX fallback, and which; cuBLAS),
//! described, and looked up in NVML while this process holds a context on it, so the
//! report says whether sleep receipts will see this process's device memory.

use std::fmt;

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// Works.
    Ok(String),
    /// Works, with a consequence worth knowing.
    Warning(String),
    /// Stops tpctl from computing on the GPU.
    Blocker(String),
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Finding::Ok(s) => write!(f, "ok       {s}"),
            Finding::Warning(s) => write!(f, "warning  {s}"),
            Finding::Blocker(s) => write!(f, "BLOCKER  {s}"),
        }
    }
}

/// Prints the report for device `only` (every visible device when `None`); exit status 0
/// when nothing blocks, 1 otherwise.
pub fn run(only: Option<usize>) -> i32 {
    let findings = examine(only);
    for f in &findings {
        println!("{f}");
    }
    let blockers = findings.iter().filter(|f| matches!(f, Finding::Blocker(_))).count();
    if blockers == 0 {
        println!("tpctl can compute on this machine's GPU (--device cuda)");
        0
    } else {
        println!("{blockers} blocker(s): tpctl cannot compute on a GPU here");
        1
    }
}

/// The findings for device `only`, or every visible device.
pub fn examine(only: Option<usize>) -> Vec<Finding> {
    use mesh::CudaProbe;
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let shown =
        visible.as_deref().map(|v| format!(" (CUDA_VISIBLE_DEVICES={v})")).unwrap_or_default();
    let count = match mesh::DriverProbe.device_count() {
        Ok(0) => return vec![Finding::Blocker(format!("cuda: the driver sees no device{shown}"))],
        Ok(n) => n,
        Err(mesh::Error::NotCompiledWith { .. }) => {
            return vec![Finding::Blocker(
                "cuda: this tpctl was built without the `cuda` feature (build it with \
                 `cargo build --release -p tpctl --features cuda`)"
                    .to_owned(),
            )]
        }
        Err(e) => return vec![Finding::Blocker(format!("cuda: {e}"))],
    };
    let mut out = vec![Finding::Ok(format!("cuda: {count} device(s) visible{shown}"))];
    let ordinals = match only {
        Some(d) if d >= count => {
            out.push(Finding::Blocker(format!("cuda:{d}: no such device ({count} visible)")));
            return out;
        }
        Some(d) => d..d + 1,
        None => 0..count,
    };
    let nvml = vmm::NvmlMemory::new();
    if let Err(e) = &nvml {
        out.push(Finding::Warning(format!(
            "nvml: {e}; sleep receipts will read the driver's free memory instead"
        )));
    }
    for ordinal in ordinals {
        let backend = match tensor::kernels::CudaBackend::new(ordinal) {
            Ok(b) => b,
            Err(e) => {
                out.push(Finding::Blocker(format!("cuda:{ordinal}: {e}")));
                continue;
            }
        };
        let info = backend.describe();
        let uuid = info.as_ref().ok().map(|i| i.uuid.clone());
        out.push(match info {
            Ok(info) => Finding::Ok(describe(ordinal, &info)),
            Err(e) => Finding::Blocker(format!("cuda:{ordinal}: {e}")),
        });
        out.push(kernels_finding(ordinal, backend.kernel_image()));
        // While `backend` holds a context here, so NVML should list this process.
        if let Ok(nvml) = &nvml {
            out.push(nvml_finding(nvml, ordinal, uuid.as_deref(), visible.as_deref()));
        }
    }
    out.push(match collectives::nccl::version() {
        Ok(v) => Finding::Ok(format!(
            "nccl: {}.{}.{} (for axes with backend nccl)",
            v / 10_000,
            v / 100 % 100,
            v % 100
        )),
        Err(e) => Finding::Warning(format!("nccl: {e}; every axis must use shm or tcp")),
    });
    out
}

/// One device as the driver describes it.
fn describe(ordinal: usize, info: &tensor::kernels::CudaDeviceInfo) -> String {
    let gib = |b: usize| b as f64 / f64::from(1u32 << 30);
    let (major, minor) = info.compute_capability;
    let (cuda_major, cuda_minor) = info.driver_cuda;
    format!(
        "cuda:{ordinal}: {}, compute capability {major}.{minor}, {:.1} GiB ({:.1} GiB free), \
         {}; the driver supports CUDA {cuda_major}.{cuda_minor}; the kernels loaded, cuBLAS \
         ready",
        info.name,
        gib(info.total_bytes),
        gib(info.free_bytes),
        info.uuid
    )
}

/// Which form of the kernels device `ordinal` loaded: a CUBIN for its architecture is as it
/// should be; a CUBIN that could not be cached is compiled again by every process, and the PTX
/// fallback is compiled by the driver at every load and says why the CUBIN failed.
fn kernels_finding(ordinal: usize, image: &tensor::kernels::cuda::KernelImage) -> Finding {
    use tensor::kernels::cuda::KernelImage;
    let line = format!("cuda:{ordinal}: kernels: {image}");
    match image {
        KernelImage::CachedCubin { .. } | KernelImage::CompiledCubin { saved: Ok(_), .. } => {
            Finding::Ok(line)
        }
        _ => Finding::Warning(line),
    }
}

/// Whether NVML lists this process on CUDA device `ordinal` (which holds a context of it),
/// found as a rank's sleep probe finds it: by the device's UUID (`uuid`, from the driver),
/// else through `CUDA_VISIBLE_DEVICES` and `CUDA_DEVICE_ORDER`.
fn nvml_finding(
    nvml: &vmm::NvmlMemory,
    ordinal: usize,
    uuid: Option<&str>,
    visible: Option<&str>,
) -> Finding {
    let order = std::env::var("CUDA_DEVICE_ORDER").ok();
    let (device, guess) = vmm::nvml_device_for(ordinal, uuid, visible, order.as_deref());
    let Some(device) = device else {
        return Finding::Warning(format!(
            "nvml: cuda:{ordinal} is past the CUDA_VISIBLE_DEVICES list NVML is read through"
        ));
    };
    if let Some(guess) = guess {
        return Finding::Warning(format!("nvml: {guess}"));
    }
    let usage = match nvml.usage(&device) {
        Ok(u) => u,
        Err(e) => return Finding::Warning(format!("nvml: cuda:{ordinal} ({device:?}): {e}")),
    };
    let pid = std::process::id();
    let index = if usage.mig {
        format!("a MIG instance of NVML device {}", usage.index)
    } else {
        format!("NVML device {}", usage.index)
    };
    match usage.processes.iter().find(|(p, _)| *p == pid) {
        Some((_, bytes)) => Finding::Ok(format!(
            "nvml: cuda:{ordinal} is {index}, which lists this process (pid {pid}, {}); \
             sleep receipts read each rank's own device memory",
            bytes.map_or("bytes not reported".to_owned(), |b| format!("{} MiB", b >> 20))
        )),
        None => Finding::Warning(format!(
            "nvml: cuda:{ordinal} is {index}, which does not list this process (pid \
             {pid}; {} listed: in a container NVML shows the host's PIDs, or none); sleep \
             receipts will read the device's used memory instead",
            usage.processes.len()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn findings_read_as_a_checklist() {
        assert_eq!(Finding::Ok("nccl: 2.27.3".into()).to_string(), "ok       nccl: 2.27.3");
        assert_eq!(Finding::Warning("w".into()).to_string(), "warning  w");
        assert_eq!(Finding::Blocker("b".into()).to_string(), "BLOCKER  b");
    }

    #[test]
    fn a_device_is_described_in_one_line() {
        let info = tensor::kernels::CudaDeviceInfo {
            name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            total_bytes: 150_000_000_000,
            free_bytes: 149_000_000_000,
            uuid: "GPU-5d2c1e9a-03f1-4b7e-8c00-ff123456789a".into(),
            driver_cuda: (13, 0),
        };
        let line = describe(0, &info);
        assert!(
            line.starts_with("cuda:0: NVIDIA H200, compute capability 9.0, 139.7 GiB"),
            "{line}"
        );
        assert!(line.contains("(138.8 GiB free), GPU-5d2c1e9a-"), "{line}");
        assert!(line.contains("the driver supports CUDA 13.0"), "{line}");
    }

    #[test]
    fn the_kernels_line_says_which_form_was_loaded() {
        use tensor::kernels::cuda::KernelImage;
        let cached = KernelImage::CachedCubin {
            arch: "sm_90".into(),
            path: "/home/u/.cache/tpctl/kernels/sm_90-0123456789abcdef.cubin".into(),
        };
        assert_eq!(
            kernels_finding(0, &cached),
            Finding::Ok(
                "cuda:0: kernels: sm_90 CUBIN from the cache at \
                 /home/u/.cache/tpctl/kernels/sm_90-0123456789abcdef.cubin"
                    .into()
            )
        );
        let compiled = KernelImage::CompiledCubin {
            arch: "sm_90".into(),
            saved: Ok("/k/sm_90-1.cubin".into()),
        };
        assert_eq!(
            kernels_finding(1, &compiled).to_string(),
            "ok       cuda:1: kernels: sm_90 CUBIN compiled now (NVRTC), cached at /k/sm_90-1.cubin"
        );
        let uncached = KernelImage::CompiledCubin {
            arch: "sm_80".into(),
            saved: Err("no cache folder".into()),
        };
        let Finding::Warning(line) = kernels_finding(0, &uncached) else {
            panic!("an uncached CUBIN is worth a warning")
        };
        assert!(line.ends_with("sm_80 CUBIN compiled now (NVRTC), not cached: no cache folder"));
        let ptx = KernelImage::PtxFallback {
            reason: "the driver refused the sm_90 CUBIN (CUDA_ERROR_UNSUPPORTED_PTX_VERSION)"
                .into(),
        };
        let Finding::Warning(line) = kernels_finding(0, &ptx) else {
            panic!("the PTX fallback is worth a warning")
        };
        assert!(line.starts_with("cuda:0: kernels: PTX fallback"), "{line}");
        assert!(line.contains("because the driver refused the sm_90 CUBIN"), "{line}");
    }

    /// Without a usable GPU (no driver, no device, or a build without the `cuda` feature) the
    /// report is one blocker that says which.
    #[test]
    fn without_a_gpu_the_driver_is_the_blocker() {
        if std::env::var_os("TPCTL_REQUIRE_GPU").is_some() {
            return;
        }
        let findings = examine(None);
        if findings.iter().all(|f| !matches!(f, Finding::Blocker(_))) {
            return; // A machine with a GPU: nothing to check here.
        }
        let [Finding::Blocker(why)] = findings.as_slice() else {
            panic!("expected one blocker, got {findings:?}");
        };
        assert!(why.starts_with("cuda: "), "{why}");
    }
}
