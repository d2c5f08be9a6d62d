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

/// `#define`s of the op codes the kernels switch on (`UNARY_EXP`, `BINARY_ADD`, `CMP_LT`,
/// `REDUCE_SUM`, ...), generated from the Rust enums, so the two sides cannot disagree.
pub fn op_codes() -> String {
    use crate::backend::ops::{BinaryOp, CmpOp, ReduceOp, UnaryOp};
    use std::fmt::Write;
    let mut s = String::new();
    let mut define = |family: &str, name: &str, code: i32| {
        let _ = writeln!(s, "#define {family}_{} {code}", name.to_uppercase());
    };
    for op in UnaryOp::ALL {
        define("UNARY", op.name(), op.code());
    }
    for op in BinaryOp::ALL {
        define("BINARY", op.name(), op.code());
    }
    for op in CmpOp::ALL {
        define("CMP", op.name(), op.code());
    }
    for op in ReduceOp::ALL {
        define("REDUCE", op.name(), op.code());
    }
    s
}

/// The full source NVRTC compiles for kernel file `name`, or `None` if there is none: the
/// op codes, the prelude, then the file.
pub fn source(name: &str) -> Option<String> {
    let (_, body) = KERNELS.iter().find(|(n, _)| *n == name)?;
    let codes = op_codes();
    Some(format!(
        "#line 1 \"op_codes.h\"\n{codes}#line 1 \"prelude.cuh\"\n{PRELUDE}\n#line 1 \"{name}.cu\"\n{body}"
    ))
}
