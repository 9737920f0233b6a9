//! Backward-pass inputs and calls: what the `backward` criterion bench and the report's
//! `--backward` cases time. The forward's output and LSE are computed once, when the
//! inputs are made; a backward call then takes them as a training step would.

use attn_core::{Error, Layout, Options, Tensor4, Tensor4Ref};
use attn_optimized::Element;
use half::{bf16, f16};

use crate::catalog::Dtype;
use crate::inputs::{Qkv, random_vec};

pub use crate::catalog::backward_flops;

/// One head set's operands, the upstream gradient and the forward's results, in `T`.
#[derive(Debug, Clone)]
pub struct Step<T> {
    x: Qkv<T>,
    d_out: Vec<T>,
    out: Tensor4<T>,
    lse: Vec<f32>,
}

impl<T: Element> Step<T> {
    fn new(x: Qkv<T>, d_out: Vec<T>, options: &Options<'_>) -> Result<Self, Error> {
        let (out, lse) = attn_optimized::Attention::batched(x.q(), x.k(), x.v(), options)
            .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
            .map(|f| f.into_parts())?;
        Ok(Self { x, d_out, out, lse })
    }

    fn d_out(&self) -> Tensor4Ref<'_, T> {
        Tensor4Ref::from_layout(&self.d_out, self.out.dims(), Layout::Bhsd)
            .expect("sized like the output")
    }

    /// The backward pass; the gradients are dropped.
    pub fn backward(&self, options: &Options<'_>) -> Result<(), Error> {
        self.backward_of(options, false)
    }

    /// The backward pass with the additive mask's gradient as well; the gradients are
    /// dropped.
    pub fn backward_with_bias(&self, options: &Options<'_>) -> Result<(), Error> {
        self.backward_of(options, true)
    }

    /// [`Step::backward_with_bias`] into caller buffers, `dbias` reused between calls (what a
    /// training loop does).
    pub fn backward_with_bias_into(
        &self,
        options: &Options<'_>,
        grads: [&mut [T]; 3],
        dbias: &mut [f32],
    ) -> Result<(), Error> {
        let x = &self.x;
        let call = attn_optimized::Attention::batched(x.q(), x.k(), x.v(), options)?;
        let [dq, dk, dv] = grads;
        fn view<T>(
            b: &mut [T],
            dims: [usize; 4],
        ) -> Result<attn_optimized::Tensor4Mut<'_, T>, Error> {
            attn_optimized::Tensor4Mut::from_layout(b, dims, Layout::Bhsd)
        }
        let g = attn_optimized::GradientsMut {
            dq: view(dq, x.q().dims())?,
            dk: view(dk, x.k().dims())?,
            dv: view(dv, x.v().dims())?,
        };
        call.backward_with_bias_into(
            attn_optimized::ForwardRef::batch(self.out.as_ref(), &self.lse)?,
            self.d_out(),
            g,
            dbias,
            attn_optimized::Par::rayon(0),
        )?;
        Ok(())
    }

    fn backward_of(&self, options: &Options<'_>, bias: bool) -> Result<(), Error> {
        let x = &self.x;
        let g =
            attn_optimized::Attention::batched(x.q(), x.k(), x.v(), options).and_then(|call| {
                let call = if bias {
                    call.with_bias_gradient()
                } else {
                    call
                };
                call.backward(
                    attn_optimized::ForwardRef::batch(self.out.as_ref(), &self.lse)?,
                    self.d_out(),
                    attn_optimized::Par::rayon(0),
                )
            })?;
        std::hint::black_box(g);
        Ok(())
    }

    /// The reference's backward pass (f64, `S`, `P`, `dP` and `dS` of every head
    /// materialised); the gradients are dropped. It checks `out` and the LSE like an
    /// engine but recomputes its own exact forward, so the optimized forward's results
    /// made with the inputs serve it as well.
    pub fn reference_backward(&self, options: &Options<'_>) -> Result<(), Error>
    where
        T: attn_reference::Element + Default,
    {
        let x = &self.x;
        let g =
            attn_reference::Attention::batched(x.q(), x.k(), x.v(), options).and_then(|call| {
                call.backward(
                    attn_reference::ForwardRef::batch(self.out.as_ref(), &self.lse)?,
                    self.d_out(),
                )
            })?;
        std::hint::black_box(g);
        Ok(())
    }

    /// The forward pass with its LSE, then the backward pass on its results: one
    /// training step of the attention.
    pub fn forward_backward(&self, options: &Options<'_>) -> Result<(), Error> {
        let x = &self.x;
        let (out, lse) = attn_optimized::Attention::batched(x.q(), x.k(), x.v(), options)
            .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
            .map(|f| f.into_parts())?;
        let g =
            attn_optimized::Attention::batched(x.q(), x.k(), x.v(), options).and_then(|call| {
                call.backward(
                    attn_optimized::ForwardRef::batch(out.as_ref(), &lse)?,
                    self.d_out(),
                    attn_optimized::Par::rayon(0),
                )
            })?;
        std::hint::black_box(g);
        Ok(())
    }
}

/// [`Step`] in the element type under test.
///
/// ```
/// use attn_benches::catalog::Dtype;
/// use attn_benches::training::Steps;
/// use attn_core::Options;
/// let s = Steps::random(Dtype::F16, 2, 16, 16, 8, 1, &Options::default()).unwrap();
/// assert!(s.backward(&Options::default()).is_ok());
/// assert!(s.reference_backward(&Options::default()).is_ok());
/// ```
#[derive(Debug, Clone)]
pub enum Steps {
    /// f32 storage.
    F32(Step<f32>),
    /// f16 storage.
    F16(Step<f16>),
    /// bf16 storage.
    Bf16(Step<bf16>),
}

impl Steps {
    /// Deterministic operands (batch 1, `[B,H,S,D]`), a random upstream gradient, and the
    /// optimized forward's output and LSE under `options`.
    pub fn random(
        dtype: Dtype,
        heads: usize,
        n_q: usize,
        n_k: usize,
        d: usize,
        seed: u64,
        options: &Options<'_>,
    ) -> Result<Self, Error> {
        Self::random_grouped(dtype, [heads, heads], n_q, n_k, d, seed, options)
    }

    /// [`Steps::random`] with `[heads, kv_heads]` query and K/V heads.
    pub fn random_grouped(
        dtype: Dtype,
        [heads, kv_heads]: [usize; 2],
        n_q: usize,
        n_k: usize,
        d: usize,
        seed: u64,
        options: &Options<'_>,
    ) -> Result<Self, Error> {
        let x = Qkv::random_grouped([heads, kv_heads], n_q, n_k, d, seed);
        let d_out = random_vec(heads * n_q * d, seed.wrapping_add(3));
        Ok(match dtype {
            Dtype::F32 => Steps::F32(Step::new(x, d_out, options)?),
            Dtype::F16 => Steps::F16(Step::new(
                x.map(f16::from_f32),
                d_out.into_iter().map(f16::from_f32).collect(),
                options,
            )?),
            Dtype::Bf16 => Steps::Bf16(Step::new(
                x.map(bf16::from_f32),
                d_out.into_iter().map(bf16::from_f32).collect(),
                options,
            )?),
        })
    }

    /// [`Step::backward`].
    pub fn backward(&self, options: &Options<'_>) -> Result<(), Error> {
        match self {
            Steps::F32(s) => s.backward(options),
            Steps::F16(s) => s.backward(options),
            Steps::Bf16(s) => s.backward(options),
        }
    }

    /// [`Step::backward_with_bias`].
    pub fn backward_with_bias(&self, options: &Options<'_>) -> Result<(), Error> {
        match self {
            Steps::F32(s) => s.backward_with_bias(options),
            Steps::F16(s) => s.backward_with_bias(options),
            Steps::Bf16(s) => s.backward_with_bias(options),
        }
    }

    /// [`Step::backward_with_bias_into`] of an f32 step (`Error::Unsupported` for a half
    /// one).
    pub fn backward_with_bias_into(
        &self,
        options: &Options<'_>,
        grads: [&mut [f32]; 3],
        dbias: &mut [f32],
    ) -> Result<(), Error> {
        match self {
            Steps::F32(s) => s.backward_with_bias_into(options, grads, dbias),
            _ => Err(Error::unsupported("bias gradient step", "f32 steps only")),
        }
    }

    /// [`Step::reference_backward`].
    pub fn reference_backward(&self, options: &Options<'_>) -> Result<(), Error> {
        match self {
            Steps::F32(s) => s.reference_backward(options),
            Steps::F16(s) => s.reference_backward(options),
            Steps::Bf16(s) => s.reference_backward(options),
        }
    }

    /// [`Step::forward_backward`].
    pub fn forward_backward(&self, options: &Options<'_>) -> Result<(), Error> {
        match self {
            Steps::F32(s) => s.forward_backward(options),
            Steps::F16(s) => s.forward_backward(options),
            Steps::Bf16(s) => s.forward_backward(options),
        }
    }
}
