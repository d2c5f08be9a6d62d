//! Elementwise ops: the [`ElementwiseOps`] family and its dispatch.

use super::ops::{BinaryOp, CmpOp, UnaryOp};
use super::{on_backend, Backend, BackendStorage, Storage};
use crate::layout::Layout;
use crate::Result;

/// Elementwise maps over one, two or three operands (broadcast views of one shape).
pub(crate) trait ElementwiseOps: BackendStorage {
    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self>;
    /// `g * op'(x)` with `self` as `x`.
    fn unary_grad(&self, l: &Layout, g: &Self, lg: &Layout, op: UnaryOp) -> Result<Self>;
    fn binary(&self, l: &Layout, rhs: &Self, lr: &Layout, op: BinaryOp) -> Result<Self>;
    /// A U8 mask of `op` on each pair.
    fn cmp(&self, l: &Layout, rhs: &Self, lr: &Layout, op: CmpOp) -> Result<Self>;
    /// `a` where `self` (a U8 mask) is nonzero, else `b`.
    fn where_cond(&self, l: &Layout, a: &Self, la: &Layout, b: &Self, lb: &Layout) -> Result<Self>;
}

impl Storage {
    pub(crate) fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Storage> {
        on_backend!(op.name(), [self], B => Ok(B::part(self).unary(l, op)?.wrap()))
    }

    pub(crate) fn unary_grad(
        &self,
        l: &Layout,
        g: &Storage,
        lg: &Layout,
        op: UnaryOp,
    ) -> Result<Storage> {
        on_backend!("unary_grad", [self, g], B => {
            Ok(B::part(self).unary_grad(l, B::part(g), lg, op)?.wrap())
        })
    }

    pub(crate) fn binary(
        &self,
        l: &Layout,
        rhs: &Storage,
        lr: &Layout,
        op: BinaryOp,
    ) -> Result<Storage> {
        on_backend!("binary", [self, rhs], B => Ok(B::part(self).binary(l, B::part(rhs), lr, op)?.wrap()))
    }

    pub(crate) fn cmp(&self, l: &Layout, rhs: &Storage, lr: &Layout, op: CmpOp) -> Result<Storage> {
        on_backend!("cmp", [self, rhs], B => Ok(B::part(self).cmp(l, B::part(rhs), lr, op)?.wrap()))
    }

    pub(crate) fn where_cond(
        &self,
        l: &Layout,
        a: &Storage,
        la: &Layout,
        b: &Storage,
        lb: &Layout,
    ) -> Result<Storage> {
        on_backend!("where", [self, a, b], B => {
            Ok(B::part(self).where_cond(l, B::part(a), la, B::part(b), lb)?.wrap())
        })
    }
}
