//! The fused LSTM cell.

use super::{dispatch, expect_float, expect_same_dtype, Op};
use crate::backend::as_cudnn_class;
use crate::backend::CellGrads;
use crate::{Error, Result, Tensor};

impl Tensor {
    /// The pointwise part of an LSTM cell in one op (PyTorch's `_thnn_fused_lstm_cell`):
    /// from the gate pre-activations `gates [B, 4H]` (input, forget, cell and output blocks,
    /// biases already added) and the previous cell state `c [B, H]`, returns `(h, c')` with
    /// `c' = sigmoid(f) c + sigmoid(i) tanh(g)` and `h = sigmoid(o) tanh(c')`. One pass
    /// forward and one backward instead of a dozen elementwise ops; the math runs in f32 for
    /// half inputs. Under autocast it runs in the low dtype, as PyTorch's `lstm_cell` does.
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let gates = Tensor::zeros(&[2, 12], DType::F32, Device::Cpu)?;
    /// let c = Tensor::ones(&[2, 3], DType::F32, Device::Cpu)?;
    /// let (h, c2) = Tensor::lstm_cell(&gates, &c)?;
    /// // All gates at sigmoid(0) = 0.5, tanh(0) = 0: c' = 0.5 c, h = 0.5 tanh(c').
    /// assert_eq!(c2.to_vec::<f32>()?[0], 0.5);
    /// assert!((h.to_vec::<f32>()?[0] - 0.5 * 0.5f32.tanh()).abs() < 1e-7);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn lstm_cell(gates: &Tensor, c: &Tensor) -> Result<(Tensor, Tensor)> {
        let _prof = crate::profiler::op(Op::LstmCell.name());
        let [g, c] = dispatch(Op::LstmCell, [gates, c])?;
        expect_float(Op::LstmCell, &g)?;
        expect_same_dtype(Op::LstmCell, &g, &c)?;
        let fits = g.rank() == 2
            && c.rank() == 2
            && g.shape()[0] == c.shape()[0]
            && g.shape()[1] == 4 * c.shape()[1];
        if !fits {
            return Err(Error::ShapeMismatch {
                op: "lstm_cell (gates [B, 4H] and cell state [B, H])",
                lhs: g.shape().to_vec(),
                rhs: c.shape().to_vec(),
            });
        }
        let (b, h) = (c.shape()[0], c.shape()[1]);
        let s = g
            .storage()
            .lstm_cell(g.layout(), &c.storage(), c.layout())?;
        // Saved detached, so the graph holds no cycle; the activations are recomputed.
        let (gs, cs) = (g.detach(), c.detach());
        let hc = Tensor::from_storage(s, &[b, 2 * h]).attach_saving(
            "lstm_cell",
            &[&g, &c],
            &[&g, &c],
            move |d, _| {
                let (dh, dc) = (d.narrow(1, 0, h)?, d.narrow(1, h, h)?);
                let (sdh, sdc) = (dh.storage(), dc.storage());
                let s = gs.storage().lstm_cell_backward(
                    gs.layout(),
                    &cs.storage(),
                    cs.layout(),
                    CellGrads {
                        dh: (&sdh, dh.layout()),
                        dh2: None,
                        dc: (&sdc, dc.layout()),
                    },
                )?;
                let all = Tensor::from_storage(s, &[b, 5 * h]);
                Ok(vec![
                    Some(all.narrow(1, 0, 4 * h)?),
                    Some(all.narrow(1, 4 * h, h)?),
                ])
            },
        );
        Ok((hc.narrow(1, 0, h)?, hc.narrow(1, h, h)?))
    }
}

/// Row `s` of dim 0, the dim removed (a view).
fn step(t: &Tensor, s: usize) -> Result<Tensor> {
    t.narrow(0, s, 1)?.squeeze(0)
}

/// The checks of [`Tensor::lstm_layer`]: `x [T, B, I]` with `T > 0`, `h0` and `c0` `[B, H]`,
/// `w_ih [4H, I]`, `w_hh [4H, H]`, `bias [4H]`, one float dtype.
fn check_layer(t: &[Tensor; 6]) -> Result<()> {
    let [x, h0, c0, w_ih, w_hh, b] = t;
    for u in t {
        expect_float(Op::LstmLayer, u)?;
        expect_same_dtype(Op::LstmLayer, x, u)?;
    }
    let bad = |what: &'static str, lhs: &Tensor, rhs: &Tensor| {
        Err(Error::ShapeMismatch {
            op: what,
            lhs: lhs.shape().to_vec(),
            rhs: rhs.shape().to_vec(),
        })
    };
    if x.rank() != 3 || x.shape()[0] == 0 {
        return Err(Error::invalid(
            "lstm_layer",
            format!(
                "the input must be [seq, batch, features] with seq > 0, got {:?}",
                x.shape()
            ),
        ));
    }
    let hid = w_hh.shape().get(1).copied().unwrap_or(0);
    if w_hh.rank() != 2 || hid == 0 || w_hh.shape()[0] != 4 * hid {
        return Err(Error::invalid(
            "lstm_layer",
            format!("w_hh must be [4H, H], got {:?}", w_hh.shape()),
        ));
    }
    if w_ih.shape() != [4 * hid, x.shape()[2]] {
        return bad("lstm_layer (input [T, B, I] and w_ih [4H, I])", x, w_ih);
    }
    if b.shape() != [4 * hid] {
        return bad("lstm_layer (w_hh [4H, H] and bias [4H])", w_hh, b);
    }
    let state = [x.shape()[1], hid];
    for s in [h0, c0] {
        if s.shape() != state {
            return bad("lstm_layer (input [T, B, I] and state [B, H])", x, s);
        }
    }
    Ok(())
}

impl Tensor {
    /// One LSTM layer over a whole sequence as one op, as cuDNN's and PyTorch's fused RNNs
    /// do: from the input `x [T, B, I]` and the state `(h0, c0)`, each `[B, H]`, returns the
    /// outputs `y [T, B, H]` and the final `(h, c)`. Weights as in `nn.LSTM`: `w_ih [4H, I]`,
    /// `w_hh [4H, H]` (gates input, forget, cell, output); `bias [4H]` is `b_ih + b_hh`.
    ///
    /// The input projection of all steps is one product of `T B` rows, and so are the
    /// backward pass's input and weight gradients; only the recurrent product and the cell
    /// run per step. Under autocast it runs in the low dtype, as `lstm_cell`.
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let z = |s: &[usize]| Tensor::zeros(s, DType::F32, Device::Cpu);
    /// let x = Tensor::ones(&[5, 2, 3], DType::F32, Device::Cpu)?;
    /// let (y, h, c) = Tensor::lstm_layer(&x, &z(&[2, 4])?, &z(&[2, 4])?, &z(&[16, 3])?, &z(&[16, 4])?, &z(&[16])?)?;
    /// assert_eq!((y.shape(), h.shape(), c.shape()), (&[5, 2, 4][..], &[2, 4][..], &[2, 4][..]));
    /// // All gates at sigmoid(0) = 0.5 and tanh(0) = 0: the state stays zero.
    /// assert!(h.to_vec::<f32>()?.iter().all(|&v| v == 0.0));
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn lstm_layer(
        x: &Tensor,
        h0: &Tensor,
        c0: &Tensor,
        w_ih: &Tensor,
        w_hh: &Tensor,
        bias: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let _prof = crate::profiler::op(Op::LstmLayer.name());
        let inputs = dispatch(Op::LstmLayer, [x, h0, c0, w_ih, w_hh, bias])?;
        check_layer(&inputs)?;
        let [x, h0, c0, w_ih, w_hh, b] = inputs;
        let (steps, batch, hid) = (x.shape()[0], x.shape()[1], w_hh.shape()[1]);
        let x2 = crate::no_grad(|| x.reshape(&[steps * batch, x.shape()[2]]))?;
        // Per step: the saved gate pre-activations, and the h and c it made.
        let (mut gates, mut hs, mut cs) = (vec![], vec![], vec![]);
        // The products follow the cuDNN TF32 switch, as PyTorch's cuDNN LSTM does.
        let all = as_cudnn_class(|| {
            crate::no_grad(|| -> Result<Tensor> {
                // The input projection of every step; each step's recurrent product is then
                // added onto its rows in place (one product with beta = 1, no separate add), and
                // those rows are the step's gate pre-activations.
                let gx = x2.linear(&w_ih, Some(&b))?;
                let whh_t = w_hh.t()?;
                for s in 0..steps {
                    let (h, c) = (hs.last().unwrap_or(&h0), cs.last().unwrap_or(&c0));
                    let g = gx.narrow(0, s * batch, batch)?;
                    let (sh, sw) = (h.storage(), whh_t.storage());
                    gx.0.storage.write(|st| {
                        st.matmul_acc(g.layout(), &sh, h.layout(), &sw, whh_t.layout())
                    })?;
                    let (h, c) = Tensor::lstm_cell(&g, c)?;
                    gates.push(g);
                    hs.push(h);
                    cs.push(c);
                }
                // [h0, h_0 .. h_{T-1}, c_{T-1}]: the op's output is rows 1.., and rows 0..T are
                // the recurrent product's inputs, which the weight gradient reads in place.
                let mut rows: Vec<&Tensor> = vec![&h0];
                rows.extend(&hs);
                rows.push(&cs[steps - 1]);
                Tensor::stack(&rows, 0)
            })
        })?;
        let prev = crate::no_grad(|| all.narrow(0, 0, steps)?.reshape(&[steps * batch, hid]))?;
        let out = crate::no_grad(|| all.narrow(0, 1, steps + 1))?;
        // `x2` (the input as `[T B, I]`, made without a graph) serves the weight gradient.
        let (x_shape, c0s) = (x.shape().to_vec(), c0.detach());
        let (wih, whh) = (w_ih.detach(), w_hh.detach());
        let backward = move |d: &Tensor, needs: &[bool]| -> Result<Vec<Option<Tensor>>> {
            as_cudnn_class(|| -> Result<Vec<Option<Tensor>>> {
                let mut dgs = Vec::with_capacity(steps);
                let mut dh: Option<Tensor> = None;
                let mut dc = step(d, steps)?;
                for s in (0..steps).rev() {
                    // The output's gradient and the next step's recurrent one both flow into h;
                    // the cell kernel adds them and reads every operand in place.
                    let dy = step(d, s)?;
                    let recurrent = dh.take();
                    let c_prev = if s == 0 { &c0s } else { &cs[s - 1] };
                    let g = &gates[s];
                    let (sdy, sdc) = (dy.storage(), dc.storage());
                    let sdh = recurrent.as_ref().map(|v| (v.storage(), v.layout()));
                    let all = g.storage().lstm_cell_backward(
                        g.layout(),
                        &c_prev.storage(),
                        c_prev.layout(),
                        CellGrads {
                            dh: (&sdy, dy.layout()),
                            dh2: sdh.as_ref().map(|(s, l)| (&**s, *l)),
                            dc: (&sdc, dc.layout()),
                        },
                    )?;
                    let all = Tensor::from_storage(all, &[batch, 5 * hid]);
                    let dg = all.narrow(1, 0, 4 * hid)?;
                    dc = all.narrow(1, 4 * hid, hid)?;
                    if s > 0 || needs[1] {
                        dh = Some(dg.matmul(&whh)?);
                    }
                    dgs.push(dg);
                }
                dgs.reverse();
                let dg = Tensor::cat(&dgs.iter().collect::<Vec<_>>(), 0)?;
                let dx = needs[0]
                    .then(|| dg.matmul(&wih)?.reshape(&x_shape))
                    .transpose()?;
                let dw_ih = needs[3].then(|| dg.t()?.matmul(&x2)).transpose()?;
                let dw_hh = needs[4].then(|| dg.t()?.matmul(&prev)).transpose()?;
                let db = needs[5].then(|| dg.sum(&[0], false)).transpose()?;
                Ok(vec![dx, dh, needs[2].then_some(dc), dw_ih, dw_hh, db])
            })
        };
        let inputs = [&x, &h0, &c0, &w_ih, &w_hh, &b];
        let out = out.attach_saving("lstm_layer", &inputs, &inputs[..5], backward);
        Ok((
            out.narrow(0, 0, steps)?,
            step(&out, steps - 1)?,
            step(&out, steps)?,
        ))
    }
}
