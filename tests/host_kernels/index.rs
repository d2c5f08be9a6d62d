//! Indexing kernels (take, add_at) and the strided write, against the CPU backend.

use super::{function, library, randn};
use crate::backend::cuda::index::base;
use crate::backend::cuda::storage::Strided;
use crate::layout::Layout;
use crate::{bf16, DType, Device, Tensor};
use libloading::Library;

type Take = unsafe extern "C" fn(
    *const u32,
    Strided,
    *const i64,
    i64,
    i64,
    i64,
    i64,
    *mut u32,
    i64,
    *mut i32,
    i32,
) -> ();

/// Runs `take_u32` as index_select (`select`) or gather over `x` viewed by `l`; returns the
/// output and the fault flag.
fn take(
    lib: &Library,
    x: &[f32],
    l: &Layout,
    dim: usize,
    idx: &[i64],
    out_shape: &[usize],
    select: bool,
) -> (Vec<f32>, i32) {
    let (b, dim_stride) = base("take", l, out_shape, dim).unwrap();
    let inner = match select {
        true => out_shape[dim + 1..].iter().product::<usize>() as i64,
        false => 0,
    };
    let n: usize = out_shape.iter().product();
    let mut out = vec![0f32; n];
    let mut fault = 0i32;
    let f: Take = function(lib, "take_u32");
    // SAFETY: `x` holds the view's elements, `idx` its entries, `out` the n outputs; f32s
    // travel as their 32-bit patterns.
    unsafe {
        f(
            x.as_ptr().cast(),
            b,
            idx.as_ptr(),
            inner,
            idx.len() as i64,
            l.shape()[dim] as i64,
            dim_stride,
            out.as_mut_ptr().cast(),
            n as i64,
            &mut fault,
            7,
        )
    };
    (out, fault)
}

#[test]
fn take_kernel_selects_gathers_and_flags_bad_indices() {
    let Some(lib) = library("index") else { return };
    let x = randn(&[6, 7], 3);
    let xs = x.to_vec::<f32>().unwrap();
    let cpu_idx =
        |v: &[i64], shape: &[usize]| Tensor::from_vec(v.to_vec(), shape, Device::Cpu).unwrap();
    // index_select along dim 1 of the transposed view [7, 6].
    let t = Layout::contiguous(&[6, 7]).permute("t", &[1, 0]).unwrap();
    let rows = [5i64, 0, 0, 3, 5];
    let (got, fault) = take(lib, &xs, &t, 1, &rows, &[7, 5], true);
    let want = x
        .t()
        .unwrap()
        .index_select(1, &cpu_idx(&rows, &[5]))
        .unwrap();
    assert_eq!(
        (got, fault),
        (want.to_vec::<f32>().unwrap(), 0),
        "index_select"
    );
    // gather along dim 0 with a [2, 4] index.
    let g = [5i64, 5, 0, 1, 1, 1, 2, 4];
    let (got, fault) = take(
        lib,
        &xs,
        &Layout::contiguous(&[6, 7]),
        0,
        &g,
        &[2, 4],
        false,
    );
    let want = x.gather(0, &cpu_idx(&g, &[2, 4])).unwrap();
    assert_eq!((got, fault), (want.to_vec::<f32>().unwrap(), 0), "gather");
    // An index out of range: the slot in the flag, 0 in its place, the others as usual.
    let (got, fault) = take(
        lib,
        &xs,
        &Layout::contiguous(&[6, 7]),
        0,
        &[2, 6],
        &[2, 7],
        true,
    );
    assert_eq!(fault, 7);
    assert_eq!(&got[..7], &xs[14..21]);
    assert_eq!(&got[7..], &[0.0; 7]);
}

type AddAt<T> = unsafe extern "C" fn(
    *mut T,
    Strided,
    i64,
    *const i64,
    i64,
    i64,
    i64,
    *const T,
    Strided,
    i64,
    *mut i32,
    i32,
) -> ();

#[test]
fn add_at_kernel_adds_in_the_cpus_order() {
    let Some(lib) = library("index") else { return };
    // scatter_add along dim 0 of an f32 [4, 6] from a larger source [10, 7] through a
    // [10, 6] index with repeats: one thread adds in the index's order, as the CPU does.
    let x = randn(&[4, 6], 4);
    let src = randn(&[10, 7], 5);
    let ids: Vec<i64> = (0..60).map(|i| (i * i) % 4).collect();
    let index = Tensor::from_vec(ids.clone(), &[10, 6], Device::Cpu).unwrap();
    let want = x.scatter_add(0, &index, &src).unwrap();
    let mut dst = x.to_vec::<f32>().unwrap();
    let sl = Layout::contiguous(&[10, 7]);
    let sview = Layout::new(vec![10, 6], sl.strides().to_vec(), 0);
    let (db, dim_stride) = base("scatter_add", &Layout::contiguous(&[4, 6]), &[10, 6], 0).unwrap();
    let srcv = src.to_vec::<f32>().unwrap();
    let mut fault = 0;
    let f: AddAt<f32> = function(lib, "add_at_float");
    // SAFETY: the buffers hold the elements the views describe.
    unsafe {
        f(
            dst.as_mut_ptr(),
            db,
            dim_stride,
            ids.as_ptr(),
            0,
            60,
            4,
            srcv.as_ptr(),
            Strided::new("scatter_add", &sview).unwrap(),
            60,
            &mut fault,
            3,
        )
    };
    assert_eq!(fault, 0);
    assert_eq!(dst, want.to_vec::<f32>().unwrap(), "scatter_add f32");

    // index_add along dim 1 in bf16 (the backward of index_select), rounding after each
    // addition as the CPU does: bit for bit.
    let w = randn(&[3, 5], 6)
        .to_dtype(DType::BF16)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let cols = [4i64, 0, 4, 2, 4, 4];
    let sel = Tensor::from_vec(cols.to_vec(), &[6], Device::Cpu).unwrap();
    let y = w.index_select(1, &sel).unwrap();
    let g = randn(&[3, 6], 7).to_dtype(DType::BF16).unwrap();
    y.backward_with(&g).unwrap();
    let want = w.grad().unwrap().to_vec::<bf16>().unwrap();
    // The halves are added through a CAS of their 4-byte-aligned word, which may reach past
    // the last element; a device block is 256-byte aligned and a whole 512-byte multiple, so
    // the host buffer is 4-byte aligned words too, one element longer than the tensor.
    let mut words = vec![0u32; 8];
    let dst: &mut [bf16] = bytemuck::cast_slice_mut(&mut words);
    let gs = g.to_vec::<bf16>().unwrap();
    let (db, dim_stride) = base("index_add", &Layout::contiguous(&[3, 5]), &[3, 6], 1).unwrap();
    let f: AddAt<bf16> = function(lib, "add_at_bf16");
    // SAFETY: as above.
    unsafe {
        f(
            dst.as_mut_ptr(),
            db,
            dim_stride,
            cols.as_ptr(),
            1,
            6,
            5,
            gs.as_ptr(),
            Strided::new("index_add", &Layout::contiguous(&[3, 6])).unwrap(),
            18,
            &mut fault,
            3,
        )
    };
    assert_eq!(fault, 0);
    assert_eq!(&dst[..15], &want[..], "index_add bf16");
    assert_eq!(
        dst[15],
        bf16::ZERO,
        "the half past the end is left as it was"
    );
}

/// index_add from many threads at once (emulated blocks, real atomics): every addition lands,
/// including those to the two halves of one 32-bit word, which the f16/bf16 path updates by
/// compare-and-swap of the whole word. The sums are exact in every order of the additions.
#[test]
fn add_at_kernels_lose_no_update_under_contention() {
    let Some(lib) = library("index") else { return };
    fn check<T: crate::dtype::WithDType>(lib: &Library, t: &str) {
        // dst [2, 64] += src [2, 16384] along dim 1, the columns picked by a 16384-entry
        // index: each element gets 256 additions of 1/8, exact in any order even in bf16.
        let (rows, cols, m) = (2usize, 64usize, 16384usize);
        let ids: Vec<i64> = (0..m as i64)
            .map(|i| (i * 3 + i / 8) % cols as i64)
            .collect();
        let src = vec![T::from_f64(0.125); rows * m];
        // Word-aligned and padded, like a device block (see add_at_kernel_adds_in_the_cpus_order).
        let mut words = vec![0u64; rows * cols / 2 + 2];
        let dst: &mut [T] = unsafe_cast(&mut words);
        let (db, dim_stride) = base(
            "index_add",
            &Layout::contiguous(&[rows, cols]),
            &[rows, m],
            1,
        )
        .unwrap();
        let sview = Strided::new("index_add", &Layout::contiguous(&[rows, m])).unwrap();
        let mut fault = 0i32;
        let f: AddAt<T> = function(lib, &format!("add_at_{t}"));
        let (d, i, sp, fl) = (
            super::Addr::of_mut(dst),
            super::Addr::of(&ids),
            super::Addr::of(&src),
            super::Addr::of_mut(std::slice::from_mut(&mut fault)),
        );
        super::run_grid(lib, 1, 256, || {
            // SAFETY: dst holds rows x cols elements (and padding), src rows x m, the index m.
            unsafe {
                f(
                    d.ptr(),
                    db,
                    dim_stride,
                    i.ptr(),
                    1,
                    m as i64,
                    cols as i64,
                    sp.ptr(),
                    sview,
                    (rows * m) as i64,
                    fl.ptr(),
                    3,
                )
            }
        });
        assert_eq!(fault, 0);
        let mut want = vec![0.0; rows * cols];
        for r in 0..rows {
            for &k in &ids {
                want[r * cols + k as usize] += 0.125;
            }
        }
        let dst: &mut [T] = unsafe_cast(&mut words);
        let got: Vec<f64> = dst[..rows * cols].iter().map(|v| v.to_f64()).collect();
        assert_eq!(got, want, "add_at_{t}");
        assert!(
            dst[rows * cols..].iter().all(|v| v.to_f64() == 0.0),
            "padding ({t})"
        );
    }
    // A lost update shows only when two threads collide on a word, which is likely, not
    // certain (a CAS replaced by a plain store failed about three runs in five): a few rounds.
    for _ in 0..4 {
        check::<f32>(lib, "float");
        check::<crate::f16>(lib, "f16");
        check::<bf16>(lib, "bf16");
    }
}

/// `words` as elements of `T` (a plain-data type of 2 or 4 bytes).
fn unsafe_cast<T>(words: &mut [u64]) -> &mut [T] {
    let n = std::mem::size_of_val(words) / std::mem::size_of::<T>();
    // SAFETY: T is f32, f16 or bf16 (any bits are a value), u64 alignment suffices, and the
    // length covers the same bytes.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut T, n) }
}

#[test]
fn copy_into_strided_writes_only_the_view() {
    let Some(lib) = library("cast") else { return };
    type Copy = unsafe extern "C" fn(*const u32, Strided, *mut u32, i64) -> ();
    let f: Copy = function(lib, "copy_into_strided_u32");
    // Columns 2..5 of a [4, 6] tensor, and the transpose of a [3, 4] block at offset 1.
    for view in [
        Layout::contiguous(&[4, 6]).narrow("t", 1, 2, 3).unwrap(),
        Layout::new(vec![4, 3], vec![1, 6], 1),
    ] {
        let n = view.numel() as u32;
        let src: Vec<u32> = (100..100 + n).collect();
        let mut dst = vec![0u32; 24];
        // SAFETY: `src` holds the view's elements; the view lies inside `dst`.
        unsafe {
            f(
                src.as_ptr(),
                Strided::new("copy_", &view).unwrap(),
                dst.as_mut_ptr(),
                n as i64,
            )
        };
        let mut want = vec![0u32; 24];
        for (v, o) in src.iter().zip(view.offsets()) {
            want[o] = *v;
        }
        assert_eq!(dst, want, "{view:?}");
    }
}

type AddGroups<T> =
    unsafe extern "C" fn(*mut T, *const i64, *const i64, *const i64, *const T, i64) -> ();

/// The deterministic scatter_add / index_add (`set_deterministic_index_add`): the host lays
/// out each cell's additions in order ([`scatter_pairs`], [`index_add_pairs`], [`groups`]) and
/// `add_groups` adds them, one thread per cell, on an emulated grid. Bit for bit the CPU's
/// result, in bf16 where the order of roundings shows, from strided sources.
#[test]
fn add_groups_kernel_repeats_the_cpus_sums_bit_for_bit() {
    use crate::backend::cuda::index::{groups, index_add_pairs, scatter_pairs};
    let Some(lib) = library("index") else { return };
    let f: AddGroups<bf16> = function(lib, "add_groups_bf16");
    let run = |dst: &mut [bf16], src: &[bf16], pairs: Vec<(usize, usize)>| {
        let (dst_pos, starts, src_pos) = groups(pairs);
        let (d, dp, st, sp, s) = (
            super::Addr::of_mut(dst),
            super::Addr::of(&dst_pos),
            super::Addr::of(&starts),
            super::Addr::of(&src_pos),
            super::Addr::of(src),
        );
        let cells = dst_pos.len() as i64;
        super::run_grid(lib, 2, 4, || {
            // SAFETY: the positions lie inside dst and src, which the caller sized.
            unsafe { f(d.ptr(), dp.ptr(), st.ptr(), sp.ptr(), s.ptr(), cells) }
        });
    };
    let bf = |t: Tensor| t.to_dtype(DType::BF16).unwrap();

    // scatter_add along dim 0 of [4, 6] from the transpose of a [7, 10] buffer (seen [10, 7],
    // larger than the [10, 6] index), many repeats per cell.
    let x = bf(randn(&[4, 6], 51));
    let buf = bf(randn(&[7, 10], 52));
    let src = buf.t().unwrap();
    let ids: Vec<i64> = (0..60).map(|i| (i * i + i / 7) % 4).collect();
    let index = Tensor::from_vec(ids.clone(), &[10, 6], Device::Cpu).unwrap();
    let want = x.scatter_add(0, &index, &src).unwrap();
    let mut dst = x.to_vec::<bf16>().unwrap();
    let sl = Layout::contiguous(&[7, 10]).permute("t", &[1, 0]).unwrap();
    let ids: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
    let pairs = scatter_pairs(&[4, 6], 0, &ids, &[10, 6], &sl);
    run(&mut dst, &buf.to_vec::<bf16>().unwrap(), pairs);
    assert_eq!(dst, want.to_vec::<bf16>().unwrap(), "scatter_add");

    // index_add along dim 1 of [3, 5] from the transpose of a [6, 3] buffer, into a
    // destination that is not zero (its cells are read first).
    let w = bf(randn(&[3, 5], 53));
    let buf = bf(randn(&[6, 3], 54));
    let cols = [4usize, 0, 4, 2, 4, 4];
    let sl = Layout::contiguous(&[6, 3]).permute("t", &[1, 0]).unwrap();
    let mut want = w.storage().try_clone().unwrap();
    let idx = Tensor::from_vec(cols.map(|c| c as i64).to_vec(), &[6], Device::Cpu).unwrap();
    want.index_add(
        &[3, 5],
        1,
        (&idx.storage(), &Layout::contiguous(&[6])),
        (&buf.storage(), &sl),
    )
    .unwrap();
    let want = Tensor::from_storage(want, &[3, 5])
        .to_vec::<bf16>()
        .unwrap();
    let mut dst = w.to_vec::<bf16>().unwrap();
    run(
        &mut dst,
        &buf.to_vec::<bf16>().unwrap(),
        index_add_pairs(&[3, 5], 1, &cols, &sl),
    );
    assert_eq!(dst, want, "index_add");
    // Column 4 took four additions, column 1 none.
    assert_ne!(dst[4], w.to_vec::<bf16>().unwrap()[4]);
    assert_eq!(dst[1], w.to_vec::<bf16>().unwrap()[1]);
}
