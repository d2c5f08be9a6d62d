//! The host memory limit: a request past it is refused before any memory is touched, so an
//! op whose output the machine could never hold fails at once, whatever the OS's overcommit
//! policy (a host that grants every request would otherwise let the kernel fill terabytes).
//! One test in its own binary: the limit is process-wide.

use mantissa::{memory, Conv2dOptions, DType, Device, Error, Result, Tensor};

#[test]
fn requests_past_the_host_limit_are_refused_at_once() {
    let default = memory::host_memory_limit();
    assert!(default >= 64 << 20, "default limit {default}");
    // 256 MiB: each output below asks for 4 GiB or more, which a 2-core CI machine with
    // overcommit would grant and then spend seconds to minutes filling.
    let limit = 256usize << 20;
    memory::set_host_memory_limit(Some(limit));
    assert_eq!(memory::host_memory_limit(), limit);
    let refused = |r: Result<Tensor>, what: &str| match r {
        Err(Error::OutOfMemory {
            device: Device::Cpu,
            requested,
            stats,
        }) => {
            assert!(requested > limit, "{what}: {requested} bytes");
            assert!(stats.contains(&limit.to_string()), "{what}: {stats}");
        }
        Err(e) => panic!("{what}: an out-of-memory error naming the limit expected, got {e}"),
        Ok(t) => panic!("{what}: Ok with shape {:?}", t.shape()),
    };
    let n = 1usize << 30;
    let big = Tensor::ones(&[1], DType::F32, Device::Cpu)
        .unwrap()
        .expand(&[n])
        .unwrap();
    refused(big.exp(), "exp");
    refused(big.add(&big), "add");
    refused(big.to_dtype(DType::F16), "to_dtype");
    refused(big.contiguous(), "contiguous");
    assert!(matches!(
        big.to_vec::<f32>(),
        Err(Error::OutOfMemory { .. })
    ));
    refused(Tensor::zeros(&[n], DType::F32, Device::Cpu), "zeros");
    refused(Tensor::randn(&[n], DType::F32, Device::Cpu), "randn");
    let idx = Tensor::from_vec(vec![0i64], &[1], Device::Cpu)
        .unwrap()
        .expand(&[1 << 26])
        .unwrap();
    let rows = Tensor::ones(&[1, 64], DType::F32, Device::Cpu).unwrap();
    refused(rows.index_select(0, &idx), "index_select of 2^26 rows");
    // A padding that makes the output 2^32 elements (16 GiB of f32).
    let x = Tensor::ones(&[1, 1, 4, 4], DType::F32, Device::Cpu).unwrap();
    let w = Tensor::ones(&[1, 1, 3, 3], DType::F32, Device::Cpu).unwrap();
    let opts = Conv2dOptions {
        padding: [1 << 15, 1 << 15],
        ..Default::default()
    };
    refused(x.conv2d(&w, None, opts), "conv2d with a 2^15 padding");
    // What fits the limit still runs.
    let small = big.narrow(0, 0, 1 << 20).unwrap();
    let sum = small.exp().unwrap().sum_all().unwrap().item().unwrap();
    let want = (1u64 << 20) as f64 * std::f64::consts::E;
    assert!((sum - want).abs() / want < 1e-4, "sum {sum}, want {want}");
    // Back to the default, the same small request is still fine and the limit is as before.
    memory::set_host_memory_limit(None);
    assert_eq!(memory::host_memory_limit(), default);
}
