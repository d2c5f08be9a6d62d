//! Launchers for `cuda/rnn.cu`: the fused LSTM cell, forward and backward. Dense gates are
//! read at their offset and `[B, H]` operands with unit-stride rows in place (a step of a
//! sequence, a slice of `[h | c']`); others are copied first.

use super::kernels::KernelFile;
use super::profile::elems;
use super::storage::same_dtype as same;
use super::storage::{float_kname, grid, CudaStorage, Dense};
use crate::backend::CellGrads;
use crate::layout::Layout;
use crate::{Error, Result};
use cudarc::driver::{sys, PushKernelArg};

/// The gates' address: the view itself when it is dense (a step of a sequence's gates, at
/// an offset), else a dense copy.
fn gates(g: &CudaStorage, l: &Layout) -> Result<(Option<CudaStorage>, sys::CUdeviceptr)> {
    if l.is_contiguous() {
        return Ok((None, g.ptr_at(l.offset())));
    }
    let d = g.copy_strided(l)?;
    let p = d.ptr();
    Ok((Some(d), p))
}

/// `[h | c']` `[B, 2H]` from gates `[B, 4H]` and the cell state `[B, H]`.
pub(crate) fn lstm_cell(
    g: &CudaStorage,
    lg: &Layout,
    c: &CudaStorage,
    lc: &Layout,
) -> Result<CudaStorage> {
    same("lstm_cell", g, c)?;
    let t = float_kname("lstm_cell", g.dtype())?;
    let (batch, h) = (lc.shape()[0], lc.shape()[1]);
    let (_g, gp) = gates(g, lg)?;
    let (_c, cp, sc) = rows(g, (c, lc))?;
    let out = CudaStorage::alloc_on(g.rt(), g.dtype(), batch * 2 * h)?;
    let (op, b64, h64) = (out.ptr(), batch as i64, h as i64);
    let name = kname!("lstm_cell_", t);
    // The four gates and c in, h and c out, per batch row.
    let bytes = elems(batch * 7 * h, g.dtype());
    launch!(
        bytes = bytes;
        g,
        KernelFile::Rnn,
        name,
        grid(batch * h),
        &gp,
        &cp,
        &sc,
        &op,
        &b64,
        &h64
    );
    Ok(out)
}

/// A `[B, H]` operand's address and row stride: the view itself when its rows are unit
/// stride, else a dense copy (kept alive by the returned [`Dense`]).
fn rows<'a>(
    g: &CudaStorage,
    (s, l): (&'a CudaStorage, &Layout),
) -> Result<(Dense<'a>, sys::CUdeviceptr, i64)> {
    same("lstm_cell", g, s)?;
    let (shape, st) = (l.shape(), l.strides());
    if shape.len() == 2 && (st[1] == 1 || shape[1] <= 1) {
        return Ok((Dense::Borrowed(s), s.ptr_at(l.offset()), st[0] as i64));
    }
    let d = s.contiguous(l)?;
    let p = d.ptr();
    Ok((d, p, *shape.last().unwrap_or(&1) as i64))
}

/// `[d gates | d c]` `[B, 5H]` from the gradients of `h` (one, or two that are added) and
/// of `c'`, each read in place with its row stride.
pub(crate) fn lstm_cell_backward(
    g: &CudaStorage,
    lg: &Layout,
    c: &CudaStorage,
    lc: &Layout,
    d: CellGrads<'_, CudaStorage>,
) -> Result<CudaStorage> {
    let t = float_kname("lstm_cell backward", g.dtype())?;
    let (batch, h) = (lc.shape()[0], lc.shape()[1]);
    let (_g, gp) = gates(g, lg)?;
    let (_c, cp, sc) = rows(g, (c, lc))?;
    let (_dh, dhp, sdh) = rows(g, d.dh)?;
    let (_dc, dcp, sdc) = rows(g, d.dc)?;
    let dh2 = d.dh2.map(|x| rows(g, x)).transpose()?;
    let (dh2p, sdh2) = dh2.as_ref().map_or((0, 0), |(_, p, s)| (*p, *s));
    let out = CudaStorage::alloc_on(g.rt(), g.dtype(), batch * 5 * h)?;
    let op = out.ptr();
    let (b64, h64) = (batch as i64, h as i64);
    let name = kname!("lstm_cell_backward_", t);
    // The gates, c, dh, dc (and a second dh) in, the five gradient planes out.
    let planes = 7 + usize::from(dh2p != 0) + 5;
    let bytes = elems(batch * planes * h, g.dtype());
    launch!(
        bytes = bytes;
        g,
        KernelFile::Rnn,
        name,
        grid(batch * h),
        &gp,
        &cp,
        &sc,
        &dhp,
        &sdh,
        &dh2p,
        &sdh2,
        &dcp,
        &sdc,
        &op,
        &b64,
        &h64
    );
    Ok(out)
}
