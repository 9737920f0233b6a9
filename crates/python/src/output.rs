//! Results: NumPy arrays allocated here (zeroed by NumPy's calloc, so never a memset of
//! untouched pages), handed to torch without a copy (`torch.from_numpy`) when the query
//! was a torch tensor.

use half::{bf16, f16};
use std::ffi::c_int;

use numpy::PyArrayDescrMethods;
use numpy::npyffi::{PY_ARRAY_API, PyArrayObject, npy_intp};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use attn_optimized::Element;

use crate::array::{Float, Kind};

/// A raw pointer that may cross into the computation while the GIL is released.
#[derive(Debug)]
pub(crate) struct SendPtr<T>(pub *const T);

impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}

// SAFETY: a `SendPtr` is an address of input or output memory kept alive (by Python objects
// held on the calling thread) for the whole call; the computation only forms views of it
// that the engine reads or writes, sequentially per call, never the Python objects.
unsafe impl<T: Sync> Send for SendPtr<T> {}
// SAFETY: as above; sharing the address itself is harmless.
unsafe impl<T: Sync> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer as a writable one (outputs).
    pub(crate) fn as_mut(self) -> *mut T {
        self.0.cast_mut()
    }
}

/// The storage types attn computes in (their dtype is [`Element::DTYPE`]), and how their
/// NumPy arrays are made.
pub(crate) trait Storage: Element {
    /// A zeroed, C-contiguous NumPy array of this type (`int16` holding the bits for
    /// bf16, which NumPy does not have) and the address of its first element; NumPy's
    /// `MemoryError` (or `ValueError` for a size beyond any array) when it cannot be made.
    fn zeros<'py>(py: Python<'py>, shape: &[usize])
    -> PyResult<(Bound<'py, PyAny>, SendPtr<Self>)>;
}

/// `numpy.zeros(shape, N)`, through the C API (`PyArray_Zeros`, calloc'ed), failing as
/// NumPy does instead of aborting.
fn zeros_of<'py, N: numpy::Element, T>(
    py: Python<'py>,
    shape: &[usize],
) -> PyResult<(Bound<'py, PyAny>, SendPtr<T>)> {
    let mut dims: Vec<npy_intp> = Vec::with_capacity(shape.len());
    for &d in shape {
        dims.push(npy_intp::try_from(d).map_err(|_| {
            PyValueError::new_err(format!("a result axis of {d} elements is beyond NumPy's"))
        })?);
    }
    let nd = c_int::try_from(dims.len())
        .map_err(|_| PyValueError::new_err("a result with too many axes for NumPy"))?;
    // SAFETY: the NumPy C API is loaded by `PY_ARRAY_API` (imported on first use); `dims`
    // holds `nd` sizes; `into_dtype_ptr` hands over the reference that PyArray_Zeros steals.
    let raw = unsafe {
        PY_ARRAY_API.PyArray_Zeros(
            py,
            nd,
            dims.as_mut_ptr(),
            N::get_dtype(py).into_dtype_ptr(),
            0,
        )
    };
    if raw.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a non-null result of PyArray_Zeros is a new reference to an ndarray.
    let arr = unsafe { Bound::from_owned_ptr(py, raw) };
    // SAFETY: `raw` is that ndarray's `PyArrayObject`; its data field is the buffer.
    let data = unsafe { (*raw.cast::<PyArrayObject>()).fields.data };
    Ok((arr, SendPtr(data.cast::<T>().cast_const())))
}

impl Storage for f32 {
    fn zeros<'py>(
        py: Python<'py>,
        shape: &[usize],
    ) -> PyResult<(Bound<'py, PyAny>, SendPtr<Self>)> {
        zeros_of::<f32, f32>(py, shape)
    }
}

impl Storage for f16 {
    fn zeros<'py>(
        py: Python<'py>,
        shape: &[usize],
    ) -> PyResult<(Bound<'py, PyAny>, SendPtr<Self>)> {
        zeros_of::<f16, f16>(py, shape)
    }
}

impl Storage for bf16 {
    fn zeros<'py>(
        py: Python<'py>,
        shape: &[usize],
    ) -> PyResult<(Bound<'py, PyAny>, SendPtr<Self>)> {
        // int16, not uint16: torch.from_numpy takes int16 in every version (uint16 only
        // since 2.3), and `.view(torch.bfloat16)` reinterprets the bits either way.
        zeros_of::<i16, bf16>(py, shape)
    }
}

/// `torch.from_numpy`, and `torch.bfloat16`.
fn torch_attr<'py>(py: Python<'py>, name: &'static str) -> PyResult<Bound<'py, PyAny>> {
    static FROM_NUMPY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    static BFLOAT16: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let cell = if name == "from_numpy" {
        &FROM_NUMPY
    } else {
        &BFLOAT16
    };
    cell.get_or_try_init(py, || -> PyResult<_> {
        Ok(py.import("torch")?.getattr(name)?.unbind())
    })
    .map(|f| f.bind(py).clone())
}

/// Checks that a result of `dtype` can be returned in `kind`.
pub(crate) fn check_returnable(kind: Kind, dtype: Float) -> PyResult<()> {
    if dtype == Float::Bf16 && kind != Kind::Torch {
        return Err(PyTypeError::new_err(
            "bfloat16 inputs need torch tensors: NumPy has no bfloat16 for the result",
        ));
    }
    Ok(())
}

/// A NumPy result `arr` of `dtype`, as the `kind` of the query: itself, or a torch tensor
/// sharing its memory.
pub(crate) fn finish<'py>(
    arr: Bound<'py, PyAny>,
    kind: Kind,
    dtype: Float,
) -> PyResult<Bound<'py, PyAny>> {
    if kind != Kind::Torch {
        return Ok(arr);
    }
    let py = arr.py();
    let t = torch_attr(py, "from_numpy")?.call1((arr,))?;
    if dtype == Float::Bf16 {
        t.call_method1("view", (torch_attr(py, "bfloat16")?,))
    } else {
        Ok(t)
    }
}
