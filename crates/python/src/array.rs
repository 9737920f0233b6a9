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

pub(crate) use attn_core::Dtype as Float;

use crate::dlpack;
use crate::output::SendPtr;

/// Element types attn reads: the storage types of attn-core's [`Float`] (f32, f16, bf16),
/// boolean masks, int32 indices (block tables, sequence lengths), and anything else by name
/// (for the error).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Dtype {
    /// A floating-point storage type attn computes on.
    Float(Float),
    Bool,
    /// 32-bit signed integers: flash-attn's block tables and sequence lengths.
    Int32,
    /// Anything else, by name (for the error).
    Other(String),
}

impl Dtype {
    /// The float types, as they are matched on.
    pub(crate) const F32: Dtype = Dtype::Float(Float::F32);
    pub(crate) const F16: Dtype = Dtype::Float(Float::F16);
    pub(crate) const BF16: Dtype = Dtype::Float(Float::Bf16);

    /// The name NumPy and torch users know.
    pub(crate) fn name(&self) -> &str {
        match self {
            Dtype::Float(f) => float_name(*f),
            Dtype::Bool => "bool",
            Dtype::Int32 => "int32",
            Dtype::Other(name) => name,
        }
    }

    /// Bytes per element (0 for the unsupported ones, which are never read).
    pub(crate) fn size(&self) -> usize {
        match self {
            Dtype::Float(f) => f.bytes(),
            Dtype::Bool => 1,
            Dtype::Int32 => 4,
            Dtype::Other(_) => 0,
        }
    }
}

/// The name NumPy and torch give a float type.
pub(crate) fn float_name(f: Float) -> &'static str {
    match f {
        Float::F32 => "float32",
        Float::F16 => "float16",
        Float::Bf16 => "bfloat16",
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
    /// The producer and its DLPack capsule: dropping the capsule releases the producer's
    /// tensor; holding the producer too keeps a producer whose capsule does not own it.
    Capsule(
        #[allow(dead_code)] Bound<'py, PyAny>,
        #[allow(dead_code)] Bound<'py, PyCapsule>,
    ),
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
    /// Whether the caller's memory may be written through `ptr`: it is the caller's own (not
    /// a copy made here or a resolved torch view) and its producer allows writing.
    writable: bool,
    _keep: Keep<'py>,
}

/// `torch.Tensor`, once torch has been imported by someone (we never import it).
pub(crate) fn torch_tensor_type<'py>(py: Python<'py>) -> PyResult<Option<&'py Bound<'py, PyType>>> {
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
    } else if descr.kind() == b'i' && descr.itemsize() == 4 {
        Dtype::Int32
    } else {
        Dtype::Other(descr.to_string())
    }
}

/// `n` zeroed elements (`None`: a count that overflowed), or a `MemoryError` naming `what`
/// (never an abort): attn-core's [`attn_core::zeroed`] in Python's terms.
pub(crate) fn zeroed<T: Clone + Default>(what: &'static str, n: Option<usize>) -> PyResult<Vec<T>> {
    attn_core::zeroed(what, n).map_err(crate::to_py_err)
}

/// The product of `dims`, `None` when it overflows.
pub(crate) fn product(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// The axes of a view that address distinct memory: those longer than 1 with a stride
/// other than 0. Walking them alone visits each element a broadcast view repeats once.
fn distinct_axes(shape: &[usize], strides: &[isize]) -> Vec<usize> {
    (0..shape.len())
        .filter(|&a| shape[a] > 1 && strides[a] != 0)
        .collect()
}

/// Calls `f` with the offset of the first element of every row (every index of the axes
/// but the last), in row-major order; `strides` in any unit. A 0-d array is one row.
/// `rows` is the product of the outer axes, computed (checked) by the caller.
fn for_each_row(shape: &[usize], strides: &[isize], rows: usize, mut f: impl FnMut(isize)) {
    let outer = shape.len().saturating_sub(1);
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

/// The distinct elements of a view: its axes but the broadcast ones.
struct Distinct {
    dims: Vec<usize>,
    steps: Vec<isize>,
    /// The product of `dims`, checked.
    count: usize,
}

/// The distinct elements of a view (its broadcast axes left out), the count checked; `None`
/// for an empty view.
fn distinct_view(shape: &[usize], strides: &[isize]) -> PyResult<Option<Distinct>> {
    if shape.contains(&0) {
        return Ok(None);
    }
    let axes = distinct_axes(shape, strides);
    let dims: Vec<usize> = axes.iter().map(|&a| shape[a]).collect();
    let steps: Vec<isize> = axes.iter().map(|&a| strides[a]).collect();
    let count = product(&dims).ok_or_else(|| {
        PyMemoryError::new_err(format!(
            "a view of shape {} has too many elements",
            shape_str(shape)
        ))
    })?;
    Ok(Some(Distinct { dims, steps, count }))
}

/// Copies the distinct elements of a strided buffer into a compact row-major one (any
/// alignment, any byte strides, negative included); returns it and the element strides of
/// the copy over the full shape, 0 on the broadcast axes (which are not materialised).
///
/// # Safety
/// Every element `ptr + Σ i_a · byte_strides[a]` (`i_a < shape[a]`) must be `size`
/// readable bytes.
unsafe fn compact_copy(
    ptr: SendPtr<u8>,
    shape: &[usize],
    byte_strides: &[isize],
    size: usize,
) -> PyResult<(Vec<u64>, Vec<isize>)> {
    let Some(Distinct { dims, steps, count }) = distinct_view(shape, byte_strides)? else {
        return Ok((Vec::new(), vec![0; shape.len()]));
    };
    let bytes = count.checked_mul(size);
    let mut words = zeroed::<u64>("a compact copy of an input", bytes.map(|b| b.div_ceil(8)))?;
    let dst = words.as_mut_ptr().cast::<u8>();
    let ptr = ptr.0;
    let (n, step) = row_of(&dims, &steps);
    let mut written = 0;
    for_each_row(&dims, &steps, count / n, |row| {
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
    let mut strides = vec![0isize; shape.len()];
    let mut unit = 1isize;
    for (&a, &d) in distinct_axes(shape, byte_strides).iter().zip(&dims).rev() {
        strides[a] = unit;
        unit *= d as isize; // at most `count`, which was allocated
    }
    Ok((words, strides))
}

/// Walks of more elements than this release the GIL (fewer take less time than the release).
const DETACH_ABOVE: usize = 1 << 16;

/// [`compact_copy`] with the GIL released: the copy of a large view takes as long as the
/// memory takes to read, and other Python threads run meanwhile.
///
/// # Safety
/// As [`compact_copy`]; the buffer must stay alive (its owner held by the caller).
unsafe fn compact_copy_detached(
    py: Python<'_>,
    ptr: *const u8,
    shape: &[usize],
    byte_strides: &[isize],
    size: usize,
) -> PyResult<(Vec<u64>, Vec<isize>)> {
    let ptr = SendPtr(ptr);
    let elements = product(shape).unwrap_or(usize::MAX);
    if elements <= DETACH_ABOVE {
        // SAFETY: the caller's guarantee.
        return unsafe { compact_copy(ptr, shape, byte_strides, size) };
    }
    // SAFETY: the caller's guarantee.
    py.detach(|| unsafe { compact_copy(ptr, shape, byte_strides, size) })
}

impl<'py> Array<'py> {
    /// Reads `obj`: a NumPy array, a torch tensor, or any object with `__dlpack__`.
    pub(crate) fn extract(name: &'static str, obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(arr) = obj.cast::<PyUntypedArray>() {
            return Self::from_numpy(name, arr);
        }
        let py = obj.py();
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
        let mut tensor = obj.clone();
        let mut resolved = false;
        if kind == Kind::Torch {
            if tensor.getattr(intern!(py, "requires_grad"))?.is_truthy()? {
                // Outside grad mode (inside it, such tensors go through attn.torch): torch
                // exports no tensor that requires grad, but its detached alias shares memory.
                tensor = tensor.call_method0(intern!(py, "detach"))?;
            }
            // torch's lazy negation and conjugation are bits on the tensor that DLPack does
            // not carry: the memory holds the values without the sign. Resolve them (a copy,
            // only for such views) rather than read the wrong sign.
            if tensor.call_method0(intern!(py, "is_neg"))?.is_truthy()? {
                tensor = tensor.call_method0(intern!(py, "resolve_neg"))?;
                resolved = true;
            }
            if tensor.call_method0(intern!(py, "is_conj"))?.is_truthy()? {
                tensor = tensor.call_method0(intern!(py, "resolve_conj"))?;
                resolved = true;
            }
        }
        let t = dlpack::import(name, &tensor)?;
        let dtype = match t.dtype {
            // torch before 2.1 exports bool tensors as uint8.
            Dtype::Other(ref n)
                if n == "uint8"
                    && kind == Kind::Torch
                    && tensor.getattr("dtype")?.str()? == "torch.bool" =>
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
            // A resolved negation or conjugation is a copy: writes would not reach `obj`.
            writable: !t.read_only && !resolved,
            _keep: Keep::Capsule(obj.clone(), t.capsule),
            shape: t.shape,
        };
        array.zero_unit_strides();
        if size > 0 && !array.is_empty() && !(array.ptr as usize).is_multiple_of(size) {
            let bytes: Vec<isize> = array.strides.iter().map(|&s| s * size as isize).collect();
            // SAFETY: the producer's tensor holds every element its shape and strides
            // reach (`dlpack::import` checked that they lie in the address space), and the
            // capsule keeps it alive during the copy.
            let copy = unsafe { compact_copy_detached(py, array.ptr, &array.shape, &bytes, size) }?;
            array.adopt(copy);
        }
        Ok(array)
    }

    fn from_numpy(name: &'static str, arr: &Bound<'py, PyUntypedArray>) -> PyResult<Self> {
        let dtype = numpy_dtype(arr);
        let size = dtype.size();
        let shape = arr.shape().to_vec();
        let byte_strides = arr.strides().to_vec();
        // SAFETY: `as_array_ptr` is the live `PyArrayObject` of `arr`; reading its data
        // pointer and flags fields is what the NumPy API macros do.
        let (ptr, flags) = unsafe {
            let fields = &(*arr.as_array_ptr()).fields;
            (fields.data as *const u8, fields.flags)
        };
        let mut array = Array {
            name,
            kind: Kind::NumPy,
            dtype,
            strides: vec![0; shape.len()],
            ptr,
            writable: flags & numpy::npyffi::NPY_ARRAY_WRITEABLE != 0,
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
            // SAFETY: a NumPy array's shape and byte strides reach only its own elements,
            // kept alive by `_keep`.
            let copy =
                unsafe { compact_copy_detached(arr.py(), ptr, &array.shape, &byte_strides, size) }?;
            array.adopt(copy);
        }
        Ok(array)
    }

    /// Replaces the view by a compact copy of its distinct elements (`words` and their
    /// strides, 0 on the broadcast axes).
    fn adopt(&mut self, (words, strides): (Vec<u64>, Vec<isize>)) {
        self.ptr = if words.is_empty() {
            std::ptr::NonNull::<u64>::dangling().as_ptr().cast()
        } else {
            words.as_ptr().cast()
        };
        self.strides = strides;
        self.writable = false; // our copy, not the caller's memory
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

    /// A compact copy of the array (row-major over the axes it does not broadcast), for
    /// views attn cannot express.
    pub(crate) fn compacted(mut self, py: Python<'_>) -> PyResult<Self> {
        let size = self.dtype.size();
        if size == 0 {
            return Ok(self); // unsupported: rejected by the caller, never read
        }
        let bytes: Vec<isize> = self.strides.iter().map(|&s| s * size as isize).collect();
        // SAFETY: the view reaches only elements of its buffer, which `_keep` keeps alive.
        let copy = unsafe { compact_copy_detached(py, self.ptr, &self.shape, &bytes, size) }?;
        self.adopt(copy);
        Ok(self)
    }

    /// The array widened to an f32 copy of the same shape (f16/bf16 additive masks), its
    /// broadcast axes kept as such.
    pub(crate) fn widened_to_f32(mut self, py: Python<'_>) -> PyResult<Self> {
        let bytes: Vec<isize> = self.strides.iter().map(|&s| s * 2).collect();
        // SAFETY: the view reaches only 2-byte elements of its buffer, kept alive by `_keep`.
        let (half, strides) =
            unsafe { compact_copy_detached(py, self.ptr, &self.shape, &bytes, 2) }?;
        let bf16 = self.dtype == Dtype::BF16;
        // The copy's 2-byte slots, a whole number of words (the last ones padding).
        let count = half.len() * 4;
        let src = SendPtr(half.as_ptr().cast::<u16>());
        let widen = move || -> PyResult<Vec<u64>> {
            let src = src; // the whole `SendPtr`, not its field
            let mut words = zeroed::<u64>("the mask widened to float32", Some(count.div_ceil(2)))?;
            let dst = words.as_mut_ptr().cast::<f32>();
            for i in 0..count {
                // SAFETY: `half` holds `count` aligned 2-byte slots, `words` `count` f32s.
                unsafe {
                    let bits = *src.0.add(i);
                    *dst.add(i) = if bf16 {
                        half::bf16::from_bits(bits).to_f32()
                    } else {
                        half::f16::from_bits(bits).to_f32()
                    };
                }
            }
            Ok(words)
        };
        let widened = if count <= DETACH_ABOVE {
            widen()
        } else {
            py.detach(widen)
        }?;
        drop(half);
        self.dtype = Dtype::F32;
        self.adopt((widened, strides));
        Ok(self)
    }

    /// An f32 array broadcast to `shape` (right-aligned, NumPy's rule: the caller has
    /// checked that it broadcasts) as a compact copy in which every axis is materialised:
    /// the additive mask whose gradient is asked for, when it repeats values (a stride of
    /// 0) or is constant along the key axis, so that each of its positions gets its own.
    pub(crate) fn broadcast_f32(mut self, py: Python<'_>, shape: &[usize]) -> PyResult<Self> {
        let rank = shape.len();
        if self.dtype != Dtype::F32 || self.ndim() > rank {
            return Err(PyValueError::new_err(format!(
                "{} of shape {} cannot be broadcast to {} as float32",
                self.name,
                self.shape_str(),
                shape_str(shape)
            )));
        }
        let lead = rank - self.ndim();
        let mut steps = vec![0isize; rank];
        for a in 0..self.ndim() {
            let (n, want) = (self.shape[a], shape[lead + a]);
            if n != want && n != 1 {
                return Err(PyValueError::new_err(format!(
                    "{} of shape {} does not broadcast to {}",
                    self.name,
                    self.shape_str(),
                    shape_str(shape)
                )));
            }
            steps[lead + a] = if n == 1 { 0 } else { self.strides[a] };
        }
        let count = product(shape).ok_or_else(|| {
            PyMemoryError::new_err(format!(
                "{} broadcast to {} has too many elements",
                self.name,
                shape_str(shape)
            ))
        })?;
        let src = SendPtr(self.ptr.cast::<f32>());
        let dims = shape.to_vec();
        let copy = move || -> PyResult<Vec<u64>> {
            let src = src; // the whole `SendPtr`, not its field
            let mut words = zeroed::<u64>(
                "the mask broadcast for its gradient",
                Some(count.div_ceil(2)),
            )?;
            let dst = words.as_mut_ptr().cast::<f32>();
            let mut index = vec![0usize; rank];
            let mut off = 0isize;
            for i in 0..count {
                // SAFETY: `off` is the offset of an element of the view (each index within
                // its axis, the view's strides), which `_keep` keeps alive; `words` holds
                // `count` f32 slots.
                unsafe { *dst.add(i) = *src.0.offset(off) };
                for a in (0..rank).rev() {
                    index[a] += 1;
                    off += steps[a];
                    if index[a] < dims[a] {
                        break;
                    }
                    off -= steps[a] * dims[a] as isize;
                    index[a] = 0;
                }
            }
            Ok(words)
        };
        let words = if count <= DETACH_ABOVE {
            copy()
        } else {
            py.detach(copy)
        }?;
        let mut strides = vec![0isize; rank];
        let mut step = 1isize;
        for a in (0..rank).rev() {
            strides[a] = step;
            step *= shape[a] as isize;
        }
        self.shape = shape.to_vec();
        self.adopt((words, strides));
        self.zero_unit_strides();
        Ok(self)
    }

    /// A boolean mask whose bytes are all 0 or 1 (as Rust's `bool` requires), copying and
    /// normalising (`x != 0`) when they are not. Each distinct byte is read once (broadcast
    /// axes are not walked), with the GIL released.
    pub(crate) fn normalized_bool(self, py: Python<'_>) -> PyResult<Self> {
        let Some(Distinct { dims, steps, count }) = distinct_view(&self.shape, &self.strides)?
        else {
            return Ok(self);
        };
        let ptr = SendPtr(self.ptr);
        let (n, step) = row_of(&dims, &steps);
        let scan = move || {
            let ptr = ptr; // the whole `SendPtr`, not its field
            let mut ok = true;
            for_each_row(&dims, &steps, count / n, |row| {
                ok &= if step == 1 {
                    // SAFETY: the row's `n` bytes are contiguous elements of the mask's
                    // buffer, alive (held by `self`); any byte is a valid `u8`.
                    let bytes = unsafe { std::slice::from_raw_parts(ptr.0.offset(row), n) };
                    bytes.iter().all(|&b| b <= 1)
                } else {
                    // SAFETY: every offset the view reaches is a byte of its buffer.
                    (0..n).all(|j| unsafe { *ptr.0.offset(row + j as isize * step) } <= 1)
                };
            });
            ok
        };
        // A small mask is scanned at once; a large one with the GIL released.
        let ok = if count <= DETACH_ABOVE {
            scan()
        } else {
            py.detach(scan)
        };
        if ok {
            return Ok(self);
        }
        let mut out = self.compacted(py)?;
        if let Keep::Owned(ref mut words) = out._keep {
            // The copy is our own: normalise its bytes (the padding of the last word too,
            // never read).
            for w in words.iter_mut() {
                let mut b = w.to_ne_bytes();
                b.iter_mut().for_each(|x| *x = u8::from(*x != 0));
                *w = u64::from_ne_bytes(b);
            }
        }
        Ok(out)
    }

    /// Raises unless the array's memory is the caller's own and may be written: for the
    /// operands attn updates in place (`flash_attn_with_kvcache`'s caches).
    pub(crate) fn require_writable(&self) -> PyResult<()> {
        if self.writable {
            return Ok(());
        }
        let why = match (&self._keep, self.kind) {
            (Keep::Owned(_), _) => {
                "its data is not aligned for its dtype, so attn reads a copy that a write would not reach"
            }
            (_, Kind::Torch) => {
                "its producer exports it read-only, or it is a lazily negated or conjugated view whose values live in a copy"
            }
            (_, Kind::NumPy) => "it is not writeable (flags.writeable is False)",
            (_, Kind::Other) => "its DLPack producer exports it read-only",
        };
        Err(PyValueError::new_err(format!(
            "{} cannot be written in place: {why}",
            self.name
        )))
    }

    /// The elements of an int32 array in row-major order, `None` for another dtype.
    pub(crate) fn int32_values(&self) -> PyResult<Option<Vec<i32>>> {
        if self.dtype != Dtype::Int32 {
            return Ok(None);
        }
        // SAFETY: the array's elements are int32 (its dtype, just checked).
        unsafe { self.values::<i32>() }.map(Some)
    }

    /// The elements of a float32 array in row-major order, `None` for another dtype.
    pub(crate) fn f32_values(&self) -> PyResult<Option<Vec<f32>>> {
        if self.dtype != Dtype::F32 {
            return Ok(None);
        }
        // SAFETY: the array's elements are f32 (its dtype, just checked).
        unsafe { self.values::<f32>() }.map(Some)
    }

    /// Every element of the view in row-major order, broadcast ones repeated: for the small
    /// integer and float operands read whole (block tables, lengths, slopes).
    ///
    /// # Safety
    /// The array's elements must be of type `T`.
    unsafe fn values<T: Copy + Default>(&self) -> PyResult<Vec<T>> {
        let count = product(&self.shape);
        let mut out = zeroed::<T>(self.name, count)?;
        if out.is_empty() {
            return Ok(out);
        }
        let ptr = self.ptr::<T>();
        let (n, step) = row_of(&self.shape, &self.strides);
        let mut at = 0;
        for_each_row(&self.shape, &self.strides, out.len() / n, |row| {
            for j in 0..n {
                // SAFETY: the view's shape and strides reach only elements of its buffer
                // (checked at import), alive while `self` holds it; they are `T`s (the
                // caller's guarantee). `at < count` as the walk visits `count` elements.
                out[at] = unsafe { *ptr.offset(row + j as isize * step) };
                at += 1;
            }
        });
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
