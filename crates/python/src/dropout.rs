//! Attention dropout from Python: torch's `dropout_p`, the seed of a call, and
//! `dropout_mask`, attn's keep mask as a NumPy array (the test hook).
//!
//! The mask is attn-core's ([`attn_core::Dropout`]): a pure function of (seed, offset, batch
//! entry, query head, query, key), Philox4x32-10. A call with `dropout_p > 0` and no `seed`
//! draws one 64-bit seed: from torch's default CPU generator for torch tensors
//! (`attn.torch._draw_seed`, one `torch.randint`, so that `torch.manual_seed` reproduces a
//! run), from NumPy's global generator otherwise (`numpy.random.randint`, the legacy
//! global state that `numpy.random.seed` sets). The offset is 0.

use attn_core::Dropout;
use numpy::PyArrayMethods;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyFloat};

use crate::array::{is_torch_tensor, product, zeroed};
use crate::packed::Seqlens;
use crate::to_py_err;

/// torch's check of `dropout_p` (its message): a probability, NaN refused.
pub(crate) fn check_p(py: Python<'_>, dropout_p: f64) -> PyResult<()> {
    if (0.0..=1.0).contains(&dropout_p) {
        return Ok(());
    }
    let shown = PyFloat::new(py, dropout_p).repr()?;
    Err(PyValueError::new_err(format!(
        "dropout probability has to be between 0 and 1, but got {shown}"
    )))
}

/// A seed given by the caller: any integer (a Python int, a NumPy integer, a one-element
/// integer tensor) from `-2**63` to `2**64 - 1`; a negative one stands for its two's
/// complement (the bits of an int64 tensor).
pub(crate) fn seed_of(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    let py = obj.py();
    let index = py
        .import(intern!(py, "operator"))?
        .getattr(intern!(py, "index"))?
        .call1((obj,))
        .map_err(|_| {
            PyTypeError::new_err(format!(
                "seed must be an integer, not {}",
                obj.get_type()
                    .name()
                    .map_or_else(|_| "?".to_owned(), |n| n.to_string())
            ))
        })?;
    if let Ok(u) = index.extract::<u64>() {
        return Ok(u);
    }
    if let Ok(i) = index.extract::<i64>() {
        return Ok(i as u64); // two's complement: an int64 tensor's bits
    }
    Err(PyValueError::new_err(format!(
        "seed={}: a 64-bit seed is an integer from -2**63 to 2**64 - 1",
        index.repr()?
    )))
}

/// The seed of a call with dropout: the caller's, or one drawn from torch's default
/// generator (torch tensors) or NumPy's global one (anything else).
pub(crate) fn seed_for(query: &Bound<'_, PyAny>, seed: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
    if let Some(s) = seed {
        return seed_of(s);
    }
    let py = query.py();
    let drawn = if is_torch_tensor(query)? {
        py.import(intern!(py, "attn.torch"))?
            .getattr(intern!(py, "_draw_seed"))?
            .call0()?
    } else {
        let kwargs = PyDict::new(py);
        kwargs.set_item("dtype", "uint64")?;
        py.import(intern!(py, "numpy.random"))?
            .getattr(intern!(py, "randint"))?
            .call((0u64, 1u128 << 64), Some(&kwargs))?
    };
    seed_of(&drawn)
}

/// An offset of the generator's counter: `0 ≤ offset < 2**32`.
fn offset_of(offset: i64) -> PyResult<u32> {
    u32::try_from(offset).map_err(|_| {
        PyValueError::new_err(format!(
            "offset={offset}: the dropout offset is from 0 to 2**32 - 1"
        ))
    })
}

/// `(B, H, L, S)` as four sizes.
fn dims4(shape: &[usize]) -> PyResult<[usize; 4]> {
    match *shape {
        [b, h, l, s] => Ok([b, h, l, s]),
        _ => Err(PyValueError::new_err(format!(
            "shape {shape:?}: dropout_mask takes (batch, heads, L, S), or (heads, total_q, total_k) with cu_seqlens"
        ))),
    }
}

/// The bool NumPy array of `shape` holding `keep`.
fn to_numpy<'py>(py: Python<'py>, keep: Vec<bool>, shape: &[usize]) -> PyResult<Bound<'py, PyAny>> {
    let flat = numpy::PyArray1::from_vec(py, keep);
    Ok(flat.reshape(shape)?.into_any())
}

/// attn's keep mask of a call with dropout probability ``dropout_p``, ``seed`` and
/// ``offset``: a bool NumPy array, True where a weight is kept (and scaled by
/// ``1/(1 - p)``), False where it is dropped. ``shape`` is ``(B, H, L, S)``: batch entries,
/// query heads, queries and keys of a call ``attn.scaled_dot_product_attention`` makes on
/// a ``(B, H, L, E)`` query with ``dropout_p`` and ``seed`` (its offset is 0; with more
/// than four axes, the axes before the heads flattened into ``B``). With
/// ``cu_seqlens_q`` and ``cu_seqlens_k`` (a packed call), ``shape`` is
/// ``(H, total_q, total_k)`` and the mask block-diagonal: sequence ``i``'s block
/// ``[:, cu_q[i]:cu_q[i+1], cu_k[i]:cu_k[i+1]]`` is what batch entry ``i`` keeps at its
/// own positions, False outside the blocks.
///
/// Computed by attn-core's ``HeadDropout::keeps``, the function both passes of the engine
/// apply: handing this mask to torch's math path, ``softmax(S) * mask / (1 - p) @ V``,
/// reproduces attn's call. ``dropout_p`` is rounded to a multiple of ``2**-16`` as attn
/// does; 0 keeps everything.
#[pyfunction]
#[pyo3(signature = (seed, offset, shape, dropout_p, *, cu_seqlens_q=None, cu_seqlens_k=None))]
pub(crate) fn dropout_mask<'py>(
    py: Python<'py>,
    seed: &Bound<'py, PyAny>,
    offset: i64,
    shape: Vec<usize>,
    dropout_p: f64,
    cu_seqlens_q: Option<&Bound<'py, PyAny>>,
    cu_seqlens_k: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    check_p(py, dropout_p)?;
    let seed = seed_of(seed)?;
    let d = Dropout::new(dropout_p as f32, seed)
        .map_err(to_py_err)?
        .with_offset(offset_of(offset)?);
    let count = product(&shape);
    if let Some(seqs) = Seqlens::read(cu_seqlens_q, cu_seqlens_k)? {
        let [h, tq, tk] = match shape[..] {
            [h, tq, tk] => [h, tq, tk],
            _ => {
                return Err(PyValueError::new_err(format!(
                    "shape {shape:?}: with cu_seqlens, dropout_mask takes (heads, total_q, total_k)"
                )));
            }
        };
        let (cq, ck) = (seqs.q(), seqs.k());
        if cq.last() != Some(&tq) || ck.last() != Some(&tk) {
            return Err(PyValueError::new_err(format!(
                "shape {shape:?}: cu_seqlens_q ends at {:?} and cu_seqlens_k at {:?}, not at total_q and total_k",
                cq.last(),
                ck.last()
            )));
        }
        let batch = cq.len() - 1;
        d.check_streams(batch, h).map_err(to_py_err)?;
        let mut keep = zeroed::<bool>("the dropout mask", count)?;
        py.detach(|| -> attn_core::Result<()> {
            for i in 0..batch {
                let (q0, q1, k0, k1) = (cq[i], cq[i + 1], ck[i], ck[i + 1]);
                d.check_positions(q1 - q0, k1 - k0)?;
                for hh in 0..h {
                    let head = d.for_head(i, hh, h);
                    for r in q0..q1 {
                        let row = (hh * tq + r) * tk;
                        for c in k0..k1 {
                            keep[row + c] = head.is_none_or(|hd| hd.keeps(r - q0, c - k0));
                        }
                    }
                }
            }
            Ok(())
        })
        .map_err(to_py_err)?;
        return to_numpy(py, keep, &shape);
    }
    let [b, h, l, s] = dims4(&shape)?;
    d.check_streams(b, h).map_err(to_py_err)?;
    d.check_positions(l, s).map_err(to_py_err)?;
    let mut keep = zeroed::<bool>("the dropout mask", count)?;
    py.detach(|| {
        let per_head = l * s;
        if per_head == 0 {
            return;
        }
        for (bh, block) in keep.chunks_mut(per_head).enumerate() {
            let head = d.for_head(bh / h, bh % h, h);
            for (i, row) in block.chunks_mut(s).enumerate() {
                for (j, k) in row.iter_mut().enumerate() {
                    *k = head.is_none_or(|hd| hd.keeps(i, j));
                }
            }
        }
    });
    to_numpy(py, keep, &shape)
}
