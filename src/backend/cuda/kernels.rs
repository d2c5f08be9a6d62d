//! The kernel sources of `cuda/`, embedded in the binary. Each is compiled with the prelude
//! prepended (a `#line` directive keeps NVRTC's messages pointing at the right file).

/// `cuda/prelude.cuh`: f16/bf16 storage types and conversions, Philox, strided indexing.
pub const PRELUDE: &str = include_str!("../../../cuda/prelude.cuh");

/// Every kernel file: (name, source).
pub const KERNELS: &[(&str, &str)] = &[
    ("cast", include_str!("../../../cuda/cast.cu")),
    ("elementwise", include_str!("../../../cuda/elementwise.cu")),
    ("index", include_str!("../../../cuda/index.cu")),
    ("norm", include_str!("../../../cuda/norm.cu")),
    ("optim", include_str!("../../../cuda/optim.cu")),
    ("pool", include_str!("../../../cuda/pool.cu")),
    ("amp", include_str!("../../../cuda/amp.cu")),
    ("random", include_str!("../../../cuda/random.cu")),
    ("reduce", include_str!("../../../cuda/reduce.cu")),
    ("rnn", include_str!("../../../cuda/rnn.cu")),
    (
        "softmax_xent",
        include_str!("../../../cuda/softmax_xent.cu"),
    ),
];

/// The full source NVRTC compiles for kernel file `name`, or `None` if there is none.
pub fn source(name: &str) -> Option<String> {
    let (_, body) = KERNELS.iter().find(|(n, _)| *n == name)?;
    Some(format!(
        "#line 1 \"prelude.cuh\"\n{PRELUDE}\n#line 1 \"{name}.cu\"\n{body}"
    ))
}
