//! The functions of the module: `scaled_dot_product_attention`, `attention_with_lse`,
//! `attention_backward`. Each validates in Python's terms, plans the engine calls
//! ([`Plan`]), allocates its results, and computes with the GIL released.
//!
//! Attention dropout (the last section): torch's `dropout_p`, the seed of a call, and
//! `dropout_mask`, attn's keep mask as a NumPy array (the test hook). The mask is
//! attn-core's ([`attn_core::Dropout`]): a pure function of (seed, offset, batch entry, query
//! head, query, key), Philox4x32-10. A call with `dropout_p > 0` and no `seed` draws one
//! 64-bit seed: from torch's default CPU generator for torch tensors
//! (`attn.torch._draw_seed`, one `torch.randint`, so that `torch.manual_seed` reproduces a
//! run), from NumPy's global generator otherwise (`numpy.random.randint`, the legacy global
//! state that `numpy.random.seed` sets). The offset is 0.

use attn_core::{
    BoolMask4, Causal, Dropout, ForwardRef, GradientsMut, Mask4Ref, Options, Tensor4Mut, Tensor4Ref,
};

use half::{bf16, f16};
use numpy::PyArrayMethods;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyFloat, PyTuple};

use crate::array::{
    Array, Dtype, Float, Kind, is_torch_tensor, product, torch_tensor_type, zeroed,
};
use crate::output::{SendPtr, Storage, check_returnable, finish};
use crate::packed::Seqlens;
use crate::plan::{Call, Plan, Strides};
use crate::to_py_err;

/// The keyword arguments every entry point shares, validated: attn's options (the scale
/// and the causal mask; each engine call adds its mask, and the dropout once seeded:
/// [`Flags::seeded`]), torch's `enable_gqa` and `dropout_p`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Flags {
    pub options: Options<'static>,
    pub enable_gqa: bool,
    /// torch's `dropout_p`, in `[0, 1]`.
    pub dropout_p: f64,
}

impl Flags {
    /// The flags with their dropout keyed by `seed` (the caller's, or drawn for `query`'s
    /// kind: [`seed_for`]); unchanged, and nothing drawn, without dropout.
    pub(crate) fn seeded(
        mut self,
        query: &Bound<'_, PyAny>,
        seed: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        if self.dropout_p > 0.0 {
            let seed = seed_for(query, seed)?;
            let d = Dropout::new(self.dropout_p as f32, seed).map_err(to_py_err)?;
            self.options = self.options.with_dropout(d);
        }
        Ok(self)
    }
}

/// Checks torch's rules for `dropout_p`, `is_causal` with a mask, the alignment keyword and
/// the scale.
pub(crate) fn flags(
    py: Python<'_>,
    dropout_p: f64,
    is_causal: bool,
    has_mask: bool,
    scale: Option<f64>,
    enable_gqa: bool,
    causal_alignment: &str,
) -> PyResult<Flags> {
    check_p(py, dropout_p)?;
    let align = match causal_alignment {
        "top_left" => Causal::TopLeft,
        "bottom_right" => Causal::BottomRight,
        other => {
            return Err(PyValueError::new_err(format!(
                "causal_alignment='{other}': expected \"top_left\" (torch's is_causal) or \"bottom_right\""
            )));
        }
    };
    if align == Causal::BottomRight && !is_causal {
        return Err(PyValueError::new_err(
            "causal_alignment=\"bottom_right\" applies to the causal mask: pass is_causal=True with it",
        ));
    }
    if is_causal && has_mask {
        return Err(PyValueError::new_err(
            "_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True",
        ));
    }
    let mut options = Options::default();
    if let Some(s) = scale {
        options = options.with_scale(s as f32);
        options.scale_for(1).map_err(to_py_err)?;
    }
    if is_causal {
        options = options.with_causal(align);
    }
    Ok(Flags {
        options,
        enable_gqa,
        dropout_p,
    })
}

/// `torch.is_grad_enabled()` (torch is imported: a tensor was passed).
fn grad_enabled(py: Python<'_>) -> PyResult<bool> {
    static IS_GRAD_ENABLED: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    IS_GRAD_ENABLED
        .get_or_try_init(py, || -> PyResult<_> {
            Ok(py.import("torch")?.getattr("is_grad_enabled")?.unbind())
        })?
        .bind(py)
        .call0()?
        .is_truthy()
}

/// Whether a call must go through `attn.torch`'s operator: a torch operand requires grad
/// while grad mode is on (such tensors cannot be exported through DLPack), or is a meta
/// tensor or a tensor subclass (a fake tensor: no data to read). The operands are
/// `[query, key, value, attn_mask]`; on that route they must all be torch tensors, which is
/// checked here with the plain path's error (the operator reads tensors only).
fn needs_autograd(operands: [Option<&Bound<'_, PyAny>>; 4]) -> PyResult<bool> {
    let mut any = false;
    let mut unreadable = false;
    for obj in operands.iter().flatten() {
        if is_torch_tensor(obj)? {
            let py = obj.py();
            if obj.getattr(intern!(py, "requires_grad"))?.is_truthy()? {
                any = true;
            }
            // Meta tensors and tensor subclasses (fake tensors) have no data to read in
            // place: the operator `attn::sdpa_forward` computes their shapes.
            if obj.getattr(intern!(py, "is_meta"))?.is_truthy()?
                || !obj
                    .get_type()
                    .is(torch_tensor_type(py)?.expect("a tensor was passed"))
            {
                unreadable = true;
            }
        }
    }
    let Some(query) = operands[0] else {
        return Ok(false);
    };
    if !unreadable && (!any || !grad_enabled(query.py())?) {
        return Ok(false);
    }
    let names = ["query", "key", "value", "attn_mask"];
    let q_kind = kind_of("query", query)?;
    for (name, obj) in names.iter().zip(operands).skip(1) {
        let Some(obj) = obj else { continue };
        let kind = kind_of(name, obj)?;
        if (q_kind == Kind::Torch) != (kind == Kind::Torch) {
            return Err(mixed_kinds(q_kind, name, kind));
        }
    }
    Ok(true)
}

/// The kind of an operand, without reading it (the error of [`Array::extract`] for
/// anything else).
fn kind_of(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Kind> {
    if obj.cast::<numpy::PyUntypedArray>().is_ok() {
        Ok(Kind::NumPy)
    } else if is_torch_tensor(obj)? {
        Ok(Kind::Torch)
    } else if obj.hasattr("__dlpack__")? {
        Ok(Kind::Other)
    } else {
        Err(PyTypeError::new_err(format!(
            "{name} must be a NumPy array or a CPU tensor that supports DLPack (a torch.Tensor), not {}",
            obj.get_type().name()?
        )))
    }
}

/// Hands a call to `attn.torch` (Python): its operator `attn::sdpa_forward` calls back
/// without grad (or computes shapes only, for meta and fake tensors).
fn via_autograd<'py>(call: &ForwardCall<'_, 'py>, with_lse: bool) -> PyResult<Bound<'py, PyAny>> {
    let py = call.query.py();
    let packed = PyDict::new(py);
    packed.set_item(intern!(py, "cu_seqlens_q"), call.cu_seqlens.0)?;
    packed.set_item(intern!(py, "cu_seqlens_k"), call.cu_seqlens.1)?;
    py.import("attn.torch")?
        .getattr("_autograd_attention")?
        .call(
            (
                call.query,
                call.key,
                call.value,
                call.attn_mask,
                call.is_causal,
                call.scale,
                call.enable_gqa,
                call.causal_alignment,
                with_lse,
                call.dropout_p,
                call.seed,
            ),
            Some(&packed),
        )
}

fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::NumPy => "a NumPy array",
        Kind::Torch => "a torch.Tensor",
        Kind::Other => "a DLPack tensor",
    }
}

fn mixed_kinds(q: Kind, name: &str, kind: Kind) -> PyErr {
    PyTypeError::new_err(format!(
        "query is {} but {name} is {}: pass torch tensors together, or NumPy arrays together",
        kind_name(q),
        kind_name(kind)
    ))
}

/// torch tensors go with torch tensors: the query decides the kind of the results.
pub(crate) fn check_kinds(q: &Array<'_>, others: &[&Array<'_>]) -> PyResult<()> {
    for a in others {
        if (q.kind == Kind::Torch) != (a.kind == Kind::Torch) {
            return Err(mixed_kinds(q.kind, a.name, a.kind));
        }
    }
    Ok(())
}

pub(crate) fn check_storage(q: &Array<'_>) -> PyResult<()> {
    match q.dtype {
        Dtype::Float(f) => check_returnable(q.kind, f),
        _ => Err(PyTypeError::new_err(format!(
            "query has dtype {}: attn computes on float32, float16 and bfloat16 storage",
            q.dtype.name()
        ))),
    }
}

/// The operands of one dtype: `rest` must have the query's.
pub(crate) fn check_same_dtype(
    q: &Array<'_>,
    k: &Array<'_>,
    v: &Array<'_>,
    rest: &[&Array<'_>],
) -> PyResult<()> {
    if k.dtype != q.dtype || v.dtype != q.dtype {
        return Err(PyTypeError::new_err(format!(
            "Expected query, key, and value to have the same dtype, but got query.dtype: {} key.dtype: {} and value.dtype: {} instead.",
            q.dtype.name(),
            k.dtype.name(),
            v.dtype.name()
        )));
    }
    for a in rest {
        if a.dtype != q.dtype {
            return Err(PyTypeError::new_err(format!(
                "{} has dtype {} but query has {}: they must match",
                a.name,
                a.dtype.name(),
                q.dtype.name()
            )));
        }
    }
    Ok(())
}

/// Makes a mask usable by the engine: bool bytes 0/1, float widened to f32. Called once
/// the plan has checked that the mask broadcasts, and only when the engine will read it:
/// it reads every distinct element of the mask.
fn prepare_mask<'py>(py: Python<'py>, m: Array<'py>) -> PyResult<Array<'py>> {
    match m.dtype {
        Dtype::Bool => m.normalized_bool(py),
        Dtype::F16 | Dtype::BF16 => m.widened_to_f32(py),
        _ => Ok(m),
    }
}

/// torch's rule for the mask's dtype: bool, float32, or the query's.
fn check_mask_dtype(m: &Array<'_>, q: &Array<'_>) -> PyResult<()> {
    match m.dtype {
        Dtype::Bool | Dtype::F32 => Ok(()),
        Dtype::F16 | Dtype::BF16 if m.dtype == q.dtype => Ok(()),
        _ => Err(PyTypeError::new_err(format!(
            "Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype: {} and  query.dtype: {} instead.",
            m.dtype.name(),
            q.dtype.name()
        ))),
    }
}

/// A copy when an engine call would span a negative stride (attn's views step forward):
/// the last four axes are the most a call spans (batch, head, sequence, features).
pub(crate) fn forward_strides<'py>(py: Python<'py>, a: Array<'py>) -> PyResult<Array<'py>> {
    let n = a.ndim();
    if a.strides[n.saturating_sub(4)..].iter().any(|&s| s < 0) {
        a.compacted(py)
    } else {
        Ok(a)
    }
}

/// The plan of a call, and its mask made ready for the engine when the engine will read
/// it (`work`): shapes, the mask's broadcast included, are checked before any walk over
/// the mask, and a call that computes nothing does not walk it.
fn plan_call<'py>(
    py: Python<'py>,
    (q, k, v): (&Array<'py>, &Array<'py>, &Array<'py>),
    m: Option<Array<'py>>,
    f: Flags,
    work: impl Fn(&Plan) -> bool,
) -> PyResult<(Plan, Option<Array<'py>>)> {
    let mut plan = Plan::new(q, k, v, m.as_ref(), f.enable_gqa, f.options)?;
    let m = match m {
        Some(m) if work(&plan) => {
            let mut m = prepare_mask(py, m)?;
            plan.set_mask(&m)?; // the strides of a copy differ
            if !plan.mask_viewable() {
                m = m.compacted(py)?;
                plan.set_mask(&m)?;
            }
            Some(m)
        }
        // Never read: no engine call will be made.
        _ => None,
    };
    Ok((plan, m))
}

/// Reads the query, key, value and mask and checks them together.
fn read_operands<'py>(
    query: &Bound<'py, PyAny>,
    key: &Bound<'py, PyAny>,
    value: &Bound<'py, PyAny>,
    attn_mask: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Array<'py>, Array<'py>, Array<'py>, Option<Array<'py>>)> {
    let q = Array::extract("query", query)?;
    let k = Array::extract("key", key)?;
    let v = Array::extract("value", value)?;
    let m = attn_mask
        .map(|m| Array::extract("attn_mask", m))
        .transpose()?;
    let mut others = vec![&k, &v];
    others.extend(m.as_ref());
    check_kinds(&q, &others)?;
    check_storage(&q)?;
    check_same_dtype(&q, &k, &v, &[])?;
    for a in [&q, &k, &v] {
        a.require_contiguous_rows()?;
    }
    if let Some(m) = &m {
        check_mask_dtype(m, &q)?;
    }
    let py = query.py();
    Ok((
        forward_strides(py, q)?,
        forward_strides(py, k)?,
        forward_strides(py, v)?,
        m,
    ))
}

/// The mask's pointer, typed by its kind (bool or f32).
#[derive(Clone, Copy)]
enum MaskPtr {
    None,
    Bool(SendPtr<bool>),
    Additive(SendPtr<f32>),
}

fn mask_ptr(m: Option<&Array<'_>>) -> MaskPtr {
    match m {
        None => MaskPtr::None,
        Some(m) if m.dtype == Dtype::Bool => MaskPtr::Bool(SendPtr(m.ptr())),
        Some(m) => MaskPtr::Additive(SendPtr(m.ptr())),
    }
}

/// The number of elements a view of `dims` with `strides` reaches from its first element:
/// the length of the slice it needs (an error if it overflows, which the checks of the
/// inputs rule out).
fn span<const N: usize>(dims: [usize; N], strides: [usize; N]) -> attn_core::Result<usize> {
    if dims.contains(&0) {
        return Ok(0);
    }
    let mut last = 0usize;
    for a in 0..N {
        last = (dims[a] - 1)
            .checked_mul(strides[a])
            .and_then(|x| x.checked_add(last))
            .ok_or_else(|| attn_core::Error::layout("view", "its extent overflows"))?;
    }
    Ok(last + 1)
}

fn usize_strides<const N: usize>(s: [isize; N]) -> attn_core::Result<[usize; N]> {
    let mut out = [0; N];
    for (o, &x) in out.iter_mut().zip(&s) {
        *o = usize::try_from(x)
            .map_err(|_| attn_core::Error::layout("view", "a negative stride reached a call"))?;
    }
    Ok(out)
}

/// The compact row-major (batch, head, seq) strides of `dims`.
pub(crate) fn compact3(dims: [usize; 4]) -> [usize; 3] {
    [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3]]
}

/// The slice of a live buffer that a view of `dims` and `strides` from `base + off` reaches.
///
/// # Safety
/// `base + off` and every element the view reaches must be readable elements of a live
/// buffer, not written for the slice's lifetime.
unsafe fn reach<'a, T, const N: usize>(
    base: SendPtr<T>,
    off: isize,
    dims: [usize; N],
    strides: [usize; N],
) -> attn_core::Result<&'a [T]> {
    let len = span(dims, strides)?;
    Ok(if len == 0 {
        &[]
    } else {
        // SAFETY: the caller guarantees the elements from `base + off` through the view's
        // last one lie in one live buffer; `len` is exactly that range.
        unsafe { std::slice::from_raw_parts(base.0.offset(off), len) }
    })
}

/// A read-only engine view of an operand at element offset `off`.
///
/// # Safety
/// As [`reach`].
pub(crate) unsafe fn view<'a, T>(
    base: SendPtr<T>,
    off: isize,
    dims: [usize; 4],
    strides: [isize; 3],
) -> attn_core::Result<Tensor4Ref<'a, T>> {
    let strides = usize_strides(strides)?;
    let with_features = [strides[0], strides[1], strides[2], 1];
    // SAFETY: the caller's guarantee.
    let data = unsafe { reach(base, off, dims, with_features) }?;
    Tensor4Ref::new(data, dims, strides)
}

/// A writable engine view of a compact buffer at element offset `off`.
///
/// # Safety
/// The range must lie in a live buffer that nothing else reads or writes meanwhile.
pub(crate) unsafe fn view_mut<'a, T>(
    base: SendPtr<T>,
    off: usize,
    dims: [usize; 4],
    strides: [usize; 3],
) -> attn_core::Result<Tensor4Mut<'a, T>> {
    let len = span(dims, [strides[0], strides[1], strides[2], 1])?;
    let data: &mut [T] = if len == 0 {
        &mut []
    } else {
        // SAFETY: as the caller guarantees: an exclusive range of a live buffer.
        unsafe { std::slice::from_raw_parts_mut(base.as_mut().add(off), len) }
    };
    Tensor4Mut::new(data, dims, strides)
}

/// The options of one call: the plan's, and the call's `[B, H, L, S]` view of the mask.
///
/// # Safety
/// The mask pointer must address a live mask that the plan's strides describe.
unsafe fn options<'a>(plan: &Plan, mask: MaskPtr, off: isize) -> attn_core::Result<Options<'a>> {
    let mut opts: Options<'a> = plan.options;
    let Some(strides) = plan.mask_strides() else {
        return Ok(opts);
    };
    let dims = [plan.call_batch(), plan.heads, plan.l, plan.s];
    let strides = usize_strides(strides)?; // compacted by `plan_call` when negative
    match mask {
        MaskPtr::None => {}
        MaskPtr::Bool(p) => {
            // SAFETY: every position of the call's view is a byte of the mask (0 or 1:
            // normalised), alive for the call; an empty view reads nothing.
            let data = unsafe { reach(p, off, dims, strides) }?;
            opts.bool_mask_4d = Some(BoolMask4::allow(Mask4Ref::new(data, dims, strides)?));
        }
        MaskPtr::Additive(p) => {
            // SAFETY: every position of the call's view is an f32 of the mask, alive for
            // the call; an empty view reads nothing.
            let data = unsafe { reach(p, off, dims, strides) }?;
            opts.additive_mask_4d = Some(Mask4Ref::new(data, dims, strides)?);
        }
    }
    Ok(opts)
}

/// The element offset of a call's first position in an operand with `strides`
/// (`kv`: its head index is the call's kv head).
fn offset(plan: &Plan, s: &Strides, call: &Call, kv: bool) -> isize {
    plan.offset(&s.lead, &call.index, kv)
}

/// The views of one call: query, key, value and the options carrying its mask.
type CallViews<'a, T> = (
    Tensor4Ref<'a, T>,
    Tensor4Ref<'a, T>,
    Tensor4Ref<'a, T>,
    Options<'a>,
);

/// The addresses of a call's operands: query, key, value and mask.
struct Operands<T> {
    q: SendPtr<T>,
    k: SendPtr<T>,
    v: SendPtr<T>,
    mask: MaskPtr,
}

impl<T> Clone for Operands<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Operands<T> {}

impl<T> Operands<T> {
    fn of(q: &Array<'_>, k: &Array<'_>, v: &Array<'_>, m: Option<&Array<'_>>) -> Self {
        Operands {
            q: SendPtr(q.ptr()),
            k: SendPtr(k.ptr()),
            v: SendPtr(v.ptr()),
            mask: mask_ptr(m),
        }
    }

    /// The engine's views of one call's query, key and value, and its options.
    ///
    /// # Safety
    /// The addresses must be those of the live operands the plan was made from, unwritten
    /// while the views live.
    unsafe fn call<'a>(&self, plan: &Plan, call: &Call) -> attn_core::Result<CallViews<'a, T>> {
        let (bc, hc, hkc) = (plan.call_batch(), plan.heads, plan.kv_heads);
        let (l, s, e, ev) = (plan.l, plan.s, plan.e, plan.ev);
        let mask_off = plan
            .mask
            .as_ref()
            .map_or(0, |m| plan.offset(&m.lead, &call.index, false));
        let (qo, ko, vo) = (
            offset(plan, &plan.q, call, false),
            offset(plan, &plan.k, call, true),
            offset(plan, &plan.v, call, true),
        );
        let (qs, ks, vs) = (
            plan.call_strides(&plan.q),
            plan.call_strides(&plan.k),
            plan.call_strides(&plan.v),
        );
        // SAFETY: the caller's guarantee; the plan's offsets and strides reach only elements
        // of each operand (and of the mask), as it checked them against their shapes.
        let (q, k, v, mut opts) = unsafe {
            (
                view(self.q, qo, [bc, hc, l, e], qs)?,
                view(self.k, ko, [bc, hkc, s, e], ks)?,
                view(self.v, vo, [bc, hkc, s, ev], vs)?,
                options(plan, self.mask, mask_off)?,
            )
        };
        // The call's batch entries are the whole call's `call.lin / heads ..` (the axes
        // before the head axis flattened): each call draws the masks one call of the whole
        // shape would.
        let heads = plan.heads.max(1);
        opts.dropout = opts.dropout.map(|d| d.within(call.lin / heads, 0, heads));
        Ok((q, k, v, opts))
    }
}

/// The forward computation over every call, writing `out` (compact `lead + (L, Ev)`) and,
/// when given, `lse` (compact `lead + (L,)`).
///
/// # Safety
/// `ops` must address the live operands of `plan`, unwritten during the call; `out` and
/// `lse` our own compact results of the plan's shapes, touched by nothing else.
unsafe fn run_forward<T: Storage>(
    plan: &Plan,
    ops: Operands<T>,
    out: SendPtr<T>,
    lse: Option<SendPtr<f32>>,
) -> attn_core::Result<()> {
    let (bc, hc) = (plan.call_batch(), plan.heads);
    let (l, ev) = (plan.l, plan.ev);
    let [lb, lh] = plan.lin_strides(false);
    let row = l * ev;
    if ev == 0 && lse.is_none() {
        return Ok(()); // an empty output: no call computes anything
    }
    for call in plan.calls() {
        // SAFETY: the caller's guarantee on `ops`.
        let (q, k, v, opts) = unsafe { ops.call(plan, &call) }?;
        // SAFETY: this call's positions of our compact output and LSE, written by it alone
        // (the calls run one after the other).
        let (o, lse) = unsafe {
            let o = view_mut(
                out,
                call.lin * row,
                [bc, hc, l, ev],
                [lb * row, lh * row, ev],
            )?;
            let lse = match lse {
                None => None,
                Some(p) => Some(view_mut(
                    p,
                    call.lin * l,
                    [bc, hc, l, 1],
                    [lb * l, lh * l, 1],
                )?),
            };
            (o, lse)
        };
        attn_optimized::Attention::batched(q, k, v, &opts)?.forward_into(
            o,
            lse,
            attn_optimized::Par::rayon(0),
        )?;
    }
    Ok(())
}

fn forward_typed<'py, T: Storage>(
    py: Python<'py>,
    plan: &Plan,
    q: &Array<'py>,
    k: &Array<'py>,
    v: &Array<'py>,
    m: Option<&Array<'py>>,
    with_lse: bool,
) -> PyResult<(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>)> {
    let (out, out_ptr) = T::zeros(py, &plan.out_shape())?;
    let lse = with_lse
        .then(|| f32::zeros(py, &plan.lse_shape()))
        .transpose()?;
    let ops = Operands::<T>::of(q, k, v, m);
    let lse_ptr = lse.as_ref().map(|(_, p)| *p);
    // SAFETY: the operands are the arrays the plan was made from, alive (borrowed) until we
    // return; `out` and `lse` were just allocated with the plan's shapes.
    py.detach(|| unsafe { run_forward(plan, ops, out_ptr, lse_ptr) })
        .map_err(to_py_err)?;
    let kind = q.kind;
    let out = finish(out, kind, T::DTYPE)?;
    let lse = lse.map(|(a, _)| finish(a, kind, Float::F32)).transpose()?;
    Ok((out, lse))
}

/// The forward pass of every entry point, once the autograd route is excluded.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<'py>(
    query: &Bound<'py, PyAny>,
    key: &Bound<'py, PyAny>,
    value: &Bound<'py, PyAny>,
    attn_mask: Option<&Bound<'py, PyAny>>,
    f: Flags,
    seqs: Option<&Seqlens>,
    with_lse: bool,
) -> PyResult<(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>)> {
    let py = query.py();
    let (q, k, v, m) = read_operands(query, key, value, attn_mask)?;
    if let Some(seqs) = seqs {
        no_mask_when_packed(m.as_ref())?;
        return crate::packed::forward(py, &q, &k, &v, &f, seqs, with_lse);
    }
    let work = |p: &Plan| p.has_calls() && (p.ev > 0 || with_lse);
    let (plan, m) = plan_call(py, (&q, &k, &v), m, f, work)?;
    match q.dtype {
        Dtype::F32 => forward_typed::<f32>(py, &plan, &q, &k, &v, m.as_ref(), with_lse),
        Dtype::F16 => forward_typed::<f16>(py, &plan, &q, &k, &v, m.as_ref(), with_lse),
        _ => forward_typed::<bf16>(py, &plan, &q, &k, &v, m.as_ref(), with_lse),
    }
}

/// A packed batch's sequences are separated by their offsets alone: an element-wise mask
/// has no place in it.
fn no_mask_when_packed(m: Option<&Array<'_>>) -> PyResult<()> {
    if m.is_some() {
        return Err(PyValueError::new_err(
            "attn_mask with cu_seqlens: a packed batch takes no element-wise mask (each sequence attends within itself; is_causal applies per sequence)",
        ));
    }
    Ok(())
}

/// Packed batches go through the plain call: their autograd route is not written.
/// The operators' refusal of dropout without a seed.
pub(crate) fn require_seed(dropout_p: f64, seed: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
    if dropout_p > 0.0 && seed.is_none() {
        return Err(PyValueError::new_err(format!(
            "dropout_p={dropout_p} without a seed: the operators take the seed as a 0-d int64 tensor (attn.torch's functions draw one)"
        )));
    }
    Ok(())
}

/// How a forward call is made: by the module's functions (through `attn.torch`'s operator
/// when autograd or a tensor without data needs it; `(out, lse)` or `out`), or by the
/// operator's CPU kernel (computed here, `(out, lse)`, the seed required with dropout).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Route {
    Plain { with_lse: bool },
    Kernel,
}

/// One forward call's arguments, as the module's functions and the operator take them.
pub(crate) struct ForwardCall<'a, 'py> {
    pub query: &'a Bound<'py, PyAny>,
    pub key: &'a Bound<'py, PyAny>,
    pub value: &'a Bound<'py, PyAny>,
    pub attn_mask: Option<&'a Bound<'py, PyAny>>,
    pub dropout_p: f64,
    pub is_causal: bool,
    pub scale: Option<f64>,
    pub enable_gqa: bool,
    pub causal_alignment: &'a str,
    pub seed: Option<&'a Bound<'py, PyAny>>,
    /// `cu_seqlens_q` and `cu_seqlens_k` of a packed call.
    pub cu_seqlens: (Option<&'a Bound<'py, PyAny>>, Option<&'a Bound<'py, PyAny>>),
}

impl<'py> ForwardCall<'_, 'py> {
    /// The call's result by `route`, its errors as torch's kinds ([`crate::errors`]).
    pub(crate) fn run(&self, route: Route) -> PyResult<Bound<'py, PyAny>> {
        let py = self.query.py();
        crate::errors::torch_like(py, || {
            let f = flags(
                py,
                self.dropout_p,
                self.is_causal,
                self.attn_mask.is_some(),
                self.scale,
                self.enable_gqa,
                self.causal_alignment,
            )?;
            let seqs = Seqlens::read(self.cu_seqlens.0, self.cu_seqlens.1)?;
            let (q, k, v, m) = (self.query, self.key, self.value, self.attn_mask);
            let with_lse = match route {
                Route::Kernel => {
                    require_seed(self.dropout_p, self.seed)?;
                    true
                }
                Route::Plain { with_lse } => {
                    if needs_autograd([Some(q), Some(k), Some(v), m])? {
                        return via_autograd(self, with_lse);
                    }
                    with_lse
                }
            };
            let f = f.seeded(q, self.seed)?;
            let (o, lse) = forward(q, k, v, m, f, seqs.as_ref(), with_lse)?;
            match lse {
                Some(lse) => Ok(PyTuple::new(py, [o, lse])?.into_any()),
                None => Ok(o),
            }
        })
    }
}

/// Scaled dot-product attention with the semantics of
/// `torch.nn.functional.scaled_dot_product_attention`, computed by attn's streaming engine.
///
/// ``query`` ``(..., L, E)``, ``key`` ``(..., S, E)``, ``value`` ``(..., S, Ev)``: NumPy
/// arrays (float32, float16) or torch CPU tensors (float32, float16, bfloat16), read in
/// place (DLPack for tensors); the result ``(..., L, Ev)`` is of the query's kind and dtype.
/// The leading axes broadcast; the last of them is the head axis. ``attn_mask`` broadcasts
/// to ``(..., L, S)``: boolean (True = takes part in attention) or float (added to the
/// scores; float32 or the query's dtype). ``is_causal`` is torch's top-left causal mask
/// (an error together with ``attn_mask``); ``scale`` defaults to ``1/sqrt(E)``;
/// ``enable_gqa`` lets key and value have fewer heads than the query (query head ``i``
/// reads kv head ``i // (Hq // Hkv)``).
///
/// Beyond torch: ``causal_alignment="bottom_right"`` (with ``is_causal=True``) aligns the
/// causal mask to the last key, as decoding and FlashAttention ≥ 2.1 do (query ``i`` sees
/// keys ``j <= i + S - L``). ``cu_seqlens_q`` and ``cu_seqlens_k`` (both or neither) make
/// the call a packed batch of sequences of different lengths, flash-attn's varlen layout:
/// ``query`` ``(total_q, Hq, E)``, ``key`` ``(total_k, Hkv, E)``, ``value``
/// ``(total_k, Hkv, Ev)``, sequence ``i`` on the rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``
/// (and ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``), attending within itself; the result is
/// ``(total_q, Hq, Ev)``, the LSE of ``attention_with_lse`` ``(Hq, total_q)``. No
/// ``attn_mask`` and no autograd route with them.
///
/// Dropout, torch's: with ``dropout_p`` in ``(0, 1]`` each weight after the softmax is kept
/// with probability ``1 - p`` and scaled by ``1/(1 - p)`` (the float32 ``1/(1 - p)``), or
/// set to 0; ``p`` is rounded to a multiple of ``2**-16``; ``p = 0`` computes exactly what a
/// call without dropout does; ``p`` outside ``[0, 1]`` is torch's ValueError. The mask is a
/// pure function of a 64-bit ``seed`` and of (batch entry, query head, query, key) —
/// Philox4x32-10; batch entries number the leading axes before the head axis, flattened; a
/// packed call's are its sequences, with positions counted from each sequence's start;
/// grouped-query heads are keyed by the query head — so the same seed gives the same
/// result, whatever the thread count. ``seed`` is an integer from ``-2**63`` to
/// ``2**64 - 1`` (a negative one is an int64's bits); without it each call draws one: from
/// torch's default CPU generator for torch tensors (one ``torch.randint``:
/// ``torch.manual_seed`` reproduces a run, successive calls differ), from NumPy's legacy
/// global generator otherwise (one ``numpy.random.randint``: ``numpy.random.seed``
/// reproduces a run). ``attn.dropout_mask`` returns the mask a seed draws. The masks are
/// attn's, not torch's (another generator), with the same distribution.
///
/// Where attn differs from torch:
///
/// - A key hidden by any mask contributes nothing: a NaN or infinity in its score, bias
///   or value row never reaches the output (torch computes ``0 * NaN``).
/// - A row that sees no key (fully masked, or ``S == 0``) is 0, never NaN.
/// - ``scale`` may be any finite float, as in torch (0: every score 0, uniform weights
///   over the visible keys; negative: the scores reversed); NaN and infinities are
///   ValueErrors.
/// - The innermost axis of query, key and value must be contiguous (stride 1); other
///   strides, broadcast (stride 0) included, are read in place. Negative strides (NumPy
///   views such as ``x[::-1]``) and unaligned NumPy buffers are copied once.
/// - Results are deterministic: they do not depend on the number of threads.
/// - The LSE is available: see ``attention_with_lse``.
///
/// Errors are ``attn.InputError`` (shapes, options: a ValueError) and
/// ``attn.InputTypeError`` (dtypes, kinds of input: a TypeError), with the operand and its
/// shape in the message; both are RuntimeErrors too, as torch's errors for the same input
/// are. Torch tensors that require grad (with grad mode on) go through ``attn.torch``'s
/// operator, so ``loss.backward()`` works, packed calls included. The GIL is released while
/// attn computes.
#[pyfunction]
#[pyo3(signature = (query, key, value, attn_mask=None, dropout_p=0.0, is_causal=false, *, scale=None, enable_gqa=false, causal_alignment="top_left", seed=None, cu_seqlens_q=None, cu_seqlens_k=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn scaled_dot_product_attention<'py>(
    query: &Bound<'py, PyAny>,
    key: &Bound<'py, PyAny>,
    value: &Bound<'py, PyAny>,
    attn_mask: Option<&Bound<'py, PyAny>>,
    dropout_p: f64,
    is_causal: bool,
    scale: Option<f64>,
    enable_gqa: bool,
    causal_alignment: &str,
    seed: Option<&Bound<'py, PyAny>>,
    cu_seqlens_q: Option<&Bound<'py, PyAny>>,
    cu_seqlens_k: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    ForwardCall {
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal_alignment,
        seed,
        cu_seqlens: (cu_seqlens_q, cu_seqlens_k),
    }
    .run(Route::Plain { with_lse: false })
}

/// ``scaled_dot_product_attention`` that also returns the natural-log log-sum-exp of each
/// row of scores: ``(out, lse)``, ``lse`` of shape ``(..., L)`` in float32 (``-inf`` for a
/// row that sees no key). The arguments and the differences from torch are those of
/// ``scaled_dot_product_attention``. With torch tensors that require grad, ``out`` is
/// differentiable and ``lse`` is not.
#[pyfunction]
#[pyo3(signature = (query, key, value, attn_mask=None, dropout_p=0.0, is_causal=false, *, scale=None, enable_gqa=false, causal_alignment="top_left", seed=None, cu_seqlens_q=None, cu_seqlens_k=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_with_lse<'py>(
    query: &Bound<'py, PyAny>,
    key: &Bound<'py, PyAny>,
    value: &Bound<'py, PyAny>,
    attn_mask: Option<&Bound<'py, PyAny>>,
    dropout_p: f64,
    is_causal: bool,
    scale: Option<f64>,
    enable_gqa: bool,
    causal_alignment: &str,
    seed: Option<&Bound<'py, PyAny>>,
    cu_seqlens_q: Option<&Bound<'py, PyAny>>,
    cu_seqlens_k: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyTuple>> {
    ForwardCall {
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        causal_alignment,
        seed,
        cu_seqlens: (cu_seqlens_q, cu_seqlens_k),
    }
    .run(Route::Plain { with_lse: true })?
    .cast_into::<PyTuple>()
    .map_err(Into::into)
}

// ---------------------------------------------------------------------------------------
// The backward pass.

/// A gradient accumulated in f32 over `full` (the broadcast shape), summed down to an
/// operand's `own` shape and rounded once to `T`.
///
/// # Safety
/// `dst` must be a compact buffer of `own_shape`'s elements that nothing else touches.
unsafe fn reduce_into<T: Storage>(
    full: &[f32],
    full_shape: &[usize],
    own_shape: &[usize],
    dst: SendPtr<T>,
) -> PyResult<()> {
    let dst = dst.as_mut();
    let rank = full_shape.len();
    let own = {
        let mut o = vec![1; rank - own_shape.len()];
        o.extend_from_slice(own_shape);
        o
    };
    // Compact strides of the own shape over the full axes, 0 on summed axes.
    let mut strides = vec![0usize; rank];
    let mut step = 1;
    for a in (0..rank).rev() {
        strides[a] = if own[a] == full_shape[a] { step } else { 0 };
        step *= own[a];
    }
    let count: usize = own.iter().product();
    let direct = own == full_shape;
    let mut acc = if direct {
        Vec::new()
    } else {
        zeroed::<f32>("a gradient", Some(count))?
    };
    if !direct {
        let mut index = vec![0usize; rank];
        for &x in full {
            let o: usize = index.iter().zip(&strides).map(|(i, s)| i * s).sum();
            acc[o] += x;
            for a in (0..rank).rev() {
                index[a] += 1;
                if index[a] < full_shape[a] {
                    break;
                }
                index[a] = 0;
            }
        }
    }
    // A sum starts from +0: so does a gradient that is not summed (`+ 0.0` turns a -0 into
    // +0 and keeps every other value).
    let src = if direct { full } else { &acc };
    for (i, &x) in src.iter().enumerate().take(count) {
        // SAFETY: `dst` is our own compact result of `count` elements.
        unsafe { *dst.add(i) = T::from_f32(x + 0.0) };
    }
    Ok(())
}

/// Strides over `lead + (rows,)` of an array of exactly that shape (the output, dO, LSE).
fn output_strides(a: &Array<'_>, lead_len: usize) -> Strides {
    Strides {
        lead: a.strides[..lead_len].to_vec(),
        seq: a.strides[lead_len],
    }
}

/// The addresses of the backward pass's own operands: dO, O and the LSE.
struct Upstream<T> {
    go: SendPtr<T>,
    o: SendPtr<T>,
    lse: SendPtr<f32>,
}

/// The gradients of every call, written into compact f32 buffers over the broadcast
/// shapes: dQ over `lead + (L, E)`, dK and dV over `kv_lead + (S, E | Ev)` (each call
/// writes its own positions).
///
/// # Safety
/// `ops` and `up` must address the live operands of `plan` (dO and O of the output's
/// shape with strides `go_s`, `o_s`, the LSE with `lse_s`), unwritten during the call.
unsafe fn run_backward<T: Storage>(
    plan: &Plan,
    ops: Operands<T>,
    up: Upstream<T>,
    (go_s, o_s, lse_s): (&Strides, &Strides, &Strides),
    (dq, dk, dv): (&mut [f32], &mut [f32], &mut [f32]),
    mut dmask: Option<MaskGrad<'_>>,
) -> attn_core::Result<()> {
    let (bc, hc, hkc) = (plan.call_batch(), plan.heads, plan.kv_heads);
    let (l, s, e, ev) = (plan.l, plan.s, plan.e, plan.ev);
    let [lb, lh] = plan.lin_strides(false);
    let [kb, kh] = plan.lin_strides(true);
    let (go_strides, o_strides) = (plan.call_strides(go_s), plan.call_strides(o_s));
    let lse_strides = plan.call_strides(lse_s);
    for call in plan.calls() {
        // SAFETY: the caller's guarantee on `ops`.
        let (q, k, v, opts) = unsafe { ops.call(plan, &call) }?;
        let (go_off, o_off, lse_off) = (
            offset(plan, go_s, &call, false),
            offset(plan, o_s, &call, false),
            offset(plan, lse_s, &call, false),
        );
        // SAFETY: the caller's guarantee on `up`: dO and O have the output's shape and the
        // LSE its leading shape and rows, so the call's output positions are theirs.
        let (go, o, lse) = unsafe {
            (
                view(up.go, go_off, [bc, hc, l, ev], go_strides)?,
                view(up.o, o_off, [bc, hc, l, ev], o_strides)?,
                view(up.lse, lse_off, [bc, hc, l, 1], lse_strides)?,
            )
        };
        let (q_row, k_row, v_row) = (l * e, s * e, s * ev);
        let grads = GradientsMut {
            dq: Tensor4Mut::new(
                &mut dq[call.lin * q_row..],
                [bc, hc, l, e],
                [lb * q_row, lh * q_row, e],
            )?,
            dk: Tensor4Mut::new(
                &mut dk[call.lin_kv * k_row..],
                [bc, hkc, s, e],
                [kb * k_row, kh * k_row, e],
            )?,
            dv: Tensor4Mut::new(
                &mut dv[call.lin_kv * v_row..],
                [bc, hkc, s, ev],
                [kb * v_row, kh * v_row, ev],
            )?,
        };
        let call_ = attn_optimized::Attention::batched(q, k, v, &opts)?;
        let fwd = ForwardRef::new(o, lse);
        let par = attn_optimized::Par::rayon(0);
        match dmask.as_mut() {
            None => {
                call_.backward_into(fwd, go, grads, par)?;
            }
            Some(dmask) => {
                // The bias gradient comes with the owned backward only: dQ, dK, dV copied
                // into the call's positions, dS summed into the mask's.
                let g = call_.with_bias_gradient().backward(fwd, go, par)?;
                let GradientsMut { dq, dk, dv } = grads;
                copy_gradient(&g.dq, dq)?;
                copy_gradient(&g.dk, dk)?;
                copy_gradient(&g.dv, dv)?;
                let dbias = g.dbias.ok_or_else(|| {
                    attn_core::Error::unsupported("bias gradient", "the engine returned none")
                })?;
                dmask.add(plan, &call, &dbias)?;
            }
        }
    }
    Ok(())
}

/// Writes an owned gradient of a call into its view of our compact buffers.
fn copy_gradient<T: Storage>(
    src: &attn_core::Tensor4<T>,
    mut dst: Tensor4Mut<'_, f32>,
) -> attn_core::Result<()> {
    let [b, h, n, d] = src.dims();
    if dst.dims() != [b, h, n, d] {
        return Err(attn_core::Error::layout(
            "gradient",
            "the engine's gradient does not match the call's view",
        ));
    }
    for bi in 0..b {
        for hi in 0..h {
            let from = src.as_ref().head(bi, hi)?;
            let mut to = dst.head_mut(bi, hi)?;
            for i in 0..n {
                for j in 0..d {
                    to[(i, j)] = from[(i, j)].to_f32();
                }
            }
        }
    }
    Ok(())
}

/// The gradient of the additive mask, accumulated in f32 over the mask's shape as the
/// engine reads it (right-aligned to `lead + (L, S)`, compact; the axes of length 1 are
/// those it broadcasts on): each call's `dbias` summed into its positions, call after call.
struct MaskGrad<'b> {
    buf: &'b mut [f32],
    /// The mask's dims over `lead + (L, S)` (1 where it broadcasts).
    dims: Vec<usize>,
    /// Compact strides of `dims` (0 on axes of length 1).
    strides: Vec<usize>,
}

impl MaskGrad<'_> {
    fn add(
        &mut self,
        plan: &Plan,
        call: &Call,
        dbias: &attn_core::Tensor4<f32>,
    ) -> attn_core::Result<()> {
        let r = plan.lead.len();
        let base: usize = (0..r).map(|a| call.index[a] * self.strides[a]).sum();
        let (ba, ha) = plan.call_axes();
        let own = |axis: Option<usize>| axis.map_or(1, |a| self.dims[a]);
        let stride = |axis: Option<usize>| axis.map_or(0, |a| self.strides[a]);
        let want = [own(ba), own(ha), self.dims[r], self.dims[r + 1]];
        if dbias.dims() != want {
            return Err(attn_core::Error::layout(
                "bias gradient",
                format!("dims {:?} but the mask's own are {want:?}", dbias.dims()),
            ));
        }
        let [sb, sh, sr, sc] = [stride(ba), stride(ha), self.strides[r], self.strides[r + 1]];
        let [b, h, n, m] = want;
        for bi in 0..b {
            for hi in 0..h {
                let d = dbias.as_ref().head(bi, hi)?;
                for i in 0..n {
                    let row = base + bi * sb + hi * sh + i * sr;
                    for j in 0..m {
                        let Some(x) = self.buf.get_mut(row + j * sc) else {
                            return Err(attn_core::Error::layout(
                                "bias gradient",
                                "a position beyond the mask's",
                            ));
                        };
                        *x += d[(i, j)];
                    }
                }
            }
        }
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
fn backward_typed<'py, T: Storage>(
    py: Python<'py>,
    plan: &Plan,
    q: &Array<'py>,
    k: &Array<'py>,
    v: &Array<'py>,
    go: &Array<'py>,
    o: &Array<'py>,
    lse: &Array<'py>,
    m: Option<&Array<'py>>,
    mask_grad: Option<&MaskGradOut>,
) -> PyResult<Bound<'py, PyTuple>> {
    let r = plan.lead.len();
    let (go_s, o_s) = (output_strides(go, r), output_strides(o, r));
    // The LSE has no feature axis: its positions are its "rows" of one element.
    let lse_s = output_strides(lse, r);
    let ops = Operands::<T>::of(q, k, v, m);
    let up = Upstream {
        go: SendPtr(go.ptr::<T>()),
        o: SendPtr(o.ptr::<T>()),
        lse: SendPtr(lse.ptr::<f32>()),
    };
    let full = |lead: &[usize], rows: usize, d: usize| {
        let mut s = lead.to_vec();
        s.extend([rows, d]);
        s
    };
    let shapes = [
        full(&plan.lead, plan.l, plan.e),
        full(&plan.kv_lead, plan.s, plan.e),
        full(&plan.kv_lead, plan.s, plan.ev),
    ];
    let mut dq = zeroed::<f32>("dQ", product(&shapes[0]))?;
    let mut dk = zeroed::<f32>("dK", product(&shapes[1]))?;
    let mut dv = zeroed::<f32>("dV", product(&shapes[2]))?;
    let strides = (&go_s, &o_s, &lse_s);
    // The mask's gradient, over the shape the engine reads it with (`engine_shape`), when
    // asked for and there are scores to differentiate.
    let engine_mask = mask_grad.filter(|_| m.is_some() && plan.has_calls() && plan.s > 0);
    let mut dmask_buf = match engine_mask {
        Some(g) => zeroed::<f32>("the mask's gradient", product(&g.engine_shape))?,
        None => Vec::new(),
    };
    let dmask = engine_mask.map(|g| {
        let rank = r + 2;
        let mut dims = vec![1; rank - g.engine_shape.len()];
        dims.extend_from_slice(&g.engine_shape);
        let mut strides = vec![0usize; rank];
        let mut step = 1;
        for a in (0..rank).rev() {
            strides[a] = if dims[a] == 1 { 0 } else { step };
            step *= dims[a];
        }
        MaskGrad {
            buf: &mut dmask_buf,
            dims,
            strides,
        }
    });
    // SAFETY: the operands are the arrays the plan was made from (dO, O and the LSE checked
    // against its shapes), alive (borrowed) until we return.
    py.detach(|| unsafe {
        run_backward(plan, ops, up, strides, (&mut dq, &mut dk, &mut dv), dmask)
    })
    .map_err(to_py_err)?;
    let mut arrays = Vec::with_capacity(3);
    for a in [q, k, v] {
        arrays.push(T::zeros(py, &a.shape)?);
    }
    let dsts: Vec<SendPtr<T>> = arrays.iter().map(|(_, p)| *p).collect();
    let owns = [&q.shape, &k.shape, &v.shape];
    // The sums over broadcast axes read every gradient once: with the GIL released.
    py.detach(|| {
        for (((grad, shape), own), dst) in [&dq, &dk, &dv]
            .into_iter()
            .zip(&shapes)
            .zip(owns)
            .zip(&dsts)
        {
            // SAFETY: `dst` is our own compact result of the operand's shape, just allocated.
            unsafe { reduce_into::<T>(grad, shape, own, *dst) }?;
        }
        PyResult::Ok(())
    })?;
    let mut results = Vec::with_capacity(4);
    for (arr, _) in arrays {
        results.push(finish(arr, q.kind, T::DTYPE)?);
    }
    if let Some(g) = mask_grad {
        let computed = engine_mask.is_some().then_some(dmask_buf.as_slice());
        let out = match g.dtype {
            Float::F32 => mask_gradient::<f32>(py, computed, g, q.kind),
            Float::F16 => mask_gradient::<f16>(py, computed, g, q.kind),
            Float::Bf16 => mask_gradient::<bf16>(py, computed, g, q.kind),
        }?;
        results.push(out);
    }
    PyTuple::new(py, results)
}

/// What the gradient of the mask is returned as: the mask's shape and dtype as passed, and
/// the shape the engine reads it with (the mask broadcast along its key axis when constant
/// there, so that the engine has a per-key gradient to give).
pub(crate) struct MaskGradOut {
    shape: Vec<usize>,
    dtype: Float,
    engine_shape: Vec<usize>,
}

/// The mask's gradient as an array of its dtype and shape: `computed` (over
/// `engine_shape`) summed along the key axis where the mask was broadcast there, or 0
/// where nothing was computed (no scores).
fn mask_gradient<'py, M: Storage>(
    py: Python<'py>,
    computed: Option<&[f32]>,
    g: &MaskGradOut,
    kind: Kind,
) -> PyResult<Bound<'py, PyAny>> {
    check_returnable(kind, M::DTYPE)?;
    let (arr, dst) = M::zeros(py, &g.shape)?;
    if let Some(buf) = computed {
        // SAFETY: `dst` is our own compact array of the mask's shape, just allocated.
        py.detach(|| unsafe { reduce_into::<M>(buf, &g.engine_shape, &g.shape, dst) })?;
    }
    finish(arr, kind, M::DTYPE)
}

/// The gradients of a loss with respect to ``query``, ``key`` and ``value``, given the
/// upstream gradient ``grad_out`` (dO, shaped like the output) and what
/// ``attention_with_lse`` returned for the same operands and options: its output ``out``
/// and float32 ``lse``. Returns ``(dq, dk, dv)`` shaped and typed like the operands (a
/// broadcast operand's gradient is summed over the axes it was broadcast along; a kv head
/// shared by a group of query heads gets the sum over the group).
///
/// The mask arguments must be those of the forward call, and so must ``dropout_p`` and
/// ``seed`` (required with ``dropout_p > 0``: the backward pass regenerates the forward's
/// dropout mask from it). ``mask_grad=True`` (an additive float ``attn_mask``) returns the
/// mask's gradient too, ``(dq, dk, dv, dmask)``: ``dS``, the gradient of the scores the
/// softmax sees, summed over the axes along which the mask broadcasts, shaped and typed like
/// the mask as passed (each position of a broadcast view, stride 0, its own; a mask
/// constant along the key axis differentiated as broadcast to the keys and summed back; 0
/// at hidden entries), summed in a fixed order. A hidden key gets no gradient, and a row that sees no key gives ``dq = 0``
/// (never NaN). Gradients are accumulated in float32 and rounded once. The GIL is released
/// while attn computes.
#[pyfunction]
#[pyo3(signature = (grad_out, query, key, value, out, lse, attn_mask=None, is_causal=false, *, scale=None, enable_gqa=false, causal_alignment="top_left", dropout_p=0.0, seed=None, cu_seqlens_q=None, cu_seqlens_k=None, mask_grad=false))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward<'py>(
    grad_out: &Bound<'py, PyAny>,
    query: &Bound<'py, PyAny>,
    key: &Bound<'py, PyAny>,
    value: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    lse: &Bound<'py, PyAny>,
    attn_mask: Option<&Bound<'py, PyAny>>,
    is_causal: bool,
    scale: Option<f64>,
    enable_gqa: bool,
    causal_alignment: &str,
    dropout_p: f64,
    seed: Option<&Bound<'py, PyAny>>,
    cu_seqlens_q: Option<&Bound<'py, PyAny>>,
    cu_seqlens_k: Option<&Bound<'py, PyAny>>,
    mask_grad: bool,
) -> PyResult<Bound<'py, PyTuple>> {
    let py = query.py();
    crate::errors::torch_like(py, || {
        let f = flags(
            py,
            dropout_p,
            is_causal,
            attn_mask.is_some(),
            scale,
            enable_gqa,
            causal_alignment,
        )?;
        if dropout_p > 0.0 && seed.is_none() {
            return Err(PyValueError::new_err(format!(
                "attention_backward with dropout_p={dropout_p} needs seed=, the seed of the forward call (pass the same seed= to both)"
            )));
        }
        let f = f.seeded(query, seed)?;
        let (q, k, v, m) = read_operands(query, key, value, attn_mask)?;
        let go = Array::extract("grad_out", grad_out)?;
        let o = Array::extract("out", out)?;
        let ls = Array::extract("lse", lse)?;
        check_kinds(&q, &[&go, &o, &ls])?;
        check_same_dtype(&q, &k, &v, &[&go, &o])?;
        if ls.dtype != Dtype::F32 {
            return Err(PyTypeError::new_err(format!(
                "lse has dtype {}: it must be the float32 LSE that attention_with_lse returned",
                ls.dtype.name()
            )));
        }
        go.require_contiguous_rows()?;
        o.require_contiguous_rows()?;
        if let Some(seqs) = Seqlens::read(cu_seqlens_q, cu_seqlens_k)? {
            no_mask_when_packed(m.as_ref())?;
            let (go, o, ls) = (
                forward_strides(py, go)?,
                forward_strides(py, o)?,
                forward_strides(py, ls)?,
            );
            return crate::packed::backward(py, &go, &q, &k, &v, &o, &ls, &f, &seqs);
        }
        let passed = m.as_ref().map(|m| (m.shape.clone(), m.dtype.clone()));
        let (mut plan, mut m) = plan_call(py, (&q, &k, &v), m, f, Plan::has_calls)?;
        let mask_grad = if mask_grad {
            let grad = mask_gradient_of(passed, plan.s)?;
            if let Some(mm) = m.take() {
                m = Some(mask_for_gradient(py, mm, &grad)?);
                if let Some(mm) = &m {
                    plan.set_mask(mm)?;
                }
            }
            Some(grad)
        } else {
            None
        };
        let (out_shape, lse_shape) = (plan.out_shape(), plan.lse_shape());
        for (a, want) in [(&go, &out_shape), (&o, &out_shape), (&ls, &lse_shape)] {
            if &a.shape != want {
                return Err(PyValueError::new_err(format!(
                    "{} has shape {} but the attention output's is {}",
                    a.name,
                    a.shape_str(),
                    crate::array::shape_str(want)
                )));
            }
        }
        let (go, o, ls) = (
            forward_strides(py, go)?,
            forward_strides(py, o)?,
            forward_strides(py, ls)?,
        );
        match q.dtype {
            Dtype::F32 => backward_typed::<f32>(
                py,
                &plan,
                &q,
                &k,
                &v,
                &go,
                &o,
                &ls,
                m.as_ref(),
                mask_grad.as_ref(),
            ),
            Dtype::F16 => backward_typed::<f16>(
                py,
                &plan,
                &q,
                &k,
                &v,
                &go,
                &o,
                &ls,
                m.as_ref(),
                mask_grad.as_ref(),
            ),
            _ => backward_typed::<bf16>(
                py,
                &plan,
                &q,
                &k,
                &v,
                &go,
                &o,
                &ls,
                m.as_ref(),
                mask_grad.as_ref(),
            ),
        }
    })
}

/// What `mask_grad=True` returns, from the mask as passed (its shape and dtype): a float
/// mask is required (a boolean one has no gradient).
fn mask_gradient_of(passed: Option<(Vec<usize>, Dtype)>, s: usize) -> PyResult<MaskGradOut> {
    let Some((shape, dtype)) = passed else {
        return Err(PyValueError::new_err(
            "mask_grad=True without attn_mask: there is no mask to differentiate",
        ));
    };
    let Dtype::Float(dtype) = dtype else {
        return Err(PyValueError::new_err(format!(
            "mask_grad=True with a {} attn_mask: only an additive float mask has a gradient",
            dtype.name()
        )));
    };
    // A mask constant along the key axis (length 1 there, or 0-d) is differentiated as if
    // broadcast to the keys, its gradient summed back.
    let mut engine_shape = shape.clone();
    match engine_shape.last_mut() {
        None => engine_shape.push(s),
        Some(last) if *last == 1 => *last = s,
        Some(_) => {}
    }
    Ok(MaskGradOut {
        shape,
        dtype,
        engine_shape,
    })
}

/// The mask as the engine must read it for its gradient: every position its own (a copy
/// materialising the axes of stride 0, and the key axis when the mask is constant along
/// it), so that the engine's gradient, summed over the axes of length 1, is the gradient
/// of each position of the mask as passed.
fn mask_for_gradient<'py>(
    py: Python<'py>,
    m: Array<'py>,
    grad: &MaskGradOut,
) -> PyResult<Array<'py>> {
    let repeats = m
        .shape
        .iter()
        .zip(&m.strides)
        .any(|(&n, &st)| n > 1 && st == 0);
    if repeats || grad.engine_shape != m.shape {
        m.broadcast_f32(py, &grad.engine_shape)
    } else {
        Ok(m)
    }
}

// ---------------------------------------------------------------------------------------
// Dropout: probabilities, seeds, the keep mask.

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
    crate::errors::torch_like(py, || {
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
    })
}
