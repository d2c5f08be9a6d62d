//! `cuda/sort.cu` on the host against the CPU's argsort: the shared-memory kernel as real
//! blocks of threads (with barriers), and the global-memory network stage by stage, on rows
//! with ties, NaN and signed zeros, in f32 and i64.

use super::{function, library, run_grid, Addr};
use crate::backend::cpu::CpuStorage;
use crate::layout::Layout;

/// The CPU backend's argsort of rows `[rows, n]` of `x`.
fn cpu_argsort(x: CpuStorage, rows: usize, n: usize, desc: bool) -> Vec<i64> {
    match crate::backend::cpu::argsort(&x, &Layout::contiguous(&[rows, n]), desc).unwrap() {
        CpuStorage::I64(v) => v,
        _ => unreachable!("argsort gives I64"),
    }
}

/// Rows of values with ties (a few distinct values), NaN and both zeros.
fn awkward(rows: usize, n: usize, seed: u64) -> Vec<f32> {
    let pool = [1.5, -2.0, 0.0, -0.0, f32::NAN, 7.25, -2.0, 1.5, 3.0];
    let mut s = seed;
    (0..rows * n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            pool[(s >> 33) as usize % pool.len()]
        })
        .collect()
}

#[test]
fn shared_memory_argsort_matches_the_cpu_on_emulated_blocks() {
    let Some(lib) = library("sort") else {
        return;
    };
    type Rows = unsafe extern "C" fn(*const f32, *mut i64, i64, i64, i64, i32) -> ();
    type RowsI = unsafe extern "C" fn(*const i64, *mut i64, i64, i64, i64, i32) -> ();
    let (f, fi): (Rows, RowsI) = (
        function(lib, "argsort_rows_float"),
        function(lib, "argsort_rows_i64"),
    );
    // Row lengths around powers of two; fewer blocks than rows (blocks loop over rows).
    for (rows, n) in [(3usize, 1usize), (5, 7), (2, 64), (4, 100), (1, 2048)] {
        let np2 = n.next_power_of_two() as i64;
        let x = awkward(rows, n, n as u64);
        let xi: Vec<i64> = x
            .iter()
            .map(|v| if v.is_nan() { 9 } else { *v as i64 })
            .collect();
        for desc in [false, true] {
            let mut out = vec![-1i64; rows * n];
            let (xa, oa) = (Addr::of(&x), Addr::of_mut(&mut out));
            run_grid(lib, 2, 64, || {
                // SAFETY: x and out hold rows x n elements; each row's block writes its own.
                unsafe { f(xa.ptr(), oa.ptr(), rows as i64, n as i64, np2, desc as i32) }
            });
            let want = cpu_argsort(CpuStorage::F32(x.clone()), rows, n, desc);
            assert_eq!(out, want, "f32 rows {rows} n {n} descending {desc}");
            let mut out = vec![-1i64; rows * n];
            let (xa, oa) = (Addr::of(&xi), Addr::of_mut(&mut out));
            run_grid(lib, 3, 32, || {
                // SAFETY: as above.
                unsafe { fi(xa.ptr(), oa.ptr(), rows as i64, n as i64, np2, desc as i32) }
            });
            let want = cpu_argsort(CpuStorage::I64(xi.clone()), rows, n, desc);
            assert_eq!(out, want, "i64 rows {rows} n {n} descending {desc}");
        }
    }
}

#[test]
fn global_memory_network_matches_the_cpu() {
    let Some(lib) = library("sort") else {
        return;
    };
    type Init = unsafe extern "C" fn(*const f32, *mut f32, *mut i64, i64, i64, i64) -> ();
    type Step = unsafe extern "C" fn(*mut f32, *mut i64, i64, i64, i64, i64, i64, i32) -> ();
    let init: Init = function(lib, "argsort_init_float");
    let step: Step = function(lib, "argsort_step_float");
    let (rows, n) = (3usize, 2500usize);
    let np2 = n.next_power_of_two();
    let x = awkward(rows, n, 11);
    for desc in [false, true] {
        let (mut keys, mut ids) = (vec![0f32; rows * np2], vec![0i64; rows * np2]);
        let (r, n64, p) = (rows as i64, n as i64, np2 as i64);
        // SAFETY: keys and ids hold rows x np2 places, x rows x n elements; a direct call is
        // a grid of one thread, which loops over every place.
        unsafe { init(x.as_ptr(), keys.as_mut_ptr(), ids.as_mut_ptr(), r, n64, p) };
        let mut k = 2;
        while k <= np2 {
            let mut j = k / 2;
            while j > 0 {
                // SAFETY: as above, one thread over every pair.
                unsafe {
                    step(
                        keys.as_mut_ptr(),
                        ids.as_mut_ptr(),
                        r,
                        n64,
                        p,
                        j as i64,
                        k as i64,
                        desc as i32,
                    )
                };
                j /= 2;
            }
            k *= 2;
        }
        let got: Vec<i64> = ids.chunks(np2).flat_map(|row| row[..n].to_vec()).collect();
        let want = cpu_argsort(CpuStorage::F32(x.clone()), rows, n, desc);
        assert_eq!(got, want, "descending {desc}");
    }
}
