//! Batch normalisation's kernels (`cuda/norm.cu`) on emulated blocks, against the CPU
//! backend's fused passes, row-major and channels-last, over several chunks and channel tiles.

use super::{function, library, randn, run_grid, Addr};
use crate::backend::cuda::norm::{finalize_threads, BnArgs, PartialPlan};
use crate::backend::norm::{Addend, BnForward, BnGrad, BnSource, FusedRelu, LnWant};
use crate::backend::spec::ChannelSplit;
use crate::backend::Storage;
use crate::layout::Layout;
use crate::{MemoryFormat, Tensor};

type Partial = unsafe extern "C" fn(
    i32,
    *const f32,
    *const f32,
    *const f32,
    *mut f32,
    *const f32,
    *mut f32,
    i64,
    i64,
    i64,
    i64,
    i32,
) -> ();
type Finalize = unsafe extern "C" fn(*const f32, BnArgs, i64, i64, i64, i64) -> ();
type Affine = unsafe extern "C" fn(
    *const f32,
    *const f32,
    *const f32,
    *const f32,
    *const f32,
    *mut f32,
    i64,
    i64,
    i64,
    i32,
) -> ();

fn values(s: Storage, n: usize) -> Vec<f32> {
    Tensor::from_storage(s, &[n]).to_vec::<f32>().unwrap()
}

/// Relative closeness, with an absolute floor for sums that cancel to near zero.
fn near(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-5 * scale, "{what}: [{i}] {g} vs {w}");
    }
}

/// The elements of `t` in its storage order (its layout is dense).
fn stored(t: &Tensor) -> Vec<f32> {
    match t.is_channels_last() {
        true => t.permute(&[0, 2, 3, 1]).unwrap().to_vec::<f32>().unwrap(),
        false => t.to_vec::<f32>().unwrap(),
    }
}

#[test]
fn batch_norm_kernels_match_the_cpu_on_emulated_blocks() {
    let Some(lib) = library("norm") else {
        return;
    };
    let partial: Partial = function(lib, "bn_partial_float");
    let finalize: Finalize = function(lib, "bn_finalize");
    let affine: Affine = function(lib, "bn_affine_float");
    let affine_fc: Affine = function(lib, "bn_affine_fc_float");
    // [n, c, h, w]: 40 channels make two channel tiles channels-last, one of them partial.
    // (shape, format, chunk rows, threads per block, vector groups per tile): 64 threads keep
    // the emulation quick; some cases run the launcher's 256. With tg > 0, channels-last
    // takes 16-byte vectors (4 f32 channels): 40 channels are 10 groups, in one tile of 16
    // (6 idle) or three of 4 (the last partial).
    for (shape, format, chunk, threads, tg) in [
        ([5, 6, 3, 4], MemoryFormat::Contiguous, 2, 64, 0),
        ([5, 6, 3, 4], MemoryFormat::ChannelsLast, 7, 64, 0),
        ([3, 40, 2, 3], MemoryFormat::ChannelsLast, 5, 256, 0),
        ([3, 40, 2, 3], MemoryFormat::ChannelsLast, 4, 64, 0),
        ([3, 7, 2, 3], MemoryFormat::Contiguous, 1, 256, 0),
        ([3, 40, 2, 3], MemoryFormat::ChannelsLast, 5, 256, 16),
        ([3, 40, 2, 3], MemoryFormat::ChannelsLast, 4, 64, 4),
        ([4, 8, 3, 3], MemoryFormat::ChannelsLast, 9, 32, 2),
    ] {
        let what = format!("{shape:?} {format:?} chunk {chunk}, {threads} threads, tg {tg}");
        let x = randn(&shape, 40).mul(2.0).unwrap().add(3.0).unwrap();
        let x = x.to_memory_format(format).unwrap();
        let dy = randn(&shape, 41).to_memory_format(format).unwrap();
        let l = x.layout().clone();
        let s = ChannelSplit::of("test", &l).unwrap();
        let c = s.channels;
        let (xs, ds) = (stored(&x), stored(&dy));

        // The chunking the launcher would use covers the same elements in fewer blocks; a
        // smaller chunk exercises the combination.
        let plan = PartialPlan::new(s, crate::DType::F32, true);
        assert!(plan.blocks(s) >= 1 && plan.chunk >= 1);
        assert_eq!(
            plan.tg > 0,
            s.inner == 1 && c.is_multiple_of(4),
            "{what}: the launcher's path"
        );
        let chunks = s.outer.div_ceil(chunk);
        let tiles = match (s.inner, tg) {
            (1, 0) => c.div_ceil(32),
            (1, tg) => (c / 4).div_ceil(tg),
            _ => c,
        };
        let i = |v: usize| v as i64;
        // A fused ReLU's output, about half of it positive, in x's format.
        let yt = x.sub(3.0).unwrap().to_memory_format(format).unwrap();
        let ys = stored(&yt);
        // The partials of mode 0 (moments) or the gradient sums (modes 1 and 2, `st` the
        // forward's statistics: their means, and mode 2's recomputed ReLU); with `mask`, dy
        // counts where y > 0, and the masked dy comes back too.
        let partials = |mode: i32, st: &[f32], mask: bool| {
            let ya = Addr::of(&ys);
            let mut part = vec![f32::NAN; chunks * c * 2];
            let mut masked = vec![f32::NAN; if mask { xs.len() } else { 0 }];
            let oa = Addr::of_mut(&mut masked);
            let (xa, da, ma) = (Addr::of(&xs), Addr::of(&ds), Addr::of(st));
            let pa = Addr::of_mut(&mut part);
            // Fewer blocks than work: each block strides over (chunk, tile) pairs.
            let blocks = (chunks * tiles).div_ceil(2) as u32;
            run_grid(lib, blocks, threads, || {
                // SAFETY: x and dy hold the tensor's elements, st 5 c values (modes 1 and 2),
                // part one pair per (chunk, channel); one thread of a block writes each pair.
                unsafe {
                    partial(
                        mode,
                        xa.ptr(),
                        if mode != 0 {
                            da.ptr()
                        } else {
                            std::ptr::null()
                        },
                        if mask { ya.ptr() } else { std::ptr::null() },
                        if mask { oa.ptr() } else { std::ptr::null_mut() },
                        ma.ptr(),
                        pa.ptr(),
                        i(s.outer),
                        i(c),
                        i(s.inner),
                        i(chunk),
                        tg as i32,
                    )
                }
            });
            assert!(
                part.iter().all(|v| v.is_finite()),
                "{what}: every partial written"
            );
            (part, masked)
        };
        // bn_finalize with fewer blocks than channels (the grid strides), as many threads as
        // the launcher would give these chunks.
        let run_finalize = |part: Option<&[f32]>, a: BnArgs| {
            let pa = part.map(Addr::of);
            let threads = finalize_threads(part.map_or(0, |_| chunks));
            run_grid(lib, c.div_ceil(3) as u32, threads, || {
                let pp = pa.map_or(std::ptr::null(), |p| p.ptr::<f32>() as *const f32);
                // SAFETY: part holds every chunk's pairs; the arguments' vectors hold c (out:
                // 5 c forward, 4 c backward) values; thread 0 of a channel's block writes them.
                unsafe { finalize(pp, a, i(s.outer), i(c), i(s.inner), i(chunk)) }
            });
        };
        let ptr = |v: &[f32]| v.as_ptr() as u64;
        let count = (s.outer * s.inner) as f64;

        // Forward on the batch: the statistics, the running ones updated, the batch counted.
        let (w, b) = (randn(&[c], 46), randn(&[c], 47));
        let (ws, bs) = (w.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        let (rm0, rv0) = (randn(&[c], 48), randn(&[c], 49).abs().unwrap());
        let (mut rm, mut rv) = (rm0.to_vec::<f32>().unwrap(), rv0.to_vec::<f32>().unwrap());
        let mut tracked = [5i64];
        let mut stats = vec![f32::NAN; 5 * c];
        let (part, _) = partials(0, &[], false);
        let a = BnArgs {
            mode: 0,
            momentum: 0.3,
            eps: 1e-3,
            count,
            weight: ptr(&ws),
            bias: ptr(&bs),
            running_mean: rm.as_mut_ptr() as u64,
            running_var: rv.as_mut_ptr() as u64,
            tracked: tracked.as_mut_ptr() as u64,
            out: stats.as_mut_ptr() as u64,
            ..Default::default()
        };
        run_finalize(Some(&part), a);
        let lv = Layout::contiguous(&[c]);
        let (mut crm, mut crv) = (
            rm0.storage().try_clone().unwrap(),
            rv0.storage().try_clone().unwrap(),
        );
        let mut ctracked = crate::backend::Storage::Cpu(crate::backend::CpuStorage::I64(vec![5]));
        let (wst, bst) = (w.storage(), b.storage());
        let want = x.storage().batch_norm_stats(
            &l,
            BnForward {
                weight: Some((&wst, &lv)),
                bias: Some((&bst, &lv)),
                source: BnSource::Batch {
                    running: Some((&mut crm, &mut crv)),
                    tracked: Some(&mut ctracked),
                    momentum: 0.3,
                    sums: None,
                },
                eps: 1e-3,
            },
        );
        near(
            &stats,
            &values(want.unwrap(), 5 * c),
            &format!("{what}: statistics"),
        );
        near(&rm, &values(crm, c), &format!("{what}: running mean"));
        near(&rv, &values(crv, c), &format!("{what}: running var"));
        assert_eq!(tracked[0], 6, "{what}: the batch counted");

        // Forward from the per-channel sums a convolution's epilogue made (mode 5, no
        // partials): the same statistics and running statistics, the batch counted.
        let mut sums64 = vec![0f64; 2 * c];
        for (k, &v) in xs.iter().enumerate() {
            let ch = (k / s.inner) % c;
            sums64[ch] += f64::from(v);
            sums64[c + ch] += f64::from(v) * f64::from(v);
        }
        let sums: Vec<f32> = sums64.iter().map(|&v| v as f32).collect();
        let (mut rm5, mut rv5) = (rm0.to_vec::<f32>().unwrap(), rv0.to_vec::<f32>().unwrap());
        let mut tracked5 = [5i64];
        let mut stats5 = vec![f32::NAN; 5 * c];
        let a = BnArgs {
            mode: 5,
            momentum: 0.3,
            eps: 1e-3,
            count,
            weight: ptr(&ws),
            bias: ptr(&bs),
            running_mean: rm5.as_mut_ptr() as u64,
            running_var: rv5.as_mut_ptr() as u64,
            tracked: tracked5.as_mut_ptr() as u64,
            stats: ptr(&sums),
            out: stats5.as_mut_ptr() as u64,
            ..Default::default()
        };
        run_finalize(None, a);
        near(&stats5, &stats, &format!("{what}: statistics from sums"));
        near(&rm5, &rm, &format!("{what}: running mean from sums"));
        near(&rv5, &rv, &format!("{what}: running var from sums"));
        assert_eq!(tracked5[0], 6, "{what}: the batch counted from sums");

        // Forward on the running statistics (eval): no partials.
        let mut eval_stats = vec![f32::NAN; 5 * c];
        let a = BnArgs {
            mode: 1,
            eps: 1e-3,
            count,
            weight: ptr(&ws),
            running_mean: rm.as_mut_ptr() as u64,
            running_var: rv.as_mut_ptr() as u64,
            out: eval_stats.as_mut_ptr() as u64,
            ..Default::default()
        };
        let (rm_before, rv_before) = (rm.clone(), rv.clone());
        run_finalize(None, a);
        let (ms, vs) = (
            Tensor::from_vec(rm.clone(), &[c], crate::Device::Cpu).unwrap(),
            Tensor::from_vec(rv.clone(), &[c], crate::Device::Cpu).unwrap(),
        );
        let want = x.storage().batch_norm_stats(
            &l,
            BnForward {
                weight: Some((&wst, &lv)),
                bias: None,
                source: BnSource::Running(&ms.storage(), &vs.storage()),
                eps: 1e-3,
            },
        );
        near(
            &eval_stats,
            &values(want.unwrap(), 5 * c),
            &format!("{what}: eval statistics"),
        );
        assert!(
            rm == rm_before && rv == rv_before,
            "{what}: eval leaves the running statistics"
        );

        // Backward, each mode: coefficients and the parameters' gradients.
        let st = Tensor::from_vec(stats.clone(), &[5 * c], crate::Device::Cpu).unwrap();
        let ls = Layout::contiguous(&[5 * c]);
        // The fused ReLU: none, its kept output as the mask (the masked dy written), or its
        // output recomputed from x and the statistics.
        let unmasked_dw = std::cell::RefCell::new(Vec::new());
        for (mode, grad, relu_kind) in [
            (2, BnGrad::Train, Relu::None),
            (2, BnGrad::Train, Relu::Kept),
            (2, BnGrad::Train, Relu::Recompute),
            (3, BnGrad::EvalWithParams, Relu::None),
            (3, BnGrad::EvalWithParams, Relu::Recompute),
            (4, BnGrad::EvalInputOnly, Relu::None),
        ] {
            let masked = relu_kind == Relu::Kept;
            let sums_mode = if relu_kind == Relu::Recompute { 2 } else { 1 };
            let (sums, masked_dy) = partials(sums_mode, &stats, masked);
            let (yst, sst) = (yt.storage(), st.storage());
            let relu = match relu_kind {
                Relu::Kept => FusedRelu::GradKept(&*yst, yt.layout()),
                Relu::Recompute => FusedRelu::Recompute(&*sst, &ls),
                Relu::None => FusedRelu::None,
            };
            let (mut coef, mut dw, mut db) =
                (vec![f32::NAN; 4 * c], vec![f32::NAN; c], vec![f32::NAN; c]);
            let with_sums = mode != 4;
            let a = BnArgs {
                mode,
                count,
                stats: ptr(&stats),
                out: coef.as_mut_ptr() as u64,
                dweight: if with_sums { dw.as_mut_ptr() as u64 } else { 0 },
                dbias: if with_sums { db.as_mut_ptr() as u64 } else { 0 },
                ..Default::default()
            };
            run_finalize(with_sums.then_some(&sums[..]), a);
            let out = dy
                .storage()
                .batch_norm_grad(
                    dy.layout(),
                    &x.storage(),
                    &l,
                    &st.storage(),
                    &ls,
                    grad,
                    relu,
                )
                .unwrap();
            let (want, params) = (out.coef, out.params);
            let what = format!("{what}: backward {grad:?}, ReLU {relu_kind:?}");
            if masked {
                // The masked dy in dy's storage order, as the CPU's ReLU backward gives it.
                let want = values(out.masked.expect("kept"), xs.len());
                assert_eq!(masked_dy, want, "{what}: the masked gradient");
                assert!(want.contains(&0.0), "{what}: some masked off");
            }
            near(
                &coef,
                &values(want, 4 * c),
                &format!("{what}: coefficients"),
            );
            match params {
                Some((w, b)) => {
                    near(&dw, &values(w, c), &format!("{what}: weight gradient"));
                    near(&db, &values(b, c), &format!("{what}: bias gradient"));
                    // A fused ReLU drops some of dy: its sums differ from the plain ones.
                    match (grad, relu_kind) {
                        (BnGrad::Train, Relu::None) => *unmasked_dw.borrow_mut() = dw.clone(),
                        (BnGrad::Train, _) => {
                            assert_ne!(dw, *unmasked_dw.borrow(), "{what}: dy masked")
                        }
                        _ => {}
                    }
                }
                None => assert!(
                    !with_sums && dw.iter().all(|v| v.is_nan()),
                    "{what}: no sums"
                ),
            }
        }

        // coef = [alpha | center | gamma | beta], distinct per channel.
        // Every other alpha negative: the outputs take both signs.
        let sign = |k: usize| if k < c && k % 2 == 1 { -1.0 } else { 1.0 };
        let coef: Vec<f32> = (0..4 * c)
            .map(|k| sign(k) * (0.25 + 0.1 * k as f32))
            .collect();
        let kt = Tensor::from_vec(coef.clone(), &[4 * c], crate::Device::Cpu).unwrap();
        let lk = Layout::contiguous(&[4 * c]);
        // (addend, fused ReLU): forward plain, clamped, with a residual (clamped or not),
        // backward plain, masked by the kept output, masked by the output recomputed from x
        // with the forward's statistics. The residual is dy's values.
        for (add, relu) in [
            (Add::None, Relu::None),
            (Add::None, Relu::Kept),
            (Add::Scaled, Relu::None),
            (Add::Scaled, Relu::Kept),
            (Add::Scaled, Relu::Recompute),
            (Add::Residual, Relu::None),
            (Add::Residual, Relu::Kept),
        ] {
            let n = l.numel();
            let mut out = vec![f32::NAN; n];
            let pick = |on: bool, v: &[f32]| if on { v.as_ptr() } else { std::ptr::null() };
            let with_dy = add != Add::None;
            let backward = add == Add::Scaled;
            let (dp, mp) = (
                pick(with_dy, &ds),
                pick(backward && relu == Relu::Kept, &ys),
            );
            let fp = pick(backward && relu == Relu::Recompute, &stats);
            let clamp = !backward && relu != Relu::None;
            let flags = i32::from(clamp) | (i32::from(add == Add::Residual) << 1);
            // SAFETY: x, dy, the mask and out hold n elements, the statistics 5 c, coef 4 c.
            unsafe {
                affine(
                    xs.as_ptr(),
                    dp,
                    mp,
                    fp,
                    coef.as_ptr(),
                    out.as_mut_ptr(),
                    n as i64,
                    c as i64,
                    s.inner as i64,
                    flags,
                )
            };
            let (xst, dst, kst, yst) = (x.storage(), dy.storage(), kt.storage(), yt.storage());
            let sst = st.storage();
            let addend = match add {
                Add::None => Addend::None,
                Add::Scaled => Addend::Scaled(&*dst, dy.layout()),
                Add::Residual => Addend::Residual(&*dst, dy.layout()),
            };
            let fused = match (add, relu) {
                (_, Relu::None) => FusedRelu::None,
                (Add::Scaled, Relu::Kept) => FusedRelu::GradKept(&*yst, yt.layout()),
                (Add::Scaled, Relu::Recompute) => FusedRelu::Recompute(&*sst, &ls),
                _ => FusedRelu::Output,
            };
            let want = xst.channel_affine(&l, addend, &kst, &lk, fused);
            // The CPU writes its output in x's storage order, as the kernel does.
            let want = values(want.unwrap(), n);
            if clamp {
                assert!(want.contains(&0.0), "{what}: the ReLU clamps some");
            }
            let what = format!("{what}: affine ({add:?}, ReLU: {relu:?})");
            near(&out, &want, &what);
            // Channels-last in vectors of 4 channels, on a grid whose stride is two whole rows
            // (two blocks of c / 4 threads): each thread keeps its channels' coefficients.
            // Both kernels, each right for any call (the one for a recomputed ReLU's mask
            // takes the whole-row path only there).
            for (kernel, affine) in [("", affine), ("fc ", affine_fc)] {
                if s.inner != 1 || !c.is_multiple_of(4) {
                    break;
                }
                let mut rows_out = vec![f32::NAN; n];
                let (xa, da, ma, fa) = (
                    Addr::of(&xs),
                    Addr(dp as usize),
                    Addr(mp as usize),
                    Addr(fp as usize),
                );
                let (ka, oa) = (Addr::of(&coef), Addr::of_mut(&mut rows_out));
                run_grid(lib, 2, (c / 4) as u32, || {
                    // SAFETY: as the call above, with the same operands.
                    unsafe {
                        affine(
                            xa.ptr(),
                            da.ptr(),
                            ma.ptr(),
                            fa.ptr(),
                            ka.ptr(),
                            oa.ptr(),
                            n as i64,
                            c as i64,
                            1,
                            flags,
                        )
                    }
                });
                near(
                    &rows_out,
                    &want,
                    &format!("{what}, {kernel}a stride of whole rows"),
                );
            }
            if backward && relu != Relu::None {
                // The mask drops dy at some elements and keeps it at others.
                let unmasked = xst.channel_affine(&l, addend, &kst, &lk, FusedRelu::None);
                let unmasked = values(unmasked.unwrap(), n);
                let differ = unmasked.iter().zip(&want).filter(|(u, w)| u != w).count();
                assert!(0 < differ && differ < n, "{what}: {differ} of {n} masked");
            }
        }
    }
}

/// A fused ReLU under test: none, its kept output, its output recomputed from x.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Relu {
    None,
    Kept,
    Recompute,
}

/// The addend of an affine pass under test.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Add {
    None,
    Scaled,
    Residual,
}

/// bn_affine in f16 and bf16 on the shapes whose 16-byte vectors hold one channel's run
/// (row-major, inner % 8 == 0) or 8 adjacent channels (channels-last, C % 8 == 0), and on
/// shapes that take the element path, against the CPU's pass; misaligned pointers too.
#[test]
fn batch_norm_affine_half_kernels_take_vectors_and_match_the_cpu() {
    let Some(lib) = library("norm") else {
        return;
    };
    fn check<T: crate::dtype::WithDType>(lib: &libloading::Library, t: &str, tol: f32) {
        type AffineT<T> = unsafe extern "C" fn(
            *const T,
            *const T,
            *const T,
            *const f32,
            *const f32,
            *mut T,
            i64,
            i64,
            i64,
            i32,
        ) -> ();
        let affine: AffineT<T> = function(lib, &format!("bn_affine_{t}"));
        for (shape, format, skew) in [
            ([2, 3, 4, 4], MemoryFormat::Contiguous, 0),
            ([2, 16, 3, 3], MemoryFormat::ChannelsLast, 0),
            ([2, 16, 3, 3], MemoryFormat::ChannelsLast, 1),
            ([2, 3, 3, 3], MemoryFormat::Contiguous, 0),
            ([2, 5, 2, 3], MemoryFormat::ChannelsLast, 0),
        ] {
            let what = format!("{t} {shape:?} {format:?} skew {skew}");
            let x = randn(&shape, 50)
                .to_dtype(T::DTYPE)
                .unwrap()
                .to_memory_format(format)
                .unwrap();
            let r = randn(&shape, 51)
                .to_dtype(T::DTYPE)
                .unwrap()
                .to_memory_format(format)
                .unwrap();
            let l = x.layout().clone();
            let c = shape[1];
            let coef: Vec<f32> = (0..4 * c).map(|k| 0.5 - 0.07 * k as f32).collect();
            let kt = Tensor::from_vec(coef.clone(), &[4 * c], crate::Device::Cpu).unwrap();
            let lk = Layout::contiguous(&[4 * c]);
            let n = l.numel();
            // Storage order, shifted by `skew` elements so that no pointer is 16-byte aligned.
            let order = |t: &Tensor| {
                let v = match format {
                    MemoryFormat::ChannelsLast => {
                        t.permute(&[0, 2, 3, 1]).unwrap().contiguous().unwrap()
                    }
                    _ => t.contiguous().unwrap(),
                };
                let mut out = vec![T::from_f64(0.0); skew];
                out.extend(v.to_vec::<T>().unwrap());
                out
            };
            let (xs, rs) = (order(&x), order(&r));
            for (residual, relu) in [(false, false), (true, true), (true, false)] {
                let mut out = vec![T::from_f64(f64::NAN); n + skew];
                let rp = if residual {
                    rs[skew..].as_ptr()
                } else {
                    std::ptr::null()
                };
                let flags = i32::from(relu) | (i32::from(residual) << 1);
                // SAFETY: x, the residual and out hold n elements past `skew`, coef 4 c.
                unsafe {
                    affine(
                        xs[skew..].as_ptr(),
                        rp,
                        std::ptr::null(),
                        std::ptr::null(),
                        coef.as_ptr(),
                        out[skew..].as_mut_ptr(),
                        n as i64,
                        c as i64,
                        ChannelSplit::of("test", &l).unwrap().inner as i64,
                        flags,
                    )
                };
                let (xst, rst, kst) = (x.storage(), r.storage(), kt.storage());
                let addend = match residual {
                    true => Addend::Residual(&*rst, r.layout()),
                    false => Addend::None,
                };
                let fused = if relu {
                    FusedRelu::Output
                } else {
                    FusedRelu::None
                };
                let want = xst.channel_affine(&l, addend, &kst, &lk, fused).unwrap();
                let want = Tensor::from_storage(want, &[n])
                    .to_dtype(crate::DType::F32)
                    .unwrap();
                let want = want.to_vec::<f32>().unwrap();
                // Aligned channels-last vectors again on a grid whose stride is one whole row
                // (c / V threads): each thread keeps its channels' coefficients.
                let v = 16 / std::mem::size_of::<T>();
                let mut rows_out = out.clone();
                if skew == 0 && format == MemoryFormat::ChannelsLast && c.is_multiple_of(v) {
                    rows_out.fill(T::from_f64(f64::NAN));
                    let (xa, ra, ka) = (Addr::of(&xs), Addr(rp as usize), Addr::of(&coef));
                    let oa = Addr::of_mut(&mut rows_out);
                    run_grid(lib, 1, (c / v) as u32, || {
                        // SAFETY: as the call above, with the same operands.
                        unsafe {
                            affine(
                                xa.ptr(),
                                ra.ptr(),
                                std::ptr::null(),
                                std::ptr::null(),
                                ka.ptr(),
                                oa.ptr(),
                                n as i64,
                                c as i64,
                                1,
                                flags,
                            )
                        }
                    });
                }
                let what = format!("{what}: residual {residual}, ReLU {relu}");
                let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
                for got in [&out, &rows_out] {
                    let got: Vec<f32> = got[skew..].iter().map(|v| v.to_f64() as f32).collect();
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!((g - w).abs() <= tol * scale, "{what}: [{i}] {g} vs {w}");
                    }
                }
            }
        }
    }
    check::<crate::f16>(lib, "f16", 1e-3);
    check::<crate::bf16>(lib, "bf16", 8e-3);
    check::<f32>(lib, "float", 1e-6);
}

#[test]
fn layer_norm_kernels_match_the_cpu_on_emulated_blocks() {
    let Some(lib) = library("norm") else {
        return;
    };
    type Forward =
        unsafe extern "C" fn(*const f32, *const f32, *const f32, *mut f32, *mut f32, i64, i64, f32);
    type Backward = unsafe extern "C" fn(
        *const f32,
        *const f32,
        *const f32,
        *const f32,
        *mut f32,
        *mut f32,
        i64,
        i64,
    );
    type Params = unsafe extern "C" fn(*const f32, *mut f32, *mut f32, i64, i64);
    let fwd: Forward = function(lib, "ln_forward_float");
    let bwd: Backward = function(lib, "ln_backward_float");
    let params: Params = function(lib, "ln_params_float");
    let (rows, cols) = (5, 77);
    let x = randn(&[rows, cols], 42).mul(2.0).unwrap().add(1.5).unwrap();
    let dy = randn(&[rows, cols], 43);
    let (w, b) = (randn(&[cols], 44), randn(&[cols], 45));
    let (xs, ds) = (x.to_vec::<f32>().unwrap(), dy.to_vec::<f32>().unwrap());
    let (ws, bs) = (w.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    let (lx, lw) = (
        Layout::contiguous(&[rows, cols]),
        Layout::contiguous(&[cols]),
    );
    for affine in [false, true] {
        let what = format!("affine {affine}");
        let (wst, bst) = (w.storage(), b.storage());
        let (wp, bp) = match affine {
            true => (Some((&*wst, &lw)), Some((&*bst, &lw))),
            false => (None, None),
        };
        let (want_y, want_s) = x.storage().layer_norm(&lx, cols, wp, bp, 1e-5).unwrap();
        let all = LnWant {
            dx: true,
            params: true,
        };
        let want = dy
            .storage()
            .layer_norm_backward(&lx, &x.storage(), &lx, cols, &want_s, wp, all)
            .unwrap();
        let want_dx = want.dx.unwrap();
        let (want_dw, want_db) = want.params.unwrap();
        let (mut y, mut stats) = (vec![f32::NAN; rows * cols], vec![f32::NAN; 2 * rows]);
        let mut dx = vec![f32::NAN; rows * cols];
        let (wa, ba) = (affine.then(|| Addr::of(&ws)), affine.then(|| Addr::of(&bs)));
        let pick = |a: Option<Addr>| a.map_or(std::ptr::null(), |a| a.ptr::<f32>() as *const f32);
        let (xa, da) = (Addr::of(&xs), Addr::of(&ds));
        let (ya, sa, dxa) = (
            Addr::of_mut(&mut y),
            Addr::of_mut(&mut stats),
            Addr::of_mut(&mut dx),
        );
        let (r, c) = (rows as i64, cols as i64);
        // Fewer blocks than rows: each block strides over rows.
        run_grid(lib, 2, 64, || {
            // SAFETY: x and y hold rows x cols elements, w and b cols (or null), stats two per
            // row; a row's elements are written by distinct threads, its stats by thread 0.
            unsafe { fwd(xa.ptr(), pick(wa), pick(ba), ya.ptr(), sa.ptr(), r, c, 1e-5) }
        });
        run_grid(lib, 3, 64, || {
            // SAFETY: as above; dx holds rows x cols elements; no partial sums (null).
            unsafe {
                let none = std::ptr::null_mut();
                bwd(
                    da.ptr(),
                    xa.ptr(),
                    pick(wa),
                    sa.ptr(),
                    dxa.ptr(),
                    none,
                    r,
                    c,
                )
            }
        });
        // Again with the parameters' partial sums of each of 3 blocks ([3, 2, cols]), then
        // their sums; the input's gradient is the same either way.
        let (blocks, mut dx2) = (3usize, vec![f32::NAN; rows * cols]);
        let mut part = vec![f32::NAN; blocks * 2 * cols];
        let (mut dw, mut db) = (vec![f32::NAN; cols], vec![f32::NAN; cols]);
        let (dx2a, pa) = (Addr::of_mut(&mut dx2), Addr::of_mut(&mut part));
        run_grid(lib, blocks as u32, 64, || {
            // SAFETY: as above; part holds 2 cols sums per block; cols <= 8 x 64 threads.
            unsafe {
                bwd(
                    da.ptr(),
                    xa.ptr(),
                    pick(wa),
                    sa.ptr(),
                    dx2a.ptr(),
                    pa.ptr(),
                    r,
                    c,
                )
            }
        });
        let (dwa, dba) = (Addr::of_mut(&mut dw), Addr::of_mut(&mut db));
        run_grid(lib, 2, 32, || {
            // SAFETY: part holds blocks x 2 x cols sums, dw and db cols elements each.
            unsafe { params(pa.ptr(), dwa.ptr(), dba.ptr(), blocks as i64, c) }
        });
        assert_eq!(dx, dx2, "{what}: the input gradient with the sums");
        near(
            &dw,
            &values(want_dw, cols),
            &format!("{what}: weight gradient"),
        );
        near(
            &db,
            &values(want_db, cols),
            &format!("{what}: bias gradient"),
        );
        near(&y, &values(want_y, rows * cols), &format!("{what}: output"));
        near(
            &stats,
            &values(want_s, 2 * rows),
            &format!("{what}: statistics"),
        );
        near(
            &dx,
            &values(want_dx, rows * cols),
            &format!("{what}: input gradient"),
        );
    }
}

/// `bn_scale_bias_f16`: batch norm's map `alpha (x - center) + gamma` as an f16 scale and
/// bias, `[alpha | gamma - alpha center]`, over more channels than the grid's threads (the
/// loop strides), each within one f16 rounding of the f32 value; channels whose scale or
/// bias passes f16's range come divided by the smallest power of two that brings both
/// within 2^15, its factor beside them (1 for the others), and `wgrad_rescale_f16`
/// multiplies a KRSC weight gradient's channels back by those factors.
#[test]
fn batch_norm_scale_and_bias_in_f16() {
    let Some(lib) = library("norm") else {
        return;
    };
    type ScaleBias = unsafe extern "C" fn(*const f32, *mut half::f16, *mut f32, i64) -> ();
    type Rescale = unsafe extern "C" fn(*mut half::f16, *const f32, i64, i64) -> ();
    let kernel: ScaleBias = function(lib, "bn_scale_bias_f16");
    let rescale: Rescale = function(lib, "wgrad_rescale_f16");
    let c = 37;
    let mut coef: Vec<f32> = randn(&[4 * c], 60)
        .mul(3.0)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    // Channel 3's scale and channel 5's bias pass f16's 65504; channel 7's is not finite.
    coef[3] = 9.0e4;
    (coef[5], coef[c + 5]) = (2.0e3, -4.0e3);
    coef[7] = f32::INFINITY;
    let mut out = vec![half::f16::NAN; 2 * c];
    let mut factor = vec![f32::NAN; c];
    let (ka, oa, fa) = (
        Addr::of(&coef),
        Addr::of_mut(&mut out),
        Addr::of_mut(&mut factor),
    );
    run_grid(lib, 2, 8, || {
        // SAFETY: coef holds 4 c values, out 2 c, factor c; each channel is written by one
        // thread.
        unsafe { kernel(ka.ptr(), oa.ptr(), fa.ptr(), c as i64) }
    });
    for k in 0..c {
        let (a, m, g) = (coef[k], coef[c + k], coef[2 * c + k]);
        let (scale, bias) = (a, g - a * m);
        let big = scale.abs().max(bias.abs());
        let want_factor = match big.is_finite() {
            true => (0..)
                .map(|e| 2f32.powi(e))
                .find(|f| big / f <= 32768.0)
                .unwrap(),
            false => 1.0,
        };
        assert_eq!(factor[k], want_factor, "factor of channel {k}");
        assert_eq!(factor[k] != 1.0, [3, 5].contains(&k), "channel {k}");
        for (got, want, what) in [(out[k], scale, "scale"), (out[c + k], bias, "bias")] {
            let (got, want) = (got.to_f32() * factor[k], want);
            if !want.is_finite() {
                assert_eq!(got, want, "{what} of channel {k}");
                continue;
            }
            assert!(
                (got - want).abs() <= want.abs() * 2f32.powi(-11) * 1.01 + 1e-7 * factor[k],
                "{what} of channel {k}: {got} vs {want}"
            );
        }
    }
    // A weight gradient [2, 3, 3, c] (KRSC): each channel's values times its factor.
    let n = 2 * 3 * 3 * c;
    let dw: Vec<half::f16> = randn(&[n], 61)
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|&v| half::f16::from_f32(v))
        .collect();
    let mut scaled = dw.clone();
    let (sa, fa) = (Addr::of_mut(&mut scaled), Addr::of(&factor));
    run_grid(lib, 3, 8, || {
        // SAFETY: scaled holds n values, factor c; each value is written by one thread.
        unsafe { rescale(sa.ptr(), fa.ptr(), n as i64, c as i64) }
    });
    for i in 0..n {
        let f = factor[i % c];
        let want = match f == 1.0 {
            true => dw[i],
            false => half::f16::from_f32(dw[i].to_f32() * f),
        };
        assert_eq!(scaled[i].to_bits(), want.to_bits(), "element {i}");
    }
}
