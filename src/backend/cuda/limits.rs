//! The 32-bit limits of the CUDA libraries: cuDNN's descriptors take `int` dims and strides,
//! and a tensor of more than 2^31 - 1 elements is `CUDNN_STATUS_NOT_SUPPORTED`. A call past
//! the limit is split along the batch into pieces that fit (PyTorch does the same for its
//! convolutions), or runs on the engine's own kernels, which index in 64 bits.
//!
//! `MANTISSA_CUDA_INDEX_LIMIT` (elements, read once) lowers the limit, so that the split can
//! be exercised without gigabytes of data; the emulated cuDNN of the tests reads the same
//! variable and refuses what passes it.

use std::sync::OnceLock;

/// The most elements one tensor may have in a cuDNN call: 2^31 - 1, or the lower value of
/// `MANTISSA_CUDA_INDEX_LIMIT`.
///
/// ```
/// # #[cfg(feature = "cuda-backend")]
/// assert!(mantissa::backend::cuda::limits::library_index_limit() <= i32::MAX as usize);
/// ```
pub fn library_index_limit() -> usize {
    static LIMIT: OnceLock<usize> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        let max = i32::MAX as usize;
        std::env::var("MANTISSA_CUDA_INDEX_LIMIT")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&v| v > 0)
            .map_or(max, |v| v.min(max))
    })
}

/// How many items of a batch one library call may take when each item has `per_item`
/// elements in the largest tensor that is split with the batch: at least 1, or `None` when
/// one item alone passes the limit.
pub(crate) fn items_per_call(per_item: usize) -> Option<usize> {
    let limit = library_index_limit();
    match per_item {
        0 => Some(usize::MAX),
        n if n > limit => None,
        n => Some(limit / n),
    }
}

#[cfg(test)]
mod tests {
    use super::{items_per_call, library_index_limit};

    #[test]
    fn a_batch_is_cut_where_its_pieces_fit_the_limit() {
        let limit = library_index_limit();
        assert_eq!(items_per_call(0), Some(usize::MAX));
        assert_eq!(items_per_call(1), Some(limit));
        assert_eq!(items_per_call(limit), Some(1));
        assert_eq!(items_per_call(limit / 3 + 1), Some(2));
        assert_eq!(items_per_call(limit + 1), None);
    }
}
