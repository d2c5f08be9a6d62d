//! Branch-free f32 `exp`, `tanh` and `sigmoid` that the compiler vectorises (libm's are
//! calls, one element at a time). Cephes' polynomials: `exp` within 2 ulp over its whole
//! range (subnormal results included), `tanh` and `sigmoid` within a few ulp; NaN stays NaN
//! and the infinities give the limits. Used by the activations (tanh, sigmoid, SiLU, GELU's
//! tanh form), softmax and the LSTM cell; the other elementwise ops keep libm.

/// `1.5 * 2^23`: adding it rounds an f32 of magnitude below 2^22 to an integer, and the sum's
/// low mantissa bits hold that integer.
const ROUND: f32 = 12_582_912.0;

/// `e^x`.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Beyond these the result is inf or 0 anyway; `clamp` keeps NaN.
    let x = x.clamp(-104.0, 88.8);
    // x = n ln 2 + r with |r| <= ln 2 / 2.
    let m = x * LOG2E + ROUND;
    let n = m - ROUND;
    let bits = m.to_bits() as i32 - ROUND.to_bits() as i32;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n in two factors, each a normal f32 for n in [-150, 128]: a subnormal result is
    // rounded once, by the last product, and n = 128 overflows to inf.
    let h = bits >> 1;
    let s1 = f32::from_bits(((h + 127) << 23) as u32);
    let s2 = f32::from_bits(((bits - h + 127) << 23) as u32);
    y * s1 * s2
}

/// `1 / (1 + e^-x)`.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `tanh x`: an odd polynomial below 0.625 in magnitude, `1 - 2 / (e^2|x| + 1)` above, with
/// the sign of x.
#[inline(always)]
pub(crate) fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let mut p = -5.704_988_7e-3f32;
    p = p * z + 2.063_909e-2;
    p = p * z - 5.373_971_6e-2;
    p = p * z + 1.333_144_2e-1;
    p = p * z - 3.333_328e-1;
    // The sign from x keeps tanh(-0) = -0.
    let small = (p * z * x + x).copysign(x);
    let large = (1.0 - 2.0 / (exp(2.0 * a) + 1.0)).copysign(x);
    if a < 0.625 {
        small
    } else {
        large
    }
}

#[cfg(test)]
mod tests {
    /// The largest error of `f` against `want` (computed in f64) over `xs`, in units of the
    /// f32 spacing at the true value.
    fn max_ulp(xs: impl Iterator<Item = f32>, f: fn(f32) -> f32, want: fn(f64) -> f64) -> f64 {
        let mut worst = 0.0f64;
        for x in xs {
            let (got, w) = (f(x) as f64, want(x as f64));
            if w == 0.0 || !w.is_finite() {
                assert_eq!(got, w, "at {x}");
                continue;
            }
            let wf = w as f32;
            // The spacing of f32 around the true value (subnormals have a fixed spacing).
            let ulp = (f32::from_bits(wf.abs().to_bits() + 1) - wf.abs()) as f64;
            worst = worst.max((got - w).abs() / ulp);
        }
        worst
    }

    /// A dense sweep of [-lo, hi] with the values around zero and some random-looking ones.
    fn sweep(lo: f32, hi: f32) -> impl Iterator<Item = f32> {
        let n = 400_000;
        (0..=n)
            .map(move |k| lo + (hi - lo) * k as f32 / n as f32)
            .chain((0..2000).map(|k| (k as f32 - 1000.0) * 1e-6))
            .chain([0.0, -0.0, 1e-30, -1e-30, 0.624_999_9, 0.625, -0.625])
    }

    #[test]
    fn exp_is_within_two_ulp_everywhere() {
        let e = max_ulp(sweep(-103.9, 88.7), super::exp, f64::exp);
        assert!(e <= 2.0, "exp: {e} ulp");
        assert_eq!(super::exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(super::exp(89.0), f32::INFINITY);
        assert_eq!(super::exp(f32::NEG_INFINITY), 0.0);
        assert!(super::exp(f32::NAN).is_nan());
        // A subnormal result, rounded once.
        assert_eq!(super::exp(-100.0), (-100.0f64).exp() as f32);
    }

    #[test]
    fn tanh_and_sigmoid_are_within_a_few_ulp() {
        let t = max_ulp(sweep(-20.0, 20.0), super::tanh, f64::tanh);
        assert!(t <= 4.0, "tanh: {t} ulp");
        let s = max_ulp(sweep(-80.0, 40.0), super::sigmoid, |x| {
            1.0 / (1.0 + (-x).exp())
        });
        assert!(s <= 4.0, "sigmoid: {s} ulp");
        for (x, th, sg) in [
            (f32::INFINITY, 1.0, 1.0),
            (f32::NEG_INFINITY, -1.0, 0.0),
            (50.0, 1.0, 1.0),
        ] {
            assert_eq!((super::tanh(x), super::sigmoid(x)), (th, sg), "at {x}");
        }
        assert!(super::tanh(f32::NAN).is_nan() && super::sigmoid(f32::NAN).is_nan());
        assert_eq!(super::tanh(-0.0).to_bits(), (-0.0f32).to_bits());
    }
}
