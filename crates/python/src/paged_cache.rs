//! `attn.PagedKVCache`: attn's [`PagedKvCache`] for serving from Python — a pool of pages
//! that sequences are added to, appended to, forked and freed, and one call over a batch
//! of them.

use attn_optimized::{KvQuantization, PagedKvCache, SeqId};
use half::{bf16, f16};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::array::{Array, Dtype, Float, float_name, is_torch_tensor};
use crate::cache::{dtype_of, format_name, kv_format};
use crate::output::{Storage, check_returnable};
use crate::packed::{offsets, operand};
use crate::paged::{Form, PagedOptions, Queries, returned, run, window_of};
use crate::sdpa::forward_strides;
use crate::{ByDtype, to_py_err};

/// The cache in its storage type.
type Inner = ByDtype<PagedKvCache<f32>, PagedKvCache<f16>, PagedKvCache<bf16>>;

/// A paged key/value cache for serving many sequences, backed by attn.
///
/// ``PagedKVCache(num_pages, page_size, kv_heads, head_dim, value_dim=None, *,
/// dtype="float32")`` allocates a pool of ``num_pages`` pages of ``page_size`` tokens, for
/// ``kv_heads`` heads of keys ``head_dim`` wide and values ``value_dim`` wide (default
/// ``head_dim``), in float32, float16 or bfloat16 (a name, a NumPy dtype or a torch dtype).
/// ``PagedKVCache.latent(num_pages, page_size, kv_heads, head_dim, value_dim, *, dtype)``
/// is a latent cache (multi-head latent attention): one row a token and head, the key, whose
/// first ``value_dim`` columns are the value (``append_latent``).
///
/// Sequences are ints: ``add_sequence()`` makes an empty one; ``append(seq, key, value)``
/// adds ``t`` tokens (``key`` ``(t, kv_heads, head_dim)``, ``value`` ``(t, kv_heads,
/// value_dim)``: flash-attn's token-major layout, unlike ``KVCache``'s), taking pages from
/// the pool as they fill; ``fork(seq)`` makes a new sequence sharing ``seq``'s full pages
/// (its partial last page copied, so neither's appends reach the other); ``free(seq)``
/// returns each of its pages to the pool with its last user. Running out of pages is a
/// ValueError that changes nothing.
///
/// ``attend(query, seqs, cu_seqlens_q=None, *, is_causal=True, scale=None, window_size=(-1,
/// -1), softcap=0.0, alibi_slopes=None)`` attends the newest queries of the sequences
/// ``seqs`` (a list of ids) to their cached tokens, which must include the queries' own:
/// ``query`` ``(batch, n, heads, head_dim)`` (``n`` queries each, ``batch = len(seqs)``)
/// gives ``(batch, n, heads, value_dim)``; ``query`` ``(total, heads, head_dim)`` packs
/// the sequences' queries one after the other (sequence ``i`` on the rows
/// ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``; without ``cu_seqlens_q``, one query each) and
/// gives ``(total, heads, value_dim)``. ``heads`` is a multiple of ``kv_heads`` (GQA).
/// Causal masks, windows and ALiBi are aligned bottom-right, as in
/// ``flash_attn_with_kvcache``. ``attend_with_lse`` also returns the float32 LSE,
/// ``(batch, heads, n)`` or ``(heads, total)``. Results are NumPy arrays, or torch tensors
/// for a torch query. The GIL is released while attn computes.
#[pyclass(name = "PagedKVCache", module = "attn")]
#[derive(Debug)]
pub(crate) struct PyPagedKvCache {
    inner: Inner,
    dtype: Float,
    /// The engine's handle of each id handed out; `None` once freed.
    seqs: Vec<Option<SeqId>>,
    num_pages: usize,
    kv_heads: usize,
    head_dim: usize,
    value_dim: usize,
    latent: bool,
}

/// The sequence ids of `obj`: a list, tuple, NumPy array or torch tensor of ints.
fn seq_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let list = if obj.hasattr("tolist")? {
        obj.call_method0("tolist")?
    } else {
        obj.clone()
    };
    if list.extract::<i64>().is_ok() {
        return Err(PyTypeError::new_err(
            "seqs must be a sequence of sequence ids: pass [seq] for one sequence",
        ));
    }
    list.extract().map_err(|_| {
        PyTypeError::new_err(
            "seqs must be a sequence of sequence ids (ints: a list, a NumPy array, a torch tensor)",
        )
    })
}

/// A `(t, kv_heads, width)` block of new rows, of the cache's dtype.
fn new_rows<'py>(
    name: &'static str,
    obj: &Bound<'py, PyAny>,
    dtype: Float,
    (kv_heads, width): (usize, usize),
) -> PyResult<Array<'py>> {
    let a = Array::extract(name, obj)?;
    if a.dtype != Dtype::Float(dtype) {
        return Err(PyTypeError::new_err(format!(
            "{name} has dtype {} but the cache holds {}",
            a.dtype.name(),
            float_name(dtype)
        )));
    }
    match a.shape[..] {
        [_, h, d] if (h, d) == (kv_heads, width) => {}
        _ => {
            return Err(PyValueError::new_err(format!(
                "{name} of shape {} must be (tokens, {kv_heads}, {width}): (tokens, kv_heads, features)",
                a.shape_str()
            )));
        }
    }
    a.require_contiguous_rows()?;
    forward_strides(obj.py(), a)
}

impl PyPagedKvCache {
    fn create(
        (num_pages, page_size, kv_heads, head_dim, value_dim): (usize, usize, usize, usize, usize),
        dtype: Option<&Bound<'_, PyAny>>,
        (latent, format): (bool, Option<KvQuantization>),
    ) -> PyResult<Self> {
        let dtype = dtype_of("PagedKVCache", dtype)?;
        let dims = (num_pages, page_size, kv_heads, head_dim, value_dim);
        fn make<T: Storage>(
            (p, s, h, dk, dv): (usize, usize, usize, usize, usize),
            (latent, format): (bool, Option<KvQuantization>),
        ) -> PyResult<PagedKvCache<T>> {
            match (latent, format) {
                (false, None) => PagedKvCache::new(p, s, h, dk, dv),
                (false, Some(f)) => PagedKvCache::quantized(p, s, h, dk, dv, f),
                (true, _) => PagedKvCache::latent(p, s, h, dk, dv),
            }
            .map_err(to_py_err)
        }
        let kind = (latent, format);
        let inner = match dtype {
            Float::F32 => Inner::F32(make(dims, kind)?),
            Float::F16 => Inner::F16(make(dims, kind)?),
            Float::Bf16 => Inner::BF16(make(dims, kind)?),
        };
        Ok(Self {
            inner,
            dtype,
            seqs: Vec::new(),
            num_pages,
            kv_heads,
            head_dim,
            value_dim,
            latent,
        })
    }

    /// The engine's handle of sequence `seq`, a ValueError for an id never handed out or
    /// freed.
    fn id(&self, seq: i64) -> PyResult<SeqId> {
        let slot = usize::try_from(seq).ok().and_then(|s| self.seqs.get(s));
        match slot {
            Some(Some(id)) => Ok(*id),
            Some(None) => Err(PyValueError::new_err(format!("sequence {seq} was freed"))),
            None => Err(PyValueError::new_err(format!(
                "sequence {seq} is not a sequence of this cache (it has handed out ids 0..{})",
                self.seqs.len()
            ))),
        }
    }

    /// Keeps a new engine handle and returns its id.
    fn adopt(&mut self, id: SeqId) -> usize {
        self.seqs.push(Some(id));
        self.seqs.len() - 1
    }

    #[allow(clippy::too_many_arguments)]
    fn attend_impl<'py>(
        &self,
        query: &Bound<'py, PyAny>,
        seqs: &Bound<'py, PyAny>,
        cu_seqlens_q: Option<&Bound<'py, PyAny>>,
        is_causal: bool,
        scale: Option<f64>,
        window_size: Option<&Bound<'py, PyAny>>,
        softcap: f64,
        alibi_slopes: Option<&Bound<'py, PyAny>>,
        with_lse: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = query.py();
        let q = Array::extract("query", query)?;
        if q.dtype != Dtype::Float(self.dtype) {
            return Err(PyTypeError::new_err(format!(
                "query has dtype {} but the cache holds {}",
                q.dtype.name(),
                float_name(self.dtype)
            )));
        }
        check_returnable(q.kind, self.dtype)?;
        q.require_contiguous_rows()?;
        let q = Queries::new(forward_strides(py, q)?)?;
        let ids = seq_ids(seqs)?
            .into_iter()
            .map(|s| self.id(s))
            .collect::<PyResult<Vec<_>>>()?;
        let cu = match (q.form, cu_seqlens_q) {
            (Form::Packed, Some(cu)) => offsets("cu_seqlens_q", cu)?,
            (Form::Packed, None) if q.total == ids.len() => (0..=ids.len()).collect(),
            (Form::Packed, None) => {
                return Err(PyValueError::new_err(format!(
                    "query has {} rows for {} sequences: pass cu_seqlens_q (without it, each sequence has one query)",
                    q.total,
                    ids.len()
                )));
            }
            (Form::Batch { batch, n }, None) if batch == ids.len() => {
                (0..=batch).map(|b| b * n).collect() // at most `total`, checked
            }
            (Form::Batch { batch, .. }, None) => {
                return Err(PyValueError::new_err(format!(
                    "query has {batch} sequences (its first axis) but seqs names {}",
                    ids.len()
                )));
            }
            (Form::Batch { .. }, Some(_)) => {
                return Err(PyValueError::new_err(
                    "cu_seqlens_q goes with a packed query (total, heads, head_dim); a (batch, n, heads, head_dim) query has n queries a sequence",
                ));
            }
        };
        let options = PagedOptions::read(
            scale,
            is_causal,
            window_of(window_size)?,
            softcap,
            alibi_slopes,
            (ids.len(), q.heads),
        )?;
        let results = typed!(&self.inner, c, T, {
            // SAFETY: the query was read as the cache's dtype, `T`, and lives (borrowed)
            // until we return.
            let copy = unsafe { q.copy::<T>() }?;
            // SAFETY: as above.
            let view = unsafe { q.view::<T>(copy.as_deref()) }?;
            let batch = c.batch(&ids).map_err(to_py_err)?;
            let opts = options.options();
            let call = batch.attention(view, &cu, &opts).map_err(to_py_err)?;
            run(py, &call, q.form, q.kind(), with_lse)?
        });
        returned(py, results)
    }
}

#[pymethods]
impl PyPagedKvCache {
    #[new]
    #[pyo3(signature = (num_pages, page_size, kv_heads, head_dim, value_dim=None, *, dtype=None, format=None))]
    fn new(
        num_pages: usize,
        page_size: usize,
        kv_heads: usize,
        head_dim: usize,
        value_dim: Option<usize>,
        dtype: Option<&Bound<'_, PyAny>>,
        format: Option<&str>,
    ) -> PyResult<Self> {
        let dims = (
            num_pages,
            page_size,
            kv_heads,
            head_dim,
            value_dim.unwrap_or(head_dim),
        );
        let format = kv_format("PagedKVCache", format)?;
        Self::create(dims, dtype, (false, format))
    }

    /// A latent cache (DeepSeek's multi-head latent attention): one row of ``head_dim``
    /// a token and head, the key, whose first ``value_dim`` (at most ``head_dim``) columns
    /// are the value, stored once (``append_latent``).
    #[staticmethod]
    #[pyo3(signature = (num_pages, page_size, kv_heads, head_dim, value_dim, *, dtype=None))]
    fn latent(
        num_pages: usize,
        page_size: usize,
        kv_heads: usize,
        head_dim: usize,
        value_dim: usize,
        dtype: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let dims = (num_pages, page_size, kv_heads, head_dim, value_dim);
        Self::create(dims, dtype, (true, None))
    }

    /// A new, empty sequence: its id.
    fn add_sequence(&mut self) -> PyResult<usize> {
        let id = typed!(&mut self.inner, c, T, c.add_sequence()).map_err(to_py_err)?;
        Ok(self.adopt(id))
    }

    /// Appends ``t`` tokens to sequence ``seq``: ``key`` ``(t, kv_heads, head_dim)``,
    /// ``value`` ``(t, kv_heads, value_dim)``. Nothing is appended on error (no free page
    /// left included).
    fn append(
        &mut self,
        seq: i64,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let py = key.py();
        let id = self.id(seq)?;
        if self.latent {
            return Err(PyValueError::new_err(
                "a latent cache stores keys and values as one row: append_latent(seq, latent)",
            ));
        }
        if is_torch_tensor(key)? != is_torch_tensor(value)? {
            return Err(PyTypeError::new_err(
                "key and value must both be torch tensors, or both NumPy arrays",
            ));
        }
        let k = new_rows("key", key, self.dtype, (self.kv_heads, self.head_dim))?;
        let v = new_rows("value", value, self.dtype, (self.kv_heads, self.value_dim))?;
        if k.shape[0] != v.shape[0] {
            return Err(PyValueError::new_err(format!(
                "key {} and value {} carry different numbers of tokens",
                k.shape_str(),
                v.shape_str()
            )));
        }
        typed!(&mut self.inner, c, T, {
            // SAFETY: `k` and `v` were read as the cache's dtype, `T` (non-negative
            // strides), and live through the call.
            let (kv, vv) = unsafe { (operand::<T>(&k), operand::<T>(&v)) };
            let (kv, vv) = (kv.map_err(to_py_err)?, vv.map_err(to_py_err)?);
            py.detach(|| c.append(id, kv, vv)).map_err(to_py_err)
        })
    }

    /// Appends ``t`` tokens to sequence ``seq`` of a latent cache: ``latent`` ``(t,
    /// kv_heads, head_dim)``, the keys, whose first ``value_dim`` columns are the values.
    fn append_latent(&mut self, seq: i64, latent: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = latent.py();
        let id = self.id(seq)?;
        if !self.latent {
            return Err(PyValueError::new_err(
                "this cache stores keys and values apart: append(seq, key, value) (PagedKVCache.latent makes a latent cache)",
            ));
        }
        let rows = new_rows("latent", latent, self.dtype, (self.kv_heads, self.head_dim))?;
        typed!(&mut self.inner, c, T, {
            // SAFETY: `rows` was read as the cache's dtype, `T` (non-negative strides), and
            // lives through the call.
            let view = unsafe { operand::<T>(&rows) }.map_err(to_py_err)?;
            py.detach(|| c.append_latent(id, view)).map_err(to_py_err)
        })
    }

    /// A new sequence holding what ``seq`` holds: it shares ``seq``'s full pages and gets
    /// its own copy of the partial last one (one free page), so that appending to either
    /// leaves the other as it was. Returns its id.
    fn fork(&mut self, seq: i64) -> PyResult<usize> {
        let id = self.id(seq)?;
        let new = typed!(&mut self.inner, c, T, c.fork(id)).map_err(to_py_err)?;
        Ok(self.adopt(new))
    }

    /// Frees sequence ``seq``: each of its pages returns to the pool with its last user.
    /// The id is not reused.
    fn free(&mut self, seq: i64) -> PyResult<()> {
        let id = self.id(seq)?;
        typed!(&mut self.inner, c, T, c.free(id)).map_err(to_py_err)?;
        if let Some(slot) = usize::try_from(seq).ok().and_then(|s| self.seqs.get_mut(s)) {
            *slot = None;
        }
        Ok(())
    }

    /// The tokens sequence ``seq`` holds.
    fn seq_len(&self, seq: i64) -> PyResult<usize> {
        let id = self.id(seq)?;
        typed!(&self.inner, c, T, c.len(id)).map_err(to_py_err)
    }

    /// The pages sequence ``seq`` uses, in order: its row of the block table.
    fn pages(&self, seq: i64) -> PyResult<Vec<u32>> {
        let id = self.id(seq)?;
        typed!(&self.inner, c, T, c.pages_of(id).map(<[u32]>::to_vec)).map_err(to_py_err)
    }

    /// The ids of the sequences not freed, in order.
    #[getter]
    fn sequences(&self) -> Vec<usize> {
        (0..self.seqs.len())
            .filter(|&s| self.seqs[s].is_some())
            .collect()
    }

    /// Pages no sequence uses.
    /// How the pages store keys and values: ``None`` (the dtype's elements), ``"int8"``,
    /// ``"int8-channels"`` or ``"fp8"``.
    #[getter]
    fn format(&self) -> Option<&'static str> {
        format_name(typed!(&self.inner, c, T, c.quantization()))
    }

    #[getter]
    fn free_pages(&self) -> usize {
        typed!(&self.inner, c, T, c.free_pages())
    }

    /// Tokens a page.
    #[getter]
    fn page_size(&self) -> usize {
        typed!(&self.inner, c, T, c.page_size())
    }

    /// Pages in the pool.
    #[getter]
    fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Key/value heads.
    #[getter]
    fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Features per cached key.
    #[getter]
    fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Features per cached value.
    #[getter]
    fn value_dim(&self) -> usize {
        self.value_dim
    }

    /// Whether this is a latent cache (``PagedKVCache.latent``).
    #[getter]
    fn is_latent(&self) -> bool {
        self.latent
    }

    /// The storage dtype's name.
    #[getter]
    fn dtype(&self) -> &str {
        float_name(self.dtype)
    }

    /// Attends ``query`` — ``(len(seqs), n, heads, head_dim)``, or packed ``(total, heads,
    /// head_dim)`` with ``cu_seqlens_q`` — to the cached tokens of the sequences ``seqs``:
    /// ``(len(seqs), n, heads, value_dim)`` or ``(total, heads, value_dim)``. The queries
    /// are each sequence's newest positions: ``is_causal=True`` (the default), windows
    /// (``window_size=(left, right)``, ``-1`` unbounded) and ALiBi (``alibi_slopes``,
    /// float32 ``(heads,)`` or ``(len(seqs), heads)``) are aligned bottom-right; ``softcap``
    /// (0.0: off) caps the scores; ``scale`` defaults to ``1/sqrt(head_dim)``.
    #[pyo3(
        signature = (query, seqs, cu_seqlens_q=None, *, is_causal=true, scale=None, window_size=None, softcap=0.0, alibi_slopes=None),
        text_signature = "($self, query, seqs, cu_seqlens_q=None, *, is_causal=True, scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn attend<'py>(
        &self,
        query: &Bound<'py, PyAny>,
        seqs: &Bound<'py, PyAny>,
        cu_seqlens_q: Option<&Bound<'py, PyAny>>,
        is_causal: bool,
        scale: Option<f64>,
        window_size: Option<&Bound<'py, PyAny>>,
        softcap: f64,
        alibi_slopes: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.attend_impl(
            query,
            seqs,
            cu_seqlens_q,
            is_causal,
            scale,
            window_size,
            softcap,
            alibi_slopes,
            false,
        )
    }

    /// ``attend`` and the float32 natural-log LSE of each row (``-inf`` for a row that
    /// sees no key): ``(out, lse)``, ``lse`` ``(len(seqs), heads, n)`` or ``(heads, total)``.
    #[pyo3(
        signature = (query, seqs, cu_seqlens_q=None, *, is_causal=true, scale=None, window_size=None, softcap=0.0, alibi_slopes=None),
        text_signature = "($self, query, seqs, cu_seqlens_q=None, *, is_causal=True, scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn attend_with_lse<'py>(
        &self,
        query: &Bound<'py, PyAny>,
        seqs: &Bound<'py, PyAny>,
        cu_seqlens_q: Option<&Bound<'py, PyAny>>,
        is_causal: bool,
        scale: Option<f64>,
        window_size: Option<&Bound<'py, PyAny>>,
        softcap: f64,
        alibi_slopes: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.attend_impl(
            query,
            seqs,
            cu_seqlens_q,
            is_causal,
            scale,
            window_size,
            softcap,
            alibi_slopes,
            true,
        )
    }

    fn __repr__(&self) -> String {
        format!(
            "PagedKVCache(num_pages={}, page_size={}, kv_heads={}, head_dim={}, value_dim={}, dtype={:?}{}, free_pages={}, sequences={})",
            self.num_pages,
            self.page_size(),
            self.kv_heads,
            self.head_dim,
            self.value_dim,
            float_name(self.dtype),
            if self.latent { ", latent" } else { "" },
            self.free_pages(),
            self.sequences().len()
        )
    }
}
