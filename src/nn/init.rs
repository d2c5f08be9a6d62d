//! PyTorch's `torch.nn.init` for parameters: each function writes new values into the
//! tensor it is given, in place (under [`crate::no_grad`], through [`Tensor::copy_`]), so the
//! tensor keeps its dtype, device, `requires_grad` and every other handle to it (a tied
//! weight, an optimizer's parameter list) sees the new values. Random values come from the
//! [`Generator`] passed in, drawn by [`Tensor::randn_with`] and [`Tensor::rand_with`] in the
//! tensor's shape, dtype and device, so the same seed gives the same values.
//!
//! ```
//! use mantissa::nn::init::{self, FanMode, Nonlinearity};
//! use mantissa::{DType, Device, Generator, Tensor};
//! let w = Tensor::zeros(&[64, 32], DType::F32, Device::Cpu)?.requires_grad(true)?;
//! let mut g = Generator::new(0);
//! init::kaiming_uniform_(&w, 0.0, FanMode::FanIn, Nonlinearity::Relu, &mut g)?;
//! let bound = (2.0f64).sqrt() * (3.0 / 32.0f64).sqrt();
//! assert!(w.to_vec::<f32>()?.iter().all(|v| (v.abs() as f64) <= bound));
//! assert!(w.is_requires_grad());
//! # Ok::<(), mantissa::Error>(())
//! ```

use crate::{Error, Generator, Result, Tensor};

/// Which fan [`kaiming_uniform_`] and [`kaiming_normal_`] scale by (PyTorch's `mode`):
/// `FanIn` keeps the variance of the forward pass, `FanOut` that of the backward pass.
///
/// ```
/// use mantissa::nn::init::{fan, FanMode};
/// use mantissa::{DType, Device, Tensor};
/// let w = Tensor::zeros(&[8, 3, 5, 5], DType::F32, Device::Cpu)?;
/// assert_eq!(fan(&w, FanMode::FanOut)?, 8 * 25);
/// # Ok::<(), mantissa::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FanMode {
    FanIn,
    FanOut,
}

/// The nonlinearity a gain is computed for ([`calculate_gain`]): PyTorch's names, `Conv`
/// standing for every `conv*` and `conv_transpose*` one.
///
/// ```
/// use mantissa::nn::init::{calculate_gain, Nonlinearity};
/// assert_eq!(calculate_gain(Nonlinearity::Tanh, None)?, 5.0 / 3.0);
/// # Ok::<(), mantissa::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nonlinearity {
    Linear,
    Conv,
    Sigmoid,
    Tanh,
    Relu,
    LeakyRelu,
    Selu,
}

/// The recommended gain for `nonlinearity` (PyTorch's `calculate_gain`): 1 for linear,
/// convolution and sigmoid, 5/3 for tanh, sqrt(2) for ReLU, sqrt(2 / (1 + slope^2)) for leaky
/// ReLU (`param` is the negative slope, 0.01 when `None`), 3/4 for SELU. `param` is read by
/// leaky ReLU only, as in PyTorch; a slope that is not finite is an error.
///
/// ```
/// use mantissa::nn::init::{calculate_gain, Nonlinearity};
/// let g = calculate_gain(Nonlinearity::LeakyRelu, Some(0.2))?;
/// assert!((g - (2.0 / 1.04f64).sqrt()).abs() < 1e-12);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn calculate_gain(nonlinearity: Nonlinearity, param: Option<f64>) -> Result<f64> {
    Ok(match nonlinearity {
        Nonlinearity::Linear | Nonlinearity::Conv | Nonlinearity::Sigmoid => 1.0,
        Nonlinearity::Tanh => 5.0 / 3.0,
        Nonlinearity::Relu => 2f64.sqrt(),
        Nonlinearity::LeakyRelu => {
            let slope = param.unwrap_or(0.01);
            if !slope.is_finite() {
                return Err(Error::invalid(
                    "init::calculate_gain",
                    format!("negative_slope {slope} of leaky_relu is not a finite number"),
                ));
            }
            (2.0 / (1.0 + slope * slope)).sqrt()
        }
        Nonlinearity::Selu => 0.75,
    })
}

/// `(fan_in, fan_out)` of a weight (PyTorch's `_calculate_fan_in_and_fan_out`): dim 1 and
/// dim 0 times the product of the dims after them (a convolution's receptive field). A
/// tensor of rank below 2 has no fans: an error.
///
/// ```
/// use mantissa::nn::init::fan_in_and_fan_out;
/// use mantissa::{DType, Device, Tensor};
/// let w = Tensor::zeros(&[16, 4, 3, 3], DType::F32, Device::Cpu)?;
/// assert_eq!(fan_in_and_fan_out(&w)?, (36, 144));
/// assert!(fan_in_and_fan_out(&Tensor::zeros(&[5], DType::F32, Device::Cpu)?).is_err());
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn fan_in_and_fan_out(t: &Tensor) -> Result<(usize, usize)> {
    fans("init::fan_in_and_fan_out", t)
}

/// The fan `mode` picks of [`fan_in_and_fan_out`] (PyTorch's `_calculate_correct_fan`).
///
/// ```
/// use mantissa::nn::init::{fan, FanMode};
/// use mantissa::{DType, Device, Tensor};
/// let w = Tensor::zeros(&[10, 3], DType::F32, Device::Cpu)?;
/// assert_eq!(fan(&w, FanMode::FanIn)?, 3);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn fan(t: &Tensor, mode: FanMode) -> Result<usize> {
    let (fan_in, fan_out) = fans("init::fan", t)?;
    Ok(match mode {
        FanMode::FanIn => fan_in,
        FanMode::FanOut => fan_out,
    })
}

/// [`fan_in_and_fan_out`] with the name of the function the user called in its error.
fn fans(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    let s = t.shape();
    if s.len() < 2 {
        return Err(Error::invalid(
            op,
            format!(
                "fan in and fan out cannot be computed for a tensor of fewer than 2 dims \
                 (shape {s:?})"
            ),
        ));
    }
    // The element count fits in usize (the tensor exists), so these products do too.
    let field: usize = s[2..].iter().product();
    Ok((s[1] * field, s[0] * field))
}

/// Writes `values` (same shape and device) into `t` without recording a graph.
fn write(t: &Tensor, values: &Tensor) -> Result<()> {
    crate::no_grad(|| t.copy_(values))
}

/// Refuses a tensor of a dtype random values cannot be drawn in (integers and masks).
fn expect_float(op: &'static str, t: &Tensor) -> Result<()> {
    if t.dtype().is_float() {
        return Ok(());
    }
    Err(Error::DType {
        op,
        dtype: t.dtype(),
        expected: "a float dtype",
    })
}

/// Fills `t` with values from N(mean, std^2) (PyTorch's `normal_`); `std` must be finite and
/// non-negative, `mean` finite.
///
/// ```
/// use mantissa::nn::init;
/// use mantissa::{DType, Device, Generator, Tensor};
/// let w = Tensor::zeros(&[4, 4], DType::F16, Device::Cpu)?;
/// init::normal_(&w, 0.0, 0.02, &mut Generator::new(1))?;
/// assert_eq!(w.dtype(), DType::F16);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn normal_(t: &Tensor, mean: f64, std: f64, gen: &mut Generator) -> Result<()> {
    let op = "init::normal_";
    expect_float(op, t)?;
    if !mean.is_finite() || !std.is_finite() || std < 0.0 {
        return Err(Error::invalid(
            op,
            format!("mean {mean} and std {std} must be finite, std >= 0"),
        ));
    }
    let v = Tensor::randn_with(t.shape(), mean, std, t.dtype(), t.device(), gen)?;
    write(t, &v)
}

/// Fills `t` with values from U(a, b) (PyTorch's `uniform_`); `a <= b`, both finite (with
/// `a == b`, every value is `a`).
///
/// ```
/// use mantissa::nn::init;
/// use mantissa::{DType, Device, Generator, Tensor};
/// let w = Tensor::zeros(&[100], DType::F32, Device::Cpu)?;
/// init::uniform_(&w, -0.5, 0.5, &mut Generator::new(1))?;
/// assert!(w.to_vec::<f32>()?.iter().all(|v| (-0.5..=0.5).contains(v)));
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn uniform_(t: &Tensor, a: f64, b: f64, gen: &mut Generator) -> Result<()> {
    uniform_named("init::uniform_", t, a, b, gen)
}

/// [`uniform_`] with the caller's name in its errors.
fn uniform_named(op: &'static str, t: &Tensor, a: f64, b: f64, gen: &mut Generator) -> Result<()> {
    expect_float(op, t)?;
    if !a.is_finite() || !b.is_finite() || a > b {
        return Err(Error::invalid(
            op,
            format!("bounds [{a}, {b}) must be finite with a <= b"),
        ));
    }
    if a == b {
        // An empty interval: the one value, as PyTorch's uniform_(a, a) gives.
        return constant_(t, a);
    }
    let v = Tensor::rand_with(t.shape(), a, b, t.dtype(), t.device(), gen)?;
    write(t, &v)
}

/// Fills `t` with `value` (PyTorch's `constant_`); any dtype (the value is rounded to it).
///
/// ```
/// use mantissa::nn::init;
/// use mantissa::{DType, Device, Tensor};
/// let b = Tensor::zeros(&[3], DType::F32, Device::Cpu)?.requires_grad(true)?;
/// init::constant_(&b, 0.1)?;
/// assert_eq!(b.to_vec::<f32>()?, vec![0.1; 3]);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn constant_(t: &Tensor, value: f64) -> Result<()> {
    crate::no_grad(|| t.fill_(value))
}

/// Fills `t` with zeros (PyTorch's `zeros_`).
///
/// ```
/// use mantissa::nn::init;
/// use mantissa::{DType, Device, Tensor};
/// let b = Tensor::ones(&[2], DType::F32, Device::Cpu)?;
/// init::zeros_(&b)?;
/// assert_eq!(b.to_vec::<f32>()?, vec![0.0, 0.0]);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn zeros_(t: &Tensor) -> Result<()> {
    constant_(t, 0.0)
}

/// Fills `t` with ones (PyTorch's `ones_`).
///
/// ```
/// use mantissa::nn::init;
/// use mantissa::{DType, Device, Tensor};
/// let w = Tensor::zeros(&[2], DType::F32, Device::Cpu)?;
/// init::ones_(&w)?;
/// assert_eq!(w.to_vec::<f32>()?, vec![1.0, 1.0]);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn ones_(t: &Tensor) -> Result<()> {
    constant_(t, 1.0)
}

/// Glorot's uniform initialisation (PyTorch's `xavier_uniform_`): U(-x, x) with
/// `x = gain * sqrt(6 / (fan_in + fan_out))`. Rank 2 or more.
///
/// ```
/// use mantissa::nn::init;
/// use mantissa::{DType, Device, Generator, Tensor};
/// let w = Tensor::zeros(&[30, 20], DType::F32, Device::Cpu)?;
/// init::xavier_uniform_(&w, 1.0, &mut Generator::new(0))?;
/// let x = (6.0f64 / 50.0).sqrt();
/// assert!(w.to_vec::<f32>()?.iter().all(|v| (v.abs() as f64) <= x));
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn xavier_uniform_(t: &Tensor, gain: f64, gen: &mut Generator) -> Result<()> {
    let op = "init::xavier_uniform_";
    let std = xavier_std(op, t, gain)?;
    let bound = 3f64.sqrt() * std;
    uniform_named(op, t, -bound, bound, gen)
}

/// Glorot's normal initialisation (PyTorch's `xavier_normal_`): N(0, std^2) with
/// `std = gain * sqrt(2 / (fan_in + fan_out))`. Rank 2 or more.
///
/// ```
/// use mantissa::nn::init;
/// use mantissa::{DType, Device, Generator, Tensor};
/// let w = Tensor::zeros(&[8, 8], DType::F32, Device::Cpu)?;
/// init::xavier_normal_(&w, 1.0, &mut Generator::new(0))?;
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn xavier_normal_(t: &Tensor, gain: f64, gen: &mut Generator) -> Result<()> {
    let op = "init::xavier_normal_";
    let std = xavier_std(op, t, gain)?;
    normal_named(op, t, std, gen)
}

/// `gain * sqrt(2 / (fan_in + fan_out))`, checked.
fn xavier_std(op: &'static str, t: &Tensor, gain: f64) -> Result<f64> {
    let (fan_in, fan_out) = fans(op, t)?;
    if !gain.is_finite() {
        return Err(Error::invalid(op, format!("gain {gain} is not finite")));
    }
    // Both fans 0 only for a tensor with no elements: nothing is written then.
    Ok(gain.abs() * (2.0 / (fan_in + fan_out).max(1) as f64).sqrt())
}

/// N(0, std^2) into `t` with the caller's name in its errors.
fn normal_named(op: &'static str, t: &Tensor, std: f64, gen: &mut Generator) -> Result<()> {
    expect_float(op, t)?;
    let v = Tensor::randn_with(t.shape(), 0.0, std, t.dtype(), t.device(), gen)?;
    write(t, &v)
}

/// He's uniform initialisation (PyTorch's `kaiming_uniform_`): U(-x, x) with
/// `x = gain * sqrt(3 / fan)`, the gain [`calculate_gain`]`(nonlinearity, a)` (`a` is the
/// negative slope of a leaky ReLU) and the fan `mode` picks. Rank 2 or more; a tensor with
/// no elements is left as it is, as in PyTorch.
///
/// ```
/// use mantissa::nn::init::{self, FanMode, Nonlinearity};
/// use mantissa::{DType, Device, Generator, Tensor};
/// let w = Tensor::zeros(&[16, 8], DType::F32, Device::Cpu)?;
/// // nn.Linear's own initialisation: a = sqrt(5) gives the bound 1 / sqrt(fan_in).
/// init::kaiming_uniform_(&w, 5f64.sqrt(), FanMode::FanIn, Nonlinearity::LeakyRelu, &mut Generator::new(0))?;
/// assert!(w.to_vec::<f32>()?.iter().all(|v| (v.abs() as f64) <= 1.0 / 8f64.sqrt() + 1e-7));
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn kaiming_uniform_(
    t: &Tensor,
    a: f64,
    mode: FanMode,
    nonlinearity: Nonlinearity,
    gen: &mut Generator,
) -> Result<()> {
    let op = "init::kaiming_uniform_";
    let Some(std) = kaiming_std(op, t, a, mode, nonlinearity)? else {
        return Ok(());
    };
    let bound = 3f64.sqrt() * std;
    uniform_named(op, t, -bound, bound, gen)
}

/// He's normal initialisation (PyTorch's `kaiming_normal_`): N(0, std^2) with
/// `std = gain / sqrt(fan)`, gain and fan as in [`kaiming_uniform_`].
///
/// ```
/// use mantissa::nn::init::{self, FanMode, Nonlinearity};
/// use mantissa::{DType, Device, Generator, Tensor};
/// let w = Tensor::zeros(&[16, 8, 3, 3], DType::F32, Device::Cpu)?;
/// init::kaiming_normal_(&w, 0.0, FanMode::FanOut, Nonlinearity::Relu, &mut Generator::new(0))?;
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn kaiming_normal_(
    t: &Tensor,
    a: f64,
    mode: FanMode,
    nonlinearity: Nonlinearity,
    gen: &mut Generator,
) -> Result<()> {
    let op = "init::kaiming_normal_";
    let Some(std) = kaiming_std(op, t, a, mode, nonlinearity)? else {
        return Ok(());
    };
    normal_named(op, t, std, gen)
}

/// `gain / sqrt(fan)`, or `None` for a tensor with no elements (PyTorch warns and writes
/// nothing, before looking at the fans).
fn kaiming_std(
    op: &'static str,
    t: &Tensor,
    a: f64,
    mode: FanMode,
    nonlinearity: Nonlinearity,
) -> Result<Option<f64>> {
    if t.numel() == 0 {
        return Ok(None);
    }
    let (fan_in, fan_out) = fans(op, t)?;
    let fan = match mode {
        FanMode::FanIn => fan_in,
        FanMode::FanOut => fan_out,
    };
    let gain = calculate_gain(nonlinearity, Some(a)).map_err(|_| {
        Error::invalid(
            op,
            format!("a (the negative slope) {a} is not a finite number"),
        )
    })?;
    Ok(Some(gain / (fan as f64).sqrt()))
}

/// Values from N(mean, std^2) truncated to `[a, b]` (PyTorch's `trunc_normal_`, by the same
/// inverse-CDF method: uniform values between the CDF's values at `a` and `b`, mapped through
/// the normal's inverse CDF and clamped to `[a, b]`). The uniform values come from the
/// generator as f64 on the host, are mapped there, and are copied into `t` in its dtype and
/// device. `std > 0`, `a < b`, all finite.
///
/// ```
/// use mantissa::nn::init;
/// use mantissa::{DType, Device, Generator, Tensor};
/// let w = Tensor::zeros(&[1000], DType::F32, Device::Cpu)?;
/// init::trunc_normal_(&w, 0.0, 1.0, -0.5, 0.5, &mut Generator::new(0))?;
/// assert!(w.to_vec::<f32>()?.iter().all(|v| (-0.5..=0.5).contains(v)));
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn trunc_normal_(
    t: &Tensor,
    mean: f64,
    std: f64,
    a: f64,
    b: f64,
    gen: &mut Generator,
) -> Result<()> {
    let op = "init::trunc_normal_";
    expect_float(op, t)?;
    let finite = [mean, std, a, b].iter().all(|v| v.is_finite());
    if !finite || std <= 0.0 || a >= b {
        return Err(Error::invalid(
            op,
            format!(
                "mean {mean}, std {std}, bounds [{a}, {b}]: need finite values, std > 0 and a < b"
            ),
        ));
    }
    let (lo, hi) = (normal_cdf((a - mean) / std), normal_cdf((b - mean) / std));
    let u = Tensor::rand_with(
        t.shape(),
        0.0,
        1.0,
        crate::DType::F64,
        crate::Device::Cpu,
        gen,
    )?;
    let values: Vec<f64> = u
        .to_vec::<f64>()?
        .into_iter()
        .map(|u| {
            // p strictly inside (0, 1) for the inverse CDF; the clamp below restores [a, b].
            let p = (lo + (hi - lo) * u).clamp(f64::MIN_POSITIVE, 1.0 - f64::EPSILON / 2.0);
            (mean + std * normal_quantile(p)).clamp(a, b)
        })
        .collect();
    let v = Tensor::from_vec(values, t.shape(), crate::Device::Cpu)?
        .to_dtype(t.dtype())?
        .to_device(t.device())?;
    write(t, &v)
}

/// The standard normal's CDF, `erfc(-x / sqrt(2)) / 2`.
fn normal_cdf(x: f64) -> f64 {
    0.5 * libm::erfc(-x / std::f64::consts::SQRT_2)
}

/// The standard normal's inverse CDF for `p` in (0, 1): Acklam's rational approximation
/// (relative error below 1.2e-9) refined by one Halley step on [`normal_cdf`], which brings
/// it to about f64's precision. The upper half is the lower one mirrored, where the CDF
/// (an `erfc` of a positive argument) is accurate to the last bits.
fn normal_quantile(p: f64) -> f64 {
    if p > 0.5 {
        return -normal_quantile(1.0 - p);
    }
    const A: [f64; 6] = [
        -3.969683028665376e1,
        2.209460984245205e2,
        -2.759285104469687e2,
        1.38357751867269e2,
        -3.066479806614716e1,
        2.506628277459239,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e1,
        1.615858368580409e2,
        -1.556989798598866e2,
        6.680131188771972e1,
        -1.328068155288572e1,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-3,
        -3.223964580411365e-1,
        -2.400758277161838,
        -2.549732539343734,
        4.374664141464968,
        2.938163982698783,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-3,
        3.224671290700398e-1,
        2.445134137142996,
        3.754408661907416,
    ];
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    let x = if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    };
    // Halley's step on f(x) = cdf(x) - p, with f' the density.
    let e = normal_cdf(x) - p;
    let u = e * (2.0 * std::f64::consts::PI).sqrt() * (x * x / 2.0).exp();
    x - u / (1.0 + x * u / 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quantile_inverts_the_cdf() {
        for &p in &[1e-300, 1e-10, 0.001, 0.02, 0.3, 0.5, 0.7, 0.98, 0.999_999] {
            let x = normal_quantile(p);
            // Relative to the smaller tail, where the CDF is read.
            let (got, want) = match p > 0.5 {
                true => (normal_cdf(-x), 1.0 - p),
                false => (normal_cdf(x), p),
            };
            assert!((got - want).abs() <= 1e-12 * want, "{p} {x}");
        }
        // Known quantiles of the standard normal.
        assert!((normal_quantile(0.975) - 1.959_963_984_540_054).abs() < 1e-12);
        assert!((normal_quantile(0.5)).abs() < 1e-15);
    }
}
