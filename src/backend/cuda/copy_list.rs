//! Many copies in one launch (`copy_list_*` in `cuda/cast.cu`): `cat` writes each input into
//! its place in the output, and an input and its place that both walk as rows of unit-stride
//! elements (any dense tensor, a narrowed part of one, a column block) go into lists of up to
//! [`LIST`] per launch instead of a launch each. Others take [`CudaStorage::copy_into`].

use super::kernels::KernelFile;
use super::profile::elems;
use super::storage::{rows_grid, CudaStorage};
use crate::layout::Layout;
use crate::{Error, Result};
use cudarc::driver::{DeviceRepr, PushKernelArg};

/// Copies per launch (`COPY_LIST`).
pub(crate) const LIST: usize = 64;
/// Elements per block-sized chunk of a copy (`COPY_CHUNK`).
pub(crate) const CHUNK: usize = 8192;

/// `cuda/cast.cu`'s `CopyList`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct CopyList {
    count: i64,
    chunks: i64,
    src: [u64; LIST],
    dst: [u64; LIST],
    rows: [i64; LIST],
    cols: [i64; LIST],
    sld: [i64; LIST],
    dld: [i64; LIST],
    start: [i64; LIST],
}

// SAFETY: plain old data with the C layout the kernel declares.
unsafe impl DeviceRepr for CopyList {}

// The copy kernels take the list alone: within a launch's 4,096 bytes of parameters.
const _: () = assert!(std::mem::size_of::<CopyList>() <= 4096);

/// One copy: `rows x cols` elements from `src` (row stride `sld`) to `dst` (row stride
/// `dld`), addresses of the first element.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Copy2d {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) sld: usize,
    pub(crate) dld: usize,
}

/// The copies in lists of at most [`LIST`], in order.
pub(crate) fn lists(copies: &[Copy2d]) -> Vec<CopyList> {
    copies
        .chunks(LIST)
        .map(|part| {
            let mut l = CopyList {
                count: part.len() as i64,
                chunks: 0,
                src: [0; LIST],
                dst: [0; LIST],
                rows: [0; LIST],
                cols: [0; LIST],
                sld: [0; LIST],
                dld: [0; LIST],
                start: [0; LIST],
            };
            for (k, c) in part.iter().enumerate() {
                (l.src[k], l.dst[k]) = (c.src, c.dst);
                (l.rows[k], l.cols[k]) = (c.rows as i64, c.cols as i64);
                (l.sld[k], l.dld[k], l.start[k]) = (c.sld as i64, c.dld as i64, l.chunks);
                l.chunks += (c.rows * c.cols).div_ceil(CHUNK) as i64;
            }
            l
        })
        .collect()
}

/// The walk of two views of one shape as `(rows, cols, source row stride, destination row
/// stride)` with unit-stride columns, when there is one: dims of size 1 are dropped and a dim
/// merges into the one inside it where both views allow. The destination's rows must not
/// overlap.
pub(crate) fn as_rows(src: &Layout, dst: &Layout) -> Option<(usize, usize, usize, usize)> {
    // (size, source stride, destination stride), innermost first, merged.
    let mut dims: Vec<(usize, usize, usize)> = Vec::new();
    let walk = src.shape().iter().zip(src.strides()).zip(dst.strides());
    for ((&n, &ss), &ds) in walk.rev().filter(|((&n, _), _)| n != 1) {
        match dims.last_mut() {
            Some(d) if ss == d.1 * d.0 && ds == d.2 * d.0 => d.0 *= n,
            _ => dims.push((n, ss, ds)),
        }
    }
    match dims[..] {
        [] => Some((1, 1, 1, 1)),
        [(cols, 1, 1)] => Some((1, cols, cols, cols)),
        [(cols, 1, 1), (rows, sld, dld)] if dld >= cols => Some((rows, cols, sld, dld)),
        _ => None,
    }
}

/// Runs `copies` (all of elements `width` bytes wide) in one launch per list; `s` names the
/// device.
pub(super) fn run(s: &CudaStorage, width: usize, copies: &[Copy2d]) -> Result<()> {
    let name = match width {
        1 => "copy_list_u8",
        2 => "copy_list_u16",
        4 => "copy_list_u32",
        8 => "copy_list_u64",
        _ => {
            return Err(Error::invalid(
                "cat",
                format!("no copy kernel for {width}-byte elements"),
            ))
        }
    };
    for (list, part) in lists(copies).iter().zip(copies.chunks(LIST)) {
        let n: usize = part.iter().map(|c| c.rows * c.cols).sum();
        // A block of 256 threads per chunk (the kernel strides past 65,535).
        let cfg = rows_grid(list.chunks as usize);
        let bytes = 2 * elems(n, s.dtype());
        launch!(bytes = bytes; s, KernelFile::Cast, name, cfg, list);
    }
    Ok(())
}

impl CudaStorage {
    /// Writes each `src` (viewed by its layout) into the view `dl` of this storage, the views
    /// not overlapping one another: same-dtype parts that walk as rows in lists (one launch
    /// per [`LIST`]), the others one at a time.
    pub(crate) fn copy_many_into(
        &mut self,
        parts: &[(&Layout, &CudaStorage, &Layout)],
    ) -> Result<()> {
        let mut copies = Vec::new();
        for &(dl, src, sl) in parts {
            let walk = (src.dtype() == self.dtype() && dl.numel() > 0)
                .then(|| as_rows(sl, dl))
                .flatten();
            match walk {
                Some((rows, cols, sld, dld)) => copies.push(Copy2d {
                    src: src.ptr_at(sl.offset()),
                    dst: self.ptr_at(dl.offset()),
                    rows,
                    cols,
                    sld,
                    dld,
                }),
                None => self.copy_into(dl, src, sl)?,
            }
        }
        run(self, self.dtype().size_in_bytes(), &copies)
    }
}
