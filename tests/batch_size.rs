//! The batch-size finder: on a CUDA device (the emulated one in CI, its memory capped with
//! `MANTISSA_EMU_MEM_BYTES`) the size it returns runs and the next one does not; on the CPU, the
//! trial step leaves the model and optimizer as it found them.

mod common;
use common::parity::{emulated, gpu};
use mantissa::nn::*;
use mantissa::optim::{Adam, AdamConfig, Optimizer, SgdConfig, Sgld};
use mantissa::train::{classifier_fits, find_batch_size, BatchSizeSearch};
use mantissa::*;

/// An MLP with batch norm and dropout over 1024 features (4 KiB a sample in f32).
fn model(device: Device) -> Sequential {
    let mut g = Generator::new(3);
    let mut m = Sequential::new()
        .push(Linear::new(1024, 64, true, &mut g).unwrap())
        .push(Activation::Relu)
        .push(Dropout::new(0.2, 5))
        .push(Linear::new(64, 10, true, &mut g).unwrap());
    m.to_device(device).unwrap();
    m
}

fn batch(b: usize, device: Device) -> Result<(Tensor, Tensor)> {
    let x = Tensor::randn(&[b, 1024], DType::F32, device)?;
    let y = Tensor::zeros(&[b], DType::I64, device)?;
    Ok((x, y))
}

fn snapshot(m: &dyn Module) -> Vec<(String, Vec<u8>)> {
    let mut v = Vec::new();
    m.visit("", &mut |n, t, _| v.push((n, t.to_le_bytes().unwrap())));
    v
}

#[test]
fn the_found_size_runs_and_the_next_does_not() {
    let Some(dev) = gpu() else { return };
    if emulated(dev) && std::env::var_os("MANTISSA_EMU_MEM_BYTES").is_none() {
        eprintln!("skipped: the emulated device needs MANTISSA_EMU_MEM_BYTES (a small cap)");
        return;
    }
    let net = model(dev);
    let mut opt = Adam::new(net.parameters(), AdamConfig::adam(1e-3)).unwrap();
    let before = snapshot(&net);
    let search = BatchSizeSearch {
        start: 16,
        max: 1 << 26,
    };
    let mut trial = |b: usize| {
        let (x, y) = batch(b, dev)?;
        classifier_fits(&net, &mut opt, None, &x, &y)
    };
    let found = find_batch_size(dev, search, &mut trial).unwrap();
    eprintln!("found {} after {:?}", found.size, found.tried);
    let size = found.size;
    assert!(size >= 16 && size < search.max, "{size}");
    assert!(found.tried.contains(&(size, true)));
    assert!(found.tried.iter().any(|&(b, ok)| !ok && b <= 2 * size));
    // Doubling from 16, then bisecting: every size that fitted is below every one that did
    // not.
    let largest_ok = found.tried.iter().filter(|t| t.1).map(|t| t.0).max();
    let smallest_bad = found.tried.iter().filter(|t| !t.1).map(|t| t.0).min();
    assert_eq!(largest_ok, Some(size));
    assert_eq!(smallest_bad, Some(size + 1), "bisected to the last sample");
    memory::empty_cache(dev).unwrap();
    trial(size).unwrap();
    // Near the device's capacity the memory a step takes is not monotone in the batch size:
    // the caching allocator carves requests up to 1 MiB from 2 MiB segments that long-lived
    // blocks pin (PyTorch's allocator behaves alike), so on an 8 MiB device a larger batch,
    // whose input has a segment of its own, may fit where the next size up did not. What the
    // finder promises is that the found size runs and the next one, tried the same way, does
    // not; and neither does four times the size (its input alone is near half the device).
    for b in [size + 1, 4 * size] {
        memory::empty_cache(dev).unwrap();
        match trial(b) {
            Err(Error::OutOfMemory { .. }) => {}
            other => panic!("{b} samples: {other:?}"),
        }
    }
    // The trials left the parameters, the dropout stream and the gradients as they were.
    assert_eq!(snapshot(&net), before);
    assert!(net.parameters().iter().all(|p| p.grad().is_none()));
}

#[test]
fn a_trial_step_leaves_no_trace_and_the_cpu_is_refused() {
    let mut g = Generator::new(1);
    let mut net = Sequential::new()
        .push(Conv2d::new(1, 4, 3, Conv2dOptions::default(), true, &mut g).unwrap())
        .push(BatchNorm2d::new(4).unwrap())
        .push(Activation::Relu)
        .push(Dropout::new(0.5, 9))
        .push(Flatten)
        .push(Linear::new(4 * 4 * 4, 3, true, &mut g).unwrap());
    net.train();
    let mut opt = Sgld::new(net.parameters(), SgdConfig::new(0.1), 1.0, 4).unwrap();
    let (before, gen) = (snapshot(&net), opt.generator());
    let x = Tensor::randn(&[6, 1, 6, 6], DType::F32, Device::Cpu).unwrap();
    let y = Tensor::from_vec(vec![0i64, 1, 2, 0, 1, 2], &[6], Device::Cpu).unwrap();
    classifier_fits(&net, &mut opt, Some(DType::BF16), &x, &y).unwrap();
    assert_eq!(
        snapshot(&net),
        before,
        "parameters, BN statistics, dropout stream"
    );
    assert_eq!(opt.generator(), gen);
    assert!(net.parameters().iter().all(|p| p.grad().is_none()));
    // The optimizer's state exists (a first step's memory) and says no update was applied.
    assert_eq!(opt.states()[0].step_count().unwrap(), 0);
    assert!(opt.states()[0].tensors.contains_key("step"));
    // A bad label is the step's own error, not a size.
    let bad = Tensor::from_vec(vec![7i64; 6], &[6], Device::Cpu).unwrap();
    assert!(classifier_fits(&net, &mut opt, None, &x, &bad).is_err());
    assert_eq!(snapshot(&net), before);

    let search = BatchSizeSearch { start: 8, max: 64 };
    let err = find_batch_size(Device::Cpu, search, |_| Ok(())).unwrap_err();
    assert!(err.to_string().contains("give the batch size"), "{err}");
    if let Some(dev) = gpu() {
        let bad = BatchSizeSearch { start: 0, max: 64 };
        assert!(find_batch_size(dev, bad, |_| Ok(())).is_err());
        // A trial's error other than out of memory comes back as it is.
        let err = find_batch_size(dev, search, |_| {
            Err(Error::Invalid {
                op: "trial",
                msg: "broken".into(),
            })
        });
        assert!(err.unwrap_err().to_string().contains("broken"));
        // Everything fits: the search stops at max.
        let all = find_batch_size(dev, search, |_| Ok(())).unwrap();
        assert_eq!(all.size, 64);
        assert_eq!(
            all.tried,
            vec![(8, true), (16, true), (32, true), (64, true)]
        );
    }
}

#[test]
fn a_size_the_device_refuses_is_the_ceiling() {
    let Some(dev) = gpu() else { return };
    let search = BatchSizeSearch {
        start: 4,
        max: 1000,
    };
    // Past 100 the call is refused as a real cuDNN refuses a tensor past its 32-bit limits;
    // past 300, as a size the engine cannot represent.
    let refusal = |b: usize| -> Result<()> {
        match b {
            ..=100 => Ok(()),
            101..=300 => Err(Error::CudaLibraryStatus {
                lib: "cuDNN",
                op: "conv2d",
                device: dev,
                status: "CUDNN_STATUS_NOT_SUPPORTED".into(),
                what: "output descriptor".into(),
            }),
            _ => Err(Error::TooLarge {
                op: "conv2d",
                shape: vec![b],
                msg: "past the limit".into(),
            }),
        }
    };
    let found = find_batch_size(dev, search, refusal).unwrap();
    assert_eq!(found.size, 100, "{:?}", found.tried);
    assert!(found.tried.contains(&(101, false)), "{:?}", found.tried);
    // Any other library status is a fault, returned as it is.
    let fault = |b: usize| -> Result<()> {
        match b {
            ..=8 => Ok(()),
            _ => Err(Error::CudaLibraryStatus {
                lib: "cuDNN",
                op: "conv2d",
                device: dev,
                status: "CUDNN_STATUS_BAD_PARAM".into(),
                what: "input descriptor".into(),
            }),
        }
    };
    match find_batch_size(dev, search, fault) {
        Err(Error::CudaLibraryStatus { status, .. }) => assert!(status.contains("BAD_PARAM")),
        other => panic!("{other:?}"),
    }
}
