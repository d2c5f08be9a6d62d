//! M2: the engine's elementwise kernels against the device-to-device copy, in GB/s of the
//! bytes each must move: add, mul and relu forward, and relu's backward (which reads the saved
//! output and the gradient and writes the input's gradient), in f16 and f32, contiguous and
//! channels-last.

use mantissa::*;
use std::time::Instant;

/// Milliseconds per call of `f`: median of 5 timings of 10 calls each, after 3 warm-up calls;
/// the device is synchronised around each timing.
fn time_ms(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let sync = || mantissa::backend::cuda::runtime::runtime(0)?.synchronize();
    for _ in 0..3 {
        f()?;
    }
    let mut times = Vec::new();
    for _ in 0..5 {
        sync()?;
        let t0 = Instant::now();
        for _ in 0..10 {
            f()?;
        }
        sync()?;
        times.push(t0.elapsed().as_secs_f64() * 1e3 / 10.0);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[2])
}

/// One line per dtype and memory format (`quick`: on [2, 8, 12, 12]; else [256, 64, 112,
/// 112], a ResNet-50 stem activation, 205M elements).
pub fn elementwise(d: Device, quick: bool) -> Result<String> {
    let shape: [usize; 4] = if quick {
        [2, 8, 12, 12]
    } else {
        [256, 64, 112, 112]
    };
    let n: usize = shape.iter().product();
    let mut lines = vec![format!("M2 elementwise on {shape:?} (GB/s; % of the copy)")];
    let mut gen = Generator::new(8);
    for dtype in [DType::F16, DType::F32] {
        let plane = (n * dtype.size_in_bytes()) as f64;
        let gbs = |planes: f64, ms: f64| planes * plane / (ms * 1e-3) / 1e9;
        let r = |s: &mut Generator| Tensor::randn_with(&shape, 0.0, 1.0, dtype, d, s);
        let (a, b, g) = (r(&mut gen)?, r(&mut gen)?, r(&mut gen)?);
        let copy = gbs(2.0, time_ms(|| a.copy().map(drop))?);
        for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
            let f = |t: &Tensor| t.to_memory_format(format);
            let (x, y, dy) = (f(&a)?, f(&b)?, f(&g)?);
            let add = gbs(3.0, time_ms(|| x.add(&y).map(drop))?);
            let mul = gbs(3.0, time_ms(|| x.mul(&y).map(drop))?);
            let relu_ms = time_ms(|| x.relu().map(drop))?;
            let xg = x.detach().requires_grad(true)?;
            let both_ms = time_ms(|| {
                xg.relu()?.backward_with(&dy)?;
                xg.zero_grad();
                Ok(())
            })?;
            let (relu, back) = (gbs(2.0, relu_ms), gbs(3.0, (both_ms - relu_ms).max(1e-6)));
            let pct = |v: f64| 100.0 * v / copy;
            lines.push(format!(
                "  {dtype:?} {format:?}: copy {copy:.0}; add {add:.0} ({:.0}%), mul {mul:.0} ({:.0}%), relu {relu:.0} ({:.0}%), relu backward {back:.0} ({:.0}%)",
                pct(add),
                pct(mul),
                pct(relu),
                pct(back)
            ));
        }
    }
    Ok(lines.join("\n"))
}
