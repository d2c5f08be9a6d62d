//! The TF32 switches, as PyTorch has them: f32 convolutions and the products of a cuDNN-class
//! op (the LSTM layer) may round operands to TF32 by default
//! (`torch.backends.cudnn.allow_tf32 = True`); plain f32 matrix products are exact unless
//! allowed (`torch.backends.cuda.matmul.allow_tf32 = False`). `conv` and `matmul` re-export
//! each switch beside the op it governs.

use std::sync::atomic::{AtomicBool, Ordering};

static CUDNN_TF32: AtomicBool = AtomicBool::new(true);
static MATMUL_TF32: AtomicBool = AtomicBool::new(false);

/// Lets f32 convolutions, and the products of the LSTM layer, use TF32 tensor cores (10-bit
/// mantissa products, f32 accumulation), as PyTorch's `torch.backends.cudnn.allow_tf32`
/// does. On by default, as there; `false` makes them exact f32. Plain matrix products have
/// their own switch, off by default ([`set_allow_tf32`]).
///
/// ```
/// use mantissa::backend::cuda::conv::{cudnn_allow_tf32, set_cudnn_allow_tf32};
/// assert!(cudnn_allow_tf32());
/// set_cudnn_allow_tf32(false);
/// assert!(!cudnn_allow_tf32());
/// set_cudnn_allow_tf32(true);
/// ```
pub fn set_cudnn_allow_tf32(allow: bool) {
    CUDNN_TF32.store(allow, Ordering::Relaxed);
}

/// Whether f32 convolutions and LSTM products may use TF32 (see [`set_cudnn_allow_tf32`]).
pub fn cudnn_allow_tf32() -> bool {
    CUDNN_TF32.load(Ordering::Relaxed)
}

/// Lets f32 matrix products use TF32 tensor cores (10-bit mantissa products, f32
/// accumulation), as `torch.backends.cuda.matmul.allow_tf32 = True` does. Off by default:
/// f32 products are exact f32 unless the user allows this.
///
/// ```
/// mantissa::backend::cuda::matmul::set_allow_tf32(true);
/// assert!(mantissa::backend::cuda::matmul::allow_tf32());
/// mantissa::backend::cuda::matmul::set_allow_tf32(false);
/// ```
pub fn set_allow_tf32(allow: bool) {
    MATMUL_TF32.store(allow, Ordering::Relaxed);
}

/// Whether f32 products may use TF32 (see [`set_allow_tf32`]).
pub fn allow_tf32() -> bool {
    MATMUL_TF32.load(Ordering::Relaxed)
}

/// Whether the f32 product about to run may use TF32: the matmul switch, or inside a
/// cuDNN-class op (the LSTM layer) the cuDNN one ([`set_cudnn_allow_tf32`]).
pub(crate) fn product_tf32() -> bool {
    allow_tf32() || (crate::backend::in_cudnn_class() && cudnn_allow_tf32())
}

#[cfg(test)]
mod tests {
    use super::{product_tf32, set_allow_tf32, set_cudnn_allow_tf32};
    use crate::backend::as_cudnn_class;

    #[test]
    fn lstm_products_follow_the_cudnn_switch_and_plain_products_the_matmul_one() {
        // PyTorch's defaults: plain products exact, cuDNN-class ops (the LSTM) TF32.
        assert!(!product_tf32());
        assert!(as_cudnn_class(product_tf32));
        set_cudnn_allow_tf32(false);
        assert!(!as_cudnn_class(product_tf32));
        set_allow_tf32(true);
        assert!(product_tf32() && as_cudnn_class(product_tf32));
        set_allow_tf32(false);
        set_cudnn_allow_tf32(true);
        // The scope ends with its closure, and on another thread it was never open.
        as_cudnn_class(|| {
            std::thread::spawn(|| assert!(!product_tf32()))
                .join()
                .unwrap()
        });
        assert!(!product_tf32());
    }
}
