//! attn from Python: the extension module `attn._attn`, behind the `attn` package
//! (`python/attn/`), built with maturin (`pyproject.toml`) as one abi3 wheel for CPython ≥ 3.9.
//!
//! It gives NumPy and torch users `torch.nn.functional.scaled_dot_product_attention`'s call
//! — the same argument names, defaults, shapes, broadcasting, masks and errors — computed
//! by attn's streaming engine ([`attn_optimized`]):
//!
//! - `scaled_dot_product_attention`, `attention_with_lse` and `attention_backward`
//!   (`sdpa.rs`), planned as batched engine calls over strided views (`plan.rs`), or as one
//!   packed call for a batch of sequences of different lengths (`cu_seqlens_q`,
//!   `cu_seqlens_k`: `packed.rs`);
//! - attention dropout (`dropout_p`, torch's): each call's seed (given, or drawn from
//!   torch's or NumPy's generator) and `dropout_mask`, attn-core's keep mask as a NumPy
//!   array for tests (`sdpa.rs`); a call split into several engine calls keys each by
//!   its place in the whole ([`attn_core::Dropout::within`]);
//! - `KVCache`, the engine's [`attn_optimized::KvCache`] for decoding (`cache.rs`);
//! - `PagedKVCache`, the engine's [`attn_optimized::PagedKvCache`] for serving
//!   (`paged_cache.rs`), and `flash_attn_with_kvcache`, flash-attn's call over paged (or
//!   per-sequence) caches the caller owns, new keys and values written into them in place
//!   (`paged.rs`), both one [`attn_optimized::Attention::paged`] call;
//! - inputs read in place (`array.rs`): NumPy arrays through NumPy's C API, torch tensors
//!   and any other CPU producer through DLPack (`dlpack.rs`, the consumer);
//! - results allocated as NumPy arrays and handed to torch without a copy (`output.rs`);
//! - `attn.torch` (Python) defines the forward and backward passes as `torch.library`
//!   operators (`attn::sdpa_forward`, `attn::sdpa_backward`, `attn::sdpa_backward_mask`)
//!   through a `Library` of its own, with their autograd formula; their CPU kernels are
//!   this crate's (`operator.rs`); `attn.transformers` registers
//!   `attn_implementation="attn"`.
//!
//! The GIL is released while the engine computes; every error is a Python `ValueError` or
//! `TypeError` carrying attn's message (operand and shapes), or a `MemoryError` for a
//! result too large to allocate, never a crash; the functions
//! with torch's semantics raise them as `attn.InputError` and `attn.InputTypeError`, which
//! are `RuntimeError`s too, as torch's errors are (`errors.rs`). The crate is
//! built with PyO3's `extension-module` feature, so `cargo build` and `cargo test
//! --workspace` need no Python; its tests are the pytest suite in `tests/`, run by
//! `cargo xtask test`.

/// A value in one of the three storage types (a cache of f32, f16 or bf16 elements), for
/// [`typed!`].
#[derive(Debug)]
pub(crate) enum ByDtype<A, B, C> {
    F32(A),
    F16(B),
    BF16(C),
}

/// Calls `$body` with `$c` bound to the typed value of a [`ByDtype`] and `$t` to its
/// element type.
macro_rules! typed {
    ($inner:expr, $c:ident, $t:ident, $body:expr) => {
        match $inner {
            $crate::ByDtype::F32($c) => {
                #[allow(unused)]
                type $t = f32;
                $body
            }
            $crate::ByDtype::F16($c) => {
                #[allow(unused)]
                type $t = half::f16;
                $body
            }
            $crate::ByDtype::BF16($c) => {
                #[allow(unused)]
                type $t = half::bf16;
                $body
            }
        }
    };
}

mod array;
mod cache;
mod dlpack;
mod errors;
mod operator;
mod output;
mod packed;
mod paged;
mod paged_cache;
mod plan;
mod sdpa;

use pyo3::exceptions::{PyMemoryError, PyValueError};
use pyo3::prelude::*;

/// attn's error as the Python exception a caller expects: `MemoryError` for an
/// allocation that failed, `ValueError` for everything else (shapes, options, capacity).
fn to_py_err(e: attn_core::Error) -> PyErr {
    match e {
        attn_core::Error::Allocation { .. } => PyMemoryError::new_err(e.to_string()),
        _ => PyValueError::new_err(e.to_string()),
    }
}

/// The instruction set attn's kernels run with on this CPU: `"amx"`, `"avx512bf16"`,
/// `"avx512"`, `"avx2"` or `"baseline"` (the names `ATTN_ISA` takes).
#[pyfunction]
fn isa() -> String {
    attn_optimized::exp::isa().name().to_owned()
}

/// The threads attn computes with: its rayon pool's (set ``RAYON_NUM_THREADS`` before
/// the first call to choose; the default is one per core).
#[pyfunction]
fn num_threads() -> usize {
    rayon::current_num_threads()
}

/// The extension module `attn._attn`.
#[pymodule]
#[pyo3(name = "_attn")]
fn attn_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(sdpa::scaled_dot_product_attention, m)?)?;
    m.add_function(wrap_pyfunction!(sdpa::attention_with_lse, m)?)?;
    m.add_function(wrap_pyfunction!(sdpa::attention_backward, m)?)?;
    m.add_function(wrap_pyfunction!(paged::flash_attn_with_kvcache, m)?)?;
    m.add_function(wrap_pyfunction!(sdpa::dropout_mask, m)?)?;
    m.add_function(wrap_pyfunction!(operator::sdpa_forward_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(operator::sdpa_backward_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(isa, m)?)?;
    m.add_function(wrap_pyfunction!(num_threads, m)?)?;
    m.add("InputError", errors::input_error(m.py())?)?;
    m.add("InputTypeError", errors::input_type_error(m.py())?)?;
    m.add_class::<cache::PyKvCache>()?;
    m.add_class::<paged_cache::PyPagedKvCache>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
