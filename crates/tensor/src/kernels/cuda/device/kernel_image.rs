//! Which kernels a context loads: a CUBIN for the device's architecture, read from the kernel
//! cache (`kernel_cache`, where the key, the file and its checks live) or compiled with
//! NVRTC and saved there; generic PTX only when that fails (for example a driver older than
//! the NVRTC, which refuses its CUBIN), with a warning.

use crate::kernels::cuda::kernel_cache::{KernelCache, KernelKey, Lookup, CACHE_VAR};
use crate::kernels::cuda::KernelImage;
use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::{result, sys, CompileError, CompileOptions, Ptx};
use std::ffi::{CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

/// The CUDA C source of every kernel.
pub(super) const SOURCE: &str = include_str!("../kernels.cu");

/// The name NVRTC gives the source in its messages.
const NAME: &str = "tpctl_kernels.cu";

/// NVRTC's options for `arch`. No fused multiply-add, so products and sums round as on the
/// CPU (the PTX fallback compiles with the same).
fn options(arch: &str) -> Vec<String> {
    vec!["--fmad=false".to_owned(), format!("--gpu-architecture={arch}")]
}

/// The kernels loaded into `ctx` (device `ordinal`), and which form they took.
///
/// # Errors
/// Both forms failed: the PTX's compile log or the driver's refusal, with the CUBIN's reason.
pub(super) fn load(
    ctx: &Arc<CudaContext>,
    ordinal: usize,
) -> Result<(Arc<CudaModule>, KernelImage), String> {
    let reason = match ctx.compute_capability() {
        Ok((major, minor)) => {
            let arch = format!("sm_{major}{minor}");
            match cubin(&arch) {
                Ok((bytes, image)) => match ctx.load_module(Ptx::from_binary(bytes)) {
                    Ok(module) => return Ok((module, image)),
                    Err(e) => format!(
                        "the driver refused the {arch} CUBIN ({e}; a driver older than NVRTC?)"
                    ),
                },
                Err(why) => why,
            }
        }
        Err(e) => format!("the device's compute capability is unknown ({e})"),
    };
    tracing::warn!(
        "cuda:{ordinal}: loading the kernels as generic PTX, which the driver compiles at every \
         load, because {reason}"
    );
    let ptx = ptx().map_err(|log| format!("{log} (after the CUBIN failed: {reason})"))?;
    let module = ctx.load_module(ptx.clone()).map_err(|e| {
        format!(
            "loading the kernels' PTX (a driver older than NVRTC?): {e} (after the CUBIN failed: \
             {reason})"
        )
    })?;
    Ok((module, KernelImage::PtxFallback { reason }))
}

/// The CUBIN for `arch` and where it came from: once per architecture and process (a failure
/// is kept too), from the kernel cache when it holds a whole entry for these inputs, else
/// compiled now and saved there.
fn cubin(arch: &str) -> Result<(Vec<u8>, KernelImage), String> {
    type Made = Result<(Vec<u8>, KernelImage), String>;
    static MADE: Mutex<Vec<(String, Made)>> = Mutex::new(Vec::new());
    // Held while compiling, so ranks opening at once compile once.
    let mut made = MADE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, m)) = made.iter().find(|(a, _)| a == arch) {
        return m.clone();
    }
    let m = make_cubin(arch);
    made.push((arch.to_owned(), m.clone()));
    m
}

fn make_cubin(arch: &str) -> Result<(Vec<u8>, KernelImage), String> {
    let nvrtc = nvrtc_version()?;
    let options = options(arch);
    let key = KernelKey { source: SOURCE, options: &options, arch, nvrtc };
    let cache = KernelCache::from_env();
    if let Some(cache) = &cache {
        let path = cache.path(&key);
        match cache.read(&key) {
            Lookup::Hit(image) => {
                tracing::debug!("kernels: {arch} CUBIN from {}", path.display());
                return Ok((image, KernelImage::CachedCubin { arch: arch.to_owned(), path }));
            }
            Lookup::Miss => {}
            Lookup::Unusable(why) => tracing::warn!(
                "kernel cache: ignoring {} ({why}); compiling the kernels again",
                path.display()
            ),
        }
    }
    let image = compile_cubin(arch, &options)?;
    let saved = match &cache {
        None => Err(format!("no cache folder ({CACHE_VAR} is off, or neither it nor HOME is set)")),
        Some(cache) => cache
            .write(&key, &image)
            .map_err(|e| format!("writing {}: {e}", cache.path(&key).display())),
    };
    match &saved {
        Ok(path) => {
            tracing::info!("kernels: {arch} CUBIN compiled and cached at {}", path.display())
        }
        Err(why) => tracing::warn!("kernel cache: the {arch} CUBIN is not cached: {why}"),
    }
    Ok((image, KernelImage::CompiledCubin { arch: arch.to_owned(), saved }))
}

/// NVRTC's version, major and minor.
fn nvrtc_version() -> Result<(i32, i32), String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC was found loadable before any backend opens (`CudaBackend::new` probes
    // it); `nvrtcVersion` writes one int through each pointer, both live locals.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("asking NVRTC its version: {e}"))?;
    Ok((major, minor))
}

/// The kernels compiled with `options` to a CUBIN for `arch`.
fn compile_cubin(arch: &str, options: &[String]) -> Result<Vec<u8>, String> {
    let source = CString::new(SOURCE).map_err(|e| format!("the kernels' source: {e}"))?;
    let name = CString::new(NAME).map_err(|e| format!("the kernels' name: {e}"))?;
    let prog = result::create_program(&source, Some(&name))
        .map_err(|e| format!("nvrtc: creating the program: {e}"))?;
    // SAFETY: `prog` was just created and is destroyed only below; `source` and `name`, which
    // it refers to, outlive it.
    let compiled = unsafe { result::compile_program(prog, options) };
    let out = match compiled {
        // SAFETY: as above; the log is read before the program is destroyed.
        Err(e) => Err(match unsafe { result::get_program_log(prog) } {
            Ok(log) => {
                // SAFETY: NVRTC's log is a NUL-terminated string of the returned length.
                let log = unsafe { CStr::from_ptr(log.as_ptr()) };
                format!(
                    "nvrtc failed to compile the kernels for {arch} ({e}):\n{}",
                    log.to_string_lossy()
                )
            }
            Err(l) => format!("nvrtc failed to compile the kernels for {arch} ({e}; no log: {l})"),
        }),
        Ok(()) => {
            // SAFETY: as above, after a successful compile for `arch`, a real architecture.
            let image = unsafe { get_cubin(prog) };
            image.map_err(|e| format!("nvrtc: reading the {arch} CUBIN: {e}"))
        }
    };
    // SAFETY: `prog` is live and destroyed once, here.
    if let Err(e) = unsafe { result::destroy_program(prog) } {
        tracing::debug!("nvrtc: destroying the program: {e}");
    }
    out
}

/// The CUBIN of a compiled program.
///
/// # Safety
/// `prog` is a live program, compiled successfully for a real architecture (`sm_XX`).
unsafe fn get_cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>, result::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: the caller's promise; the size is written through a live local.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }.result()?;
    let mut image = vec![0u8; size];
    // SAFETY: `image` holds the size NVRTC just reported.
    unsafe { sys::nvrtcGetCUBIN(prog, image.as_mut_ptr().cast()) }.result()?;
    Ok(image)
}

/// The kernels' generic PTX (the fallback), compiled once per process. A failure is kept too:
/// it does not fix itself.
pub(super) fn ptx() -> Result<&'static Ptx, String> {
    static PTX: OnceLock<Result<Ptx, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        let opts =
            CompileOptions { fmad: Some(false), name: Some(NAME.into()), ..Default::default() };
        cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| match e {
            CompileError::CompileError { nvrtc, log, .. } => {
                format!(
                    "nvrtc failed to compile the kernels ({nvrtc:?}):\n{}",
                    log.to_string_lossy()
                )
            }
            other => format!("nvrtc: {other}"),
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether NVRTC loads here (it needs no GPU); a note and `false` where it does not,
    /// unless `TPCTL_REQUIRE_GPU=1`, when that fails.
    fn nvrtc_loads() -> bool {
        // SAFETY: as in `CudaBackend::new`: only loads the library by name.
        if unsafe { sys::is_culib_present() } {
            return true;
        }
        let require = std::env::var("TPCTL_REQUIRE_GPU").is_ok_and(|v| v == "1");
        assert!(!require, "TPCTL_REQUIRE_GPU=1 but NVRTC is not on the loader path");
        eprintln!("note: NVRTC is not on the loader path, not compiling the kernels");
        false
    }

    /// NVRTC works without a GPU, so this runs wherever `libnvrtc.so.12` loads.
    #[test]
    fn cuda_kernels_compile_with_nvrtc() {
        if !nvrtc_loads() {
            return;
        }
        let ptx = ptx().unwrap_or_else(|log| panic!("{log}"));
        let text = ptx.to_src();
        for name in [
            "rms_norm",
            "add_rms_norm",
            "rope",
            "split_rope",
            "split_rope_append",
            "silu_mul",
            "gated_halves",
            "gelu_tanh_mul",
            "scale",
            "add_assign",
            "add_rows",
            "embedding",
            "argmax_rows",
            "top_k_rows",
            "sample_rows",
            "normalizers",
            "columns_at",
            "dequantize",
            "attention",
            "to_bf16",
            "to_f16",
            "copy_cols",
            "write_rows",
        ] {
            assert!(text.contains(&format!(".entry {name}(")), "no kernel `{name}` in the PTX");
        }
    }

    /// A CUBIN for an architecture NVRTC knows is an ELF image that names the kernels.
    #[test]
    fn cuda_kernels_compile_to_a_cubin_with_nvrtc() {
        if !nvrtc_loads() {
            return;
        }
        let image = compile_cubin("sm_80", &options("sm_80")).unwrap_or_else(|log| panic!("{log}"));
        assert_eq!(&image[..4], b"\x7fELF", "not an ELF image");
        let has = |name: &str| image.windows(name.len()).any(|w| w == name.as_bytes());
        assert!(has("rms_norm") && has("attention_merge"), "the CUBIN lacks the kernels' names");
        let v = nvrtc_version().unwrap();
        assert!(v.0 >= 11, "NVRTC {v:?}");
    }
}
