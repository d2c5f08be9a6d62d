//! The kernel sources of `cuda/`, embedded in the binary. Each is compiled with the prelude
//! prepended (a `#line` directive keeps NVRTC's messages pointing at the right file).

/// `cuda/prelude.cuh`: f16/bf16 storage types and conversions, Philox, strided indexing.
pub const PRELUDE: &str = include_str!("../../../cuda/prelude.cuh");

/// Every kernel file: (name, source).
pub const KERNELS: &[(&str, &str)] = &[
    ("attention", include_str!("../../../cuda/attention.cu")),
    ("cast", include_str!("../../../cuda/cast.cu")),
    ("elementwise", include_str!("../../../cuda/elementwise.cu")),
    ("flash", include_str!("../../../cuda/flash.cu")),
    ("index", include_str!("../../../cuda/index.cu")),
    ("norm", include_str!("../../../cuda/norm.cu")),
    ("optim", include_str!("../../../cuda/optim.cu")),
    ("pool", include_str!("../../../cuda/pool.cu")),
    ("pool_vec", include_str!("../../../cuda/pool_vec.cu")),
    ("amp", include_str!("../../../cuda/amp.cu")),
    ("random", include_str!("../../../cuda/random.cu")),
    ("reduce", include_str!("../../../cuda/reduce.cu")),
    ("rnn", include_str!("../../../cuda/rnn.cu")),
    (
        "softmax_xent",
        include_str!("../../../cuda/softmax_xent.cu"),
    ),
    ("sort", include_str!("../../../cuda/sort.cu")),
];

/// Headers a family of kernel files shares, placed after the prelude: (header name, source,
/// the files that include it).
const HEADERS: &[(&str, &str, &[&str])] = &[(
    "pool.cuh",
    include_str!("../../../cuda/pool.cuh"),
    &["pool", "pool_vec"],
)];

/// The kernel files, by name: what a launch names (a misspelt file is a compile error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelFile {
    Amp,
    Attention,
    Cast,
    Elementwise,
    Flash,
    Index,
    Norm,
    Optim,
    Pool,
    PoolVec,
    Random,
    Reduce,
    Rnn,
    SoftmaxXent,
    Sort,
}

impl KernelFile {
    /// Every kernel file.
    pub const ALL: [KernelFile; 15] = [
        KernelFile::Amp,
        KernelFile::Attention,
        KernelFile::Cast,
        KernelFile::Elementwise,
        KernelFile::Flash,
        KernelFile::Index,
        KernelFile::Norm,
        KernelFile::Optim,
        KernelFile::Pool,
        KernelFile::PoolVec,
        KernelFile::Random,
        KernelFile::Reduce,
        KernelFile::Rnn,
        KernelFile::SoftmaxXent,
        KernelFile::Sort,
    ];

    /// The file's name in [`KERNELS`] (`cuda/<name>.cu`).
    pub fn name(self) -> &'static str {
        match self {
            KernelFile::Amp => "amp",
            KernelFile::Attention => "attention",
            KernelFile::Cast => "cast",
            KernelFile::Elementwise => "elementwise",
            KernelFile::Flash => "flash",
            KernelFile::Index => "index",
            KernelFile::Norm => "norm",
            KernelFile::Optim => "optim",
            KernelFile::Pool => "pool",
            KernelFile::PoolVec => "pool_vec",
            KernelFile::Random => "random",
            KernelFile::Reduce => "reduce",
            KernelFile::Rnn => "rnn",
            KernelFile::SoftmaxXent => "softmax_xent",
            KernelFile::Sort => "sort",
        }
    }
}

/// How many parts a kernel file compiles in (`cuda/prelude.cuh`: `MANTISSA_PART`): the f32 and
/// integer kernels, the f16 ones, the bf16 ones.
pub const PARTS: usize = 3;

/// The part that holds kernel `name`: the first dtype its name spells (`cast_f16_float`: 1,
/// the f16 part; `optim_master_float_bf16`: 0), or 0 for a name without one.
///
/// ```
/// # #[cfg(feature = "cuda-backend")] {
/// use mantissa::backend::cuda::kernels::part_of;
/// assert_eq!(part_of("unary_strided_bf16"), 2);
/// assert_eq!(part_of("cast_f16_float"), 1);
/// assert_eq!(part_of("optim_master_float_f16"), 0);
/// assert_eq!(part_of("bn_finalize"), 0);
/// # }
/// ```
pub fn part_of(name: &str) -> usize {
    for token in name.split('_') {
        match token {
            "f16" => return 1,
            "bf16" => return 2,
            "float" | "i64" | "u8" | "u16" | "u32" | "u64" => return 0,
            _ => {}
        }
    }
    0
}

/// The part that holds the kernels of `dtype` (f16: 1, bf16: 2, any other: 0), for a caller
/// that knows which dtypes a run will use ([`super::compile::prefetch`]).
pub fn part_for(dtype: crate::DType) -> usize {
    match dtype {
        crate::DType::F16 => 1,
        crate::DType::BF16 => 2,
        _ => 0,
    }
}

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
/// op codes, the prelude, the headers of its family, then the file.
pub fn source(name: &str) -> Option<String> {
    let (_, body) = KERNELS.iter().find(|(n, _)| *n == name)?;
    let codes = op_codes();
    let headers: String = HEADERS
        .iter()
        .filter(|(_, _, files)| files.contains(&name))
        .map(|(h, text, _)| format!("#line 1 \"{h}\"\n{text}\n"))
        .collect();
    Some(format!(
        "#line 1 \"op_codes.h\"\n{codes}#line 1 \"prelude.cuh\"\n{PRELUDE}\n{headers}#line 1 \"{name}.cu\"\n{body}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_file_has_its_name_and_source() {
        let names: Vec<&str> = KernelFile::ALL.iter().map(|f| f.name()).collect();
        let listed: Vec<&str> = KERNELS.iter().map(|(n, _)| *n).collect();
        assert_eq!(names.len(), listed.len());
        for n in &listed {
            assert!(names.contains(n), "{n} has no KernelFile");
        }
        for f in KernelFile::ALL {
            let src = source(f.name()).expect("a listed file");
            assert!(src.contains("#define UNARY_SOFTPLUS") && src.contains("#define CMP_GE"));
        }
    }
}
