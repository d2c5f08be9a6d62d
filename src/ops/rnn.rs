//! The fused LSTM cell.

use super::{dispatch, expect_float, expect_same_dtype, Op};
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
        let hc =
            Tensor::from_storage(s, &[b, 2 * h]).attach("lstm_cell", &[&g, &c], move |d, _| {
                let s = gs.storage().lstm_cell_backward(
                    gs.layout(),
                    &cs.storage(),
                    cs.layout(),
                    &d.storage(),
                    d.layout(),
                )?;
                let all = Tensor::from_storage(s, &[b, 5 * h]);
                Ok(vec![
                    Some(all.narrow(1, 0, 4 * h)?),
                    Some(all.narrow(1, 4 * h, h)?),
                ])
            });
        Ok((hc.narrow(1, 0, h)?, hc.narrow(1, h, h)?))
    }
}
