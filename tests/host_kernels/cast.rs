//! Casts (cast.cu), contiguous and strided, against the CPU backend's `to_dtype`, element for
//! element: every conversion the CUDA `to_dtype` launches directly, with NaN, infinities,
//! signed zero, half overflow and rounding ties, and values the integer casts truncate and
//! saturate.

use super::{function, library};
use crate::backend::cpu::CpuStorage;
use crate::backend::cuda::storage::{kname, Strided};
use crate::backend::Storage;
use crate::layout::Layout;
use crate::{DType, Device, Tensor};

type Cast = unsafe extern "C" fn(*const u8, *mut u8, i64) -> ();
type CastStrided = unsafe extern "C" fn(*const u8, Strided, *mut u8, i64) -> ();

const ROWS: usize = 6;
const COLS: usize = 7;

/// 42 source values for a source dtype: the specials first, then ordinary values.
fn values(from: DType) -> Vec<f64> {
    let specials: Vec<f64> = match from {
        // Indices and masks: exact in f32 (the casts go through f32; an i64 beyond 2^24 is
        // rounded twice on the way to a half type).
        DType::I64 => vec![-5.0, 0.0, 7.0, 16_777_216.0, -70_000.0, 65_519.0, 3.0],
        DType::U8 => vec![0.0, 1.0, 255.0, 128.0, 37.0],
        _ => vec![
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            -0.0,
            65_520.0,
            1.0 + 2f64.powi(-11),
            1.0 + 3.0 * 2f64.powi(-11),
            1.0 + 2f64.powi(-8),
            300.7,
            -3.7,
            255.5,
            1e20,
            -1e20,
            2.9,
            0.49,
            3e-8,
        ],
    };
    let mut g = crate::Generator::new(17);
    let more = g.normal(ROWS * COLS - specials.len());
    let scale = match from {
        DType::U8 => 60.0,
        DType::I64 => 1000.0,
        _ => 50.0,
    };
    let more = more.into_iter().map(|v| match from {
        DType::U8 => (v * scale).abs().min(255.0).trunc(),
        DType::I64 => (v * scale).trunc(),
        _ => v * scale,
    });
    specials.into_iter().chain(more).collect()
}

fn cpu(t: &Tensor, l: &Layout) -> CpuStorage {
    match &*t.storage() {
        Storage::Cpu(s) => s.copy_strided(l),
        #[allow(unreachable_patterns)]
        _ => unreachable!("a CPU tensor"),
    }
}

/// Equal values, NaN equal to NaN and zeros equal only with the same sign.
fn same(got: &[f64], want: &[f64]) -> bool {
    got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(g, w)| g.to_bits() == w.to_bits() || g.is_nan() && w.is_nan())
}

#[test]
fn cast_kernels_match_the_cpu_contiguous_and_strided() {
    let Some(lib) = library("cast") else { return };
    let floats = [DType::F32, DType::F16, DType::BF16];
    let mut pairs: Vec<(DType, DType)> =
        [DType::F32, DType::F16, DType::BF16, DType::I64, DType::U8]
            .iter()
            .flat_map(|&s| floats.iter().map(move |&d| (s, d)))
            .collect();
    pairs.extend([(DType::F32, DType::I64), (DType::F32, DType::U8)]);
    let n = ROWS * COLS;
    for (from, to) in pairs {
        // The source as the CPU holds it (rounded to `from`), and its transpose as a view.
        let src = Tensor::from_vec(values(from), &[ROWS, COLS], Device::Cpu)
            .unwrap()
            .to_dtype(from)
            .unwrap();
        let flat = Layout::contiguous(&[ROWS, COLS]);
        let bytes = cpu(&src, &flat).to_le_bytes(&flat);
        let (s, d) = (kname("t", from).unwrap(), kname("t", to).unwrap());
        for viewed in [src.clone(), src.transpose(0, 1).unwrap()] {
            let view = viewed.layout().clone();
            let want = viewed.to_dtype(to).unwrap().to_vec_f64().unwrap();
            let mut out = vec![0u8; n * to.size_in_bytes()];
            if view.is_contiguous() {
                let f: Cast = function(lib, &format!("cast_{s}_{d}"));
                // SAFETY: `bytes` holds n elements of `from`, `out` n of `to`.
                unsafe { f(bytes.as_ptr(), out.as_mut_ptr(), n as i64) };
            } else {
                let f: CastStrided = function(lib, &format!("cast_strided_{s}_{d}"));
                let st = Strided::new("t", &view).unwrap();
                // SAFETY: the view lies inside `bytes`; `out` holds n elements of `to`.
                unsafe { f(bytes.as_ptr(), st, out.as_mut_ptr(), n as i64) };
            }
            let got = CpuStorage::from_le_bytes(&out, to).unwrap();
            let got = got.to_f64_vec(&Layout::contiguous(&[n]));
            let how = if view.is_contiguous() { "" } else { " strided" };
            assert!(
                same(&got, &want),
                "cast {from:?} -> {to:?}{how}:\n{got:?}\nvs\n{want:?}"
            );
        }
    }
}

#[test]
fn strided_copy_kernels_read_the_view() {
    let Some(lib) = library("cast") else { return };
    // A [4, 6] tensor of distinct values; its transpose and a narrowed, offset part of it,
    // copied by the same-width kernels of every element size.
    let base = Layout::contiguous(&[4, 6]);
    let views = [
        base.permute("t", &[1, 0]).unwrap(),
        base.narrow("t", 1, 1, 4)
            .unwrap()
            .narrow("t", 0, 1, 2)
            .unwrap(),
    ];
    for (width, dtype) in [
        ("u8", DType::U8),
        ("u16", DType::F16),
        ("u32", DType::F32),
        ("u64", DType::I64),
    ] {
        let src = Tensor::from_vec((1..=24).map(f64::from).collect(), &[4, 6], Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let bytes = cpu(&src, &base).to_le_bytes(&base);
        let f: CastStrided = function(lib, &format!("copy_strided_{width}"));
        for view in &views {
            let n = view.numel();
            let mut out = vec![0u8; n * dtype.size_in_bytes()];
            // SAFETY: the view lies inside `bytes`; `out` holds its n elements.
            unsafe {
                f(
                    bytes.as_ptr(),
                    Strided::new("t", view).unwrap(),
                    out.as_mut_ptr(),
                    n as i64,
                )
            };
            let got = CpuStorage::from_le_bytes(&out, dtype).unwrap();
            let got = got.to_f64_vec(&Layout::contiguous(&[n]));
            let want: Vec<f64> = view.offsets().map(|o| (o + 1) as f64).collect();
            assert_eq!(got, want, "copy_strided_{width} {view:?}");
        }
    }
}

/// `cat`'s copy lists (`copy_list_u32`): inputs of several shapes and strides (one over two
/// chunks) written into their columns of the output, as the CPU's `cat` writes them; views
/// that do not walk as unit-stride rows are left to the one-at-a-time copy.
#[test]
fn copy_lists_place_each_input_as_cat_does() {
    use crate::backend::cuda::copy_list::{as_rows, lists, Copy2d, CHUNK, LIST};
    let Some(lib) = library("cast") else { return };
    type CopyListFn = unsafe extern "C" fn(crate::backend::cuda::copy_list::CopyList) -> ();
    let f: CopyListFn = function(lib, "copy_list_u32");
    let t = |shape: &[usize], k: f64| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| (i as f64 * k).sin() as f32).collect();
        Tensor::from_vec(v, shape, Device::Cpu).unwrap()
    };
    let rows = 3;
    // Dense; a column block of a wider tensor (row stride 9); long enough for two chunks.
    let a = t(&[rows, 4], 0.3);
    let b = t(&[rows, 9], 0.7).narrow(1, 2, 5).unwrap();
    let c = t(&[rows, CHUNK / 2], 1.1);
    let inputs = [&a, &b, &c];
    let want = Tensor::cat(&inputs, 1).unwrap();
    let total: usize = inputs.iter().map(|x| x.shape()[1]).sum();
    let mut out = vec![f32::NAN; rows * total];
    let out_layout = Layout::contiguous(&[rows, total]);
    let data: Vec<Vec<f32>> = inputs
        .iter()
        .map(|x| match &*x.storage() {
            Storage::Cpu(CpuStorage::F32(v)) => v.clone(),
            _ => unreachable!("f32 on the host"),
        })
        .collect();
    let mut start = 0;
    let mut copies = Vec::new();
    for (x, d) in inputs.iter().zip(&data) {
        let dl = out_layout.narrow("cat", 1, start, x.shape()[1]).unwrap();
        let (r, cols, sld, dld) = as_rows(x.layout(), &dl).expect("rows");
        copies.push(Copy2d {
            src: d[x.layout().offset()..].as_ptr() as u64,
            dst: out[dl.offset()..].as_mut_ptr() as u64,
            rows: r,
            cols,
            sld,
            dld,
        });
        start += x.shape()[1];
    }
    let list = lists(&copies)[0];
    assert!(copies.len() <= LIST);
    // SAFETY: every copy's source holds its rows at its row stride, every destination is a
    // block of `out`'s columns; called directly the kernel runs as one thread.
    unsafe { f(list) };
    assert_eq!(out, want.to_vec::<f32>().unwrap());

    // Whole dense tensors merge into one row; a transposed source has no unit-stride rows.
    let dense = Layout::contiguous(&[rows, 4]);
    assert_eq!(
        as_rows(&dense, &dense),
        Some((1, 4 * rows, 4 * rows, 4 * rows))
    );
    let tr = t(&[4, rows], 0.5).t().unwrap();
    assert_eq!(as_rows(tr.layout(), &dense), None);
}
