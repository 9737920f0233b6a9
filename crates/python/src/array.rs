//! Inputs: NumPy arrays (read through the NumPy C API) and DLPack tensors (torch and any
//! other CPU producer), seen as one strided view type, [`Array`].
//!
//! An input is used in place (zero-copy) when attn's views can express it: an aligned
//! buffer whose strides are whole elements. Anything else (unaligned NumPy data, byte
//! strides that are not a multiple of the element size, and — decided by the caller —
//! negative strides on the axes an engine call spans) is copied once into a compact
//! buffer, the one documented copy.

use pyo3::exceptions::{PyMemoryError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCapsule, PyDict, PyType};

use numpy::npyffi::NPY_TYPES;
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};

use crate::dlpack;

/// Element types attn reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Dtype {
    F32,
    F16,
    BF16,
    Bool,
    /// Anything else, by name (for the error).
    Other(String),
}

impl Dtype {
    /// The name NumPy and torch users know.
    pub(crate) fn name(&self) -> &str {
        match self {
            Dtype::F32 => "float32",
            Dtype::F16 => "float16",
            Dtype::BF16 => "bfloat16",
            Dtype::Bool => "bool",
            Dtype::Other(name) => name,
        }
    }

    /// Bytes per element (0 for the unsupported ones, which are never read).
    pub(crate) fn size(&self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            Dtype::Bool => 1,
            Dtype::Other(_) => 0,
        }
    }
}

/// Where an input came from: results are returned in the query's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A `numpy.ndarray`: results are NumPy arrays.
    NumPy,
    /// A `torch.Tensor`: results are torch tensors.
    Torch,
    /// Another DLPack producer: results are NumPy arrays.
    Other,
}

/// What keeps an input's memory alive while it is read.
enum Keep<'py> {
    /// The NumPy array itself (also held by the caller).
    Object(#[allow(dead_code)] Bound<'py, PyAny>),
    /// The DLPack capsule: dropping it releases the producer's tensor.
    Capsule(#[allow(dead_code)] Bound<'py, PyCapsule>),
    /// Our own compact copy, in 8-byte words (aligned for every element type).
    Owned(#[allow(dead_code)] Vec<u64>),
}

/// A strided view of an input's elements.
pub(crate) struct Array<'py> {
    /// The operand's name, for messages (`"query"`, `"attn_mask"`, …).
    pub name: &'static str,
    pub kind: Kind,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Element strides; 0 on axes of length ≤ 1.
    pub strides: Vec<isize>,
    /// Address of element `[0, …, 0]`, aligned for `dtype`.
    ptr: *const u8,
    _keep: Keep<'py>,
}

/// `torch.Tensor`, once torch has been imported by someone (we never import it).
fn torch_tensor_type<'py>(py: Python<'py>) -> PyResult<Option<&'py Bound<'py, PyType>>> {
    static TENSOR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    static MODULES: PyOnceLock<Py<PyDict>> = PyOnceLock::new();
    if let Some(t) = TENSOR.get(py) {
        return Ok(Some(t.bind(py)));
    }
    let modules = MODULES.get_or_try_init(py, || -> PyResult<_> {
        Ok(py
            .import("sys")?
            .getattr("modules")?
            .cast_into::<PyDict>()?
            .unbind())
    })?;
    match modules.bind(py).get_item("torch")? {
        Some(torch) if torch.hasattr("Tensor")? => {
            let t = torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind();
            Ok(Some(TENSOR.get_or_init(py, || t).bind(py)))
        }
        _ => Ok(None),
    }
}

/// Whether `obj` is a `torch.Tensor`.
pub(crate) fn is_torch_tensor(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    match torch_tensor_type(obj.py())? {
        Some(t) => obj.is_instance(t),
        None => Ok(false),
    }
}

fn numpy_dtype(arr: &Bound<'_, PyUntypedArray>) -> Dtype {
    let descr = arr.dtype();
    if descr.is_native_byteorder() == Some(false) {
        return Dtype::Other(format!("{} (non-native byte order)", descr));
    }
    let num = descr.num();
    if num == NPY_TYPES::NPY_FLOAT as i32 {
        Dtype::F32
    } else if num == NPY_TYPES::NPY_HALF as i32 {
        Dtype::F16
    } else if num == NPY_TYPES::NPY_BOOL as i32 {
        Dtype::Bool
    } else {
        Dtype::Other(descr.to_string())
    }
}

/// `n` zeroed elements, or a `MemoryError` naming `what` (never an abort) when `n` overflowed
/// (`None`) or cannot be allocated.
pub(crate) fn zeroed<T: Clone + Default>(what: &str, n: Option<usize>) -> PyResult<Vec<T>> {
    let fail = || PyMemoryError::new_err(format!("could not allocate {what}"));
    let n = n.ok_or_else(fail)?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| fail())?;
    v.resize(n, T::default());
    Ok(v)
}

/// The product of `dims`, `None` when it overflows.
pub(crate) fn product(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// Calls `f` with the offset of the first element of every row (every index of the axes
/// but the last), in row-major order; `strides` in any unit. A 0-d array is one row.
fn for_each_row(shape: &[usize], strides: &[isize], mut f: impl FnMut(isize)) {
    if shape.contains(&0) {
        return;
    }
    let outer = shape.len().saturating_sub(1);
    let rows: usize = shape[..outer].iter().product();
    let mut index = vec![0usize; outer];
    for _ in 0..rows {
        f(index
            .iter()
            .zip(strides)
            .map(|(&i, &s)| i as isize * s)
            .sum());
        for a in (0..outer).rev() {
            index[a] += 1;
            if index[a] < shape[a] {
                break;
            }
            index[a] = 0;
        }
    }
}

/// The length and stride of the rows of [`for_each_row`].
fn row_of(shape: &[usize], strides: &[isize]) -> (usize, isize) {
    (
        shape.last().copied().unwrap_or(1),
        strides.last().copied().unwrap_or(0),
    )
}

/// Copies the elements of a strided buffer into a compact row-major one (any alignment,
/// any byte strides, negative included).
///
/// # Safety
/// Every element `ptr + Σ i_a · byte_strides[a]` (`i_a < shape[a]`) must be `size`
/// readable bytes.
unsafe fn compact_copy(
    ptr: *const u8,
    shape: &[usize],
    byte_strides: &[isize],
    size: usize,
) -> PyResult<Vec<u64>> {
    let count = product(shape).unwrap_or(usize::MAX);
    let bytes = count.checked_mul(size);
    let mut words = zeroed::<u64>("a compact copy of an input", bytes.map(|b| b.div_ceil(8)))?;
    let dst = words.as_mut_ptr().cast::<u8>();
    let (n, step) = row_of(shape, byte_strides);
    let mut written = 0;
    for_each_row(shape, byte_strides, |row| {
        if step == size as isize {
            // SAFETY: the caller guarantees the row's `n` contiguous elements are readable;
            // `written + n ≤ count` keeps the destination inside `words`.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr.offset(row), dst.add(written * size), n * size)
            };
        } else {
            for j in 0..n {
                // SAFETY: as above, element by element.
                unsafe {
                    let src = ptr.offset(row + j as isize * step);
                    std::ptr::copy_nonoverlapping(src, dst.add((written + j) * size), size);
                }
            }
        }
        written += n;
    });
    Ok(words)
}

fn compact_strides(shape: &[usize]) -> Vec<isize> {
    let mut strides = vec![0isize; shape.len()];
    let mut step = 1isize;
    for a in (0..shape.len()).rev() {
        strides[a] = if shape[a] > 1 { step } else { 0 };
        step = step.saturating_mul(shape[a] as isize);
    }
    strides
}

impl<'py> Array<'py> {
    /// Reads `obj`: a NumPy array, a torch tensor, or any object with `__dlpack__`.
    pub(crate) fn extract(name: &'static str, obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(arr) = obj.cast::<PyUntypedArray>() {
            return Self::from_numpy(name, arr);
        }
        let kind = if is_torch_tensor(obj)? {
            Kind::Torch
        } else if obj.hasattr("__dlpack__")? {
            Kind::Other
        } else {
            return Err(PyTypeError::new_err(format!(
                "{name} must be a NumPy array or a CPU tensor that supports DLPack (a torch.Tensor), not {}",
                obj.get_type().name()?
            )));
        };
        let detached;
        let obj = if kind == Kind::Torch
            && obj
                .getattr(intern!(obj.py(), "requires_grad"))?
                .is_truthy()?
        {
            // Outside grad mode (inside it, such tensors go through attn.torch): torch
            // exports no tensor that requires grad, but its detached alias shares memory.
            detached = obj.call_method0(intern!(obj.py(), "detach"))?;
            &detached
        } else {
            obj
        };
        let t = dlpack::import(name, obj)?;
        let _ = t.read_only; // inputs are only read
        let dtype = match t.dtype {
            // torch before 2.1 exports bool tensors as uint8.
            Dtype::Other(ref n)
                if n == "uint8"
                    && kind == Kind::Torch
                    && obj.getattr("dtype")?.str()? == "torch.bool" =>
            {
                Dtype::Bool
            }
            d => d,
        };
        let size = dtype.size();
        let mut array = Array {
            name,
            kind,
            dtype,
            strides: t.strides,
            ptr: t.ptr,
            _keep: Keep::Capsule(t.capsule),
            shape: t.shape,
        };
        array.zero_unit_strides();
        if size > 0 && !array.is_empty() && !(array.ptr as usize).is_multiple_of(size) {
            let bytes: Vec<isize> = array.strides.iter().map(|&s| s * size as isize).collect();
            // SAFETY: the producer's tensor holds every element its shape and strides
            // reach, and the capsule keeps it alive during the copy.
            let words = unsafe { compact_copy(array.ptr, &array.shape, &bytes, size) }?;
            array.adopt(words);
        }
        Ok(array)
    }

    fn from_numpy(name: &'static str, arr: &Bound<'py, PyUntypedArray>) -> PyResult<Self> {
        let dtype = numpy_dtype(arr);
        let size = dtype.size();
        let shape = arr.shape().to_vec();
        let byte_strides = arr.strides().to_vec();
        // SAFETY: `as_array_ptr` is the live `PyArrayObject` of `arr`; reading its data
        // pointer field is what the NumPy API macros do.
        let ptr = unsafe { (*arr.as_array_ptr()).fields.data } as *const u8;
        let mut array = Array {
            name,
            kind: Kind::NumPy,
            dtype,
            strides: vec![0; shape.len()],
            ptr,
            _keep: Keep::Object(arr.clone().into_any()),
            shape,
        };
        if size == 0 {
            return Ok(array); // unsupported: rejected by the caller, never read
        }
        let whole = byte_strides.iter().all(|s| s % size as isize == 0);
        if whole && (ptr as usize).is_multiple_of(size) {
            array.strides = byte_strides.iter().map(|s| s / size as isize).collect();
            array.zero_unit_strides();
        } else if !array.is_empty() {
            // SAFETY: a NumPy array's shape and byte strides reach only its own elements.
            let words = unsafe { compact_copy(ptr, &array.shape, &byte_strides, size) }?;
            array.adopt(words);
        }
        Ok(array)
    }

    /// Replaces the view by a compact copy (`words`, in row-major order).
    fn adopt(&mut self, words: Vec<u64>) {
        self.ptr = words.as_ptr().cast();
        self.strides = compact_strides(&self.shape);
        self._keep = Keep::Owned(words);
    }

    fn zero_unit_strides(&mut self) {
        for (s, &n) in self.strides.iter_mut().zip(&self.shape) {
            if n <= 1 {
                *s = 0;
            }
        }
    }

    /// Whether the array has no element.
    pub(crate) fn is_empty(&self) -> bool {
        self.shape.contains(&0)
    }

    /// The number of axes.
    pub(crate) fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// The shape as Python prints it: `(2, 3)`.
    pub(crate) fn shape_str(&self) -> String {
        shape_str(&self.shape)
    }

    /// The address of element `[0, …, 0]`, typed. Valid only for the array's own dtype.
    pub(crate) fn ptr<T>(&self) -> *const T {
        self.ptr.cast()
    }

    /// A compact copy of the array (row-major), for views attn cannot express.
    pub(crate) fn compacted(mut self) -> PyResult<Self> {
        let size = self.dtype.size();
        if size == 0 || self.is_empty() {
            self.strides = compact_strides(&self.shape);
            return Ok(self);
        }
        let bytes: Vec<isize> = self.strides.iter().map(|&s| s * size as isize).collect();
        // SAFETY: the view reaches only elements of its buffer, which `_keep` keeps alive.
        let words = unsafe { compact_copy(self.ptr, &self.shape, &bytes, size) }?;
        self.adopt(words);
        Ok(self)
    }

    /// The array widened to an f32 copy of the same shape (f16/bf16 additive masks).
    pub(crate) fn widened_to_f32(self) -> PyResult<Self> {
        let mut out = self.compacted()?;
        let count: usize = out.shape.iter().product();
        let mut words = zeroed::<u64>("the mask widened to float32", Some(count.div_ceil(2)))?;
        let dst = words.as_mut_ptr().cast::<f32>();
        let src = out.ptr.cast::<u16>();
        for i in 0..count {
            // SAFETY: `compacted` holds `count` compact 2-byte elements, aligned; `words`
            // holds `count` f32 slots.
            unsafe {
                let bits = *src.add(i);
                let x = match out.dtype {
                    Dtype::F16 => half::f16::from_bits(bits).to_f32(),
                    _ => half::bf16::from_bits(bits).to_f32(),
                };
                *dst.add(i) = x;
            }
        }
        out.dtype = Dtype::F32;
        out.adopt(words);
        Ok(out)
    }

    /// A boolean mask whose bytes are all 0 or 1 (as Rust's `bool` requires), copying and
    /// normalising (`x != 0`) when they are not.
    pub(crate) fn normalized_bool(self) -> PyResult<Self> {
        let (n, step) = row_of(&self.shape, &self.strides);
        let mut ok = true;
        for_each_row(&self.shape, &self.strides, |row| {
            ok &= if step == 1 {
                // SAFETY: the row's `n` bytes are contiguous elements of the mask's buffer;
                // any byte is a valid `u8`.
                let bytes = unsafe { std::slice::from_raw_parts(self.ptr.offset(row), n) };
                bytes.iter().all(|&b| b <= 1)
            } else {
                // SAFETY: every offset the view reaches is a byte of its buffer.
                (0..n).all(|j| unsafe { *self.ptr.offset(row + j as isize * step) } <= 1)
            };
        });
        if ok {
            return Ok(self);
        }
        let out = self.compacted()?;
        let count: usize = out.shape.iter().product();
        let bytes = out.ptr as *mut u8;
        for i in 0..count {
            // SAFETY: `compacted` owns `count` compact bytes (our own buffer, written only here).
            unsafe { *bytes.add(i) = u8::from(*bytes.add(i) != 0) };
        }
        Ok(out)
    }

    /// The innermost axis is contiguous (or has at most one element).
    pub(crate) fn innermost_contiguous(&self) -> bool {
        self.is_empty()
            || self.shape.last().is_none_or(|&n| n <= 1)
            || self.strides.last() == Some(&1)
    }

    /// Raises unless the innermost axis is contiguous.
    pub(crate) fn require_contiguous_rows(&self) -> PyResult<()> {
        if self.innermost_contiguous() {
            return Ok(());
        }
        let hint = match self.kind {
            Kind::Torch => format!("{}.contiguous()", self.name),
            _ => format!("numpy.ascontiguousarray({})", self.name),
        };
        Err(PyValueError::new_err(format!(
            "{} of shape {} has stride {} on its last axis: attn reads rows of contiguous features (stride 1); pass {hint}",
            self.name,
            self.shape_str(),
            self.strides.last().copied().unwrap_or(0)
        )))
    }
}

/// `(2, 3)`, `(4,)`, `()`.
pub(crate) fn shape_str(shape: &[usize]) -> String {
    match shape {
        [one] => format!("({one},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}
