//! Training batch norm as one library call where the device offers one (cuDNN's NHWC batch
//! norm on CUDA, when switched on: `backend::cuda::dnn_norm`), `relu(bn(x) + r)` with the
//! ReLU and the residual optional; [`Tensor::batch_norm_counted`] runs its own passes where
//! this declines.

use super::norm_call::{BnCall, InPlace};
use crate::backend::norm::{FusedBn, FusedBnBack};
use crate::backend::Storage;
use crate::layout::Layout;
use crate::{DType, Device, MemoryFormat, Result, Tensor};

/// `relu(bn(x) + r)` (ReLU and `r` as `call` and `r` say) in one library call, with its
/// backward in one more; `None` where the device has none for these operands (the CPU; on
/// CUDA when switched off, for a layout other than dense channels-last 4-D, for a residual
/// without a ReLU, or where cuDNN declines) and where the running statistics or the counter
/// are not whole tensors the call can write. `x` and `r` are in their fused format already;
/// `params` are the affine parameters as given, `w` and `b` their f32 values; `name` is the
/// op's name in the graph.
#[allow(clippy::too_many_arguments)]
pub(super) fn batch_norm_fused(
    name: &'static str,
    x: &Tensor,
    r: Option<&Tensor>,
    running: (Option<&Tensor>, Option<&Tensor>),
    tracked: Option<&Tensor>,
    params: (Option<&Tensor>, Option<&Tensor>),
    (w, b): (Option<&Tensor>, Option<&Tensor>),
    call: BnCall,
) -> Result<Option<Tensor>> {
    let plain = matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16);
    if x.device() == Device::Cpu || !call.training || x.rank() != 4 || !plain {
        return Ok(None);
    }
    let (Some(weight), Some(bias), Some(w), Some(b)) = (params.0, params.1, w, b) else {
        return Ok(None);
    };
    // The library writes the running statistics and the counter in its call: each given one
    // must be one it can write.
    let here = InPlace::of(x, running, tracked);
    let given = (
        running.0.is_some() || running.1.is_some(),
        tracked.is_some(),
    );
    if given != (here.running.is_some(), here.tracked.is_some()) {
        return Ok(None);
    }
    let c = x.shape()[1];
    let whole = |v: &Tensor| v.filled_in(MemoryFormat::Contiguous);
    let (w, b) = (whole(w)?, whole(b)?);
    let out = {
        let (xs, ws, bs) = (x.storage(), w.storage(), b.storage());
        let rs = r.map(|r| r.storage());
        let residual = rs.as_deref().zip(r.map(|r| r.layout()));
        here.write(|running, tracked| {
            let p: FusedBn<'_, Storage> = FusedBn {
                weight: &ws,
                bias: &bs,
                running,
                tracked,
                residual,
                relu: call.relu,
                momentum: call.momentum,
                eps: call.eps,
            };
            xs.batch_norm_fused(x.layout(), p)
        })?
    };
    let Some(out) = out else {
        return Ok(None);
    };
    let format = MemoryFormat::ChannelsLast;
    let layout = Layout::with_format("batch_norm", x.shape(), format)?;
    let y = Tensor::from_storage_in(out.y, layout.clone());
    let saved_len = out.saved.len();
    let saved = Tensor::from_storage(out.saved, &[saved_len]);
    let reserve_len = out.reserve.len();
    let reserve = Tensor::from_storage(out.reserve, &[reserve_len]);
    // The backward reads x, the parameters, and with a ReLU the output (which the next op
    // keeps anyway); the residual is not read again.
    let kept_y = call.relu.then(|| y.detach());
    let mut inputs = vec![x, weight, bias];
    inputs.extend(r);
    let (rw, rb, ry) = (w.clone(), b.clone(), kept_y.clone());
    let mut reads = vec![x, &rw, &rb];
    reads.extend(ry.as_ref());
    let (wdt, bdt, rdt) = (weight.dtype(), bias.dtype(), r.map(|r| r.dtype()));
    let (xs, eps, relu) = (x.detach(), call.eps, call.relu);
    Ok(Some(y.attach_saving(
        name,
        &inputs,
        &reads,
        move |dy, needs| {
            let dy = dy.to_dtype(xs.dtype())?.to_memory_format(format)?;
            let g = {
                let (xst, ws, bs) = (xs.storage(), w.storage(), b.storage());
                let (ss, res) = (saved.storage(), reserve.storage());
                let ys = kept_y.as_ref().map(|y| y.storage());
                let back: FusedBnBack<'_, Storage> = FusedBnBack {
                    x: (&xst, xs.layout()),
                    y: ys.as_deref().zip(kept_y.as_ref().map(|y| y.layout())),
                    weight: &ws,
                    bias: &bs,
                    saved: &ss,
                    reserve: &res,
                    residual: rdt.is_some(),
                    relu,
                    eps,
                };
                dy.storage().batch_norm_fused_backward(dy.layout(), back)?
            };
            let dx = Tensor::from_storage_in(g.dx, layout.clone());
            let dw = Tensor::from_storage(g.dweight, &[c]);
            let db = Tensor::from_storage(g.dbias, &[c]);
            let mut grads = vec![
                needs[0].then_some(dx),
                needs[1].then(|| dw.to_dtype(wdt)).transpose()?,
                needs[2].then(|| db.to_dtype(bdt)).transpose()?,
            ];
            if let (Some(rdt), Some(dz)) = (rdt, g.dz) {
                let dz = Tensor::from_storage_in(dz, layout.clone());
                grads.push(needs[3].then(|| dz.to_dtype(rdt)).transpose()?);
            }
            Ok(grads)
        },
    )))
}
