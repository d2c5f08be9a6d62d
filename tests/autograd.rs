//! Autograd semantics: accumulation, explicit gradients, no_grad, detach, freeing the graph,
//! views sharing storage.

use mantissa::*;

fn v(x: Vec<f32>, s: &[usize]) -> Tensor {
    Tensor::from_vec(x, s, Device::Cpu).unwrap()
}

#[test]
fn gradients_accumulate_on_leaves_until_cleared() {
    let x = v(vec![1.0, 2.0], &[2]).requires_grad(true).unwrap();
    for _ in 0..2 {
        x.mul(3.0).unwrap().sum_all().unwrap().backward().unwrap();
    }
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![6.0, 6.0]);
    x.zero_grad();
    assert!(x.grad().is_none());
    // A tensor used twice gets both contributions.
    x.mul(&x)
        .unwrap()
        .add(&x)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![3.0, 5.0]);
}

#[test]
fn backward_with_explicit_gradient_and_non_scalar_error() {
    let x = v(vec![1.0, 2.0, 3.0], &[3]).requires_grad(true).unwrap();
    let y = x.sqr().unwrap();
    let err = y.backward().unwrap_err().to_string();
    assert!(err.contains("scalar"), "{err}");
    y.backward_with(&v(vec![1.0, 0.5, 0.0], &[3])).unwrap();
    assert_eq!(
        x.grad().unwrap().to_vec::<f32>().unwrap(),
        vec![2.0, 2.0, 0.0]
    );
}

#[test]
fn graph_is_freed_after_backward() {
    let x = v(vec![1.0, 2.0], &[2]).requires_grad(true).unwrap();
    let loss = x.exp().unwrap().sum_all().unwrap();
    loss.backward().unwrap();
    let err = loss.backward().unwrap_err().to_string();
    assert!(err.contains("already freed"), "{err}");
    // Every node the pass ran is freed, intermediate ones included: a new graph built on an
    // intermediate cannot go back through it.
    let y = v(vec![1.0, 2.0], &[2]).requires_grad(true).unwrap();
    let tmp = y.mul(2.0).unwrap();
    tmp.exp().unwrap().sum_all().unwrap().backward().unwrap();
    let err = tmp.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(err.contains("`mul`"), "{err}");
}

#[test]
fn no_grad_and_detach_cut_the_graph() {
    let x = v(vec![1.0], &[1]).requires_grad(true).unwrap();
    let y = no_grad(|| x.mul(2.0)).unwrap();
    assert!(!y.is_requires_grad() && y.is_leaf());
    assert!(is_grad_enabled());
    {
        let _g = NoGradGuard::new();
        assert!(!is_grad_enabled());
        {
            let _inner = NoGradGuard::new();
        }
        assert!(!is_grad_enabled(), "inner guard restores the outer state");
    }
    assert!(is_grad_enabled());
    let d = x.mul(2.0).unwrap().detach();
    assert!(!d.is_requires_grad());
    let err = d.exp().unwrap().sum_all().unwrap().backward().unwrap_err();
    assert!(err.to_string().contains("does not require grad"));
    // Setting requires_grad on a non-leaf is refused; on an integer tensor too.
    assert!(x.mul(2.0).unwrap().requires_grad(true).is_err());
    let i = Tensor::from_vec(vec![1i64], &[1], Device::Cpu).unwrap();
    assert!(i.requires_grad(true).is_err());
}

#[test]
fn views_share_storage_and_in_place_copies_show_through() {
    let base = Tensor::arange(0.0, 6.0, 1.0, DType::F32, Device::Cpu)
        .unwrap()
        .reshape(&[2, 3])
        .unwrap();
    let col = base.narrow(1, 1, 1).unwrap();
    assert!(col.shares_storage(&base));
    assert!(!col.is_contiguous());
    let before = base.version();
    col.copy_(&v(vec![10.0, 20.0], &[2, 1])).unwrap();
    assert!(base.version() > before);
    assert_eq!(
        base.to_vec::<f32>().unwrap(),
        vec![0.0, 10.0, 2.0, 3.0, 20.0, 5.0]
    );
    let t = base.t().unwrap();
    assert_eq!(t.shape(), &[3, 2]);
    assert_eq!(
        t.to_vec::<f32>().unwrap(),
        vec![0.0, 3.0, 10.0, 20.0, 2.0, 5.0]
    );
    let e = v(vec![1.0, 2.0], &[2, 1]).expand(&[2, 3]).unwrap();
    assert_eq!(e.strides(), &[1, 0]);
    assert_eq!(
        e.contiguous().unwrap().to_vec::<f32>().unwrap(),
        vec![1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    );
}

#[test]
fn seeded_random_tensors_repeat() {
    manual_seed(42);
    let a = Tensor::randn(&[5], DType::F32, Device::Cpu).unwrap();
    manual_seed(42);
    let b = Tensor::randn(&[5], DType::F32, Device::Cpu).unwrap();
    assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    let c = Tensor::randn(&[5], DType::F32, Device::Cpu).unwrap();
    assert_ne!(a.to_vec::<f32>().unwrap(), c.to_vec::<f32>().unwrap());
    let mut g = Generator::new(1);
    let d = Tensor::ones(&[10000], DType::F32, Device::Cpu)
        .unwrap()
        .dropout_with(0.25, true, &mut g)
        .unwrap();
    let kept = d
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .filter(|&&x| x != 0.0)
        .count();
    assert!((7300..7700).contains(&kept), "{kept}");
    assert!(d
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .all(|&x| x == 0.0 || (x - 4.0 / 3.0).abs() < 1e-6));
    let e = Tensor::ones(&[4], DType::F32, Device::Cpu)
        .unwrap()
        .dropout(0.5, false)
        .unwrap();
    assert_eq!(e.to_vec::<f32>().unwrap(), vec![1.0; 4]);
}

#[test]
fn scalar_conversions_and_item() {
    let x = Tensor::full(&[1, 1], 2.5, DType::BF16, Device::Cpu).unwrap();
    assert_eq!(x.item().unwrap(), 2.5);
    assert!(Tensor::ones(&[2], DType::F32, Device::Cpu)
        .unwrap()
        .item()
        .is_err());
    assert!(x.to_vec::<f32>().is_err());
    assert_eq!(x.to_vec::<bf16>().unwrap(), vec![bf16::from_f32(2.5)]);
    let i = Tensor::arange(0.0, 3.0, 1.0, DType::F32, Device::Cpu)
        .unwrap()
        .to_dtype(DType::I64)
        .unwrap();
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![0, 1, 2]);
}
