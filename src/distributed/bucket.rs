//! The data-parallel wrapper's buckets: which parameters share one (planned once), the flat
//! buffer each keeps for the whole run with every gradient's place in it, the copy of the
//! gradients into their places, and the broadcast of many tensors in one collective per
//! dtype.

use super::group::ProcessGroup;
use crate::layout::Layout;
use crate::{DType, MemoryFormat, Result, Tensor};

/// The size of a gradient bucket, as PyTorch's `bucket_cap_mb=25`.
pub const BUCKET_CAP_BYTES: usize = 25 << 20;
/// The size of the first bucket (the last gradients backward makes), as PyTorch's
/// `_DEFAULT_FIRST_BUCKET_BYTES`: they then do not wait behind a large bucket.
pub const FIRST_BUCKET_BYTES: usize = 1 << 20;
/// The most bytes one coalesced broadcast carries (PyTorch's `_broadcast_coalesced` buffer
/// size): a model's parameters go in pieces of about this, not all at once.
const BROADCAST_BYTES: usize = 250 << 20;

/// The parameters whose gradients are averaged together, and their dtype.
pub(super) struct Bucket {
    /// Parameter indices, in the order their gradients sit in the flat buffer.
    pub(super) params: Vec<usize>,
    pub(super) dtype: DType,
}

/// Buckets in reverse parameter order: a new one when the dtype changes or the cap would be
/// passed (a parameter larger than the cap gets one of its own).
pub(super) fn plan_buckets(params: &[Tensor], cap: usize) -> Vec<Bucket> {
    let mut out: Vec<Bucket> = Vec::new();
    let mut bytes = 0usize;
    for i in (0..params.len()).rev() {
        let p = &params[i];
        let size = p.numel().saturating_mul(p.dtype().size_in_bytes());
        // While the first bucket fills, its own smaller cap.
        let limit = match out.len() {
            1 => FIRST_BUCKET_BYTES.min(cap),
            _ => cap,
        };
        let fits = out
            .last()
            .is_some_and(|b| b.dtype == p.dtype() && bytes.saturating_add(size) <= limit);
        if fits {
            out.last_mut().expect("checked").params.push(i);
            bytes += size;
        } else {
            out.push(Bucket {
                params: vec![i],
                dtype: p.dtype(),
            });
            bytes = size;
        }
    }
    out
}

/// The flat buffer of each bucket (zeros, the bucket's dtype, on the parameters' device),
/// and each parameter's place in its bucket's: a view of the parameter's shape and memory
/// format (a channels-last parameter's has channels-last strides), which becomes its
/// gradient. Made once, for the wrapper's life.
pub(super) fn buffers(params: &[Tensor], buckets: &[Bucket]) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
    crate::no_grad(|| {
        let mut views: Vec<Option<Tensor>> = vec![None; params.len()];
        let mut flats = Vec::with_capacity(buckets.len());
        for bucket in buckets {
            let total: usize = bucket.params.iter().map(|&i| params[i].numel()).sum();
            let device = params[bucket.params[0]].device();
            let flat = Tensor::zeros(&[total], bucket.dtype, device)?;
            let mut at = 0;
            for &i in &bucket.params {
                let p = &params[i];
                let n = p.numel();
                let place = flat.narrow(0, at, n)?;
                views[i] = Some(from_memory_order(&place, p.shape(), p.memory_format())?);
                at += n;
            }
            flats.push(flat);
        }
        let views = views
            .into_iter()
            .map(|v| v.expect("every parameter is in a bucket"))
            .collect();
        Ok((flats, views))
    })
}

/// Copies the gradients of `bucket`'s parameters (of `params`) into their `places` in its
/// buffer `flat`, in one multi-copy (one launch per list on CUDA): nothing for a gradient
/// that is its place already (left there by the last step and not replaced), zeros for a
/// parameter without one. `source` gives a gradient as it may be read while `flat` is
/// written: in the bucket's dtype, on another storage.
pub(super) fn fill(
    flat: &Tensor,
    bucket: &Bucket,
    params: &[Tensor],
    places: &[Tensor],
    mut source: impl FnMut(Tensor) -> Result<Tensor>,
) -> Result<()> {
    const OP: &str = "DistributedDataParallel";
    let mut sources: Vec<(usize, Tensor)> = Vec::new();
    let mut missing: Vec<usize> = Vec::new();
    for &i in &bucket.params {
        let place = &places[i];
        match params[i].grad() {
            Some(g) if g.shares_storage(place) && g.layout() == place.layout() => {}
            Some(g) => sources.push((i, source(g)?)),
            None => missing.push(i),
        }
    }
    let largest = missing.iter().map(|&i| params[i].numel()).max();
    let zeros = match largest {
        Some(n) => Some(Tensor::zeros(&[n], bucket.dtype, flat.device())?),
        None => None,
    };
    if sources.is_empty() && zeros.is_none() {
        return Ok(());
    }
    // Each copy walks its place and its source in the place's memory order (a channels-last
    // place as NHWC), so that dense ones go in one list.
    let in_order = |place: &Layout, src: &Layout| -> Result<(Layout, Layout)> {
        match place.dense_order() {
            Some(p) => Ok((place.permute(OP, &p)?, src.permute(OP, &p)?)),
            None => Ok((place.clone(), src.clone())),
        }
    };
    let mut walks = Vec::with_capacity(sources.len() + missing.len());
    for (i, g) in &sources {
        walks.push(in_order(places[*i].layout(), g.layout())?);
    }
    for &i in &missing {
        // The zeros seen with the place's strides.
        let place = places[i].layout();
        let from = Layout::new(place.shape().to_vec(), place.strides().to_vec(), 0);
        walks.push(in_order(place, &from)?);
    }
    let reads: Vec<_> = sources.iter().map(|(_, g)| g.storage()).collect();
    let zero = zeros.as_ref().map(|z| z.storage());
    let repeated = zero
        .iter()
        .flat_map(|z| std::iter::repeat_n(&**z, missing.len()));
    let srcs = reads.iter().map(|s| &**s).chain(repeated);
    let parts: Vec<_> = walks
        .iter()
        .zip(srcs)
        .map(|((dl, sl), s)| (dl, s, sl))
        .collect();
    flat.0.storage.write(|s| s.copy_many_into(&parts))
}

/// Copies rank 0's `tensors` into every rank's, in place (PyTorch's `_broadcast_coalesced`):
/// per dtype, in pieces of about [`BROADCAST_BYTES`], the tensors are flattened into one
/// buffer, broadcast in one collective, and copied back on the other ranks. `op` names the
/// caller in errors. The profiler shows each collective, with its flattening and copies
/// back, as a `ddp.broadcast` op.
pub(super) fn broadcast_coalesced(
    group: &ProcessGroup,
    op: &'static str,
    tensors: &[Tensor],
) -> Result<()> {
    for (i, t) in tensors.iter().enumerate() {
        if t.device() != group.device() {
            return Err(group.err(
                op,
                format!(
                    "tensor {i} (shape {:?}) is on {}, the group's device is {}",
                    t.shape(),
                    t.device(),
                    group.device()
                ),
            ));
        }
    }
    // A world of one has nothing to send.
    if group.world_size() == 1 {
        return Ok(());
    }
    crate::no_grad(|| {
        for piece in pieces(tensors) {
            let _prof = crate::profiler::op("ddp.broadcast");
            let flats = piece
                .iter()
                .map(|t| in_memory_order(&t.detach(), t.memory_format()))
                .collect::<Result<Vec<_>>>()?;
            let refs: Vec<&Tensor> = flats.iter().collect();
            let flat = Tensor::cat(&refs, 0)?;
            drop(flats);
            group.broadcast(&flat, 0)?;
            if group.rank() == 0 {
                continue;
            }
            let mut at = 0;
            for t in piece {
                let n = t.numel();
                let from =
                    from_memory_order(&flat.narrow(0, at, n)?, t.shape(), t.memory_format())?;
                t.detach().copy_(&from)?;
                at += n;
            }
        }
        Ok(())
    })
}

/// `tensors` in groups of one dtype and at most [`BROADCAST_BYTES`] (a larger tensor alone),
/// each dtype's in their order.
fn pieces(tensors: &[Tensor]) -> Vec<Vec<&Tensor>> {
    let mut dtypes: Vec<DType> = Vec::new();
    for t in tensors {
        if !dtypes.contains(&t.dtype()) {
            dtypes.push(t.dtype());
        }
    }
    let mut out: Vec<Vec<&Tensor>> = Vec::new();
    for d in dtypes {
        let mut bytes = 0usize;
        let mut piece: Vec<&Tensor> = Vec::new();
        for t in tensors.iter().filter(|t| t.dtype() == d) {
            let size = t.numel().saturating_mul(d.size_in_bytes());
            if !piece.is_empty() && bytes.saturating_add(size) > BROADCAST_BYTES {
                out.push(std::mem::take(&mut piece));
                bytes = 0;
            }
            piece.push(t);
            bytes = bytes.saturating_add(size);
        }
        out.push(piece);
    }
    out
}

/// `g` as a 1-D tensor of its elements in `format`'s order (the parameter's).
pub(super) fn in_memory_order(g: &Tensor, format: MemoryFormat) -> Result<Tensor> {
    match format {
        MemoryFormat::ChannelsLast if g.rank() == 4 => g
            .to_memory_format(MemoryFormat::ChannelsLast)?
            .permute(&[0, 2, 3, 1])?
            .reshape(&[g.numel()]),
        _ => g.contiguous()?.reshape(&[g.numel()]),
    }
}

/// The inverse of [`in_memory_order`]: a view of `flat` of `shape` in `format`.
pub(super) fn from_memory_order(
    flat: &Tensor,
    shape: &[usize],
    format: MemoryFormat,
) -> Result<Tensor> {
    match format {
        MemoryFormat::ChannelsLast if shape.len() == 4 => flat
            .reshape(&[shape[0], shape[2], shape[3], shape[1]])?
            .permute(&[0, 3, 1, 2]),
        _ => flat.reshape(shape),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;

    fn param(shape: &[usize], dtype: DType) -> Tensor {
        Tensor::randn(shape, DType::F32, Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .requires_grad(true)
            .unwrap()
    }

    #[test]
    fn buckets_go_in_reverse_order_within_their_caps() {
        let plan = |ps: &[Tensor]| -> Vec<Vec<usize>> {
            plan_buckets(ps, BUCKET_CAP_BYTES)
                .into_iter()
                .map(|b| b.params)
                .collect()
        };
        // 4-byte elements: quarters of a MiB.
        let mib = |quarters: usize| param(&[quarters, 65536], DType::F32);
        // Backward's last gradients (the first parameters) fill the small first bucket:
        // 0.25 + 0.5 MiB fit in 1 MiB, 0.75 more do not; the rest fill 25 MiB buckets.
        let ps = vec![mib(40), mib(40), mib(3), mib(2), mib(1)];
        assert_eq!(plan(&ps), vec![vec![4, 3], vec![2, 1, 0]]);
        // A parameter past the first bucket's cap has it alone; another dtype starts a bucket.
        let ps = vec![
            param(&[8], DType::F16),
            mib(3),
            mib(2),
            mib(40),
            mib(40),
            mib(40),
        ];
        assert_eq!(plan(&ps), vec![vec![5], vec![4, 3, 2, 1], vec![0]]);
        // 3 x 10 MiB: two fit in 25 MiB.
        let ps = vec![mib(40), mib(40), mib(40), mib(1)];
        assert_eq!(plan(&ps), vec![vec![3], vec![2, 1], vec![0]]);
    }

    #[test]
    fn each_parameter_has_a_place_in_its_buckets_buffer_in_its_format() {
        let ps = vec![
            param(&[3, 2], DType::F32),
            param(&[2, 3, 2, 2], DType::F32)
                .detach()
                .to_memory_format(MemoryFormat::ChannelsLast)
                .unwrap()
                .requires_grad(true)
                .unwrap(),
            param(&[5], DType::BF16),
        ];
        let buckets = plan_buckets(&ps, BUCKET_CAP_BYTES);
        let (flats, views) = buffers(&ps, &buckets).unwrap();
        assert_eq!(flats.len(), 2);
        // Bucket 0 (bf16) holds parameter 2; bucket 1 parameters 1 then 0.
        assert_eq!(
            (flats[0].shape(), flats[0].dtype()),
            (&[5][..], DType::BF16)
        );
        assert_eq!(flats[1].shape(), &[24 + 6]);
        for (p, v) in ps.iter().zip(&views) {
            assert_eq!((v.shape(), v.dtype()), (p.shape(), p.dtype()));
            assert_eq!(v.memory_format(), p.memory_format());
            assert!(!v.is_requires_grad());
        }
        assert!(views[1].is_channels_last());
        assert!(views[0].shares_storage(&flats[1]) && views[1].shares_storage(&flats[1]));
        assert!(views[2].shares_storage(&flats[0]));
        assert_eq!(
            (views[1].layout().offset(), views[0].layout().offset()),
            (0, 24)
        );
        // A write through a view lands in its place of the flat buffer, in memory order.
        let nhwc: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let src = Tensor::from_vec(nhwc.clone(), &[2, 2, 2, 3], Device::Cpu)
            .unwrap()
            .permute(&[0, 3, 1, 2])
            .unwrap();
        views[1].copy_(&src).unwrap();
        assert_eq!(
            flats[1].narrow(0, 0, 24).unwrap().to_vec::<f32>().unwrap(),
            nhwc
        );
    }

    #[test]
    fn broadcast_pieces_keep_one_dtype_and_their_order() {
        let a = param(&[4], DType::F32);
        let b = param(&[2], DType::F16);
        let c = param(&[3], DType::F32);
        let got: Vec<Vec<usize>> = pieces(&[a, b, c])
            .iter()
            .map(|p| p.iter().map(|t| t.numel()).collect())
            .collect();
        assert_eq!(got, vec![vec![4, 3], vec![2]]);
        // A world of one sends nothing and changes nothing.
        let pg = ProcessGroup::single(Device::Cpu);
        let t = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu).unwrap();
        broadcast_coalesced(&pg, "test", std::slice::from_ref(&t)).unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
    }
}
