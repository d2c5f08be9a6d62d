//! Printing a tensor as PyTorch does: nested brackets, one number format for all shown
//! values, and past 1000 elements the first and last three of each long dim with `...`
//! between; then the shape, the dtype, the device when not the CPU, and the op that made it
//! (or `requires_grad=true` for a leaf).

use super::Tensor;
use crate::{DType, Device, Result};
use std::fmt;

/// Past this many elements, long dims are elided.
const SUMMARIZE: usize = 1000;
/// Elements kept at each end of an elided dim.
const EDGE: usize = 3;

/// What is shown of one dim: the indices kept, and where `...` goes (after that many).
struct Shown {
    indices: Vec<usize>,
    gap: Option<usize>,
}

fn shown_dims(shape: &[usize], summarize: bool) -> Vec<Shown> {
    shape
        .iter()
        .map(|&n| match summarize && n > 2 * EDGE {
            true => Shown {
                indices: (0..EDGE).chain(n - EDGE..n).collect(),
                gap: Some(EDGE),
            },
            false => Shown {
                indices: (0..n).collect(),
                gap: None,
            },
        })
        .collect()
}

/// The shown elements, gathered on the tensor's device (a large tensor is never copied
/// whole to the host), as f64 in row-major order over the shown indices.
fn shown_values(t: &Tensor, dims: &[Shown]) -> Result<Vec<f64>> {
    let mut x = t.clone();
    for (d, s) in dims.iter().enumerate() {
        if s.gap.is_some() {
            let idx: Vec<i64> = s.indices.iter().map(|&i| i as i64).collect();
            let n = idx.len();
            let idx = Tensor::from_vec(idx, &[n], t.device())?;
            x = x.index_select(d as isize, &idx)?;
        }
    }
    crate::no_grad(|| x.detach().to_vec_f64())
}

/// How the shown values are written: integers, fixed with 4 decimals, or scientific.
#[derive(Clone, Copy)]
enum Style {
    Int,
    /// Floats that are all whole numbers: `2.`.
    Whole,
    Fixed,
    Sci,
}

fn style(dtype: DType, values: &[f64]) -> Style {
    if !dtype.is_float() {
        return Style::Int;
    }
    let finite: Vec<f64> = values
        .iter()
        .filter(|v| v.is_finite())
        .map(|v| v.abs())
        .collect();
    let nonzero: Vec<f64> = finite.iter().copied().filter(|&v| v > 0.0).collect();
    let max = finite.iter().copied().fold(0.0, f64::max);
    if finite.iter().all(|v| v.fract() == 0.0) && max < 1e8 {
        return Style::Whole;
    }
    let min = nonzero.iter().copied().fold(f64::INFINITY, f64::min);
    match max / min > 1000.0 || max >= 1e8 || min < 1e-4 {
        true => Style::Sci,
        false => Style::Fixed,
    }
}

fn write_value(v: f64, s: Style) -> String {
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf" } else { "-inf" }.into();
    }
    match s {
        Style::Int => format!("{v}"),
        Style::Whole => format!("{v}."),
        Style::Fixed => format!("{v:.4}"),
        Style::Sci => {
            // Rust writes `1.0000e-5`; PyTorch `1.0000e-05`.
            let t = format!("{v:.4e}");
            match t.split_once('e') {
                Some((m, e)) => {
                    let e: i32 = e.parse().unwrap_or(0);
                    let sign = if e < 0 { '-' } else { '+' };
                    format!("{m}e{sign}{:02}", e.abs())
                }
                None => t,
            }
        }
    }
}

/// Lines are wrapped before this many characters, as PyTorch's `linewidth`.
const LINE: usize = 80;

/// Writes the nested brackets of dims `d..` from `cells` (consumed in order, each `width`
/// wide), the innermost rows wrapped at [`LINE`].
fn write_nested(
    out: &mut String,
    dims: &[Shown],
    d: usize,
    cells: &mut impl Iterator<Item = String>,
    (indent, width): (usize, usize),
) {
    out.push('[');
    let last = d + 1 == dims.len();
    let n = dims[d].indices.len();
    let per_line = (LINE.saturating_sub(indent + 2) / (width + 2)).max(1);
    for k in 0..n {
        if k > 0 {
            out.push(',');
            match last {
                true if k % per_line == 0 => {
                    out.push('\n');
                    out.push_str(&" ".repeat(indent + 1));
                }
                true => out.push(' '),
                false => {
                    // One newline between rows, one more per dim above them.
                    out.push_str(&"\n".repeat(dims.len() - d - 1));
                    out.push_str(&" ".repeat(indent + 1));
                }
            }
        }
        if dims[d].gap == Some(k) {
            out.push_str("...,");
            match last {
                true => out.push(' '),
                false => {
                    out.push_str(&"\n".repeat(dims.len() - d - 1));
                    out.push_str(&" ".repeat(indent + 1));
                }
            }
        }
        match last {
            true => out.push_str(&cells.next().unwrap_or_default()),
            false => write_nested(out, dims, d + 1, cells, (indent + 1, width)),
        }
    }
    out.push(']');
}

impl fmt::Display for Tensor {
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![1.5f32, -2.0, 0.25, 4.0], &[2, 2], Device::Cpu)?;
    /// assert_eq!(
    ///     x.to_string(),
    ///     "tensor([[ 1.5000, -2.0000],\n        [ 0.2500,  4.0000]], shape=[2, 2], dtype=F32)"
    /// );
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims = shown_dims(self.shape(), self.numel() > SUMMARIZE);
        let body = match shown_values(self, &dims) {
            Err(e) => format!("<values unreadable: {e}>"),
            Ok(values) => {
                let s = style(self.dtype(), &values);
                let cells: Vec<String> = values.iter().map(|&v| write_value(v, s)).collect();
                let width = cells.iter().map(|c| c.len()).max().unwrap_or(0);
                let mut cells = cells.into_iter().map(|c| format!("{c:>width$}"));
                match self.rank() {
                    0 => cells.next().unwrap_or_default(),
                    _ => {
                        let mut out = String::new();
                        let at = ("tensor(".len(), width);
                        write_nested(&mut out, &dims, 0, &mut cells, at);
                        out
                    }
                }
            }
        };
        write!(
            f,
            "tensor({body}, shape={:?}, dtype={:?}",
            self.shape(),
            self.dtype()
        )?;
        if self.device() != Device::Cpu {
            write!(f, ", device={}", self.device())?;
        }
        match self.op_name() {
            Some(op) => write!(f, ", grad_fn=<{op}>)"),
            None if self.is_requires_grad() => write!(f, ", requires_grad=true)"),
            None => write!(f, ")"),
        }
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
