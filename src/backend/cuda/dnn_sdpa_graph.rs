//! The operation graphs of `dnn_sdpa.rs` (cuDNN's fused attention), built descriptor by
//! descriptor as cudnn-frontend's composite SDPA node lowers them for a cuDNN 9.0-9.20
//! runtime: the tensors of `[B, H, T, e]` views, the forward and the deterministic backward.

use super::dnn_graph::{pointwise_desc, strided, Attr, Built, Desc, Kind, Plan, Role, Ty};
use super::flash::FaRows;
use crate::{Error, Result};
use cudarc::cudnn::sys;

use sys::cudnnDataType_t as Dt;
use sys::cudnnPointwiseMode_t as Pw;

/// The variant pack's ids of the tensors in memory and the by-value scalars.
pub(super) mod uid {
    pub(in super::super) const Q: i64 = 1;
    pub(in super::super) const K: i64 = 2;
    pub(in super::super) const V: i64 = 3;
    pub(in super::super) const O: i64 = 4;
    pub(in super::super) const STATS: i64 = 5;
    pub(in super::super) const SCALE: i64 = 6;
    pub(in super::super) const DO: i64 = 7;
    pub(in super::super) const DQ: i64 = 8;
    pub(in super::super) const DK: i64 = 9;
    pub(in super::super) const DV: i64 = 10;
    pub(in super::super) const ROW_SUM: i64 = 11;
    pub(in super::super) const ONE: i64 = 12;
    pub(in super::super) const FILL: i64 = 13;
    /// Virtual tensors count up from here.
    pub(in super::super) const VIRTUAL: i64 = 100;
}

/// The `[B, H, T, e]` dims and strides of a view the kernels read as `r` with `rows` rows of
/// `e` (`b` batch entries of `r.h` heads); a dim of one element gets the stride a dense
/// layout would give it, as cuDNN wants a real one there.
pub(super) fn bhte(r: &FaRows, b: usize, rows: usize, e: usize) -> ([i64; 4], [i64; 4]) {
    let dims = [b as i64, r.h, rows as i64, e as i64];
    let mut strides = [r.sb, r.sh, r.st, 1];
    for i in (0..3).rev() {
        if dims[i] == 1 {
            strides[i] = strides[i + 1] * dims[i + 1];
        }
    }
    (dims, strides)
}

/// The same with the last two dims swapped: K^T and V^T over K's and V's memory.
fn transposed((mut dims, mut strides): ([i64; 4], [i64; 4])) -> ([i64; 4], [i64; 4]) {
    dims.swap(2, 3);
    strides.swap(2, 3);
    (dims, strides)
}

/// Dense strides of `dims`.
fn dense(dims: [i64; 4]) -> [i64; 4] {
    [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1]
}

/// An operation graph as it is built: its tensors and other descriptors, then its
/// operations in order (what [`Plan::build`] takes).
pub(super) struct Graph {
    keep: Vec<Desc>,
    ops: Vec<Desc>,
    next: i64,
}

/// A tensor of the graph being built (its index in `keep`).
#[derive(Clone, Copy)]
pub(super) struct T(usize);

impl Graph {
    fn new() -> Graph {
        Graph {
            keep: Vec::new(),
            ops: Vec::new(),
            next: uid::VIRTUAL,
        }
    }

    fn tensor(
        &mut self,
        dt: Dt,
        (dims, strides): ([i64; 4], [i64; 4]),
        id: i64,
        role: Role,
    ) -> Result<T> {
        self.keep.push(strided(dt, &dims, &strides, id, role)?);
        Ok(T(self.keep.len() - 1))
    }

    /// A virtual tensor, densely laid out.
    fn virt(&mut self, dt: Dt, dims: [i64; 4]) -> Result<T> {
        self.virt_laid(dt, (dims, dense(dims)))
    }

    /// A virtual tensor with these dims and strides.
    fn virt_laid(&mut self, dt: Dt, laid: ([i64; 4], [i64; 4])) -> Result<T> {
        self.next += 1;
        let id = self.next;
        self.tensor(dt, laid, id, Role::Virtual)
    }

    /// A by-value f32 scalar.
    fn scalar(&mut self, id: i64) -> Result<T> {
        self.tensor(Dt::CUDNN_DATA_FLOAT, ([1; 4], [1; 4]), id, Role::ByValue)
    }

    /// Finalizes operation `op` (`what` names it in a refusal) and appends it.
    fn op(&mut self, op: Desc, what: &str) -> Result<()> {
        op.finalize().map_err(|s| Error::CudaLibrary {
            lib: "cuDNN",
            msg: format!("attention graph: {what}: {s:?}"),
        })?;
        self.ops.push(op);
        Ok(())
    }

    /// A pointwise operation `y = mode(x, b, t)`, computed in `prec`; `axis` for GEN_INDEX.
    fn pointwise(
        &mut self,
        mode: Pw,
        [x, b, t]: [Option<T>; 3],
        y: T,
        prec: Dt,
        axis: Option<i64>,
    ) -> Result<()> {
        let pw = pointwise_desc(mode, prec, axis)?;
        let op = Desc::new(Kind::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
        op.descs(Attr::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&pw])?;
        let slots = [
            (x, Attr::CUDNN_ATTR_OPERATION_POINTWISE_XDESC),
            (b, Attr::CUDNN_ATTR_OPERATION_POINTWISE_BDESC),
            (t, Attr::CUDNN_ATTR_OPERATION_POINTWISE_TDESC),
            (Some(y), Attr::CUDNN_ATTR_OPERATION_POINTWISE_YDESC),
        ];
        for (tensor, name) in slots {
            if let Some(T(i)) = tensor {
                op.descs(name, &[&self.keep[i]])?;
            }
        }
        op.float(Attr::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, 1.0)?;
        op.float(Attr::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, 1.0)?;
        self.keep.push(pw);
        self.op(op, &format!("pointwise {mode:?}"))
    }

    /// `y = mode(x, b)` in f32.
    fn binary(&mut self, mode: Pw, x: T, b: T, y: T) -> Result<()> {
        self.pointwise(
            mode,
            [Some(x), Some(b), None],
            y,
            Dt::CUDNN_DATA_FLOAT,
            None,
        )
    }

    /// `y = mode(x)` in f32.
    fn unary(&mut self, mode: Pw, x: T, y: T) -> Result<()> {
        self.pointwise(mode, [Some(x), None, None], y, Dt::CUDNN_DATA_FLOAT, None)
    }

    /// `c = a b` over the last two dims, f32 accumulation.
    fn matmul(&mut self, a: T, b: T, c: T) -> Result<()> {
        let mm = Desc::new(Kind::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
        mm.enumerated(
            Attr::CUDNN_ATTR_MATMUL_COMP_TYPE,
            Ty::CUDNN_TYPE_DATA_TYPE,
            Dt::CUDNN_DATA_FLOAT,
        )?;
        mm.finalize().map_err(|s| Error::CudaLibrary {
            lib: "cuDNN",
            msg: format!("attention graph: the matmul descriptor: {s:?}"),
        })?;
        let op = Desc::new(Kind::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
        op.descs(Attr::CUDNN_ATTR_OPERATION_MATMUL_ADESC, &[&self.keep[a.0]])?;
        op.descs(Attr::CUDNN_ATTR_OPERATION_MATMUL_BDESC, &[&self.keep[b.0]])?;
        op.descs(Attr::CUDNN_ATTR_OPERATION_MATMUL_CDESC, &[&self.keep[c.0]])?;
        op.descs(Attr::CUDNN_ATTR_OPERATION_MATMUL_DESC, &[&mm])?;
        self.keep.push(mm);
        self.op(op, "matmul")
    }

    /// `y = x` reduced (sum or max) over the dims where `y` has one element.
    fn reduce(&mut self, max: bool, x: T, y: T) -> Result<()> {
        let red = Desc::new(Kind::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
        let op_ty = if max {
            sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_MAX
        } else {
            sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD
        };
        red.enumerated(
            Attr::CUDNN_ATTR_REDUCTION_OPERATOR,
            Ty::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE,
            op_ty,
        )?;
        red.enumerated(
            Attr::CUDNN_ATTR_REDUCTION_COMP_TYPE,
            Ty::CUDNN_TYPE_DATA_TYPE,
            Dt::CUDNN_DATA_FLOAT,
        )?;
        red.finalize().map_err(|s| Error::CudaLibrary {
            lib: "cuDNN",
            msg: format!("attention graph: the reduction descriptor: {s:?}"),
        })?;
        let op = Desc::new(Kind::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
        op.descs(
            Attr::CUDNN_ATTR_OPERATION_REDUCTION_XDESC,
            &[&self.keep[x.0]],
        )?;
        op.descs(
            Attr::CUDNN_ATTR_OPERATION_REDUCTION_YDESC,
            &[&self.keep[y.0]],
        )?;
        op.descs(Attr::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &[&red])?;
        self.keep.push(red);
        self.op(op, "reduction")
    }

    /// `y`, x's memory through y's dims and strides (a transpose, a change of type).
    fn reshape(&mut self, x: T, y: T) -> Result<()> {
        let op = Desc::new(Kind::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
        op.descs(Attr::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, &[&self.keep[x.0]])?;
        op.descs(Attr::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, &[&self.keep[y.0]])?;
        self.op(op, "reshape")
    }

    /// The top-left causal mask of scores `s` (`[B, H, L, S]`): query i keeps keys 0..=i,
    /// the others take the by-value fill.
    fn causal(&mut self, s: T, dims: [i64; 4]) -> Result<T> {
        let (row, col) = (
            self.virt(Dt::CUDNN_DATA_INT32, dims)?,
            self.virt(Dt::CUDNN_DATA_INT32, dims)?,
        );
        let f32 = Dt::CUDNN_DATA_FLOAT;
        self.pointwise(
            Pw::CUDNN_POINTWISE_GEN_INDEX,
            [Some(s), None, None],
            row,
            f32,
            Some(2),
        )?;
        self.pointwise(
            Pw::CUDNN_POINTWISE_GEN_INDEX,
            [Some(s), None, None],
            col,
            f32,
            Some(3),
        )?;
        let keep = self.virt(Dt::CUDNN_DATA_BOOLEAN, dims)?;
        let boolean = Dt::CUDNN_DATA_BOOLEAN;
        self.pointwise(
            Pw::CUDNN_POINTWISE_CMP_GE,
            [Some(row), Some(col), None],
            keep,
            boolean,
            None,
        )?;
        let fill = self.scalar(uid::FILL)?;
        let masked = self.virt(f32, dims)?;
        let ops = [Some(s), Some(fill), Some(keep)];
        self.pointwise(Pw::CUDNN_POINTWISE_BINARY_SELECT, ops, masked, f32, None)?;
        Ok(masked)
    }

    /// The plan of the graph on handle `h`; declined where cuDNN refused any part of it.
    pub(super) fn plan(self, h: sys::cudnnHandle_t, deterministic: bool) -> Result<Built> {
        let ops = self.ops.len();
        let mut descs = self.keep;
        descs.extend(self.ops);
        Plan::build(h, descs, ops, deterministic)
    }
}

/// The forward graph for the views `q`, `k`, `v` and the output `o`.
pub(super) fn forward_graph(
    dt: Dt,
    [b, h, l, s, e]: [usize; 5],
    [q, k, v, o]: [&FaRows; 4],
    causal: bool,
) -> Result<Graph> {
    let mut g = Graph::new();
    let f32 = Dt::CUDNN_DATA_FLOAT;
    let (qt, kt) = (
        g.tensor(dt, bhte(q, b, l, e), uid::Q, Role::Memory)?,
        g.tensor(dt, transposed(bhte(k, b, s, e)), uid::K, Role::Memory)?,
    );
    let scores = [b, h, l, s].map(|x| x as i64);
    let rows = [b as i64, h as i64, l as i64, 1];
    let raw = g.virt(f32, scores)?;
    g.matmul(qt, kt, raw)?;
    let scale = g.scalar(uid::SCALE)?;
    let mut sc = g.virt(f32, scores)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, raw, scale, sc)?;
    if causal {
        sc = g.causal(sc, scores)?;
    }
    let max = g.virt(f32, rows)?;
    g.reduce(true, sc, max)?;
    let shifted = g.virt(f32, scores)?;
    g.binary(Pw::CUDNN_POINTWISE_SUB, sc, max, shifted)?;
    let ex = g.virt(f32, scores)?;
    g.unary(Pw::CUDNN_POINTWISE_EXP, shifted, ex)?;
    let sum = g.virt(f32, rows)?;
    g.reduce(false, ex, sum)?;
    let log = g.virt(f32, rows)?;
    g.unary(Pw::CUDNN_POINTWISE_LOG, sum, log)?;
    let stats = g.tensor(f32, (rows, dense(rows)), uid::STATS, Role::Memory)?;
    g.binary(Pw::CUDNN_POINTWISE_ADD, max, log, stats)?;
    let p = g.virt(dt, scores)?;
    g.binary(Pw::CUDNN_POINTWISE_DIV, ex, sum, p)?;
    let vt = g.tensor(dt, bhte(v, b, s, e), uid::V, Role::Memory)?;
    let ot = g.tensor(dt, bhte(o, b, l, e), uid::O, Role::Memory)?;
    g.matmul(p, vt, ot)?;
    Ok(g)
}

/// The backward graph for the views `q`, `k`, `v`, `o`, `dout` and the gradients written.
pub(super) fn backward_graph(
    dt: Dt,
    [b, h, l, s, e]: [usize; 5],
    views: [&FaRows; 8],
    causal: bool,
) -> Result<Graph> {
    let [q, k, v, o, dout, dq, dk, dv] = views;
    let mut g = Graph::new();
    let f32 = Dt::CUDNN_DATA_FLOAT;
    let qt = g.tensor(dt, bhte(q, b, l, e), uid::Q, Role::Memory)?;
    let kt = g.tensor(dt, transposed(bhte(k, b, s, e)), uid::K, Role::Memory)?;
    let vt = g.tensor(dt, transposed(bhte(v, b, s, e)), uid::V, Role::Memory)?;
    let ot = g.tensor(dt, bhte(o, b, l, e), uid::O, Role::Memory)?;
    let gt = g.tensor(dt, bhte(dout, b, l, e), uid::DO, Role::Memory)?;
    let rows = [b as i64, h as i64, l as i64, 1];
    let stats = g.tensor(f32, (rows, dense(rows)), uid::STATS, Role::Memory)?;
    let (scale, one) = (g.scalar(uid::SCALE)?, g.scalar(uid::ONE)?);
    // rowsum(dO O), into memory of ours.
    let prod = g.virt(f32, [b, h, l, e].map(|x| x as i64))?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, gt, ot, prod)?;
    let summed = g.virt(f32, rows)?;
    g.reduce(false, prod, summed)?;
    let row_sum = g.tensor(f32, (rows, dense(rows)), uid::ROW_SUM, Role::Memory)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, summed, one, row_sum)?;
    // P = exp(S scale - Stats), masked.
    let scores = [b, h, l, s].map(|x| x as i64);
    let raw = g.virt(f32, scores)?;
    g.matmul(qt, kt, raw)?;
    let sc = g.virt(f32, scores)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, raw, scale, sc)?;
    let mut shifted = g.virt(f32, scores)?;
    g.binary(Pw::CUDNN_POINTWISE_SUB, sc, stats, shifted)?;
    if causal {
        shifted = g.causal(shifted, scores)?;
    }
    let p = g.virt(f32, scores)?;
    g.unary(Pw::CUDNN_POINTWISE_EXP, shifted, p)?;
    // P^T and dS^T: [B, H, S, L] over the scores' memory, in the I/O type.
    let t_dims = [b, h, s, l].map(|x| x as i64);
    let t_strides = [(h * l * s) as i64, (l * s) as i64, 1, s as i64];
    let pt = g.virt_laid(dt, (t_dims, t_strides))?;
    g.reshape(p, pt)?;
    let dvt = g.tensor(dt, bhte(dv, b, s, e), uid::DV, Role::Memory)?;
    g.matmul(pt, gt, dvt)?;
    let dp = g.virt(f32, scores)?;
    g.matmul(gt, vt, dp)?;
    let centred = g.virt(f32, scores)?;
    g.binary(Pw::CUDNN_POINTWISE_SUB, dp, row_sum, centred)?;
    let weighted = g.virt(f32, scores)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, centred, p, weighted)?;
    let ds = g.virt(f32, scores)?;
    g.binary(Pw::CUDNN_POINTWISE_MUL, weighted, scale, ds)?;
    let dst = g.virt_laid(dt, (t_dims, t_strides))?;
    g.reshape(ds, dst)?;
    let dkt = g.tensor(dt, bhte(dk, b, s, e), uid::DK, Role::Memory)?;
    g.matmul(dst, qt, dkt)?;
    // K again from K^T (f32, K's strides), for dQ = dS K.
    let k_again = g.virt_laid(f32, bhte(k, b, s, e))?;
    g.reshape(kt, k_again)?;
    let dqt = g.tensor(dt, bhte(dq, b, l, e), uid::DQ, Role::Memory)?;
    g.matmul(ds, k_again, dqt)?;
    Ok(g)
}
