//! The weight-cast cache of an autocast region: an f32 parameter (a leaf that requires grad)
//! is cast to the low dtype once per region. The key holds the storage version, so an
//! in-place update between two uses gives a fresh cast; nothing is cached under `no_grad`.

use crate::{DType, Result, Tensor};
use std::cell::RefCell;
use std::collections::HashMap;

thread_local! {
    static CACHE: RefCell<HashMap<(u64, u64, DType), Tensor>> = RefCell::new(HashMap::new());
}

pub(super) fn clear() {
    // `try_with`: a guard dropped at thread exit may outlive the cache.
    let _ = CACHE.try_with(|c| c.borrow_mut().clear());
}

/// Number of cached casts on this thread (for tests and diagnostics).
pub fn cached_casts() -> usize {
    CACHE.with(|c| c.borrow().len())
}

/// `t` cast to `dtype`, through the cache when `t` is a trainable f32 leaf.
pub(crate) fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    let cacheable =
        t.dtype() == DType::F32 && t.is_leaf() && t.is_requires_grad() && crate::is_grad_enabled();
    if !cacheable {
        return t.to_dtype(dtype);
    }
    let key = (t.id(), t.version(), dtype);
    if let Some(hit) = CACHE.with(|c| c.borrow().get(&key).cloned()) {
        return Ok(hit);
    }
    let out = t.to_dtype(dtype)?;
    CACHE.with(|c| c.borrow_mut().insert(key, out.clone()));
    Ok(out)
}
