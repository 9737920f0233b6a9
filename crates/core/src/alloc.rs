//! Fallible buffers: an allocation the allocator refuses, or a size that overflows, is an
//! [`Error::Allocation`] naming what was asked for, never an abort.

use crate::{Error, Result};

/// `n` copies of `value` (`n = None`: a count that overflowed), or [`Error::Allocation`]
/// naming `what` and its size in bytes.
///
/// ```
/// use attn_core::{Error, filled};
/// assert_eq!(filled("mask", Some(3), true).unwrap(), vec![true; 3]);
/// assert!(matches!(filled("mask", None, true), Err(Error::Allocation { what: "mask", .. })));
/// assert!(filled("scores", Some(usize::MAX / 8), 0.0f32).is_err());
/// ```
pub fn filled<T: Clone>(what: &'static str, n: Option<usize>, value: T) -> Result<Vec<T>> {
    let fail = || Error::allocation_of::<T>(what, n);
    let n = n.ok_or_else(fail)?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| fail())?;
    v.resize(n, value);
    Ok(v)
}

/// `n` default (zero) elements, or [`Error::Allocation`]: [`filled`] with `T::default()`.
///
/// ```
/// use attn_core::zeroed;
/// assert_eq!(zeroed::<half::bf16>("output", Some(2)).unwrap(), vec![half::bf16::ZERO; 2]);
/// assert!(zeroed::<f32>("output", Some(usize::MAX)).is_err());
/// ```
pub fn zeroed<T: Clone + Default>(what: &'static str, n: Option<usize>) -> Result<Vec<T>> {
    filled(what, n, T::default())
}
