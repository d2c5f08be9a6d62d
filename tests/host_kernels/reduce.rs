//! Row reductions (reduce.cu) on emulated blocks, dropout masks and normal draws (random.cu),
//! against the CPU backend.

use super::{function, library, run_grid, Addr};
use crate::backend::ops::ReduceOp;
use crate::backend::Storage;
use crate::dtype::WithDType;
use crate::layout::Layout;
use crate::{bf16, f16, DType, Device, Tensor};
use libloading::Library;

const ROWS: usize = 5;
const COLS: usize = 77;

/// `[ROWS, COLS]` values of `T`: normal draws, with a NaN in row 1 and in row 3 and the
/// maximum and minimum of row 2 each repeated (ties go to the first index).
fn rows<T: WithDType>(seed: u64) -> Tensor {
    let mut v = crate::Generator::new(seed).normal(ROWS * COLS);
    v[COLS + 40] = f64::NAN;
    v[3 * COLS + 3] = f64::NAN;
    let row2 = &mut v[2 * COLS..3 * COLS];
    row2[10] = 9.0;
    row2[60] = 9.0;
    row2[20] = -9.0;
    row2[70] = -9.0;
    Tensor::from_vec(v, &[ROWS, COLS], Device::Cpu)
        .unwrap()
        .to_dtype(T::DTYPE)
        .unwrap()
}

fn cpu_reduce(x: &Tensor, op: ReduceOp) -> Vec<f64> {
    let l = Layout::contiguous(&[ROWS, COLS]);
    let s = x.storage().reduce(&l, &[1], op).unwrap();
    Tensor::from_storage(s, &[ROWS]).to_vec_f64().unwrap()
}

fn reduce_in<T: WithDType>(lib: &Library, t: &str, tol: f64) {
    type Reduce<T> = unsafe extern "C" fn(i32, *const T, *mut T, i64, i64) -> ();
    type ArgMax<T> = unsafe extern "C" fn(f32, *const T, *mut i64, i64, i64) -> ();
    let reduce: Reduce<T> = function(lib, &format!("reduce_rows_{t}"));
    let argmax: ArgMax<T> = function(lib, &format!("argmax_rows_{t}"));
    let x = rows::<T>(41);
    let xs = x.to_vec::<T>().unwrap();
    let xa = Addr::of(&xs);
    let (r, c) = (ROWS as i64, COLS as i64);
    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Mean] {
        let code = op.code();
        let mut out = [T::zero(); ROWS];
        let oa = Addr::of_mut(&mut out);
        // Two blocks of 64 threads: each block strides over rows and each thread over columns.
        run_grid(lib, 2, 64, || {
            // SAFETY: x holds ROWS x COLS elements, out ROWS; thread 0 of a block writes its row.
            unsafe { reduce(code, xa.ptr(), oa.ptr(), r, c) }
        });
        let got: Vec<f64> = out.iter().map(|v| v.to_f64()).collect();
        let want = cpu_reduce(&x, op);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let ok = match op {
                // The CPU adds with compensation, the kernel as a tree in f32.
                ReduceOp::Sum | ReduceOp::Mean => {
                    g.is_nan() && w.is_nan() || (g - w).abs() <= tol * (1.0 + w.abs())
                }
                _ => g == w || g.is_nan() && w.is_nan(),
            };
            assert!(ok, "{op:?} ({t}) row {i}: {got:?} vs {want:?}");
        }
    }
    for (sign, op) in [(1.0, ReduceOp::ArgMax), (-1.0, ReduceOp::ArgMin)] {
        let mut out = vec![-1i64; ROWS];
        let oa = Addr::of_mut(&mut out);
        run_grid(lib, 2, 64, || {
            // SAFETY: as above, with i64 outputs.
            unsafe { argmax(sign, xa.ptr(), oa.ptr(), r, c) }
        });
        let want: Vec<i64> = cpu_reduce(&x, op).iter().map(|&v| v as i64).collect();
        assert_eq!(out, want, "{op:?} ({t})");
    }
}

#[test]
fn reduction_kernels_match_the_cpu_with_nan_and_ties() {
    let Some(lib) = library("reduce") else { return };
    reduce_in::<f32>(lib, "float", 1e-6);
    // A half result may land one rounding step away when the f32 sums differ in the last bit.
    reduce_in::<f16>(lib, "f16", 1e-3);
    reduce_in::<bf16>(lib, "bf16", 8e-3);
}

#[test]
fn dropout_kernels_draw_the_cpus_mask() {
    let Some(lib) = library("random") else { return };
    type Mask<T> = unsafe extern "C" fn(u64, u64, u64, f32, *mut T, i64, *const u64) -> ();
    fn check<T: WithDType + PartialEq>(lib: &Library, t: &str, dtype: DType) {
        let f: Mask<T> = function(lib, &format!("dropout_mask_{t}"));
        // A length that is not a multiple of 4 (the last block is cut), a stream that does
        // not start at 0, and the edge thresholds (keep all, keep none).
        let n = 4 * 37 + 3;
        let seed = 0x1234_5678_9abc_def0;
        for (p, start) in [(0.3, 11u64), (0.0, 0), (1.0, 5)] {
            let threshold = (p * 4_294_967_296.0f64).ceil() as u64;
            let scale = if p < 1.0 { 1.0 / (1.0 - p) } else { 0.0 };
            let want =
                Storage::dropout_mask(Device::Cpu, n, threshold, scale, (seed, start), dtype)
                    .unwrap();
            let want = Tensor::from_storage(want, &[n]).to_vec::<T>().unwrap();
            let mut out = vec![T::zero(); n];
            // SAFETY: `out` holds n elements; run as one thread, which loops over every block.
            unsafe {
                f(
                    seed,
                    start,
                    threshold,
                    scale as f32,
                    out.as_mut_ptr(),
                    n as i64,
                    std::ptr::null(),
                )
            };
            assert!(out == want, "dropout p={p} ({t})");
            // A graph's replay: the state read from memory, `start` the draw's offset in
            // the step (3 blocks past the state's offset here).
            let state = [seed, start.wrapping_sub(3)];
            let mut replayed = vec![T::zero(); n];
            // SAFETY: as above; `state` holds the two words the kernel reads.
            unsafe {
                f(
                    0,
                    3,
                    threshold,
                    scale as f32,
                    replayed.as_mut_ptr(),
                    n as i64,
                    state.as_ptr(),
                )
            };
            assert!(
                replayed == want,
                "dropout p={p} ({t}) from a state in memory"
            );
            if p == 0.3 {
                let kept = out.iter().filter(|v| v.to_f64() != 0.0).count();
                assert!(
                    (kept as f64 / n as f64 - 0.7).abs() < 0.15,
                    "kept {kept} of {n}"
                );
            }
        }
    }
    check::<f32>(lib, "float", DType::F32);
    check::<f16>(lib, "f16", DType::F16);
    check::<bf16>(lib, "bf16", DType::BF16);
}

#[test]
fn normal_kernels_draw_the_cpus_values() {
    let Some(lib) = library("random") else { return };
    type Normal<T> = unsafe extern "C" fn(u64, u64, f64, f64, *mut T, i64, *const u64) -> ();
    fn check<T: WithDType>(lib: &Library, t: &str, dtype: DType) {
        let f: Normal<T> = function(lib, &format!("normal_{t}"));
        // An odd length (the last pair is cut) and a stream that does not start at 0.
        let (n, seed, start, mean, std) = (2 * 91 + 1, 0x0fed_cba9_8765_4321, 7u64, 0.25, 3.0);
        let want = Storage::normal(Device::Cpu, n, mean, std, (seed, start), dtype).unwrap();
        let want = Tensor::from_storage(want, &[n]).to_vec_f64().unwrap();
        let mut out = vec![T::zero(); n];
        // SAFETY: `out` holds n elements; run as one thread, which loops over every pair.
        unsafe {
            f(
                seed,
                start,
                mean,
                std,
                out.as_mut_ptr(),
                n as i64,
                std::ptr::null(),
            )
        };
        // The same draw from a state in memory (a graph's replay), 2 blocks into the step.
        let state = [seed, start - 2];
        let mut replayed = vec![T::zero(); n];
        // SAFETY: as above; `state` holds the two words the kernel reads.
        unsafe {
            f(
                1,
                2,
                mean,
                std,
                replayed.as_mut_ptr(),
                n as i64,
                state.as_ptr(),
            )
        };
        assert!(
            replayed
                .iter()
                .zip(&out)
                .all(|(a, b)| a.to_f64() == b.to_f64()),
            "normal_{t} from a state in memory"
        );
        let got: Vec<f64> = out.iter().map(|v| v.to_f64()).collect();
        // The kernel rounds through f32 where the host rounds f64 to T once: equal up to a
        // double rounding's last bit of T.
        let tol = match dtype {
            DType::F32 => 0.0,
            _ => 1e-2,
        };
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= tol * w.abs(),
                "normal_{t}[{i}]: {g} vs {w}"
            );
        }
        let m = got.iter().sum::<f64>() / n as f64;
        assert!((m - mean).abs() < 0.5, "mean {m}");
    }
    check::<f32>(lib, "float", DType::F32);
    check::<f16>(lib, "f16", DType::F16);
    check::<bf16>(lib, "bf16", DType::BF16);
}

#[test]
fn column_reductions_match_the_cpu_in_two_passes() {
    let Some(lib) = library("reduce") else { return };
    type Partial<T> = unsafe extern "C" fn(i32, *const T, *mut f32, i64, i64, i64) -> ();
    type Final<T> = unsafe extern "C" fn(i32, *const f32, *mut T, i64, i64, i64) -> ();
    fn check<T: WithDType>(lib: &Library, t: &str, tol: f64) {
        let partial: Partial<T> = function(lib, &format!("reduce_cols_partial_{t}"));
        let fin: Final<T> = function(lib, &format!("reduce_cols_final_{t}"));
        // 150 rows in chunks of 64 (the last one short), 7 columns; a NaN in column 2.
        let (rows, cols, chunk) = (150usize, 7usize, 64usize);
        let mut v = crate::Generator::new(5).normal(rows * cols);
        v[40 * cols + 2] = f64::NAN;
        let x = Tensor::from_vec(v, &[rows, cols], Device::Cpu)
            .unwrap()
            .to_dtype(T::DTYPE)
            .unwrap();
        let xs = x.to_vec::<T>().unwrap();
        let chunks = rows.div_ceil(chunk);
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Mean] {
            let mut part = vec![0f32; chunks * cols];
            let mut out = vec![T::zero(); cols];
            let (r, c) = (rows as i64, cols as i64);
            // SAFETY: x holds rows x cols elements, part chunks x cols, out cols; one thread
            // loops over every work item.
            unsafe {
                partial(
                    op.code(),
                    xs.as_ptr(),
                    part.as_mut_ptr(),
                    r,
                    c,
                    chunk as i64,
                );
                fin(
                    op.code(),
                    part.as_ptr(),
                    out.as_mut_ptr(),
                    r,
                    c,
                    chunks as i64,
                );
            }
            let l = Layout::contiguous(&[rows, cols]);
            let want = x.storage().reduce(&l, &[0], op).unwrap();
            let want = Tensor::from_storage(want, &[cols]).to_vec_f64().unwrap();
            for (j, (g, w)) in out.iter().map(|v| v.to_f64()).zip(&want).enumerate() {
                let ok = g.is_nan() && w.is_nan() || (g - w).abs() <= tol * (1.0 + w.abs());
                assert!(ok, "{op:?} ({t}) column {j}: {g} vs {w}");
            }
            assert!(out[2].to_f64().is_nan(), "{op:?}: the NaN column");
        }
    }
    check::<f32>(lib, "float", 1e-5);
    check::<f16>(lib, "f16", 2e-3);
    check::<bf16>(lib, "bf16", 1e-2);
}
