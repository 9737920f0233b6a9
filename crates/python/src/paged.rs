//! Paged KV caches from Python: flash-attn's `flash_attn_with_kvcache` over caches the
//! caller owns, as one [`Attention::paged`] call, and what it shares with
//! `attn.PagedKVCache` (`paged_cache.rs`): the score options in flash-attn's terms
//! ([`PagedOptions`]), the packed queries ([`Queries`]) and the results ([`run`]).
//!
//! `flash_attn_with_kvcache` reads its caches in place: `k_cache (num_blocks, page_size,
//! h_kv, d)` with an int32 `block_table (batch, max_pages)` is a pool of pages, a
//! [`PagedKv`] of `[pages, h_kv, page_size, d]` strides; without a block table,
//! `k_cache (batch, seqlen_cache, h_kv, d)` is the same view with one page of
//! `seqlen_cache` rows per sequence (its row of the cache). New keys and values `k`, `v`
//! are written into the caches at positions `cache_seqlens..` before the call reads them,
//! after every check has passed (and the engine call has been validated), so an error
//! leaves the caller's caches as they were.

use std::collections::HashMap;

use attn_core::{Alibi, Causal, Options, PagedKv, SlidingWindow, SoftCap, Tensor4Mut, Tensor4Ref};
use attn_optimized::{Attention, Batch, Par};
use half::{bf16, f16};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyTuple};

use crate::array::{Array, Dtype, Float, Kind, is_torch_tensor, zeroed};
use crate::output::{SendPtr, Storage, check_returnable, finish};
use crate::sdpa::{check_kinds, forward_strides, view, view_mut};
use crate::to_py_err;

// ---------------------------------------------------------------------------------------
// What the two entry points share.

/// The score options of a paged call in flash-attn's terms, validated: `softmax_scale`,
/// `causal` (aligned bottom-right: the queries are each sequence's newest positions),
/// `window_size`, `softcap` and `alibi_slopes`.
#[derive(Debug, Clone)]
pub(crate) struct PagedOptions {
    scale: Option<f32>,
    causal: bool,
    window: Option<SlidingWindow>,
    softcap: Option<SoftCap>,
    slopes: Option<Vec<f32>>,
}

/// flash-attn's `window_size`: a pair `(left, right)` of ints (a tuple or a list); `None`
/// is `(-1, -1)`, no window.
pub(crate) fn window_of(obj: Option<&Bound<'_, PyAny>>) -> PyResult<(i64, i64)> {
    let Some(obj) = obj else {
        return Ok((-1, -1));
    };
    match obj.extract::<Vec<i64>>().ok().as_deref() {
        Some(&[left, right]) => Ok((left, right)),
        _ => Err(PyTypeError::new_err(format!(
            "window_size must be a pair (left, right) of ints (-1: unbounded), not {}",
            obj.repr()?
        ))),
    }
}

/// One side of flash-attn's `window_size`: `-1` is unbounded.
fn window_side(window_size: (i64, i64), x: i64) -> PyResult<Option<usize>> {
    match x {
        -1 => Ok(None),
        x => usize::try_from(x).map(Some).map_err(|_| {
            PyValueError::new_err(format!(
                "window_size={window_size:?}: each side is -1 (unbounded) or a number of keys >= 0"
            ))
        }),
    }
}

impl PagedOptions {
    /// Reads the options of a call of `batch` sequences and `heads` query heads: the scale
    /// positive (default `1/sqrt(d)`), `window_size` `(left, right)` keys around each
    /// query's diagonal (`-1`: unbounded), `softcap` 0 (off) or positive, `alibi_slopes`
    /// float32 `(heads,)` or `(batch, heads)`.
    pub(crate) fn read(
        scale: Option<f64>,
        causal: bool,
        window_size: (i64, i64),
        softcap: f64,
        alibi_slopes: Option<&Bound<'_, PyAny>>,
        (batch, heads): (usize, usize),
    ) -> PyResult<Self> {
        let scale = match scale {
            None => None,
            Some(s) => {
                let s = s as f32;
                Options::default()
                    .with_scale(s)
                    .scale_for(1)
                    .map_err(to_py_err)?;
                Some(s)
            }
        };
        let (left, right) = (
            window_side(window_size, window_size.0)?,
            window_side(window_size, window_size.1)?,
        );
        let window = (left.is_some() || right.is_some())
            .then(|| SlidingWindow::new(left, right, Causal::BottomRight));
        let softcap = if softcap == 0.0 {
            None
        } else if softcap > 0.0 && (softcap as f32).is_finite() {
            Some(SoftCap::new(softcap as f32).map_err(to_py_err)?)
        } else {
            return Err(PyValueError::new_err(format!(
                "softcap={softcap}: 0.0 (no soft-capping) or a positive, finite cap"
            )));
        };
        let slopes = alibi_slopes
            .map(|obj| read_slopes(obj, batch, heads))
            .transpose()?;
        Ok(Self {
            scale,
            causal,
            window,
            softcap,
            slopes,
        })
    }

    /// The engine's options (borrowing the slopes).
    pub(crate) fn options(&self) -> Options<'_> {
        let mut opts = Options::default();
        if let Some(s) = self.scale {
            opts = opts.with_scale(s);
        }
        if self.causal {
            opts = opts.with_causal(Causal::BottomRight);
        }
        if let Some(w) = self.window {
            opts = opts.with_window(w);
        }
        if let Some(c) = self.softcap {
            opts = opts.with_softcap(c);
        }
        if let Some(s) = &self.slopes {
            opts = opts.with_alibi(Alibi::new(s));
        }
        opts
    }
}

/// flash-attn's `alibi_slopes`: float32, `(heads,)` or `(batch, heads)`.
fn read_slopes(obj: &Bound<'_, PyAny>, batch: usize, heads: usize) -> PyResult<Vec<f32>> {
    let a = Array::extract("alibi_slopes", obj)?;
    let fits = a.shape == [heads] || a.shape == [batch, heads];
    let Some(slopes) = a.f32_values()? else {
        return Err(PyTypeError::new_err(format!(
            "alibi_slopes has dtype {}: the slopes are float32",
            a.dtype.name()
        )));
    };
    if !fits {
        return Err(PyValueError::new_err(format!(
            "alibi_slopes of shape {} must be ({heads},) or ({batch}, {heads}): one slope per query head, or per sequence and query head",
            a.shape_str()
        )));
    }
    Ok(slopes)
}

/// How a call's queries were given, which is how its results are returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Form {
    /// `(total, heads, d)`, sequences one after the other (`cu_seqlens_q`): the output
    /// `(total, heads, d_v)`, the LSE `(heads, total)` (flash-attn's varlen layout).
    Packed,
    /// `(batch, n, heads, d)`, `n` queries a sequence: the output `(batch, n, heads, d_v)`,
    /// the LSE `(batch, heads, n)` (flash-attn's `flash_attn_with_kvcache`).
    Batch { batch: usize, n: usize },
}

/// A call's queries as the engine's packed `[1, heads, total, d]` rows.
pub(crate) struct Queries<'py> {
    q: Array<'py>,
    pub form: Form,
    pub heads: usize,
    pub total: usize,
    pub d: usize,
}

impl<'py> Queries<'py> {
    /// Reads a query of 3 axes `(total, heads, d)` or 4 axes `(batch, n, heads, d)`, its
    /// strides non-negative (copied by the caller otherwise).
    pub(crate) fn new(q: Array<'py>) -> PyResult<Self> {
        let (form, heads, total, d) = match q.shape[..] {
            [t, h, d] => (Form::Packed, h, t, d),
            [b, n, h, d] => {
                let total = b.checked_mul(n).ok_or_else(|| {
                    PyValueError::new_err(format!("{} has too many rows", q.name))
                })?;
                (Form::Batch { batch: b, n }, h, total, d)
            }
            _ => {
                return Err(PyValueError::new_err(format!(
                    "{} of shape {} must have 3 axes (total, heads, features: sequences packed) or 4 (batch, seqlen, heads, features)",
                    q.name,
                    q.shape_str()
                )));
            }
        };
        Ok(Self {
            q,
            form,
            heads,
            total,
            d,
        })
    }

    /// The kind of the query (the results are returned in it).
    pub(crate) fn kind(&self) -> Kind {
        self.q.kind
    }

    /// The element stride from one packed row to the next, when the batch and sequence
    /// axes of a 4-axis query merge into one (`None`: they do not, and the rows are copied).
    fn row_stride(&self) -> Option<isize> {
        let s = &self.q.strides;
        match self.form {
            Form::Packed => Some(s[0]),
            Form::Batch { batch, n } => {
                if n <= 1 {
                    Some(s[0])
                } else if batch <= 1 || (n as isize).checked_mul(s[1]) == Some(s[0]) {
                    Some(s[1])
                } else {
                    None
                }
            }
        }
    }

    /// A compact copy of the rows, `[total][heads][d]`, when they cannot be viewed in place.
    ///
    /// # Safety
    /// The query's elements must be of type `T`, alive and unwritten during the call.
    pub(crate) unsafe fn copy<T: Storage>(&self) -> PyResult<Option<Vec<T>>> {
        let Form::Batch { batch, n } = self.form else {
            return Ok(None);
        };
        if self.row_stride().is_some() {
            return Ok(None);
        }
        let (h, d) = (self.heads, self.d);
        let s = &self.q.strides;
        // SAFETY: the caller's guarantee; the query's strides are non-negative (its reader
        // copied any other) and reach only its own elements.
        let all = unsafe {
            view::<T>(
                SendPtr(self.q.ptr()),
                0,
                [batch, h, n, d],
                [s[0], s[2], s[1]],
            )
        }
        .map_err(to_py_err)?;
        let count = crate::array::product(&[self.total, h, d]);
        let mut rows = attn_core::filled("a compact copy of the queries", count, T::from_f32(0.0))
            .map_err(to_py_err)?;
        if rows.is_empty() {
            return Ok(Some(rows));
        }
        for b in 0..batch {
            for head in 0..h {
                let m = all.head(b, head).map_err(to_py_err)?;
                for i in 0..n {
                    let at = ((b * n + i) * h + head) * d;
                    for (c, x) in rows[at..at + d].iter_mut().enumerate() {
                        *x = m[(i, c)];
                    }
                }
            }
        }
        Ok(Some(rows))
    }

    /// The engine's `[1, heads, total, d]` view of the rows: `copy` when [`Queries::copy`]
    /// made one, the query in place otherwise.
    ///
    /// # Safety
    /// As [`Queries::copy`], for the view's lifetime.
    pub(crate) unsafe fn view<'a, T>(&self, copy: Option<&'a [T]>) -> PyResult<Tensor4Ref<'a, T>> {
        let (h, t, d) = (self.heads, self.total, self.d);
        if let Some(rows) = copy {
            return Tensor4Ref::new(rows, [1, h, t, d], [0, d, h * d]).map_err(to_py_err);
        }
        let head_stride = match self.form {
            Form::Packed => self.q.strides[1],
            Form::Batch { .. } => self.q.strides[2],
        };
        let row = self.row_stride().ok_or_else(|| {
            PyValueError::new_err("the queries' rows were not copied") // never: `copy` did
        })?;
        // SAFETY: the caller's guarantee; the strides are the query's own (non-negative),
        // the rows those of its batch and sequence axes merged.
        unsafe {
            view(
                SendPtr(self.q.ptr()),
                0,
                [1, h, t, d],
                [0, head_stride, row],
            )
        }
        .map_err(to_py_err)
    }
}

/// Runs a paged call and returns its output (and, when asked, its float32 LSE) in the
/// queries' `form` and `kind`, with the GIL released while attn computes.
pub(crate) fn run<'py, T: Storage>(
    py: Python<'py>,
    call: &Attention<'_, T, Batch>,
    form: Form,
    kind: Kind,
    with_lse: bool,
) -> PyResult<(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>)> {
    let [_, h, total, dv] = call.out_dims();
    let out_shape = match form {
        Form::Packed => vec![total, h, dv],
        Form::Batch { batch, n } => vec![batch, n, h, dv],
    };
    let (out, out_ptr) = T::zeros(py, &out_shape)?;
    let rows = h.checked_mul(total);
    let mut lse = if with_lse {
        zeroed::<f32>("the LSE", rows)?
    } else {
        Vec::new()
    };
    py.detach(|| {
        // SAFETY: our own compact output, just allocated: `total` rows of `h` heads of
        // `dv` features, touched by nothing else during the call.
        let o = unsafe { view_mut(out_ptr, 0, [1, h, total, dv], [0, dv, h * dv]) }?;
        let l = if with_lse {
            Some(Tensor4Mut::new(&mut lse, [1, h, total, 1], [0, total, 1])?)
        } else {
            None
        };
        call.forward_into(o, l, Par::rayon(0))
    })
    .map_err(to_py_err)?;
    let out = finish(out, kind, T::DTYPE)?;
    if !with_lse {
        return Ok((out, None));
    }
    let lse_shape = match form {
        Form::Packed => vec![h, total],
        Form::Batch { batch, n } => vec![batch, h, n],
    };
    let (arr, ptr) = f32::zeros(py, &lse_shape)?;
    if !lse.is_empty() {
        // SAFETY: our own compact f32 array of `h · total` elements, just allocated, and
        // not yet handed to anyone.
        let dst = unsafe { std::slice::from_raw_parts_mut(ptr.as_mut(), lse.len()) };
        match form {
            Form::Packed => dst.copy_from_slice(&lse),
            Form::Batch { batch, n } => {
                for b in 0..batch {
                    for head in 0..h {
                        let from = head * total + b * n;
                        let to = (b * h + head) * n;
                        dst[to..to + n].copy_from_slice(&lse[from..from + n]);
                    }
                }
            }
        }
    }
    Ok((out, Some(finish(arr, kind, Float::F32)?)))
}

/// The results as Python returns them: `out`, or `(out, lse)`.
pub(crate) fn returned<'py>(
    py: Python<'py>,
    (out, lse): (Bound<'py, PyAny>, Option<Bound<'py, PyAny>>),
) -> PyResult<Bound<'py, PyAny>> {
    match lse {
        None => Ok(out),
        Some(lse) => Ok(PyTuple::new(py, [out, lse])?.into_any()),
    }
}

// ---------------------------------------------------------------------------------------
// flash_attn_with_kvcache.

/// Where each sequence's keys lie: the block table (`[batch, pages_per_seq]` page ids of
/// the pool), each sequence's length (cached tokens and new ones), its first new position,
/// and the queries' offsets.
#[derive(Debug)]
struct Pages {
    table: Vec<u32>,
    pages_per_seq: usize,
    page_size: usize,
    lens: Vec<usize>,
    starts: Vec<usize>,
    cu_q: Vec<usize>,
    new_tokens: usize,
}

/// An int32 operand (a NumPy array, a torch tensor, any DLPack tensor) as its values and
/// shape; anything else is a `TypeError` naming `what` it holds.
fn int32_operand(
    name: &'static str,
    obj: &Bound<'_, PyAny>,
    what: &str,
) -> PyResult<(Vec<i32>, Vec<usize>)> {
    let a = Array::extract(name, obj)?;
    match a.int32_values()? {
        Some(values) => Ok((values, a.shape.clone())),
        None => Err(PyTypeError::new_err(format!(
            "{name} has dtype {}: {what} are int32",
            a.dtype.name()
        ))),
    }
}

/// Whether `obj` is an array or a tensor (read through [`Array`]) rather than a Python
/// number or list.
fn is_array(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(obj.cast::<numpy::PyUntypedArray>().is_ok()
        || is_torch_tensor(obj)?
        || obj.hasattr("__dlpack__")?)
}

/// `cache_seqlens`: an int for every sequence, or int32 `(batch,)` (a list of ints too).
fn read_seqlens(obj: &Bound<'_, PyAny>, batch: usize) -> PyResult<Vec<usize>> {
    let values: Vec<i64> = if is_array(obj)? {
        let (values, shape) = int32_operand("cache_seqlens", obj, "the cached lengths")?;
        match shape[..] {
            [] => vec![i64::from(values[0]); batch],
            [n] if n == batch => values.into_iter().map(i64::from).collect(),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "cache_seqlens of shape {} must be ({batch},): one length per sequence of q",
                    crate::array::shape_str(&shape)
                )));
            }
        }
    } else if obj.cast::<PyInt>().is_ok() {
        let n = obj.extract::<i64>().map_err(|_| {
            PyValueError::new_err(format!("cache_seqlens = {obj} is beyond any cache"))
        })?;
        vec![n; batch]
    } else if let Ok(values) = obj.extract::<Vec<i64>>() {
        if values.len() != batch {
            return Err(PyValueError::new_err(format!(
                "cache_seqlens has {} lengths but q has {batch} sequences",
                values.len()
            )));
        }
        values
    } else {
        return Err(PyTypeError::new_err(format!(
            "cache_seqlens must be an int or an int32 array of one length per sequence, not {}",
            obj.get_type().name()?
        )));
    };
    values
        .into_iter()
        .enumerate()
        .map(|(b, n)| {
            usize::try_from(n).map_err(|_| {
                PyValueError::new_err(format!(
                    "cache_seqlens[{b}] = {n}: a number of cached tokens is not negative"
                ))
            })
        })
        .collect()
}

/// The shapes of a `flash_attn_with_kvcache` call, checked against each other.
#[derive(Debug, Clone, Copy)]
struct Shapes {
    batch: usize,
    seqlen_q: usize,
    heads: usize,
    /// The caches' first axis: pages (paged) or rows (one per sequence).
    cache_rows: usize,
    /// The caches' second axis: a page's tokens, or a row's.
    page_size: usize,
    kv_heads: usize,
    new_tokens: usize,
}

/// `(a, b, c, d)` of a 4-axis operand, or a ValueError naming its axes.
fn dims4(a: &Array<'_>, axes: &str) -> PyResult<[usize; 4]> {
    match a.shape[..] {
        [x, y, z, w] => Ok([x, y, z, w]),
        _ => Err(PyValueError::new_err(format!(
            "{} of shape {} must have 4 axes {axes}",
            a.name,
            a.shape_str()
        ))),
    }
}

fn check_shapes(
    q: &Array<'_>,
    kc: &Array<'_>,
    vc: &Array<'_>,
    new: Option<&(Array<'_>, Array<'_>)>,
    paged: bool,
) -> PyResult<Shapes> {
    let [batch, seqlen_q, heads, d] = dims4(q, "(batch, seqlen_q, heads, headdim)")?;
    if batch.checked_mul(seqlen_q).is_none() {
        return Err(PyValueError::new_err(format!(
            "q of shape {} has too many rows",
            q.shape_str()
        )));
    }
    let cache_axes = if paged {
        "(num_blocks, page_size, kv_heads, headdim) with a block_table"
    } else {
        "(batch, seqlen_cache, kv_heads, headdim) without a block_table"
    };
    let [rows, ps, hkv, dk] = dims4(kc, cache_axes)?;
    let [vrows, vps, vhkv, dv] = dims4(vc, cache_axes)?;
    if dk != d {
        return Err(PyValueError::new_err(format!(
            "k_cache {} has {dk} features but q {} has {d}: keys and queries share their width",
            kc.shape_str(),
            q.shape_str()
        )));
    }
    if (vrows, vps, vhkv) != (rows, ps, hkv) {
        return Err(PyValueError::new_err(format!(
            "v_cache {} and k_cache {} must agree on all but their last axis",
            vc.shape_str(),
            kc.shape_str()
        )));
    }
    if hkv == 0 || !heads.is_multiple_of(hkv) {
        return Err(PyValueError::new_err(format!(
            "q has {heads} heads and the caches {hkv}: the number of query heads must be a multiple of the key/value heads"
        )));
    }
    let mut new_tokens = 0;
    if let Some((k, v)) = new {
        let [kb, kt, kh, kd] = dims4(k, "(batch, seqlen_new, kv_heads, headdim)")?;
        let [vb, vt, vh, vd] = dims4(v, "(batch, seqlen_new, kv_heads, headdim)")?;
        if [kb, kh, kd] != [batch, hkv, d] || [vb, vt, vh, vd] != [batch, kt, hkv, dv] {
            return Err(PyValueError::new_err(format!(
                "k {} and v {} must be ({batch}, seqlen_new, {hkv}, {d}) and ({batch}, seqlen_new, {hkv}, {dv}): q's batch, the caches' heads and widths",
                k.shape_str(),
                v.shape_str()
            )));
        }
        new_tokens = kt;
    }
    Ok(Shapes {
        batch,
        seqlen_q,
        heads,
        cache_rows: rows,
        page_size: ps,
        kv_heads: hkv,
        new_tokens,
    })
}

/// Raises unless an in-place write into `a` lands where it should and nowhere else: the
/// caller's own writable memory, no negative stride, and no two positions on one element.
fn check_write_target(a: &Array<'_>) -> PyResult<()> {
    if a.is_empty() {
        return Ok(()); // no element to write (NumPy gives empty arrays strides of 0)
    }
    a.require_writable()?;
    let mut axes = Vec::with_capacity(a.ndim());
    for (&n, &s) in a.shape.iter().zip(&a.strides) {
        if n > 1 {
            axes.push((s, n));
        }
    }
    axes.sort_unstable();
    let mut span = 1isize;
    for &(s, n) in &axes {
        if s < span {
            return Err(PyValueError::new_err(format!(
                "{} of shape {} cannot be written in place: its element strides {:?} {} (pass a cache that owns its memory, e.g. a contiguous one)",
                a.name,
                a.shape_str(),
                a.strides,
                if s < 0 {
                    "step backwards"
                } else {
                    "make positions share elements"
                }
            )));
        }
        // Within the extent DLPack or NumPy checked.
        span = span.saturating_add(s.saturating_mul(n as isize - 1));
    }
    Ok(())
}

/// The block table, lengths and offsets of a call, every page a sequence reaches checked
/// to be in the pool and every slot a new token is written to checked to be its own.
fn read_pages(
    s: &Shapes,
    cache_seqlens: Option<&Bound<'_, PyAny>>,
    block_table: Option<&Bound<'_, PyAny>>,
    cache_batch_idx: Option<&Bound<'_, PyAny>>,
) -> PyResult<Pages> {
    let batch = s.batch;
    let (table_in, pages_per_seq, capacity) = match block_table {
        Some(obj) => {
            if cache_batch_idx.is_some() {
                return Err(PyValueError::new_err(
                    "cache_batch_idx with block_table: the block table already says where each sequence's keys are",
                ));
            }
            let (values, shape) = int32_operand("block_table", obj, "page ids")?;
            let pages = match shape[..] {
                [b, p] if b == batch => p,
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "block_table of shape {} must be ({batch}, max_pages): a row of page ids per sequence of q",
                        crate::array::shape_str(&shape)
                    )));
                }
            };
            let capacity = pages.checked_mul(s.page_size).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "block_table's {pages} pages of {} tokens overflow a length",
                    s.page_size
                ))
            })?;
            (values, pages, capacity)
        }
        None => {
            let rows: Vec<i32> = match cache_batch_idx {
                Some(obj) => {
                    let (values, shape) =
                        int32_operand("cache_batch_idx", obj, "rows of the cache")?;
                    if shape != [batch] {
                        return Err(PyValueError::new_err(format!(
                            "cache_batch_idx of shape {} must be ({batch},): a row of the cache per sequence of q",
                            crate::array::shape_str(&shape)
                        )));
                    }
                    values
                }
                None if s.cache_rows == batch => (0..batch)
                    .map(|b| i32::try_from(b).unwrap_or(i32::MAX))
                    .collect(),
                None => {
                    return Err(PyValueError::new_err(format!(
                        "k_cache has {} rows but q has {batch} sequences: without block_table (or cache_batch_idx) each sequence has its row of the cache",
                        s.cache_rows
                    )));
                }
            };
            (rows, 1, s.page_size)
        }
    };
    let starts = match cache_seqlens {
        Some(obj) => read_seqlens(obj, batch)?,
        None if s.new_tokens > 0 => {
            return Err(PyValueError::new_err(
                "k and v without cache_seqlens: the new tokens are written at positions cache_seqlens.. of each sequence",
            ));
        }
        // flash-attn's rule: every sequence fills its cache.
        None => vec![capacity; batch],
    };
    let mut lens = Vec::with_capacity(batch);
    for (b, &start) in starts.iter().enumerate() {
        let len = start.saturating_add(s.new_tokens);
        if len > capacity {
            let room = if block_table.is_some() {
                format!(
                    "its block_table row of {pages_per_seq} pages of {} tokens",
                    s.page_size
                )
            } else {
                format!("a cache row of {} tokens", s.page_size)
            };
            return Err(PyValueError::new_err(format!(
                "sequence {b} needs cache_seqlens + seqlen_new = {start} + {} positions but has {capacity} ({room})",
                s.new_tokens
            )));
        }
        if s.seqlen_q > len {
            return Err(PyValueError::new_err(format!(
                "q has seqlen_q = {} but sequence {b} holds {len} keys (cache_seqlens + seqlen_new): the queries are each sequence's newest positions",
                s.seqlen_q
            )));
        }
        lens.push(len);
    }
    // The pages each sequence reaches, checked; the rest of a row is never read.
    let mut table = zeroed::<u32>("the block table", batch.checked_mul(pages_per_seq))?;
    for (b, &len) in lens.iter().enumerate() {
        // Within the row: `len` is at most its pages' tokens.
        let used = if block_table.is_some() {
            len.div_ceil(s.page_size.max(1)).min(pages_per_seq)
        } else {
            1
        };
        for j in 0..used {
            let id = table_in[b * pages_per_seq + j];
            let page = u32::try_from(id)
                .ok()
                .filter(|&p| (p as usize) < s.cache_rows);
            let Some(page) = page else {
                return Err(PyValueError::new_err(if block_table.is_some() {
                    format!(
                        "block_table[{b}, {j}] = {id} is not a page of k_cache (0..{})",
                        s.cache_rows
                    )
                } else {
                    format!(
                        "cache_batch_idx[{b}] = {id} is not a row of k_cache (0..{})",
                        s.cache_rows
                    )
                }));
            };
            table[b * pages_per_seq + j] = page;
        }
    }
    let mut cu_q = Vec::with_capacity(batch + 1);
    for b in 0..=batch {
        cu_q.push(b * s.seqlen_q); // at most `batch · seqlen_q`, checked by `check_shapes`
    }
    let pages = Pages {
        table,
        pages_per_seq,
        page_size: s.page_size,
        lens,
        starts,
        cu_q,
        new_tokens: s.new_tokens,
    };
    check_slots(&pages)?;
    Ok(pages)
}

/// The (page, row) a sequence's position lies in.
fn slot(p: &Pages, b: usize, pos: usize) -> (u32, usize) {
    (
        p.table[b * p.pages_per_seq + pos / p.page_size],
        pos % p.page_size,
    )
}

/// No two sequences write the same slot of the caches.
fn check_slots(p: &Pages) -> PyResult<()> {
    if p.new_tokens == 0 {
        return Ok(());
    }
    let mut owner = HashMap::new();
    for (b, &start) in p.starts.iter().enumerate() {
        for pos in start..start + p.new_tokens {
            let (page, row) = slot(p, b, pos);
            if let Some(other) = owner.insert((page, row), b) {
                return Err(PyValueError::new_err(format!(
                    "sequences {other} and {b} both write their new tokens into page {page}, row {row} of the caches (their block_table rows share a page they append to)"
                )));
            }
        }
    }
    Ok(())
}

/// A cache the new tokens are written to: its first element and element strides (page,
/// row, head; non-negative, checked by [`check_write_target`]).
#[derive(Clone, Copy)]
struct Target<T> {
    ptr: SendPtr<T>,
    strides: [isize; 3],
}

/// New tokens `(batch, seqlen_new, kv_heads, d)`: their first element and strides.
#[derive(Clone, Copy)]
struct Source<T> {
    ptr: SendPtr<T>,
    strides: [isize; 3],
}

/// Copies every new token's rows into their slots of the cache.
///
/// # Safety
/// `dst` must be a writable cache of `T` whose every slot `(page, row)` of `p` and head
/// `< kv_heads` addresses `d` elements inside its buffer (distinct slots, distinct
/// elements), `src` a live input of `T` of `(batch, new_tokens, kv_heads, d)`; no reference
/// to the cache's memory may be alive.
unsafe fn write_tokens<T>(dst: Target<T>, src: Source<T>, p: &Pages, kv_heads: usize, d: usize) {
    if d == 0 {
        return;
    }
    let [ps, rs, hs] = dst.strides;
    let [sb, st, sh] = src.strides;
    for (b, &start) in p.starts.iter().enumerate() {
        for i in 0..p.new_tokens {
            let (page, row) = slot(p, b, start + i);
            for h in 0..kv_heads {
                let to = page as isize * ps + row as isize * rs + h as isize * hs;
                let from = b as isize * sb + i as isize * st + h as isize * sh;
                // SAFETY: the caller's guarantee: `from` is a row of `d` elements of the
                // source, `to` a row of `d` elements of the cache. `copy` allows the two to
                // overlap (a caller may pass a view of the cache as its new tokens).
                unsafe { std::ptr::copy(src.ptr.0.offset(from), dst.ptr.as_mut().offset(to), d) };
            }
        }
    }
}

/// The engine's `[pages, kv_heads, page_size, d]` view of a cache `(pages, page_size,
/// kv_heads, d)`.
///
/// # Safety
/// `a` must be an input of element type `T` with non-negative strides, alive and unwritten
/// while the view lives.
unsafe fn pool<'a, T>(a: &Array<'_>) -> PyResult<Tensor4Ref<'a, T>> {
    let (n, s) = (&a.shape, &a.strides);
    // SAFETY: the caller's guarantee; the strides are the cache's own.
    unsafe {
        view(
            SendPtr(a.ptr()),
            0,
            [n[0], n[2], n[1], n[3]],
            [s[0], s[2], s[1]],
        )
    }
    .map_err(to_py_err)
}

/// The operands of a `flash_attn_with_kvcache` call, read and checked.
struct Call<'py> {
    q: Queries<'py>,
    k_cache: Array<'py>,
    v_cache: Array<'py>,
    new: Option<(Array<'py>, Array<'py>)>,
    pages: Pages,
    options: PagedOptions,
    kv_heads: usize,
}

fn with_kvcache_typed<'py, T: Storage>(
    py: Python<'py>,
    c: &Call<'py>,
    with_lse: bool,
) -> PyResult<(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>)> {
    let options = c.options.options();
    let p = &c.pages;
    // SAFETY: the query was read as `T` (the dtype of every float operand, checked) and
    // lives (borrowed) until we return.
    let copy = unsafe { c.q.copy::<T>() }?;
    // The call, validated before anything is written: an error leaves the caches as they
    // were. Its views are gone before the writes.
    {
        // SAFETY: every operand was read as `T` and lives until we return; nothing writes
        // them while these views live.
        let (q, k, v) = unsafe {
            (
                c.q.view::<T>(copy.as_deref())?,
                pool::<T>(&c.k_cache)?,
                pool::<T>(&c.v_cache)?,
            )
        };
        let kv = PagedKv::new(k, v, &p.table, &p.lens).map_err(to_py_err)?;
        Attention::paged(q, &p.cu_q, kv, &options).map_err(to_py_err)?;
    }
    if let Some((k, v)) = &c.new {
        let target = |a: &Array<'_>| Target::<T> {
            ptr: SendPtr(a.ptr()),
            strides: [a.strides[0], a.strides[1], a.strides[2]],
        };
        let source = |a: &Array<'_>| Source::<T> {
            ptr: SendPtr(a.ptr()),
            strides: [a.strides[0], a.strides[1], a.strides[2]],
        };
        let writes = [
            (target(&c.k_cache), source(k), c.k_cache.shape[3]),
            (target(&c.v_cache), source(v), c.v_cache.shape[3]),
        ];
        let h = c.kv_heads;
        py.detach(|| {
            for (dst, src, d) in writes {
                // SAFETY: the caches are the caller's writable memory whose positions are
                // distinct elements with non-negative strides (`check_write_target`); every
                // slot's page is in the cache (`read_pages`) and its row below the page size;
                // `k` and `v` were checked to be `(batch, seqlen_new, kv_heads, d)` of `T`;
                // no view of any operand is alive.
                unsafe { write_tokens(dst, src, p, h, d) };
            }
        });
    }
    // SAFETY: as for the validation above; the writes are done.
    let (q, k, v) = unsafe {
        (
            c.q.view::<T>(copy.as_deref())?,
            pool::<T>(&c.k_cache)?,
            pool::<T>(&c.v_cache)?,
        )
    };
    let kv = PagedKv::new(k, v, &p.table, &p.lens).map_err(to_py_err)?;
    let call = Attention::paged(q, &p.cu_q, kv, &options).map_err(to_py_err)?;
    run(py, &call, c.q.form, c.q.kind(), with_lse)
}

/// flash-attn's ``flash_attn_with_kvcache``, computed by attn on the CPU: attention of the
/// newest queries of each sequence against its cached keys and values, after writing the
/// new keys and values into the caches in place.
///
/// ``q`` ``(batch, seqlen_q, nheads, headdim)``. With ``block_table`` (int32
/// ``(batch, max_pages)``), ``k_cache`` and ``v_cache`` are pools of pages
/// ``(num_blocks, page_size, nheads_k, headdim)`` (``headdim_v`` for ``v_cache``; any page
/// size) and sequence ``b``'s position ``t`` lies in page ``block_table[b, t // page_size]``,
/// row ``t % page_size``; without it they are ``(batch, seqlen_cache, nheads_k, headdim)``,
/// one row per sequence (``cache_batch_idx``, int32 ``(batch,)``, picks another row).
/// ``cache_seqlens`` (an int, or int32 ``(batch,)``) is the number of tokens already cached;
/// without it every sequence fills its cache. ``k`` and ``v``
/// ``(batch, seqlen_new, nheads_k, headdim)`` (optional, together) are written into the
/// caches at positions ``cache_seqlens ..`` — the caller's tensors or arrays change in
/// place — and attention covers ``cache_seqlens + seqlen_new`` keys. The queries are each
/// sequence's newest positions (``seqlen_q`` at most its length): ``causal=True`` aligns
/// the causal mask bottom-right, ``window_size=(left, right)`` keeps the keys
/// ``[i + L - seqlen_q - left, i + L - seqlen_q + right]`` of query ``i`` (``-1``:
/// unbounded), ``softcap > 0`` caps the scores at ``softcap · tanh(s / softcap)``,
/// ``alibi_slopes`` (float32 ``(nheads,)`` or ``(batch, nheads)``) adds
/// ``-slope · |i + L - seqlen_q - j|``. ``nheads`` is a multiple of ``nheads_k`` (GQA).
///
/// Returns ``out`` ``(batch, seqlen_q, nheads, headdim_v)`` of q's dtype and kind (NumPy
/// arrays in, NumPy arrays out; torch tensors in, torch tensors out), and with
/// ``return_softmax_lse=True`` also the float32 natural-log LSE ``(batch, nheads,
/// seqlen_q)``. Every float operand has q's dtype (float32, float16; bfloat16 with torch).
///
/// Where attn differs from flash-attn: any page size; no backward pass (the result does
/// not require grad); a row that sees no key is 0 with LSE
/// ``-inf``; with ALiBi and ``causal=True`` the LSE is that of the formula above (flash-attn's
/// causal kernel adds ``+slope · j``, which leaves the output unchanged and shifts its LSE);
/// ``rotary_cos``/``rotary_sin`` and ``cache_leftpad`` are not supported (a ValueError);
/// ``num_splits`` is accepted and ignored (attn splits the keys by the shape alone). Every
/// bad input is a ValueError or TypeError raised before anything is written: block table
/// ids outside the pool, lengths beyond a sequence's pages, two sequences writing one slot,
/// caches that cannot be written in place (read-only, copied, or overlapping views).
#[pyfunction]
#[pyo3(
    signature = (q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=false, window_size=None, softcap=0.0, rotary_interleaved=true, alibi_slopes=None, num_splits=0, return_softmax_lse=false),
    text_signature = "(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False)"
)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_attn_with_kvcache<'py>(
    q: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    k: Option<&Bound<'py, PyAny>>,
    v: Option<&Bound<'py, PyAny>>,
    rotary_cos: Option<&Bound<'py, PyAny>>,
    rotary_sin: Option<&Bound<'py, PyAny>>,
    cache_seqlens: Option<&Bound<'py, PyAny>>,
    cache_batch_idx: Option<&Bound<'py, PyAny>>,
    cache_leftpad: Option<&Bound<'py, PyAny>>,
    block_table: Option<&Bound<'py, PyAny>>,
    softmax_scale: Option<f64>,
    causal: bool,
    window_size: Option<&Bound<'py, PyAny>>,
    softcap: f64,
    rotary_interleaved: bool,
    alibi_slopes: Option<&Bound<'py, PyAny>>,
    num_splits: i64,
    return_softmax_lse: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let py = q.py();
    crate::errors::torch_like(py, || {
        let _ = (rotary_interleaved, num_splits); // the rotary layout; a split hint
        if rotary_cos.is_some() || rotary_sin.is_some() {
            return Err(PyValueError::new_err(
                "rotary_cos/rotary_sin: attn does not apply rotary embeddings; rotate q and k before the call",
            ));
        }
        if cache_leftpad.is_some() {
            return Err(PyValueError::new_err(
                "cache_leftpad is not supported: each sequence's keys start at position 0 of its cache",
            ));
        }
        let qa = Array::extract("q", q)?;
        let kc = Array::extract("k_cache", k_cache)?;
        let vc = Array::extract("v_cache", v_cache)?;
        let new = match (k, v) {
            (None, None) => None,
            (Some(k), Some(v)) => Some((Array::extract("k", k)?, Array::extract("v", v)?)),
            _ => {
                return Err(PyValueError::new_err(
                    "k and v go together: pass both new keys and new values, or neither",
                ));
            }
        };
        let mut floats = vec![&kc, &vc];
        if let Some((k, v)) = &new {
            floats.extend([k, v]);
        }
        check_kinds(&qa, &floats)?;
        match qa.dtype {
            Dtype::Float(f) => check_returnable(qa.kind, f)?,
            _ => {
                return Err(PyTypeError::new_err(format!(
                    "q has dtype {}: attn computes on float32, float16 and bfloat16 storage",
                    qa.dtype.name()
                )));
            }
        }
        for a in &floats {
            if a.dtype != qa.dtype {
                return Err(PyTypeError::new_err(format!(
                    "{} has dtype {} but q has {}: they must match",
                    a.name,
                    a.dtype.name(),
                    qa.dtype.name()
                )));
            }
        }
        qa.require_contiguous_rows()?;
        for a in &floats {
            a.require_contiguous_rows()?;
        }
        let shapes = check_shapes(&qa, &kc, &vc, new.as_ref(), block_table.is_some())?;
        if new.is_some() {
            check_write_target(&kc)?;
            check_write_target(&vc)?;
        }
        let pages = read_pages(&shapes, cache_seqlens, block_table, cache_batch_idx)?;
        let options = PagedOptions::read(
            softmax_scale,
            causal,
            window_of(window_size)?,
            softcap,
            alibi_slopes,
            (shapes.batch, shapes.heads),
        )?;
        // Negative strides are copied (the caches only when nothing is written: a cache written
        // in place has none, checked above).
        let new = match new {
            None => None,
            Some((k, v)) => Some((forward_strides(py, k)?, forward_strides(py, v)?)),
        };
        let call = Call {
            q: Queries::new(forward_strides(py, qa)?)?,
            k_cache: forward_strides(py, kc)?,
            v_cache: forward_strides(py, vc)?,
            new,
            pages,
            options,
            kv_heads: shapes.kv_heads,
        };
        let results = match call.q.q.dtype {
            Dtype::F32 => with_kvcache_typed::<f32>(py, &call, return_softmax_lse),
            Dtype::F16 => with_kvcache_typed::<f16>(py, &call, return_softmax_lse),
            _ => with_kvcache_typed::<bf16>(py, &call, return_softmax_lse),
        }?;
        returned(py, results)
    })
}
