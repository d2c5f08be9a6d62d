//! Printing a tensor as PyTorch does (`torch/_tensor_str.py`, default print options): nested
//! brackets, one number format and width for all shown values, long rows wrapped at 80
//! columns, and past 1000 elements the first and last three of each long dim with `...`
//! between; then the shape, the dtype, the device when not the CPU, and the op that made it
//! (or `requires_grad=true` for a leaf).

use super::Tensor;
use crate::{DType, Device, Result};
use std::fmt;

/// Past this many elements, long dims are elided (PyTorch's `threshold`).
const SUMMARIZE: usize = 1000;
/// Elements kept at each end of an elided dim (PyTorch's `edgeitems`).
const EDGE: usize = 3;
/// Rows of numbers are wrapped to fit this many columns (PyTorch's `linewidth`).
const LINE: usize = 80;
/// Digits after the point in the fixed and scientific forms (PyTorch's `precision`).
const PRECISION: usize = 4;
/// The value part starts after `tensor(`, so nested lines are indented by this much.
const PREFIX: usize = "tensor(".len();

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
/// whole to the host), in row-major order over the shown indices: floats (f16 and bf16
/// widened, as PyTorch prints half from float) as f64 numbers, integers as their decimal
/// text, read as stored so that an i64 past 2^53 is exact.
fn shown_values(t: &Tensor, dims: &[Shown]) -> Result<Values> {
    let mut x = t.clone();
    for (d, s) in dims.iter().enumerate() {
        if s.gap.is_some() {
            let idx: Vec<i64> = s.indices.iter().map(|&i| i as i64).collect();
            let n = idx.len();
            let idx = Tensor::from_vec(idx, &[n], t.device())?;
            x = x.index_select(d as isize, &idx)?;
        }
    }
    crate::no_grad(|| {
        let x = x.detach();
        Ok(match x.dtype() {
            DType::I64 => Values::Int(x.to_vec::<i64>()?.iter().map(i64::to_string).collect()),
            DType::U8 => Values::Int(x.to_vec::<u8>()?.iter().map(u8::to_string).collect()),
            _ => Values::Float(x.to_vec_f64()?),
        })
    })
}

enum Values {
    Float(Vec<f64>),
    Int(Vec<String>),
}

/// How floats are written, chosen from the nonzero finite shown values as PyTorch's
/// `_Formatter` chooses.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    /// All are whole numbers: `2.` (also when there is no nonzero finite value).
    Whole,
    /// Four decimals: `2.5000`.
    Fixed,
    /// Four decimals of a mantissa and a signed exponent of two digits or more: `2.5000e-05`.
    Sci,
}

/// The float format and the width every cell is right-aligned to.
struct Formatter {
    mode: Mode,
    width: usize,
}

impl Formatter {
    /// Zeros (either sign), NaN and infinities neither choose the mode nor set the width; a
    /// value wider than the width is written unpadded. The largest and smallest magnitudes
    /// more than 1000 apart, or the largest past 1e8, switch to scientific form; for values
    /// that are not all whole numbers, so does the smallest below 1e-4.
    fn new(values: &[f64]) -> Formatter {
        let nonzero: Vec<f64> = values
            .iter()
            .copied()
            .filter(|v| v.is_finite() && *v != 0.0)
            .collect();
        if nonzero.is_empty() {
            return Formatter {
                mode: Mode::Whole,
                width: 1,
            };
        }
        let max = nonzero.iter().fold(0.0, |m: f64, v| m.max(v.abs()));
        let min = nonzero
            .iter()
            .fold(f64::INFINITY, |m: f64, v| m.min(v.abs()));
        let whole = nonzero.iter().all(|v| *v == v.ceil());
        let sci = max / min > 1000.0 || max > 1e8 || (!whole && min < 1e-4);
        let mode = match (sci, whole) {
            (true, _) => Mode::Sci,
            (false, true) => Mode::Whole,
            (false, false) => Mode::Fixed,
        };
        let f = Formatter { mode, width: 1 };
        let width = nonzero.iter().map(|&v| f.text(v).len()).max().unwrap_or(1);
        Formatter {
            mode,
            width: width.max(1),
        }
    }

    /// `v` in this format, unpadded; NaN and infinities as `nan`, `inf`, `-inf`.
    fn text(&self, v: f64) -> String {
        if v.is_nan() {
            return "nan".into();
        }
        if v.is_infinite() {
            return if v > 0.0 { "inf" } else { "-inf" }.into();
        }
        match self.mode {
            Mode::Whole => format!("{v:.0}."),
            Mode::Fixed => format!("{v:.PRECISION$}"),
            Mode::Sci => {
                // Rust writes `1.0000e-5`; PyTorch (Python's `e` format) `1.0000e-05`.
                let t = format!("{v:.PRECISION$e}");
                match t.split_once('e') {
                    Some((m, e)) => {
                        let e: i32 = e.parse().unwrap_or(0);
                        let sign = if e < 0 { '-' } else { '+' };
                        format!("{m}e{sign}{:02}", e.unsigned_abs())
                    }
                    None => t,
                }
            }
        }
    }
}

/// Right-aligns every cell to the widest, as PyTorch pads to its formatter's width (for
/// integers the widest of all shown values).
fn pad(cells: Vec<String>, width: usize) -> Vec<String> {
    cells.into_iter().map(|c| format!("{c:>width$}")).collect()
}

/// Writes dims `d..` of the shown cells (consumed in order, all one `width`) in nested
/// brackets, `indent` columns in, as PyTorch's `_tensor_str_with_formatter`.
fn nested(
    dims: &[Shown],
    d: usize,
    cells: &mut impl Iterator<Item = String>,
    (indent, width): (usize, usize),
) -> String {
    let n = dims[d].indices.len();
    let mut parts: Vec<String> = Vec::with_capacity(n + 1);
    if d + 1 == dims.len() {
        // A row: as many cells (and the `...` cell, which counts as one) per line as fit in
        // the line width after the indent, each taking its width and `, `.
        for k in 0..n {
            if dims[d].gap == Some(k) {
                parts.push(" ...".into());
            }
            parts.push(cells.next().unwrap_or_default());
        }
        let per_line = (LINE.saturating_sub(indent) / (width + 2)).max(1);
        let lines: Vec<String> = parts.chunks(per_line).map(|l| l.join(", ")).collect();
        return format!(
            "[{}]",
            lines.join(&format!(",\n{}", " ".repeat(indent + 1)))
        );
    }
    for k in 0..n {
        if dims[d].gap == Some(k) {
            parts.push("...".into());
        }
        parts.push(nested(dims, d + 1, cells, (indent + 1, width)));
    }
    // One newline between rows, one more per dim below them.
    let sep = format!(
        ",{}{}",
        "\n".repeat(dims.len() - d - 1),
        " ".repeat(indent + 1)
    );
    format!("[{}]", parts.join(&sep))
}

/// The value part of the printed tensor, between `tensor(` and the shape.
fn values_text(t: &Tensor) -> Result<String> {
    if t.numel() == 0 {
        return Ok("[]".into());
    }
    let dims = shown_dims(t.shape(), t.numel() > SUMMARIZE);
    let (cells, width) = match shown_values(t, &dims)? {
        Values::Int(cells) => {
            let width = cells.iter().map(String::len).max().unwrap_or(1);
            (pad(cells, width), width)
        }
        Values::Float(values) => {
            let f = Formatter::new(&values);
            let cells = values.iter().map(|&v| f.text(v)).collect();
            (pad(cells, f.width), f.width)
        }
    };
    let mut cells = cells.into_iter();
    Ok(match t.rank() {
        0 => cells.next().unwrap_or_default(),
        _ => nested(&dims, 0, &mut cells, (PREFIX, width)),
    })
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
        let body = values_text(self).unwrap_or_else(|e| format!("<values unreadable: {e}>"));
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
