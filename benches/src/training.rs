//! Backward-pass inputs and calls: what the `backward` criterion bench and the report's
//! `--backward` cases time. The forward's output and LSE are computed once, when the
//! inputs are made; a backward call then takes them as a training step would.

use attn_core::{Error, Layout, Options, Tensor4, Tensor4Ref};
use attn_optimized::Element;
use half::{bf16, f16};

use crate::catalog::Dtype;
use crate::inputs::{Qkv, random_vec};

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
        let (out, lse) = attn_optimized::attention_batched_with_lse(x.q(), x.k(), x.v(), options)?;
        Ok(Self { x, d_out, out, lse })
    }

    fn d_out(&self) -> Tensor4Ref<'_, T> {
        Tensor4Ref::from_layout(&self.d_out, self.out.dims(), Layout::Bhsd)
            .expect("sized like the output")
    }

    /// The backward pass; the gradients are dropped.
    pub fn backward(&self, options: &Options<'_>) -> Result<(), Error> {
        let x = &self.x;
        let g = attn_optimized::attention_backward_batched(
            self.d_out(),
            x.q(),
            x.k(),
            x.v(),
            self.out.as_ref(),
            &self.lse,
            options,
        )?;
        std::hint::black_box(g);
        Ok(())
    }

    /// The forward pass with its LSE, then the backward pass on its results: one
    /// training step of the attention.
    pub fn forward_backward(&self, options: &Options<'_>) -> Result<(), Error> {
        let x = &self.x;
        let (out, lse) = attn_optimized::attention_batched_with_lse(x.q(), x.k(), x.v(), options)?;
        let g = attn_optimized::attention_backward_batched(
            self.d_out(),
            x.q(),
            x.k(),
            x.v(),
            out.as_ref(),
            &lse,
            options,
        )?;
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
        let x = Qkv::random(heads, n_q, n_k, d, seed);
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

    /// [`Step::forward_backward`].
    pub fn forward_backward(&self, options: &Options<'_>) -> Result<(), Error> {
        match self {
            Steps::F32(s) => s.forward_backward(options),
            Steps::F16(s) => s.forward_backward(options),
            Steps::Bf16(s) => s.forward_backward(options),
        }
    }
}

/// Floating-point operations of the backward pass of `heads` heads (`d_k = d_v = d`): the
/// recompute of S, then dV, dP, dQ and dK, `2·(3·d_k + 2·d_v)` per visible (query, key)
/// pair, 2.5 times the forward's [`crate::catalog::attention_flops`].
///
/// ```
/// use attn_benches::training::backward_flops;
/// assert_eq!(backward_flops(1, 2, 2, 4, false), 4.0 * 2.0 * 5.0 * 4.0);
/// ```
pub fn backward_flops(heads: usize, n_q: usize, n_k: usize, d: usize, causal: bool) -> f64 {
    crate::catalog::attention_flops(heads, n_q, n_k, d, causal) * 2.5
}
