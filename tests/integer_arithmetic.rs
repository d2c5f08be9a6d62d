//! Integer arithmetic as PyTorch does it: u8 and i64 sums, differences, products and powers
//! wrap modulo 2^bits (`0 - 200` is 56 in u8, `i64::MAX + 1` is `i64::MIN`), maximum and
//! minimum are exact (an i64 past 2^53 is not rounded through a float), and the sums,
//! products and running sums of integer and U8 (bool) tensors are I64. On the CPU and, where
//! there is one, the CUDA device (the emulated one in CI); the expected values are Rust's own
//! wrapping arithmetic, which is PyTorch's.

use mantissa::*;

/// The CPU, and the CUDA device when there is one.
fn devices() -> Vec<Device> {
    let mut d = vec![Device::Cpu];
    match Device::cuda(0) {
        Ok(g) => d.push(g),
        Err(e) => eprintln!("skipped on CUDA: no CUDA device ({e})"),
    }
    d
}

#[test]
fn byte_arithmetic_wraps_modulo_256() {
    let a: Vec<u8> = vec![0, 3, 7, 200, 255, 16, 100, 1];
    let b: Vec<u8> = vec![200, 5, 2, 100, 1, 17, 156, 0];
    type Op = (
        &'static str,
        fn(&Tensor, &Tensor) -> Result<Tensor>,
        fn(u8, u8) -> u8,
    );
    let ops: [Op; 6] = [
        ("add", |x, y| x.add(y), u8::wrapping_add),
        ("sub", |x, y| x.sub(y), u8::wrapping_sub),
        ("mul", |x, y| x.mul(y), u8::wrapping_mul),
        ("maximum", |x, y| x.maximum(y), std::cmp::max),
        ("minimum", |x, y| x.minimum(y), std::cmp::min),
        ("pow", |x, y| x.pow(y), |x, y| x.wrapping_pow(y as u32)),
    ];
    for d in devices() {
        let x = Tensor::from_vec(a.clone(), &[2, 4], d).unwrap();
        let y = Tensor::from_vec(b.clone(), &[2, 4], d).unwrap();
        for (name, op, want) in ops {
            let got = op(&x, &y).unwrap();
            assert_eq!(got.dtype(), DType::U8, "{d} {name}");
            let want: Vec<u8> = a.iter().zip(&b).map(|(&p, &q)| want(p, q)).collect();
            assert_eq!(got.to_vec::<u8>().unwrap(), want, "{d} {name}");
            // Strided (a transposed view) and broadcast operands take the same rule.
            let got_t = op(&x.t().unwrap(), &y.t().unwrap()).unwrap();
            let want_t = op(&x, &y).unwrap().t().unwrap().contiguous().unwrap();
            assert_eq!(
                got_t.to_vec::<u8>().unwrap(),
                want_t.to_vec::<u8>().unwrap(),
                "{d} {name} strided"
            );
        }
        // An integer scalar stays integer arithmetic: 0 - 200 is 56, 200 * 2 is 144.
        let z = Tensor::from_vec(vec![0u8, 200], &[2], d).unwrap();
        assert_eq!(z.sub(200i64).unwrap().to_vec::<u8>().unwrap(), vec![56, 0]);
        assert_eq!(z.mul(2i64).unwrap().to_vec::<u8>().unwrap(), vec![0, 144]);
        assert_eq!(z.neg().unwrap().to_vec::<u8>().unwrap(), vec![0, 56]);
        // 2^9 is 0 modulo 256; 3^5 = 243.
        let base = Tensor::from_vec(vec![2u8, 3], &[2], d).unwrap();
        let exp = Tensor::from_vec(vec![9u8, 5], &[2], d).unwrap();
        assert_eq!(
            base.pow(&exp).unwrap().to_vec::<u8>().unwrap(),
            vec![0, 243]
        );
    }
}

#[test]
fn i64_arithmetic_wraps_and_stays_exact_past_2_53() {
    let big = (1i64 << 53) + 1;
    let a = vec![i64::MAX, i64::MIN, big, -7, 3_037_000_500, big];
    let b = vec![1, 1, 1, 3, 3_037_000_500, big - 1];
    type Op = (
        &'static str,
        fn(&Tensor, &Tensor) -> Result<Tensor>,
        fn(i64, i64) -> i64,
    );
    let ops: [Op; 5] = [
        ("add", |x, y| x.add(y), i64::wrapping_add),
        ("sub", |x, y| x.sub(y), i64::wrapping_sub),
        ("mul", |x, y| x.mul(y), i64::wrapping_mul),
        ("maximum", |x, y| x.maximum(y), std::cmp::max),
        ("minimum", |x, y| x.minimum(y), std::cmp::min),
    ];
    for d in devices() {
        let x = Tensor::from_vec(a.clone(), &[6], d).unwrap();
        let y = Tensor::from_vec(b.clone(), &[6], d).unwrap();
        for (name, op, want) in ops {
            let want: Vec<i64> = a.iter().zip(&b).map(|(&p, &q)| want(p, q)).collect();
            assert_eq!(
                op(&x, &y).unwrap().to_vec::<i64>().unwrap(),
                want,
                "{d} {name}"
            );
        }
        assert_eq!(
            x.add(1i64).unwrap().to_vec::<i64>().unwrap()[..3],
            [i64::MIN, i64::MIN + 1, big + 1],
            "{d}"
        );
    }
}

#[test]
fn integer_and_bool_sums_products_and_scans_are_i64() {
    for d in devices() {
        let v = Tensor::from_vec(vec![200u8, 100, 1], &[3], d).unwrap();
        let c = v.cumsum(0).unwrap();
        assert_eq!(c.dtype(), DType::I64, "{d}");
        assert_eq!(c.to_vec::<i64>().unwrap(), vec![200, 300, 301], "{d}");
        let s = v.sum_all().unwrap();
        assert_eq!(
            (s.dtype(), s.to_vec::<i64>().unwrap()),
            (DType::I64, vec![301])
        );
        let p = v.prod(0, false).unwrap();
        assert_eq!(
            (p.dtype(), p.to_vec::<i64>().unwrap()),
            (DType::I64, vec![20_000])
        );
        // A mask's sum counts its true elements, per row and in all.
        let m = Tensor::from_vec(vec![3.0f32, -1.0, 4.0, 1.0, 5.0, -9.0], &[2, 3], d)
            .unwrap()
            .gt(0.0)
            .unwrap();
        assert_eq!(
            m.sum(&[1], false).unwrap().to_vec::<i64>().unwrap(),
            vec![2, 2]
        );
        assert_eq!(m.sum(&[0], true).unwrap().shape(), &[1, 3]);
        assert_eq!(m.sum_all().unwrap().to_vec::<i64>().unwrap(), vec![4]);
        // i64 sums wrap, exactly, past 2^53.
        let big = (1i64 << 53) + 1;
        let w = Tensor::from_vec(vec![big, big, 1, i64::MAX, 1], &[5], d).unwrap();
        let want = [big, big, 1, i64::MAX, 1]
            .iter()
            .fold(0i64, |acc, &x| acc.wrapping_add(x));
        assert_eq!(
            w.sum_all().unwrap().to_vec::<i64>().unwrap(),
            vec![want],
            "{d}"
        );
        let running: Vec<i64> = [big, big, 1, i64::MAX, 1]
            .iter()
            .scan(0i64, |acc, &x| {
                *acc = acc.wrapping_add(x);
                Some(*acc)
            })
            .collect();
        assert_eq!(
            w.cumsum(0).unwrap().to_vec::<i64>().unwrap(),
            running,
            "{d}"
        );
        // An empty sum is 0, an empty product 1.
        let e = Tensor::zeros(&[2, 0], DType::U8, d).unwrap();
        assert_eq!(
            e.sum(&[1], false).unwrap().to_vec::<i64>().unwrap(),
            vec![0, 0]
        );
        assert_eq!(
            e.prod(1, false).unwrap().to_vec::<i64>().unwrap(),
            vec![1, 1]
        );
    }
}
