//! `attn.KVCache`: attn's [`KvCache`] for decoding from Python.

use attn_core::{Causal, Options, Tensor4Ref};
use attn_optimized::{Growth, KvCache, KvCodes, KvQuantization};
use half::{bf16, f16};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::array::{Array, Dtype, Float, float_name, is_torch_tensor};
use crate::output::{Storage, check_returnable, finish};
use crate::{ByDtype, to_py_err};

/// The cache in its storage type.
type Inner = ByDtype<KvCache<f32>, KvCache<f16>, KvCache<bf16>>;

/// The dtype a user names: ``"float32"``, ``numpy.float16``, ``torch.bfloat16``, … (float32
/// when none is named), for the cache class `class`.
/// A cache's ``format=``: ``None`` (the dtype's own elements), ``"int8"`` (one-byte codes
/// and a scale per token and head), ``"int8-channels"`` (keys shifted and divided per
/// channel first), ``"fp8"`` (e4m3 codes and a scale per token and head).
pub(crate) fn kv_format(class: &str, name: Option<&str>) -> PyResult<Option<KvQuantization>> {
    let int8 = KvQuantization::new(KvCodes::Int8);
    Ok(match name {
        None => None,
        Some("int8") => Some(int8),
        Some("int8-channels") => Some(int8.with_key_channels()),
        Some("fp8") => Some(KvQuantization::new(KvCodes::Fp8E4m3)),
        Some(other) => {
            return Err(PyValueError::new_err(format!(
                "{class}(format='{other}'): expected None, \"int8\", \"int8-channels\" or \"fp8\""
            )));
        }
    })
}

/// The name `format=` takes for `q` (`None` for a cache of elements).
pub(crate) fn format_name(q: Option<KvQuantization>) -> Option<&'static str> {
    q.map(|q| match (q.codes, q.key_channels) {
        (KvCodes::Fp8E4m3, _) => "fp8",
        (_, true) => "int8-channels",
        _ => "int8",
    })
}

pub(crate) fn dtype_of(class: &str, obj: Option<&Bound<'_, PyAny>>) -> PyResult<Float> {
    let Some(obj) = obj else {
        return Ok(Float::F32);
    };
    let name = if let Ok(s) = obj.extract::<String>() {
        s
    } else if obj.get_type().name()? == "dtype" && obj.hasattr("is_floating_point")? {
        obj.str()?.to_string() // a torch dtype: "torch.float16"
    } else {
        obj.py()
            .import("numpy")?
            .call_method1("dtype", (obj,))?
            .getattr("name")?
            .to_string()
    };
    match name.trim_start_matches("torch.") {
        "float32" | "float" => Ok(Float::F32),
        "float16" | "half" => Ok(Float::F16),
        "bfloat16" => Ok(Float::Bf16),
        other => Err(PyTypeError::new_err(format!(
            "{class} dtype {other}: attn caches float32, float16 or bfloat16"
        ))),
    }
}

/// A key/value cache for autoregressive decoding, backed by attn.
///
/// ``KVCache(batch, kv_heads, capacity, head_dim, value_dim=None, *, dtype="float32",
/// growth="fixed")`` holds keys ``(batch, kv_heads, capacity, head_dim)`` and values
/// ``(batch, kv_heads, capacity, value_dim)`` (``value_dim`` defaults to ``head_dim``) in
/// float32, float16 or bfloat16 (a name, a NumPy dtype or a torch dtype), with a length per
/// batch entry. ``growth="double"`` doubles the capacity when an append does not fit;
/// ``"fixed"`` makes that an error.
///
/// ``append(key, value)`` adds ``t`` tokens to every entry (``(batch, kv_heads, t, d)``, of
/// the cache's dtype); ``append_to(index, key, value)`` to one entry (``(1, kv_heads, t,
/// d)``). ``attend(query)`` attends ``(batch, heads, n, head_dim)`` queries (``heads`` a
/// multiple of ``kv_heads``: grouped-query attention) to each entry's cached tokens, which
/// must include the new ones: with ``is_causal=True`` (the default) the causal mask is
/// aligned bottom-right, query ``i`` seeing the cached positions up to ``len - n + i``.
/// Results are NumPy arrays, or torch tensors for a torch query. An entry with no token
/// gives rows of 0 (never NaN). The GIL is released while attn computes.
#[pyclass(name = "KVCache", module = "attn")]
#[derive(Debug)]
pub(crate) struct PyKvCache {
    inner: Inner,
    dtype: Float,
}

/// A `(batch, heads, tokens, d)` input of the cache's dtype, as the engine's view.
fn tokens<'py>(name: &'static str, obj: &Bound<'py, PyAny>, dtype: Float) -> PyResult<Array<'py>> {
    let a = Array::extract(name, obj)?;
    if a.dtype != Dtype::Float(dtype) {
        return Err(PyTypeError::new_err(format!(
            "{name} has dtype {} but the cache holds {}",
            a.dtype.name(),
            float_name(dtype)
        )));
    }
    if a.ndim() != 4 {
        return Err(PyValueError::new_err(format!(
            "{name} of shape {} must have 4 axes (batch, heads, tokens, features)",
            a.shape_str()
        )));
    }
    a.require_contiguous_rows()?;
    if a.strides.iter().any(|&s| s < 0) {
        a.compacted(obj.py())
    } else {
        Ok(a)
    }
}

/// The engine's view of a 4-axis input.
///
/// # Safety
/// `a` must be an input of element type `T` whose buffer outlives the view, unwritten.
unsafe fn view4<'a, T>(a: &Array<'_>) -> PyResult<Tensor4Ref<'a, T>> {
    let dims = [a.shape[0], a.shape[1], a.shape[2], a.shape[3]];
    let strides = [
        a.strides[0] as usize,
        a.strides[1] as usize,
        a.strides[2] as usize,
    ];
    let len = if dims.contains(&0) {
        0
    } else {
        // Checked, though the checks of the input rule out an overflow.
        (0..3)
            .try_fold(dims[3], |len, i| {
                (dims[i] - 1)
                    .checked_mul(strides[i])
                    .and_then(|x| x.checked_add(len))
            })
            .ok_or_else(|| {
                PyValueError::new_err(format!("{} reaches beyond the address space", a.name))
            })?
    };
    let data: &[T] = if len == 0 {
        &[]
    } else {
        // SAFETY: the caller guarantees the view's elements are live elements of type `T`;
        // non-negative strides keep them within `len` elements of the first.
        unsafe { std::slice::from_raw_parts(a.ptr::<T>(), len) }
    };
    Tensor4Ref::new(data, dims, strides).map_err(to_py_err)
}

fn attend_typed<'py, T: Storage>(
    py: Python<'py>,
    cache: &KvCache<T>,
    q: &Array<'py>,
    opts: &Options<'_>,
    with_lse: bool,
) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: `q` was read as this cache's dtype, `T`, and lives through the call.
    let view = unsafe { view4::<T>(q) }?;
    let call = cache.attention(view, opts).map_err(to_py_err)?;
    let dims = call.out_dims();
    let (arr, ptr) = T::zeros(py, &dims)?;
    let lse = with_lse.then(|| f32::zeros(py, &dims[..3])).transpose()?;
    let lse_ptr = lse.as_ref().map(|(_, p)| *p);
    py.detach(|| {
        // SAFETY: `arr` (and `lse`) are our own compact arrays of the call's output (and
        // LSE) dims, just allocated, touched by nothing else during the call.
        let out = unsafe { crate::sdpa::view_mut(ptr, 0, dims, crate::sdpa::compact3(dims)) }?;
        let lse = match lse_ptr {
            None => None,
            Some(p) => {
                let ld = [dims[0], dims[1], dims[2], 1];
                // SAFETY: as above.
                Some(unsafe { crate::sdpa::view_mut(p, 0, ld, crate::sdpa::compact3(ld)) }?)
            }
        };
        call.forward_into::<T>(out, lse, attn_optimized::Par::rayon(0))
    })
    .map_err(to_py_err)?;
    let out = finish(arr, q.kind, T::DTYPE)?;
    let Some((larr, _)) = lse else {
        return Ok(out);
    };
    let lse = finish(larr, q.kind, Float::F32)?;
    Ok(PyTuple::new(py, [out, lse])?.into_any())
}

impl PyKvCache {
    fn attend_impl<'py>(
        &self,
        query: &Bound<'py, PyAny>,
        is_causal: bool,
        scale: Option<f64>,
        with_lse: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = query.py();
        let q = tokens("query", query, self.dtype)?;
        check_returnable(q.kind, self.dtype)?;
        let mut opts = Options::default();
        if is_causal {
            opts = opts.with_causal(Causal::BottomRight);
        }
        if let Some(s) = scale {
            opts = opts.with_scale(s as f32);
        }
        typed!(
            &self.inner,
            c,
            T,
            attend_typed::<T>(py, c, &q, &opts, with_lse)
        )
    }

    fn append_impl(
        &mut self,
        b: Option<usize>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let py = key.py();
        let k = tokens("key", key, self.dtype)?;
        let v = tokens("value", value, self.dtype)?;
        if is_torch_tensor(key)? != is_torch_tensor(value)? {
            return Err(PyTypeError::new_err(
                "key and value must both be torch tensors, or both NumPy arrays",
            ));
        }
        typed!(&mut self.inner, c, T, {
            // SAFETY: `k` and `v` were read as the cache's dtype, `T`, and live through the
            // call.
            let (kv, vv) = unsafe { (view4::<T>(&k)?, view4::<T>(&v)?) };
            py.detach(|| match b {
                None => c.append(kv, vv),
                Some(b) => c.append_to(b, kv, vv),
            })
            .map_err(to_py_err)
        })
    }
}

#[pymethods]
impl PyKvCache {
    #[new]
    #[pyo3(signature = (batch, kv_heads, capacity, head_dim, value_dim=None, *, dtype=None, growth="fixed", format=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        batch: usize,
        kv_heads: usize,
        capacity: usize,
        head_dim: usize,
        value_dim: Option<usize>,
        dtype: Option<&Bound<'_, PyAny>>,
        growth: &str,
        format: Option<&str>,
    ) -> PyResult<Self> {
        let growth = match growth {
            "fixed" => Growth::Fixed,
            "double" => Growth::Double,
            other => {
                return Err(PyValueError::new_err(format!(
                    "growth='{other}': expected \"fixed\" or \"double\""
                )));
            }
        };
        let dtype = dtype_of("KVCache", dtype)?;
        let format = kv_format("KVCache", format)?;
        let d_v = value_dim.unwrap_or(head_dim);
        fn make<T: Storage>(
            (b, h, cap, dk, dv): (usize, usize, usize, usize, usize),
            format: Option<KvQuantization>,
            growth: Growth,
        ) -> PyResult<KvCache<T>> {
            match format {
                Some(f) => KvCache::quantized(b, h, cap, dk, dv, f),
                None => KvCache::new(b, h, cap, dk, dv),
            }
            .map(|c| c.with_growth(growth))
            .map_err(to_py_err)
        }
        let dims = (batch, kv_heads, capacity, head_dim, d_v);
        let inner = match dtype {
            Float::F32 => Inner::F32(make(dims, format, growth)?),
            Float::F16 => Inner::F16(make(dims, format, growth)?),
            Float::Bf16 => Inner::BF16(make(dims, format, growth)?),
        };
        Ok(Self { inner, dtype })
    }

    /// Appends ``t`` tokens to every batch entry: ``key`` ``(batch, kv_heads, t, head_dim)``,
    /// ``value`` ``(batch, kv_heads, t, value_dim)``. Nothing is appended on error.
    fn append(&mut self, key: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.append_impl(None, key, value)
    }

    /// Appends ``t`` tokens to batch entry ``index`` only: ``(1, kv_heads, t, d)``.
    fn append_to(
        &mut self,
        index: usize,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.append_impl(Some(index), key, value)
    }

    /// Attends ``query`` ``(batch, heads, n, head_dim)`` to each entry's cached tokens:
    /// ``(batch, heads, n, value_dim)``. ``is_causal=True`` aligns the causal mask
    /// bottom-right (the queries are the last ``n`` cached positions); ``scale`` defaults
    /// to ``1/sqrt(head_dim)``.
    #[pyo3(signature = (query, *, is_causal=true, scale=None))]
    fn attend<'py>(
        &self,
        query: &Bound<'py, PyAny>,
        is_causal: bool,
        scale: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.attend_impl(query, is_causal, scale, false)
    }

    /// ``attend`` and the float32 natural-log LSE of each row, ``(batch, heads, n)``
    /// (``-inf`` for a row that sees no key): ``(out, lse)``.
    #[pyo3(signature = (query, *, is_causal=true, scale=None))]
    fn attend_with_lse<'py>(
        &self,
        query: &Bound<'py, PyAny>,
        is_causal: bool,
        scale: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.attend_impl(query, is_causal, scale, true)
    }

    /// Forgets the tokens of batch entry ``index``, or of every entry (storage is kept).
    #[pyo3(signature = (index=None))]
    fn clear(&mut self, index: Option<usize>) -> PyResult<()> {
        typed!(&mut self.inner, c, T, {
            match index {
                Some(b) => c.clear(b).map_err(to_py_err),
                None => (0..c.dims()[0])
                    .try_for_each(|b| c.clear(b))
                    .map_err(to_py_err),
            }
        })
    }

    /// Tokens cached per batch entry.
    #[getter]
    fn lens(&self) -> Vec<usize> {
        typed!(&self.inner, c, T, c.lens().to_vec())
    }

    /// Tokens each entry can hold without growing.
    #[getter]
    fn capacity(&self) -> usize {
        typed!(&self.inner, c, T, c.capacity())
    }

    /// ``(batch, kv_heads, capacity, head_dim)``.
    #[getter]
    fn shape(&self) -> (usize, usize, usize, usize) {
        let [b, h, c, d] = typed!(&self.inner, c, T, c.dims());
        (b, h, c, d)
    }

    /// Features per cached value.
    #[getter]
    fn value_dim(&self) -> usize {
        typed!(&self.inner, c, T, c.values().dims()[3])
    }

    /// How the cache stores keys and values: ``None`` (the dtype's elements), ``"int8"``,
    /// ``"int8-channels"`` or ``"fp8"``.
    #[getter]
    fn format(&self) -> Option<&'static str> {
        format_name(typed!(&self.inner, c, T, c.quantization()))
    }

    /// The storage dtype's name.
    #[getter]
    fn dtype(&self) -> &str {
        float_name(self.dtype)
    }

    fn __repr__(&self) -> String {
        let (b, h, c, d) = self.shape();
        format!(
            "KVCache(batch={b}, kv_heads={h}, capacity={c}, head_dim={d}, dtype={:?}, lens={:?})",
            float_name(self.dtype),
            self.lens()
        )
    }
}
