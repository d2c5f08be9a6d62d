//! `view` as PyTorch's: every shape the strides allow without a copy (a dim split, or dims
//! merged, where the dims involved are contiguous among themselves), and an error for the
//! rest. Checked: PyTorch's own examples; every view `view` gives walks the same memory, in
//! row-major order, as the tensor it views (over many layouts and every shape of their
//! element count); the values and gradients through a view of a transposed tensor.

mod common;
use common::vals;
use mantissa::layout::Layout;
use mantissa::*;

/// The memory offset of each element of `l`, in row-major order of its shape.
fn offsets(l: &Layout) -> Vec<usize> {
    let n: usize = l.shape().iter().product();
    (0..n)
        .map(|mut flat| {
            let mut at = l.offset();
            for (&d, &s) in l.shape().iter().zip(l.strides()).rev() {
                at += (flat % d) * s;
                flat /= d;
            }
            at
        })
        .collect()
}

/// Every shape of `n` elements with at most `rank` dims (size-1 dims included).
fn shapes(n: usize, rank: usize) -> Vec<Vec<usize>> {
    if rank == 0 {
        return match n {
            1 => vec![vec![]],
            _ => vec![],
        };
    }
    let mut out = shapes(n, rank - 1);
    for d in (1..=n).filter(|d| n.is_multiple_of(*d)) {
        for mut rest in shapes(n / d, rank - 1) {
            rest.insert(0, d);
            if !out.contains(&rest) {
                out.push(rest);
            }
        }
    }
    out
}

#[test]
fn pytorchs_examples_view_and_the_rest_is_refused() {
    let x = Tensor::arange(0.0, 24.0, 1.0, DType::F32, Device::Cpu)
        .unwrap()
        .reshape(&[4, 6])
        .unwrap();
    // zeros(4, 6).t().view(6, 2, 2): the transposed dim of 4 splits in two.
    let t = x.t().unwrap();
    let v = t.view(&[6, 2, 2]).unwrap();
    assert!(v.shares_storage(&x));
    assert_eq!(vals(&v), vals(&t.reshape(&[6, 2, 2]).unwrap()));
    // The two dims of the transpose are not contiguous together: no view merges them.
    let e = t.view(&[24]).unwrap_err().to_string();
    assert!(e.contains("reshape"), "{e}");
    assert!(t.view(&[3, 8]).is_err());
    // Size-1 dims anywhere, and -1.
    assert_eq!(t.view(&[1, 6, 1, 4]).unwrap().shape(), &[1, 6, 1, 4]);
    assert_eq!(t.view(&[6, -1, 2]).unwrap().shape(), &[6, 2, 2]);
    // A 4-D tensor with its first two dims swapped: the last two, still together, merge;
    // the swapped ones split but do not merge.
    let y = Tensor::zeros(&[2, 3, 4, 5], DType::F32, Device::Cpu)
        .unwrap()
        .permute(&[1, 0, 2, 3])
        .unwrap();
    assert_eq!(y.view(&[3, 2, 20]).unwrap().strides(), &[20, 60, 1]);
    assert!(y.view(&[3, 2, 2, 2, 5]).is_ok());
    assert!(y.view(&[6, 20]).is_err());
    // With the middle two swapped, no two neighbours lie together in memory.
    let z = Tensor::zeros(&[2, 3, 4, 5], DType::F32, Device::Cpu)
        .unwrap()
        .permute(&[0, 2, 1, 3])
        .unwrap();
    assert!(z.view(&[2, 2, 2, 3, 5]).is_ok());
    assert!(z.view(&[2, 4, 15]).is_err());
    assert!(z.view(&[8, 15]).is_err());
    // A narrowed tensor's rows are still whole: its dims merge as before.
    let n = x.narrow(0, 1, 2).unwrap();
    assert_eq!(
        vals(&n.view(&[12]).unwrap()),
        (6..18).map(f64::from).collect::<Vec<_>>()
    );
    assert!(x.narrow(1, 1, 4).unwrap().view(&[16]).is_err());
    // The element count must still match.
    assert!(t.view(&[5, 5]).is_err());
}

#[test]
fn every_view_walks_the_memory_of_the_viewed_tensor() {
    let mut checked = 0;
    for base in [vec![2, 3, 4], vec![4, 1, 6], vec![2, 2, 2, 3], vec![6, 4]] {
        let n: usize = base.iter().product();
        let rank = base.len();
        // Every permutation of the dims (and each narrowed by one along dim 0 where it can).
        let mut perms = vec![(0..rank).collect::<Vec<_>>()];
        while let Some(p) = next_perm(perms.last().unwrap()) {
            perms.push(p);
        }
        for perm in perms {
            let l = Layout::contiguous(&base).permute("p", &perm).unwrap();
            let want = offsets(&l);
            for shape in shapes(n, 4) {
                if let Some(v) = l.view_as(&shape) {
                    assert_eq!(
                        offsets(&v),
                        want,
                        "{:?} {:?} as {shape:?}",
                        l.shape(),
                        l.strides()
                    );
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 500, "{checked} views checked");
}

/// The next permutation in lexicographic order.
fn next_perm(p: &[usize]) -> Option<Vec<usize>> {
    let mut p = p.to_vec();
    let i = (0..p.len().saturating_sub(1))
        .rev()
        .find(|&i| p[i] < p[i + 1])?;
    let j = (i + 1..p.len()).rev().find(|&j| p[j] > p[i])?;
    p.swap(i, j);
    p[i + 1..].reverse();
    Some(p)
}

#[test]
fn a_view_of_a_transpose_carries_values_and_gradients() {
    let x = Tensor::arange(0.0, 24.0, 1.0, DType::F32, Device::Cpu)
        .unwrap()
        .reshape(&[4, 6])
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let w = Tensor::arange(1.0, 25.0, 1.0, DType::F32, Device::Cpu)
        .unwrap()
        .reshape(&[6, 2, 2])
        .unwrap();
    let v = x.t().unwrap().view(&[6, 2, 2]).unwrap();
    v.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    // d/dx of sum(x^T viewed * w) is w viewed back through the transpose.
    let want = w
        .reshape(&[6, 4])
        .unwrap()
        .t()
        .unwrap()
        .contiguous()
        .unwrap();
    assert_eq!(vals(&x.grad().unwrap()), vals(&want));
}
