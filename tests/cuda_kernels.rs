//! Every kernel in `cuda/` compiles with NVRTC for sm_80 and sm_90 (no GPU needed). Without
//! libnvrtc the test prints `skipped` and passes, unless `MANTISSA_REQUIRE_NVRTC` is set (CI
//! sets it, after installing NVRTC from PyPI).
#![cfg(feature = "cuda-backend")]

use mantissa::backend::cuda::{kernels, nvrtc};
use mantissa::Error;

fn nvrtc_or_skip() -> bool {
    match nvrtc::version() {
        Ok((major, minor)) => {
            eprintln!("NVRTC {major}.{minor}");
            true
        }
        Err(e) if std::env::var_os("MANTISSA_REQUIRE_NVRTC").is_some() => {
            panic!("MANTISSA_REQUIRE_NVRTC is set but NVRTC cannot be loaded: {e}")
        }
        Err(e) => {
            eprintln!("skipped: no NVRTC ({e})");
            false
        }
    }
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    if !nvrtc_or_skip() {
        return;
    }
    // One thread per architecture: the compiles are independent, and NVRTC takes most of
    // this binary's time.
    std::thread::scope(|scope| {
        for arch in [80, 90] {
            scope.spawn(move || {
                for (name, _) in kernels::KERNELS {
                    let src = kernels::source(name).unwrap();
                    let bin = nvrtc::compile(name, &src, arch)
                        .unwrap_or_else(|e| panic!("{name} for sm_{arch}: {e}"));
                    assert_eq!(&bin[..4], b"\x7fELF", "{name} sm_{arch}: not a cubin");
                }
            });
        }
    });
}

#[test]
fn compile_errors_carry_the_log_and_the_cache_returns_the_same_cubin() {
    if !nvrtc_or_skip() {
        return;
    }
    let bad = "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }";
    match nvrtc::compile("broken", bad, 80) {
        Err(Error::KernelCompile { kernel, arch, log }) => {
            assert_eq!((kernel.as_str(), arch.as_str()), ("broken", "sm_80"));
            assert!(log.contains("undefined_name"), "log: {log}");
        }
        other => panic!("expected a compile error, got {:?}", other.map(|b| b.len())),
    }
    // The cache folder as the process has it (no `set_var`: other tests' threads, kernel
    // compiles among them, read the environment meanwhile). A source of its own, so that
    // its entry is this test's alone.
    let Some(dir) = nvrtc::cache_dir() else {
        eprintln!("skipped: no cache folder (neither MANTISSA_CACHE_DIR nor HOME)");
        return;
    };
    let tag = format!("cachetest{}", std::process::id());
    let src = format!("{}\n// {tag}\n", kernels::source("amp").unwrap());
    let entries = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&dir)
            .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
            .unwrap_or_default()
            .into_iter()
            .filter(|p: &std::path::PathBuf| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{tag}-sm90-")))
            })
            .collect()
    };
    let first = nvrtc::cubin(&tag, &src, 90).unwrap();
    let cached = entries();
    assert_eq!(cached.len(), 1, "one cache entry: {cached:?}");
    assert_eq!(
        std::fs::read(&cached[0]).unwrap(),
        first,
        "the entry is the cubin"
    );
    assert_eq!(nvrtc::cubin(&tag, &src, 90).unwrap(), first);
    let (bin, from_cache) = nvrtc::cubin_part(&tag, &src, 90, None).unwrap();
    assert!(
        from_cache && bin == first,
        "the second read comes from the cache"
    );
    std::fs::remove_file(&cached[0]).unwrap();
}

#[test]
fn cuda_devices_are_an_error_that_says_why_never_a_panic() {
    use mantissa::backend::cuda::probe;
    if probe::device_count().map(|n| n > 0).unwrap_or(false) {
        assert_eq!(
            mantissa::Device::cuda(0).unwrap(),
            mantissa::Device::Cuda(0)
        );
        assert_eq!(mantissa::Device::best(), mantissa::Device::Cuda(0));
        let n = probe::device_count().unwrap();
        match mantissa::Device::cuda(n) {
            Err(Error::CudaUnavailable { reason, .. }) => assert!(reason.contains("device")),
            other => panic!("cuda:{n} of {n} devices: expected CudaUnavailable, got {other:?}"),
        }
        return;
    }
    match mantissa::Device::cuda(0) {
        Err(Error::CudaUnavailable { reason, .. }) => {
            eprintln!("Device::cuda(0): {reason}");
            assert!(
                ["libcuda", "device", "not implemented", "driver"]
                    .iter()
                    .any(|w| reason.contains(w)),
                "unclear reason: {reason}"
            );
        }
        other => panic!("expected CudaUnavailable, got {other:?}"),
    }
    assert_eq!(mantissa::Device::best(), mantissa::Device::Cpu);
}

/// The device runtime: on a machine without a GPU an error that names what is missing; with
/// one, a kernel loads, a freed block is reused from the cache and the statistics count it,
/// and a request larger than the device is `Error::OutOfMemory` naming the request.
#[test]
fn the_device_runtime_loads_kernels_and_caches_memory() {
    use mantissa::backend::cuda::{probe, runtime};
    let has_gpu = probe::device_count().map(|n| n > 0).unwrap_or(false);
    if !has_gpu {
        match runtime::runtime(0) {
            Err(Error::CudaUnavailable { reason, .. }) => eprintln!("runtime(0): {reason}"),
            Err(e) => panic!("expected CudaUnavailable, got {e}"),
            Ok(_) => panic!("a runtime without a GPU"),
        }
        eprintln!("skipped: no CUDA device");
        return;
    }
    let rt = runtime::runtime(0).unwrap();
    rt.function("cast", "cast_float_bf16").unwrap();
    assert!(rt.function("cast", "no_such_kernel").is_err());
    let (p, size) = rt.alloc(3 << 20).unwrap();
    assert!(size >= 3 << 20);
    rt.free(p).unwrap();
    // Counted from here: the first request may itself be served from blocks that earlier
    // work in this process left in the cache (the tests of tests/gpu_suite share one).
    let before = rt.memory_stats();
    let (q, _) = rt.alloc(3 << 20).unwrap();
    let after = rt.memory_stats();
    assert_eq!(q, p, "the freed block is reused");
    assert_eq!(after.cache_hits, before.cache_hits + 1);
    assert!(after.allocated >= size && after.peak_allocated >= size);
    rt.free(q).unwrap();
    let total = probe::report(0).unwrap().total_memory;
    match rt.alloc(2 * total) {
        Err(Error::OutOfMemory {
            requested, stats, ..
        }) => {
            assert_eq!(requested, 2 * total);
            assert!(stats.contains("reserved"), "{stats}");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    rt.empty_cache().unwrap();
    assert_eq!(rt.memory_stats().reserved, rt.memory_stats().allocated);
}
