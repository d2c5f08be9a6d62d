//! The 32-bit limits of the CUDA libraries: cuDNN's descriptors take `int` dims and strides,
//! and a tensor of more than 2^31 - 1 elements is `CUDNN_STATUS_NOT_SUPPORTED`. A call past
//! the limit is split along the batch into pieces that fit (PyTorch does the same for its
//! convolutions), or runs on the engine's own kernels, which index in 64 bits.
//!
//! A piece of the batch starts on a 16-byte boundary, as cuDNN's tensor-core kernels and its
//! graph API require of every pointer: `aligned_items` cuts the batch where every split
//! tensor's piece does.
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

/// The byte alignment cuDNN's tensor-core kernels and its graph API ask of every data
/// pointer.
pub(crate) const LIBRARY_ALIGN: usize = 16;

/// `items` rounded down to a whole number of runs of the fewest items after which every
/// tensor split with the batch (`per_item` elements each, of `elem_bytes` bytes) ends on a
/// [`LIBRARY_ALIGN`]-byte boundary: a batch cut into pieces of that many items, from an
/// aligned start, starts every piece aligned. 0 when `items` is below one such run.
pub(crate) fn aligned_items(items: usize, elem_bytes: usize, per_item: &[usize]) -> usize {
    // Each tensor's run is a power of two (16 over the largest power of two, at most 16,
    // that divides an item's bytes), so the longest of them is a whole number of the others.
    let run = per_item
        .iter()
        .map(|&n| {
            let bytes = n.saturating_mul(elem_bytes);
            LIBRARY_ALIGN >> bytes.trailing_zeros().min(LIBRARY_ALIGN.trailing_zeros())
        })
        .max()
        .unwrap_or(1);
    items / run * run
}

#[cfg(test)]
mod tests {
    use super::{aligned_items, items_per_call, library_index_limit};

    #[test]
    fn pieces_are_cut_where_every_split_tensor_starts_aligned() {
        // f16 items of an odd number of elements: 8 of them make 16 bytes.
        assert_eq!(aligned_items(13, 2, &[189, 315]), 8);
        assert_eq!(aligned_items(7, 2, &[189, 315]), 0);
        // f32: 4 items of an odd count; 2 of 6 elements (24 bytes: 48 = 3 x 16).
        assert_eq!(aligned_items(13, 4, &[189]), 12);
        assert_eq!(aligned_items(13, 4, &[6]), 12);
        assert_eq!(aligned_items(13, 4, &[6, 8]), 12);
        // Items of whole 16-byte vectors: any count; the longest run rules.
        assert_eq!(aligned_items(13, 2, &[8, 24]), 13);
        assert_eq!(aligned_items(13, 2, &[8, 4]), 12);
        assert_eq!(aligned_items(usize::MAX, 2, &[0]), usize::MAX);
    }

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
