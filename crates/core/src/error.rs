//! The one error type of the workspace.

use thiserror::Error;

/// Everything an attention call can reject.
///
/// Shape errors name the operand and both shapes, so a message alone tells what to fix:
///
/// ```
/// use attn_core::Error;
/// let e = Error::DimensionMismatch {
///     operand: "K",
///     axis: "columns",
///     found: 63,
///     other: "Q",
///     expected: 64,
///     rule: "d_k must match",
/// };
/// assert_eq!(e.to_string(), "K has 63 columns but Q has 64 (d_k must match)");
/// ```
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum Error {
    /// Two operands disagree on a dimension they must share.
    #[error("{operand} has {found} {axis} but {other} has {expected} ({rule})")]
    DimensionMismatch {
        /// The operand whose dimension is wrong.
        operand: &'static str,
        /// Which dimension (`"rows"`, `"columns"`, `"batch entries"`, …).
        axis: &'static str,
        /// Its size in the offending operand.
        found: usize,
        /// The operand it is compared with.
        other: &'static str,
        /// The size the other operand has.
        expected: usize,
        /// The rule of the contract that ties the two together.
        rule: &'static str,
    },
    /// A matrix operand (mask, output, weight) has the wrong shape.
    #[error(
        "{operand} has shape {found_rows}×{found_cols} but must be {expected_rows}×{expected_cols} ({rule})"
    )]
    ShapeMismatch {
        /// The operand whose shape is wrong.
        operand: &'static str,
        /// Its rows.
        found_rows: usize,
        /// Its columns.
        found_cols: usize,
        /// The rows it must have.
        expected_rows: usize,
        /// The columns it must have.
        expected_cols: usize,
        /// What the expected shape is made of.
        rule: &'static str,
    },
    /// `d_k = 0`: a score needs at least one feature.
    #[error("Q and K have 0 columns (d_k must be at least 1)")]
    EmptyKeyWidth,
    /// The softmax scale is not a number whose product with `log2(e)` is a finite f32 (NaN,
    /// infinite, or beyond about 2.36e38 in magnitude).
    #[error("scale {0} is invalid (scale·log2(e) must be a finite f32)")]
    InvalidScale(f32),
    /// Grouped-query attention needs `h_q` to be a multiple of `h_kv`.
    #[error("Q has {h_q} heads but K/V have {h_kv} ({h_q} is not a positive multiple of {h_kv})")]
    HeadGrouping {
        /// Query heads.
        h_q: usize,
        /// Key/value heads.
        h_kv: usize,
    },
    /// A key-padding length is longer than the keys.
    #[error("key padding length {len} (batch entry {batch}) exceeds n_k = {n_k}")]
    KeyLength {
        /// The offending valid length.
        len: usize,
        /// The batch entry it belongs to.
        batch: usize,
        /// The number of keys.
        n_k: usize,
    },
    /// A 4-D tensor view does not fit its buffer, or a writable one overlaps itself.
    #[error("{operand}: {reason}")]
    Layout {
        /// The tensor.
        operand: &'static str,
        /// What is wrong with its dims, strides or buffer.
        reason: String,
    },
    /// An index (batch entry, head, position) is outside the object it addresses.
    #[error("{what} index {index} is out of range (there are {len})")]
    OutOfRange {
        /// What is indexed.
        what: &'static str,
        /// The index asked for.
        index: usize,
        /// How many there are.
        len: usize,
    },
    /// A value of an option outside its domain (a soft-cap that is not positive, a NaN
    /// ALiBi slope or sink logit).
    #[error("{what}[{index}] = {value} is invalid (it must be {rule})")]
    InvalidValue {
        /// The option.
        what: &'static str,
        /// Which of its values.
        index: usize,
        /// The value.
        value: f32,
        /// What it must be.
        rule: &'static str,
    },
    /// An option that this entry point cannot honour.
    #[error("{operand}: {reason}")]
    Unsupported {
        /// The option or operand.
        operand: &'static str,
        /// Why it is not accepted here, and what to use instead.
        reason: &'static str,
    },
    /// Appending would exceed a fixed capacity.
    ///
    /// `requested` is `usize::MAX` when the count it stands for overflows `usize`.
    #[error("{what}: {requested} exceeds the capacity of {capacity}")]
    Capacity {
        /// What is full.
        what: &'static str,
        /// What the operation would need.
        requested: usize,
        /// What is available.
        capacity: usize,
    },
    /// A buffer the call must allocate (an output, an LSE, a cache) cannot be had: its size
    /// overflows `usize`, exceeds `isize::MAX` bytes (the most one allocation may hold), or
    /// the allocator refused it. Nothing was computed and nothing was changed.
    ///
    /// `bytes` is `usize::MAX` when computing the size overflowed `usize`, and the message
    /// says so instead of printing a number; see [`Error::allocation`].
    #[error("could not allocate {what}: {}", AllocationSize(*bytes))]
    Allocation {
        /// What could not be allocated (`"attention output"`, `"LSE"`, `"KV cache keys"`, …).
        what: &'static str,
        /// Its size in bytes, or `usize::MAX` when that overflows `usize`.
        bytes: usize,
    },
}

/// How [`Error::Allocation`] prints its size.
struct AllocationSize(usize);

impl core::fmt::Display for AllocationSize {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.0 {
            usize::MAX => f.write_str("its size in bytes overflows usize"),
            bytes => write!(f, "{bytes} bytes"),
        }
    }
}

impl Error {
    /// [`Error::DimensionMismatch`]: `operand` has `found` along `axis` where `other` has
    /// `expected`, breaking `rule`.
    ///
    /// ```
    /// use attn_core::Error;
    /// let e = Error::mismatch("V", "rows", 3, "K", 4, "n_k must match");
    /// assert_eq!(e.to_string(), "V has 3 rows but K has 4 (n_k must match)");
    /// ```
    pub fn mismatch(
        operand: &'static str,
        axis: &'static str,
        found: usize,
        other: &'static str,
        expected: usize,
        rule: &'static str,
    ) -> Self {
        Error::DimensionMismatch {
            operand,
            axis,
            found,
            other,
            expected,
            rule,
        }
    }

    /// [`Error::OutOfRange`]: `index` into `len` items of `what`.
    ///
    /// ```
    /// use attn_core::Error;
    /// assert_eq!(Error::out_of_range("batch", 3, 2).to_string(), "batch index 3 is out of range (there are 2)");
    /// ```
    pub fn out_of_range(what: &'static str, index: usize, len: usize) -> Self {
        Error::OutOfRange { what, index, len }
    }

    /// [`Error::Capacity`]: `requested` of `what` where only `capacity` fit.
    ///
    /// ```
    /// use attn_core::Error;
    /// assert_eq!(Error::capacity("tokens", 9, 8).to_string(), "tokens: 9 exceeds the capacity of 8");
    /// ```
    pub fn capacity(what: &'static str, requested: usize, capacity: usize) -> Self {
        Error::Capacity {
            what,
            requested,
            capacity,
        }
    }

    /// [`Error::Allocation`]: `bytes` bytes of `what` could not be allocated; pass
    /// `usize::MAX` when the size computation itself overflowed.
    ///
    /// ```
    /// use attn_core::Error;
    /// let e = Error::allocation("attention output", 1 << 50);
    /// assert_eq!(e.to_string(), "could not allocate attention output: 1125899906842624 bytes");
    /// let e = Error::allocation("LSE", usize::MAX);
    /// assert_eq!(e.to_string(), "could not allocate LSE: its size in bytes overflows usize");
    /// assert!(matches!(e, Error::Allocation { what: "LSE", bytes: usize::MAX }));
    /// ```
    pub fn allocation(what: &'static str, bytes: usize) -> Self {
        Error::Allocation { what, bytes }
    }

    /// [`Error::Allocation`] for `elements` elements of `T`, or for a count that overflowed
    /// (`None`): the size in bytes is computed here, saturating to `usize::MAX`.
    ///
    /// ```
    /// use attn_core::Error;
    /// assert_eq!(
    ///     Error::allocation_of::<f32>("LSE", Some(1 << 62)),
    ///     Error::allocation("LSE", usize::MAX), // 2^64 bytes overflow usize
    /// );
    /// assert_eq!(Error::allocation_of::<u16>("output", Some(3)), Error::allocation("output", 6));
    /// ```
    pub fn allocation_of<T>(what: &'static str, elements: Option<usize>) -> Self {
        let bytes = elements.and_then(|n| n.checked_mul(size_of::<T>()));
        Error::allocation(what, bytes.unwrap_or(usize::MAX))
    }

    /// [`Error::Layout`]: what is wrong with a tensor's dims, strides or buffer.
    ///
    /// ```
    /// use attn_core::Error;
    /// assert_eq!(Error::layout("output tensor", "too short").to_string(), "output tensor: too short");
    /// ```
    pub fn layout(operand: &'static str, reason: impl Into<String>) -> Self {
        Error::Layout {
            operand,
            reason: reason.into(),
        }
    }

    /// [`Error::HeadGrouping`]: `h_q` query heads cannot share `h_kv` key/value heads.
    ///
    /// ```
    /// use attn_core::Error;
    /// assert_eq!(
    ///     Error::head_grouping(6, 4).to_string(),
    ///     "Q has 6 heads but K/V have 4 (6 is not a positive multiple of 4)"
    /// );
    /// ```
    pub fn head_grouping(h_q: usize, h_kv: usize) -> Self {
        Error::HeadGrouping { h_q, h_kv }
    }

    /// [`Error::InvalidValue`]: value `index` of option `what` is `value`, outside `rule`.
    ///
    /// ```
    /// let e = attn_core::Error::invalid_value("sink logits", 2, f32::NAN, "not NaN");
    /// assert_eq!(e.to_string(), "sink logits[2] = NaN is invalid (it must be not NaN)");
    /// ```
    pub fn invalid_value(what: &'static str, index: usize, value: f32, rule: &'static str) -> Self {
        Error::InvalidValue {
            what,
            index,
            value,
            rule,
        }
    }

    /// [`Error::Unsupported`]: an option `operand` that this entry point cannot honour.
    pub fn unsupported(operand: &'static str, reason: &'static str) -> Self {
        Error::Unsupported { operand, reason }
    }

    /// [`Error::DimensionMismatch`] for a per-row LSE buffer of the wrong length.
    ///
    /// ```
    /// use attn_core::Error;
    /// assert_eq!(Error::lse_length(3, 4).to_string(), "LSE has 3 entries but Q has 4 (one LSE per query row)");
    /// ```
    pub fn lse_length(found: usize, expected: usize) -> Self {
        Error::mismatch(
            "LSE",
            "entries",
            found,
            "Q",
            expected,
            "one LSE per query row",
        )
    }
}

/// `Ok(())` when `found == expected`, else [`Error::mismatch`] with the same arguments.
///
/// ```
/// use attn_core::check_dim;
/// assert!(check_dim("K", "columns", 64, "Q", 64, "d_k must match").is_ok());
/// assert!(check_dim("K", "columns", 63, "Q", 64, "d_k must match").is_err());
/// ```
pub fn check_dim(
    operand: &'static str,
    axis: &'static str,
    found: usize,
    other: &'static str,
    expected: usize,
    rule: &'static str,
) -> Result<()> {
    if found == expected {
        Ok(())
    } else {
        Err(Error::mismatch(operand, axis, found, other, expected, rule))
    }
}

/// `Result` with the workspace [`enum@Error`].
pub type Result<T, E = Error> = core::result::Result<T, E>;
