//! The loss scaler's kernels (amp.cu) against the CPU backend's fused unscale and update.

use super::{function, library, randn};
use crate::backend::cpu::{amp, CpuStorage};
use crate::backend::cuda::amp::{lists, UnscaleList, CHUNK};
use crate::backend::Storage;
use crate::{DType, Tensor};

type Unscale = unsafe extern "C" fn(UnscaleList, *const f32, *mut f32) -> ();
type Update = unsafe extern "C" fn(*mut f32, *mut f32, *const f32, f32, f32, i32) -> ();

#[test]
fn unscale_kernels_match_the_cpu_bit_for_bit() {
    let Some(lib) = library("amp") else { return };
    // One list of three gradients: short, over two chunks, and short again; the poisoned
    // element (when there is one) in the last.
    let sizes = [301, CHUNK + 5, 7];
    let pairs = [
        (DType::F32, DType::F32),
        (DType::F16, DType::F16),
        (DType::BF16, DType::BF16),
        (DType::F16, DType::F32),
        (DType::BF16, DType::F32),
    ];
    for (from, to) in pairs {
        // Scaled gradients (some past f16's range before unscaling, as f32), and an inverse
        // scale that is not a power of two, so rounding shows.
        for (inv, poison) in [(1.0 / 3000.0f32, None), (1.0 / 65536.0, Some(f64::NAN))] {
            let mut want_bad = false;
            let (mut inputs, mut outs, mut wants) = (Vec::new(), Vec::new(), Vec::new());
            for (k, &n) in sizes.iter().enumerate() {
                let mut v = randn(&[n], 8 + k as u64)
                    .mul(3000.0)
                    .unwrap()
                    .to_vec_f64()
                    .unwrap();
                if let (Some(p), 2) = (poison, k) {
                    v[3] = p;
                }
                let g = Tensor::from_vec(v, &[n], crate::Device::Cpu)
                    .unwrap()
                    .to_dtype(from)
                    .unwrap();
                let gs = match &*g.storage() {
                    Storage::Cpu(s) => s.clone(),
                    #[allow(unreachable_patterns)]
                    _ => unreachable!("a CPU tensor"),
                };
                let (want, bad) = amp::unscale(&gs, 0..n, inv, to).unwrap();
                want_bad |= bad;
                wants.push(want);
                inputs.push(gs.to_le_bytes(&crate::layout::Layout::contiguous(&[n])));
                outs.push(vec![0u8; n * to.size_in_bytes()]);
            }
            let entries: Vec<(u64, u64, usize)> = inputs
                .iter()
                .zip(&mut outs)
                .zip(sizes)
                .map(|((g, o), n)| (g.as_ptr() as u64, o.as_mut_ptr() as u64, n))
                .collect();
            let list = lists(&entries)[0];
            let mut found = 0.0f32;
            let f: Unscale = function(lib, &format!("amp_unscale_{}_{}", k(from), k(to)));
            // SAFETY: each listed input holds its n elements of `from`, each output n of `to`;
            // called directly the kernel runs as one thread over every chunk.
            unsafe { f(list, &inv, &mut found) };
            for ((out, want), n) in outs.iter().zip(&wants).zip(sizes) {
                let got = CpuStorage::from_le_bytes(out, to).unwrap();
                let flat = crate::layout::Layout::contiguous(&[n]);
                let (got, want) = (got.to_f64_vec(&flat), want.to_f64_vec(&flat));
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits() || a.is_nan() && b.is_nan());
                assert!(
                    same,
                    "unscale {from:?} -> {to:?}, {n} elements: {got:?} vs {want:?}"
                );
            }
            assert_eq!(found, want_bad as u8 as f32, "found_inf {from:?} -> {to:?}");
            assert_eq!(want_bad, poison.is_some(), "the poison is seen");
        }
    }
}

/// Gradient clipping's sums of squares: each chunk of a list of three gradients (short, over
/// two chunks, short) against the CPU's f64 sum of that chunk, in every dtype.
#[test]
fn sum_of_squares_kernels_match_the_cpu_per_chunk() {
    let Some(lib) = library("amp") else { return };
    type SumSquares = unsafe extern "C" fn(UnscaleList, *mut f32) -> ();
    let sizes = [301, CHUNK + 5, 7];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (mut bytes, mut want) = (Vec::new(), Vec::new());
        for (k, &n) in sizes.iter().enumerate() {
            let g = randn(&[n], 20 + k as u64)
                .mul(3.0)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let v = g.to_vec_f64().unwrap();
            for c in v.chunks(CHUNK) {
                want.push(c.iter().map(|x| x * x).sum::<f64>());
            }
            let gs = match &*g.storage() {
                Storage::Cpu(s) => s.to_le_bytes(&crate::layout::Layout::contiguous(&[n])),
                #[allow(unreachable_patterns)]
                _ => unreachable!("a CPU tensor"),
            };
            bytes.push(gs);
        }
        let entries: Vec<(u64, u64, usize)> = bytes
            .iter()
            .zip(sizes)
            .map(|(g, n)| (g.as_ptr() as u64, 0, n))
            .collect();
        let list = lists(&entries)[0];
        assert_eq!(list.chunks(), want.len());
        let mut partial = vec![f32::NAN; want.len()];
        let f: SumSquares = function(lib, &format!("amp_sum_squares_{}", k(dtype)));
        let pa = super::Addr::of_mut(&mut partial);
        super::run_grid(lib, 2, 64, || {
            // SAFETY: each listed gradient holds its n elements; partial one value per chunk,
            // written by thread 0 of the block that takes the chunk.
            unsafe { f(list, pa.ptr()) }
        });
        for (i, (g, w)) in partial.iter().zip(&want).enumerate() {
            assert!(
                ((*g as f64) - w).abs() <= 1e-5 * w,
                "{dtype:?} chunk {i}: {g} vs {w}"
            );
        }
    }
}

fn k(d: DType) -> &'static str {
    crate::backend::cuda::storage::kname("amp", d).unwrap()
}

#[test]
fn scale_update_kernel_matches_the_cpu() {
    let Some(lib) = library("amp") else { return };
    let f: Update = function(lib, "amp_update_scale");
    // (scale, tracker, found): back off, count, grow, and a growth that would overflow.
    let cases = [
        (65536.0f32, 5.0f32, 1.0f32),
        (65536.0, 1.0, 0.0),
        (65536.0, 2.0, 0.0),
        (3.0e38, 2.0, 0.0),
    ];
    for (scale, tracker, found) in cases {
        let (mut s, mut t) = (scale, tracker);
        amp::update_scale(&mut s, &mut t, found, 2.0, 0.5, 3);
        let (mut gs, mut gt) = (scale, tracker);
        // SAFETY: three f32 scalars; the kernel runs as one thread.
        unsafe { f(&mut gs, &mut gt, &found, 2.0, 0.5, 3) };
        assert_eq!(
            (gs, gt),
            (s, t),
            "scale {scale} tracker {tracker} found {found}"
        );
    }
    // The CPU's rule itself, on the same cases: back off and reset; count; grow and reset;
    // keep a scale whose growth is not finite, and reset.
    let expect = [
        (32768.0, 0.0),
        (65536.0, 2.0),
        (131072.0, 0.0),
        (3.0e38, 0.0),
    ];
    for ((scale, tracker, found), want) in cases.into_iter().zip(expect) {
        let (mut s, mut t) = (scale, tracker);
        amp::update_scale(&mut s, &mut t, found, 2.0, 0.5, 3);
        assert_eq!(
            (s, t),
            want,
            "scale {scale} tracker {tracker} found {found}"
        );
    }
}
