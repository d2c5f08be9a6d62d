//! Printing follows PyTorch's rules (`torch/_tensor_str.py`, default print options): the
//! switch to scientific form, whole-number floats as `2.`, negative zero, the summarised
//! `...` past 1000 elements, rows wrapped at 80 columns, integers, NaN and infinities, f16
//! and bf16, 0-d and empty tensors.
//!
//! Every expected value part below is PyTorch 2.15's output for the same values and dtype:
//! what `repr` writes after `tensor(` and before its own suffixes (`dtype=...`, `size=...`),
//! from `torch._tensor_str._tensor_str(t, len("tensor("))`. The engine's suffix
//! (`, shape=[..], dtype=..`) follows it.

use mantissa::{DType, Device, Tensor};

/// The value part of `t` as printed: between `tensor(` and `, shape=`.
fn body(t: &Tensor) -> String {
    let s = t.to_string();
    let s = s.strip_prefix("tensor(").expect("starts with tensor(");
    let end = s.rfind(", shape=").expect("has the shape suffix");
    s[..end].to_string()
}

fn check(t: &Tensor, torch: &str) {
    assert_eq!(body(t), torch, "\n{t}");
}

fn f32s(v: &[f32]) -> Tensor {
    Tensor::from_vec(v.to_vec(), &[v.len()], Device::Cpu).unwrap()
}

fn f64s(v: &[f64]) -> Tensor {
    Tensor::from_vec(v.to_vec(), &[v.len()], Device::Cpu).unwrap()
}

fn i64s(v: &[i64]) -> Tensor {
    Tensor::from_vec(v.to_vec(), &[v.len()], Device::Cpu).unwrap()
}

/// `v` rounded to `dtype` (f16 or bf16) from f64, as `torch.tensor(v, dtype=dtype)`.
fn halves(v: &[f64], dtype: DType) -> Tensor {
    f64s(v).to_dtype(dtype).unwrap()
}

fn arange(start: f64, end: f64, dtype: DType) -> Tensor {
    Tensor::arange(start, end, 1.0, dtype, Device::Cpu).unwrap()
}

fn scalar(v: f64, dtype: DType) -> Tensor {
    Tensor::full(&[], v, dtype, Device::Cpu).unwrap()
}

#[test]
fn scientific_form_switches_on_the_spread_and_size_of_magnitudes() {
    // Largest over smallest nonzero magnitude past 1000: scientific, also for whole numbers.
    check(&f32s(&[1., 2000.]), "[1.0000e+00, 2.0000e+03]");
    check(&f32s(&[1., 1000.]), "[   1., 1000.]");
    check(&f32s(&[0.5, 400.]), "[  0.5000, 400.0000]");
    check(&f32s(&[0.5, 600.]), "[5.0000e-01, 6.0000e+02]");
    // The smallest below 1e-4 (not a whole number): scientific.
    check(&f32s(&[0.00005, 0.0001]), "[5.0000e-05, 1.0000e-04]");
    check(&f32s(&[0.0001, 0.05]), "[1.0000e-04, 5.0000e-02]");
    // The largest past 1e8.
    check(&f64s(&[1e8, 5e7]), "[100000000.,  50000000.]");
    check(&f64s(&[2e8, 1e8]), "[2.0000e+08, 1.0000e+08]");
    check(
        &f64s(&[123456789.5, 100000000.25]),
        "[1.2346e+08, 1.0000e+08]",
    );
    // Exponents of three digits.
    check(&f64s(&[1e200, 1.0]), "[1.0000e+200,  1.0000e+00]");
    check(
        &f32s(&[1.5, -2.0, 0.25, 4.0]),
        "[ 1.5000, -2.0000,  0.2500,  4.0000]",
    );
}

#[test]
fn negative_zero_neither_chooses_the_form_nor_sets_the_width() {
    check(&f32s(&[-0., 1., 2.]), "[-0., 1., 2.]");
    check(&f32s(&[-0., 10., 20.]), "[-0., 10., 20.]");
    check(&f32s(&[-0., 1.5]), "[-0.0000, 1.5000]");
    check(&f32s(&[-0., 0.]), "[-0., 0.]");
    check(
        &f32s(&[-0., 1e-5, 1.]),
        "[-0.0000e+00, 1.0000e-05, 1.0000e+00]",
    );
    check(&f32s(&[0., 0., 0.]), "[0., 0., 0.]");
}

#[test]
fn past_1000_elements_long_dims_show_three_at_each_end() {
    check(
        &arange(0., 2000., DType::F32),
        concat!(
            "[0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 1.9970e+03, 1.9980e+03,\n",
            "        1.9990e+03]",
        ),
    );
    check(
        &arange(1000., 2001., DType::F32),
        "[1000., 1001., 1002.,  ..., 1998., 1999., 2000.]",
    );
    check(
        &arange(-500., 1001., DType::I64),
        "[-500, -499, -498,  ...,  998,  999, 1000]",
    );
    let t = arange(0., 2000., DType::F32).reshape(&[2, 1000]).unwrap();
    check(
        &t,
        concat!(
            "[[0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 9.9700e+02, 9.9800e+02,\n",
            "         9.9900e+02],\n",
            "        [1.0000e+03, 1.0010e+03, 1.0020e+03,  ..., 1.9970e+03, 1.9980e+03,\n",
            "         1.9990e+03]]",
        ),
    );
    let t = arange(0., 1200., DType::I64).reshape(&[40, 30]).unwrap();
    check(
        &t,
        concat!(
            "[[   0,    1,    2,  ...,   27,   28,   29],\n",
            "        [  30,   31,   32,  ...,   57,   58,   59],\n",
            "        [  60,   61,   62,  ...,   87,   88,   89],\n",
            "        ...,\n",
            "        [1110, 1111, 1112,  ..., 1137, 1138, 1139],\n",
            "        [1140, 1141, 1142,  ..., 1167, 1168, 1169],\n",
            "        [1170, 1171, 1172,  ..., 1197, 1198, 1199]]",
        ),
    );
    let t = arange(0., 2000., DType::I64)
        .reshape(&[10, 10, 20])
        .unwrap();
    check(
        &t,
        concat!(
            "[[[   0,    1,    2,  ...,   17,   18,   19],\n",
            "         [  20,   21,   22,  ...,   37,   38,   39],\n",
            "         [  40,   41,   42,  ...,   57,   58,   59],\n",
            "         ...,\n",
            "         [ 140,  141,  142,  ...,  157,  158,  159],\n",
            "         [ 160,  161,  162,  ...,  177,  178,  179],\n",
            "         [ 180,  181,  182,  ...,  197,  198,  199]],\n",
            "\n",
            "        [[ 200,  201,  202,  ...,  217,  218,  219],\n",
            "         [ 220,  221,  222,  ...,  237,  238,  239],\n",
            "         [ 240,  241,  242,  ...,  257,  258,  259],\n",
            "         ...,\n",
            "         [ 340,  341,  342,  ...,  357,  358,  359],\n",
            "         [ 360,  361,  362,  ...,  377,  378,  379],\n",
            "         [ 380,  381,  382,  ...,  397,  398,  399]],\n",
            "\n",
            "        [[ 400,  401,  402,  ...,  417,  418,  419],\n",
            "         [ 420,  421,  422,  ...,  437,  438,  439],\n",
            "         [ 440,  441,  442,  ...,  457,  458,  459],\n",
            "         ...,\n",
            "         [ 540,  541,  542,  ...,  557,  558,  559],\n",
            "         [ 560,  561,  562,  ...,  577,  578,  579],\n",
            "         [ 580,  581,  582,  ...,  597,  598,  599]],\n",
            "\n",
            "        ...,\n",
            "\n",
            "        [[1400, 1401, 1402,  ..., 1417, 1418, 1419],\n",
            "         [1420, 1421, 1422,  ..., 1437, 1438, 1439],\n",
            "         [1440, 1441, 1442,  ..., 1457, 1458, 1459],\n",
            "         ...,\n",
            "         [1540, 1541, 1542,  ..., 1557, 1558, 1559],\n",
            "         [1560, 1561, 1562,  ..., 1577, 1578, 1579],\n",
            "         [1580, 1581, 1582,  ..., 1597, 1598, 1599]],\n",
            "\n",
            "        [[1600, 1601, 1602,  ..., 1617, 1618, 1619],\n",
            "         [1620, 1621, 1622,  ..., 1637, 1638, 1639],\n",
            "         [1640, 1641, 1642,  ..., 1657, 1658, 1659],\n",
            "         ...,\n",
            "         [1740, 1741, 1742,  ..., 1757, 1758, 1759],\n",
            "         [1760, 1761, 1762,  ..., 1777, 1778, 1779],\n",
            "         [1780, 1781, 1782,  ..., 1797, 1798, 1799]],\n",
            "\n",
            "        [[1800, 1801, 1802,  ..., 1817, 1818, 1819],\n",
            "         [1820, 1821, 1822,  ..., 1837, 1838, 1839],\n",
            "         [1840, 1841, 1842,  ..., 1857, 1858, 1859],\n",
            "         ...,\n",
            "         [1940, 1941, 1942,  ..., 1957, 1958, 1959],\n",
            "         [1960, 1961, 1962,  ..., 1977, 1978, 1979],\n",
            "         [1980, 1981, 1982,  ..., 1997, 1998, 1999]]]",
        ),
    );
    let t = arange(0., 1010., DType::I64).reshape(&[505, 2]).unwrap();
    check(
        &t,
        concat!(
            "[[   0,    1],\n",
            "        [   2,    3],\n",
            "        [   4,    5],\n",
            "        ...,\n",
            "        [1004, 1005],\n",
            "        [1006, 1007],\n",
            "        [1008, 1009]]",
        ),
    );
}

#[test]
fn long_rows_wrap_at_80_columns() {
    let v: Vec<f32> = (0..60).map(|i| i as f32 * 1.5 - 20.0).collect();
    check(
        &f32s(&v[..30]),
        concat!(
            "[-20.0000, -18.5000, -17.0000, -15.5000, -14.0000, -12.5000, -11.0000,\n",
            "         -9.5000,  -8.0000,  -6.5000,  -5.0000,  -3.5000,  -2.0000,  -0.5000,\n",
            "          1.0000,   2.5000,   4.0000,   5.5000,   7.0000,   8.5000,  10.0000,\n",
            "         11.5000,  13.0000,  14.5000,  16.0000,  17.5000,  19.0000,  20.5000,\n",
            "         22.0000,  23.5000]",
        ),
    );
    check(
        &arange(100., 130., DType::I64),
        concat!(
            "[100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113,\n",
            "        114, 115, 116, 117, 118, 119, 120, 121, 122, 123, 124, 125, 126, 127,\n",
            "        128, 129]",
        ),
    );
    check(
        &f32s(&v).reshape(&[2, 30]).unwrap(),
        concat!(
            "[[-20.0000, -18.5000, -17.0000, -15.5000, -14.0000, -12.5000, -11.0000,\n",
            "          -9.5000,  -8.0000,  -6.5000,  -5.0000,  -3.5000,  -2.0000,  -0.5000,\n",
            "           1.0000,   2.5000,   4.0000,   5.5000,   7.0000,   8.5000,  10.0000,\n",
            "          11.5000,  13.0000,  14.5000,  16.0000,  17.5000,  19.0000,  20.5000,\n",
            "          22.0000,  23.5000],\n",
            "        [ 25.0000,  26.5000,  28.0000,  29.5000,  31.0000,  32.5000,  34.0000,\n",
            "          35.5000,  37.0000,  38.5000,  40.0000,  41.5000,  43.0000,  44.5000,\n",
            "          46.0000,  47.5000,  49.0000,  50.5000,  52.0000,  53.5000,  55.0000,\n",
            "          56.5000,  58.0000,  59.5000,  61.0000,  62.5000,  64.0000,  65.5000,\n",
            "          67.0000,  68.5000]]",
        ),
    );
    check(
        &arange(0., 100., DType::F32),
        concat!(
            "[ 0.,  1.,  2.,  3.,  4.,  5.,  6.,  7.,  8.,  9., 10., 11., 12., 13.,\n",
            "        14., 15., 16., 17., 18., 19., 20., 21., 22., 23., 24., 25., 26., 27.,\n",
            "        28., 29., 30., 31., 32., 33., 34., 35., 36., 37., 38., 39., 40., 41.,\n",
            "        42., 43., 44., 45., 46., 47., 48., 49., 50., 51., 52., 53., 54., 55.,\n",
            "        56., 57., 58., 59., 60., 61., 62., 63., 64., 65., 66., 67., 68., 69.,\n",
            "        70., 71., 72., 73., 74., 75., 76., 77., 78., 79., 80., 81., 82., 83.,\n",
            "        84., 85., 86., 87., 88., 89., 90., 91., 92., 93., 94., 95., 96., 97.,\n",
            "        98., 99.]",
        ),
    );
    let v: Vec<f64> = (0..40).map(|i| 1e-5 * (i + 1) as f64).collect();
    check(
        &f64s(&v),
        concat!(
            "[1.0000e-05, 2.0000e-05, 3.0000e-05, 4.0000e-05, 5.0000e-05, 6.0000e-05,\n",
            "        7.0000e-05, 8.0000e-05, 9.0000e-05, 1.0000e-04, 1.1000e-04, 1.2000e-04,\n",
            "        1.3000e-04, 1.4000e-04, 1.5000e-04, 1.6000e-04, 1.7000e-04, 1.8000e-04,\n",
            "        1.9000e-04, 2.0000e-04, 2.1000e-04, 2.2000e-04, 2.3000e-04, 2.4000e-04,\n",
            "        2.5000e-04, 2.6000e-04, 2.7000e-04, 2.8000e-04, 2.9000e-04, 3.0000e-04,\n",
            "        3.1000e-04, 3.2000e-04, 3.3000e-04, 3.4000e-04, 3.5000e-04, 3.6000e-04,\n",
            "        3.7000e-04, 3.8000e-04, 3.9000e-04, 4.0000e-04]",
        ),
    );
}

#[test]
fn integers_are_right_aligned_to_the_widest() {
    check(&i64s(&[-3, 10, 200, -4000]), "[   -3,    10,   200, -4000]");
    let t = i64s(&[-1, 0, 25, -300]).reshape(&[2, 2]).unwrap();
    check(&t, concat!("[[  -1,    0],\n", "        [  25, -300]]",));
    check(
        &i64s(&[i64::MAX, i64::MIN]),
        "[ 9223372036854775807, -9223372036854775808]",
    );
    let t = Tensor::from_vec(vec![0u8, 1, 255], &[3], Device::Cpu).unwrap();
    check(&t, "[  0,   1, 255]");
}

#[test]
fn nan_and_infinities_print_as_python_writes_them() {
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    check(
        &f32s(&[nan, inf, -inf, 1.5]),
        "[   nan,    inf,   -inf, 1.5000]",
    );
    check(&f32s(&[nan, 1., 20.]), "[nan,  1., 20.]");
    check(&f32s(&[-inf, 1., inf]), "[-inf, 1., inf]");
    check(
        &f32s(&[nan, -inf, 1e-5, 1.]),
        "[       nan,       -inf, 1.0000e-05, 1.0000e+00]",
    );
    check(&f32s(&[nan, nan]), "[nan, nan]");
}

#[test]
fn half_floats_print_their_values_widened() {
    check(
        &halves(&[0.1, 1.5, -2.25], DType::F16),
        "[ 0.1000,  1.5000, -2.2500]",
    );
    check(
        &halves(&[0.1, 1.5, -2.25], DType::BF16),
        "[ 0.1001,  1.5000, -2.2500]",
    );
    check(
        &halves(&[65504., 1.], DType::F16),
        "[6.5504e+04, 1.0000e+00]",
    );
    check(
        &halves(&[2f64.powi(127), -1.], DType::BF16),
        "[ 1.7014e+38, -1.0000e+00]",
    );
    check(
        &halves(&[0.0001, 0.5], DType::F16),
        "[1.0002e-04, 5.0000e-01]",
    );
}

#[test]
fn zero_dim_and_empty_tensors() {
    check(&scalar(3.5, DType::F32), "3.5000");
    check(&scalar(2., DType::F32), "2.");
    check(&scalar(-0., DType::F32), "-0.");
    check(&scalar(1e-5, DType::F32), "1.0000e-05");
    check(&scalar(-7., DType::I64), "-7");
    check(&scalar(f64::NAN, DType::BF16), "nan");
    check(&scalar(0., DType::F32), "0.");
    check(&f32s(&[]), "[]");
    check(
        &Tensor::zeros(&[2, 0], DType::I64, Device::Cpu).unwrap(),
        "[]",
    );
}

#[test]
fn the_suffix_follows_the_value_part() {
    let t = arange(0., 2000., DType::F32).reshape(&[2, 1000]).unwrap();
    let t = t.requires_grad(true).unwrap();
    assert_eq!(
        t.to_string(),
        format!(
            "tensor({}, shape=[2, 1000], dtype=F32, requires_grad=true)",
            concat!(
                "[[0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 9.9700e+02, 9.9800e+02,\n",
                "         9.9900e+02],\n",
                "        [1.0000e+03, 1.0010e+03, 1.0020e+03,  ..., 1.9970e+03, 1.9980e+03,\n",
                "         1.9990e+03]]",
            )
        )
    );
    let e = Tensor::zeros(&[2, 0], DType::I64, Device::Cpu).unwrap();
    assert_eq!(e.to_string(), "tensor([], shape=[2, 0], dtype=I64)");
}
