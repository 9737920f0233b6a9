//! The DLPack consumer: reads any CPU tensor that implements `__dlpack__` (torch tensors,
//! NumPy arrays, …) as a strided view, without a copy.
//!
//! The producer's `__dlpack__` returns a capsule named `dltensor_versioned` (DLPack ≥ 1.0,
//! asked for with `max_version=(1, 0)`) or `dltensor` (legacy producers, which reject the
//! keyword). We only borrow: the capsule keeps its name, is held for as long as the view is
//! used, and its own destructor (the producer's) calls the tensor's deleter when it goes.

use std::ffi::{CStr, c_void};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict};

use crate::array::Dtype;

/// `DLDevice`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// `DLDataType`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor`.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// `DLManagedTensor` (legacy capsules, named `dltensor`).
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// `DLPackVersion`.
#[repr(C)]
struct DlPackVersion {
    major: u32,
    minor: u32,
}

/// `DLManagedTensorVersioned` (capsules named `dltensor_versioned`).
#[repr(C)]
struct DlManagedTensorVersioned {
    version: DlPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DlTensor,
}

const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";
const FLAG_READ_ONLY: u64 = 1;
const DEVICE_CPU: i32 = 1;
const DEVICE_CUDA_HOST: i32 = 3;
const DEVICE_NAMES: [&str; 18] = [
    "?",
    "cpu",
    "cuda",
    "cuda_host",
    "opencl",
    "vulkan",
    "?",
    "?",
    "metal",
    "vpi",
    "rocm",
    "rocm_host",
    "?",
    "cuda_managed",
    "oneapi",
    "webgpu",
    "hexagon",
    "maia",
];

/// A tensor read through DLPack: its memory stays valid while `capsule` lives.
pub(crate) struct Imported<'py> {
    /// The capsule whose tensor this is; dropping it releases the tensor.
    pub capsule: Bound<'py, PyCapsule>,
    /// Address of element `[0, …, 0]` (the tensor's data plus its byte offset).
    pub ptr: *const u8,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// In elements.
    pub strides: Vec<isize>,
    pub read_only: bool,
}

/// Asks `obj.__dlpack__` for a capsule, versioned if the producer can.
fn export<'py>(name: &str, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyCapsule>> {
    let py = obj.py();
    let kwargs = PyDict::new(py);
    kwargs.set_item("max_version", (1, 0))?;
    let capsule = match obj.call_method("__dlpack__", (), Some(&kwargs)) {
        Ok(c) => c,
        // A legacy producer does not know the keyword.
        Err(e) if e.is_instance_of::<PyTypeError>(py) => obj.call_method0("__dlpack__")?,
        Err(e) => return Err(e),
    };
    capsule.cast_into::<PyCapsule>().map_err(|_| {
        PyTypeError::new_err(format!("{name}.__dlpack__() did not return a PyCapsule"))
    })
}

fn dtype_of(t: DlDataType) -> Dtype {
    match (t.code, t.bits, t.lanes) {
        (2, 32, 1) => Dtype::F32,
        (2, 16, 1) => Dtype::F16,
        (4, 16, 1) => Dtype::BF16,
        (6, 8, 1) => Dtype::Bool,
        (0, 32, 1) => Dtype::Int32,
        (code, bits, lanes) => {
            let kind = match code {
                0 => "int",
                1 => "uint",
                2 => "float",
                3 => "opaque handle",
                4 => "bfloat",
                5 => "complex",
                6 => "bool",
                _ => "unknown",
            };
            let lanes = if lanes == 1 {
                String::new()
            } else {
                format!("x{lanes}")
            };
            Dtype::Other(format!("{kind}{bits}{lanes}"))
        }
    }
}

/// The most axes a DLPack tensor may have here: NumPy's limit (`NPY_MAXDIMS`), far beyond
/// any attention operand, and a bound on what a corrupt `ndim` can make us read.
const MAX_NDIM: usize = 64;

fn invalid(name: &str, what: String) -> PyErr {
    PyValueError::new_err(format!("{name}: invalid DLPack tensor: {what}"))
}

/// Reads the `DLTensor` of a capsule: the device, the dtype, `ndim`, then the shape and
/// strides arrays, then the data pointer and the extent the view reaches, each checked
/// before anything is read through it.
fn describe(name: &str, tensor: &DlTensor) -> PyResult<(*const u8, Dtype, Vec<usize>, Vec<isize>)> {
    let device = tensor.device.device_type;
    if device != DEVICE_CPU && device != DEVICE_CUDA_HOST {
        let kind = usize::try_from(device)
            .ok()
            .and_then(|d| DEVICE_NAMES.get(d))
            .unwrap_or(&"?");
        return Err(PyValueError::new_err(format!(
            "{name} is on device {kind}:{} (DLPack device type {device}); attn computes on the CPU",
            tensor.device.device_id
        )));
    }
    let ndim = usize::try_from(tensor.ndim)
        .ok()
        .filter(|&n| n <= MAX_NDIM)
        .ok_or_else(|| {
            invalid(
                name,
                format!("ndim {} is not in 0..={MAX_NDIM}", tensor.ndim),
            )
        })?;
    if ndim > 0 && tensor.shape.is_null() {
        return Err(invalid(
            name,
            format!("ndim {ndim} with a NULL shape pointer"),
        ));
    }
    let shape_raw: &[i64] = if ndim == 0 {
        &[]
    } else {
        // SAFETY: DLPack's `shape` points to `ndim` int64 values owned by the tensor; it is
        // not NULL (checked) and `ndim` is at most MAX_NDIM.
        unsafe { std::slice::from_raw_parts(tensor.shape, ndim) }
    };
    let mut shape = Vec::with_capacity(ndim);
    for &s in shape_raw {
        shape.push(
            usize::try_from(s)
                .map_err(|_| invalid(name, format!("shape {shape_raw:?} has a negative size")))?,
        );
    }
    let strides: Vec<isize> = if tensor.strides.is_null() || ndim == 0 {
        // NULL strides: a compact row-major tensor (DLPack < 1.2 allows it).
        let mut strides = vec![0isize; ndim];
        let mut step = 1isize;
        for a in (0..ndim).rev() {
            strides[a] = step;
            step = isize::try_from(shape[a])
                .ok()
                .and_then(|n| step.checked_mul(n))
                .ok_or_else(|| invalid(name, format!("compact shape {shape_raw:?} overflows")))?;
        }
        strides
    } else {
        // SAFETY: non-NULL `strides` points to `ndim` int64 values owned by the tensor.
        let raw = unsafe { std::slice::from_raw_parts(tensor.strides, ndim) };
        raw.iter()
            .map(|&s| isize::try_from(s))
            .collect::<Result<_, _>>()
            .map_err(|_| invalid(name, format!("strides {raw:?} do not fit an isize")))?
    };
    let dtype = dtype_of(tensor.dtype);
    if shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .is_none_or(|n| n > isize::MAX as usize)
    {
        return Err(invalid(
            name,
            format!("shape {shape_raw:?} has more than isize::MAX elements"),
        ));
    }
    let offset = usize::try_from(tensor.byte_offset).map_err(|_| {
        invalid(
            name,
            format!("byte_offset {} overflows", tensor.byte_offset),
        )
    })?;
    if shape.contains(&0) || dtype.size() == 0 {
        // Nothing is read: an empty tensor (whose data may be NULL), or a dtype the caller
        // rejects by name.
        return Ok((
            std::ptr::NonNull::<u64>::dangling()
                .as_ptr()
                .cast_const()
                .cast(),
            dtype,
            shape,
            strides,
        ));
    }
    if tensor.data.is_null() {
        return Err(invalid(
            name,
            format!("data is NULL but shape {shape_raw:?} is not empty"),
        ));
    }
    // The bytes the view reaches, relative to its first element: [lo, hi + size).
    let size = dtype.size() as i128;
    let (mut lo, mut hi) = (0i128, 0i128);
    for (&n, &s) in shape.iter().zip(&strides) {
        let reach = (n as i128 - 1)
            .checked_mul(s as i128)
            .and_then(|r| r.checked_mul(size));
        let Some(reach) = reach else {
            return Err(invalid(
                name,
                format!("shape {shape_raw:?} and strides {strides:?} overflow"),
            ));
        };
        if reach < 0 { lo += reach } else { hi += reach }
    }
    let first = (tensor.data as usize as i128) + offset as i128;
    if first + lo <= 0
        || first + hi + size > isize::MAX as i128
        || hi - lo + size > isize::MAX as i128
    {
        return Err(invalid(
            name,
            format!(
                "data {:p} + byte_offset {offset} with shape {shape_raw:?} and strides {strides:?} reaches beyond the address space",
                tensor.data
            ),
        ));
    }
    Ok(((first as usize) as *const u8, dtype, shape, strides))
}

/// Imports `obj` through DLPack as a view of CPU memory.
pub(crate) fn import<'py>(name: &str, obj: &Bound<'py, PyAny>) -> PyResult<Imported<'py>> {
    let capsule = export(name, obj)?;
    let versioned = capsule.is_valid_checked(Some(VERSIONED));
    let (tensor, read_only) = if versioned {
        let ptr = capsule.pointer_checked(Some(VERSIONED))?;
        // SAFETY: a capsule named `dltensor_versioned` holds a `DLManagedTensorVersioned`
        // (DLPack ≥ 1.0), alive while the capsule is unconsumed and referenced: we hold it.
        // Its version comes first in every 1.x layout; the rest is read only for 1.x.
        let managed = unsafe { &*ptr.as_ptr().cast::<DlManagedTensorVersioned>() };
        if managed.version.major != 1 {
            return Err(PyTypeError::new_err(format!(
                "{name}: DLPack version {}.{} is not supported (attn reads 1.x)",
                managed.version.major, managed.version.minor
            )));
        }
        (&managed.dl_tensor, managed.flags & FLAG_READ_ONLY != 0)
    } else if capsule.is_valid_checked(Some(LEGACY)) {
        let ptr = capsule.pointer_checked(Some(LEGACY))?;
        // SAFETY: a capsule named `dltensor` holds a `DLManagedTensor`, alive while the
        // capsule is unconsumed and referenced: we hold it.
        let managed = unsafe { &*ptr.as_ptr().cast::<DlManagedTensor>() };
        (&managed.dl_tensor, false)
    } else {
        return Err(PyTypeError::new_err(format!(
            "{name}.__dlpack__() returned a capsule that is not an unconsumed DLPack tensor"
        )));
    };
    let (ptr, dtype, shape, strides) = describe(name, tensor)?;
    Ok(Imported {
        capsule,
        ptr,
        dtype,
        shape,
        strides,
        read_only,
    })
}
