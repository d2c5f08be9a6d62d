//! The fused LSTM cell: the [`RnnOps`] family and its dispatch.

use super::{on_backend, Backend, BackendStorage, CellGrads, Storage};
use crate::layout::Layout;
use crate::Result;

/// The fused LSTM cell's forward and backward.
pub(crate) trait RnnOps: BackendStorage {
    /// `[h | c']` `[B, 2H]` from gates `[B, 4H]` (`self`) and the cell state `c` `[B, H]`.
    fn lstm_cell(&self, lg: &Layout, c: &Self, lc: &Layout) -> Result<Self>;
    /// `[d gates | d c]` `[B, 5H]` from the gradients of `h` and `c'`.
    fn lstm_cell_backward(
        &self,
        lg: &Layout,
        c: &Self,
        lc: &Layout,
        d: CellGrads<'_, Self>,
    ) -> Result<Self>;
}

impl Storage {
    /// See [`RnnOps::lstm_cell`].
    pub(crate) fn lstm_cell(&self, lg: &Layout, c: &Storage, lc: &Layout) -> Result<Storage> {
        on_backend!("lstm_cell", [self, c], B => {
            Ok(B::part(self).lstm_cell(lg, B::part(c), lc)?.wrap())
        })
    }

    /// See [`RnnOps::lstm_cell_backward`].
    pub(crate) fn lstm_cell_backward(
        &self,
        lg: &Layout,
        c: &Storage,
        lc: &Layout,
        d: CellGrads<'_, Storage>,
    ) -> Result<Storage> {
        let mut all = vec![self, c, d.dh.0, d.dc.0];
        all.extend(d.dh2.map(|x| x.0));
        let device = super::common_device("lstm_cell backward", &all)?;
        super::on_device!(device, B => {
            let d = d.map(B::part);
            Ok(B::part(self).lstm_cell_backward(lg, B::part(c), lc, d)?.wrap())
        })
    }
}
