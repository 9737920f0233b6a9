//! attn's errors for malformed input as torch raises them. attn raises `ValueError` for
//! shapes and options and `TypeError` for dtypes and kinds of input; torch raises
//! `RuntimeError` for both. The module's functions with torch's semantics raise
//! `attn.InputError` (a `ValueError` and a `RuntimeError`) and `attn.InputTypeError` (a
//! `TypeError` and a `RuntimeError`) instead, so that code written against either library
//! catches them; the message is unchanged.

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use pyo3::{PyTypeInfo, intern};

static INPUT_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INPUT_TYPE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// The class `name` (`type(name, (base, RuntimeError), {...})` in the module `attn`),
/// created once into `cell`.
fn class<'py>(
    py: Python<'py>,
    cell: &'static PyOnceLock<Py<PyType>>,
    name: &str,
    base: Bound<'py, PyType>,
    doc: &str,
) -> PyResult<&'py Bound<'py, PyType>> {
    cell.get_or_try_init(py, || {
        let namespace = PyDict::new(py);
        namespace.set_item("__module__", "attn")?;
        namespace.set_item("__doc__", doc)?;
        let bases = PyTuple::new(py, [base, PyRuntimeError::type_object(py)])?;
        Ok(py
            .import(intern!(py, "builtins"))?
            .getattr(intern!(py, "type"))?
            .call1((name, bases, namespace))?
            .cast_into::<PyType>()?
            .unbind())
    })
    .map(|t| t.bind(py))
}

/// `attn.InputError`: malformed input (a shape, an option), a `ValueError` and a
/// `RuntimeError`.
pub(crate) fn input_error(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    let doc = "Malformed input to attn (a shape, an option): a ValueError, and a RuntimeError as torch raises.";
    class(
        py,
        &INPUT_ERROR,
        "InputError",
        PyValueError::type_object(py),
        doc,
    )
}

/// `attn.InputTypeError`: an input of a dtype or kind attn does not take, a `TypeError` and
/// a `RuntimeError`.
pub(crate) fn input_type_error(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    let doc = "An input attn does not take (a dtype, a kind of array): a TypeError, and a RuntimeError as torch raises.";
    class(
        py,
        &INPUT_TYPE_ERROR,
        "InputTypeError",
        PyTypeError::type_object(py),
        doc,
    )
}

/// `err` as torch's kind of error: a plain `ValueError` or `TypeError` becomes the class
/// that is also a `RuntimeError`, with the same arguments, traceback, cause and context;
/// anything else is returned as it is.
fn torch_like_err(py: Python<'_>, err: PyErr) -> PyErr {
    let ty = err.get_type(py);
    let class = if ty.is(PyValueError::type_object(py)) {
        input_error(py)
    } else if ty.is(PyTypeError::type_object(py)) {
        input_type_error(py)
    } else {
        return err;
    };
    let converted = (|| -> PyResult<PyErr> {
        let value = err.value(py);
        let new = class?.call1(value.getattr(intern!(py, "args"))?.cast_into::<PyTuple>()?)?;
        // The frames it was raised through (Python code on the autograd route has some),
        // and its cause and context, go with it; setting a cause of None would hide them.
        for name in ["__traceback__", "__cause__", "__context__"] {
            let attr = value.getattr(name)?;
            if !attr.is_none() {
                new.setattr(name, attr)?;
            }
        }
        Ok(PyErr::from_value(new))
    })();
    converted.unwrap_or(err)
}

/// The result of `body`, its error as torch's kind ([`torch_like_err`]).
pub(crate) fn torch_like<T>(py: Python<'_>, body: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    body().map_err(|e| torch_like_err(py, e))
}
