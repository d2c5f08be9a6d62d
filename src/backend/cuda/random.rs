//! Launchers of `cuda/random.cu`: dropout masks and normal draws from the Philox stream.

use super::kernels::KernelFile;
use super::storage::{float_kname, grid, CudaStorage};
use crate::{DType, Error, Result};
use cudarc::driver::PushKernelArg;

/// `n` dropout multipliers from the Philox stream (the CPU's definition, element for element).
pub(crate) fn dropout_mask(
    ordinal: usize,
    n: usize,
    threshold: u64,
    scale: f64,
    (seed, start): (u64, u64),
    dtype: DType,
) -> Result<CudaStorage> {
    let t = float_kname("dropout", dtype)?;
    let out = CudaStorage::alloc(ordinal, dtype, n)?;
    let (dst, n64, sc) = (out.ptr(), n as i64, scale as f32);
    let (seed, start, state) = in_graph(seed, start)?;
    let name = kname!("dropout_mask_", t);
    launch!(
        out,
        KernelFile::Random,
        name,
        grid(n.div_ceil(4)),
        &seed,
        &start,
        &threshold,
        &sc,
        &dst,
        &n64,
        &state
    );
    Ok(out)
}

/// The kernels' `(seed, start, philox)`: under a capture, the generator's state is read from
/// the replay's prologue and `start` is the draw's offset within the step (see
/// `crate::graph`); else the values as they are and a null pointer.
fn in_graph(seed: u64, start: u64) -> Result<(u64, u64, u64)> {
    Ok(match crate::capture::rng_arg(seed, start)? {
        Some((state, intra)) => (0, intra, state),
        None => (seed, start, 0),
    })
}

/// `n` draws from N(`mean`, `std`²) from the Philox stream (the CPU's definition, element for
/// element, up to the device's last bit of `log`, `sin` and `cos` in f64).
pub(crate) fn normal(
    ordinal: usize,
    n: usize,
    mean: f64,
    std: f64,
    (seed, start): (u64, u64),
    dtype: DType,
) -> Result<CudaStorage> {
    let t = float_kname("randn", dtype)?;
    let out = CudaStorage::alloc(ordinal, dtype, n)?;
    let (dst, n64) = (out.ptr(), n as i64);
    let (seed, start, state) = in_graph(seed, start)?;
    let name = kname!("normal_", t);
    launch!(
        out,
        KernelFile::Random,
        name,
        grid(n.div_ceil(2)),
        &seed,
        &start,
        &mean,
        &std,
        &dst,
        &n64,
        &state
    );
    Ok(out)
}
