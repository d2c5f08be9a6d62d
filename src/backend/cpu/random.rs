//! Random tensors from the Philox stream of [`crate::random`]: dropout multipliers and normal
//! draws, made in parallel chunks with the values a sequential draw gives (`cuda/random.cu`
//! computes the same ones on a device).

use super::{overwritten_buffer, CpuElem, CpuStorage, IntoStorage, CHUNK};
use crate::random::{box_muller, philox_block};
use crate::{DType, Error, Result};
use half::{bf16, f16};

/// `n` values of a float `dtype`, `PER` from each Philox block of `seed`'s stream from block
/// `start` on: `value(block)` gives a block's values (as f64, rounded to `dtype`). Chunks are
/// drawn in parallel; the result does not depend on the split.
fn from_blocks<const PER: usize>(
    op: &'static str,
    n: usize,
    dtype: DType,
    (seed, start): (u64, u64),
    value: impl Fn([u32; 4]) -> [f64; PER] + Sync,
) -> Result<CpuStorage> {
    fn go<T: CpuElem + bytemuck::Pod, const PER: usize>(
        n: usize,
        (seed, start): (u64, u64),
        value: &(impl Fn([u32; 4]) -> [f64; PER] + Sync),
    ) -> Vec<T> {
        let _iso = crate::parallel::Isolated::new();
        use rayon::prelude::*;
        let mut out = overwritten_buffer::<T>(n);
        // CHUNK is a multiple of PER (1, 2 or 4), so each chunk starts on a block.
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(c, chunk)| {
                let first = (c * CHUNK / PER) as u64;
                for (b, group) in chunk.chunks_mut(PER).enumerate() {
                    let v = value(philox_block(seed, start.wrapping_add(first + b as u64)));
                    for (o, x) in group.iter_mut().zip(v) {
                        *o = T::from_f64(x);
                    }
                }
            });
        out
    }
    let stream = (seed, start);
    Ok(match dtype {
        DType::F32 => go::<f32, PER>(n, stream, &value).into_storage(),
        DType::F16 => go::<f16, PER>(n, stream, &value).into_storage(),
        DType::BF16 => go::<bf16, PER>(n, stream, &value).into_storage(),
        DType::F64 => go::<f64, PER>(n, stream, &value).into_storage(),
        dtype => {
            return Err(Error::DType {
                op,
                dtype,
                expected: "a float dtype",
            })
        }
    })
}

/// `n` dropout multipliers of `dtype`: element `i` is `scale` when word `i` of the Philox
/// stream of `seed` from block `start` on (four words a block) is at least `threshold`, else
/// 0.
pub(crate) fn dropout_mask(
    n: usize,
    threshold: u64,
    scale: f64,
    stream: (u64, u64),
    dtype: DType,
) -> Result<CpuStorage> {
    from_blocks::<4>("dropout", n, dtype, stream, |words| {
        words.map(|w| if w as u64 >= threshold { scale } else { 0.0 })
    })
}

/// `n` draws from N(`mean`, `std`²) of `dtype`: elements `2j` and `2j + 1` are the Box-Muller
/// pair of block `start + j` of `seed`'s stream, as [`crate::Generator::normal`] draws them.
pub(crate) fn normal(
    n: usize,
    mean: f64,
    std: f64,
    stream: (u64, u64),
    dtype: DType,
) -> Result<CpuStorage> {
    from_blocks::<2>("randn", n, dtype, stream, |words| {
        box_muller(words).map(|z| mean + std * z)
    })
}
