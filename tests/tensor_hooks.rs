//! Gradient hooks on tensors and `retain_grad` (PyTorch's `register_hook` and
//! `retain_grad`): what a hook sees and returns, once per backward for a leaf used twice,
//! on intermediates, removed by its handle; mistakes are errors.

use mantissa::*;

fn v(x: &[f32]) -> Tensor {
    Tensor::from_vec(x.to_vec(), &[x.len()], Device::Cpu).unwrap()
}

fn read(t: &Tensor) -> Vec<f32> {
    t.grad().expect("a gradient").to_vec::<f32>().unwrap()
}

#[test]
fn a_leaf_hook_sees_the_whole_gradient_once() {
    let x = v(&[1.0, -2.0]).requires_grad(true).unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    // A nonlinear hook (clamp): applied to each use's part instead of the sum, it would
    // give another result.
    let h = x
        .register_hook(move |g| {
            log.lock().unwrap().push(g.to_vec::<f32>()?);
            Ok(Some(g.clamp(-4.0, 4.0)?))
        })
        .unwrap();
    // x used twice: d/dx (3x + 2x) = 5 per element, clamped to 4.
    let y = x.mul(3.0).unwrap().add(&x.mul(2.0).unwrap()).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(read(&x), vec![4.0, 4.0]);
    assert_eq!(*seen.lock().unwrap(), vec![vec![5.0, 5.0]]);
    h.remove();
    x.zero_grad();
    x.mul(5.0).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(read(&x), vec![5.0, 5.0], "removed");
    assert_eq!(seen.lock().unwrap().len(), 1);
}

#[test]
fn hooks_on_intermediates_change_what_flows_on_and_retain_grad_keeps_it() {
    let x = v(&[1.0, 2.0, 3.0]).requires_grad(true).unwrap();
    let h = x.mul(2.0).unwrap();
    h.retain_grad().unwrap();
    // Zero the gradient of h's middle element: x's gradient loses it too.
    h.register_hook(|g| Ok(Some(g.mul(&v(&[1.0, 0.0, 1.0]))?)))
        .unwrap();
    let loss = h.sqr().unwrap().sum_all().unwrap();
    loss.retain_grad().unwrap();
    loss.backward().unwrap();
    // d loss / dh = 2h = [4, 8, 12], masked; retained after the hook, as in PyTorch.
    assert_eq!(read(&h), vec![4.0, 0.0, 12.0]);
    assert_eq!(read(&loss), vec![1.0]);
    assert_eq!(read(&x), vec![8.0, 0.0, 24.0]);
    // A second backward through a kept graph runs the hook and accumulates again.
    let x2 = v(&[1.0]).requires_grad(true).unwrap();
    let m = x2.mul(3.0).unwrap();
    m.retain_grad().unwrap();
    let out = m.sqr().unwrap().sum_all().unwrap();
    out.backward_retain_graph().unwrap();
    out.backward().unwrap();
    assert_eq!(read(&m), vec![12.0]);
    assert_eq!(read(&x2), vec![36.0]);
}

#[test]
fn hook_mistakes_are_errors() {
    let c = v(&[1.0]);
    assert!(c.retain_grad().is_err());
    assert!(c.register_hook(|_| Ok(None)).is_err());
    let x = v(&[1.0, 2.0]).requires_grad(true).unwrap();
    x.retain_grad().unwrap(); // a leaf keeps its gradient anyway
    x.register_hook(|_| Ok(Some(v(&[1.0, 2.0, 3.0])))).unwrap();
    let e = x
        .mul(2.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap_err();
    assert!(e.to_string().contains("hook returned shape [3]"), "{e}");
    let y = v(&[1.0]).requires_grad(true).unwrap();
    y.register_hook(|_| Err(Error::Autograd("refused by the hook".into())))
        .unwrap();
    let e = y
        .mul(2.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap_err();
    assert!(e.to_string().contains("refused by the hook"), "{e}");
}
