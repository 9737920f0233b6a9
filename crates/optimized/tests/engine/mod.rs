//! The streaming engine as an [`attn_oracle::Engine`], for each storage type: what the
//! oracle's suite (`tests/conformance.rs`) and the layer test (`tests/multi_head_layer.rs`)
//! check; and the conversions between the oracle's f32 operands and the engine's storage
//! type, which the robustness suite (`tests/robustness.rs`) shares.

// Each test binary that includes this module uses a part of it.
#![allow(dead_code)]

use core::marker::PhantomData;
use core::ops::Range;

use attn_core::{Dtype, Forward, Options, PagedKv, Result, Tensor4, Tensor4Ref, validate_head};
use attn_optimized::{
    Attention, Batch, Element, ForwardRef, GradientsMut, KEY_TILE, OneHead, PagedKvCache, Par,
    PartialState, QUERY_TILE, SPLIT_KEYS, SeqId, SplitKv, TilePlan,
};
use attn_oracle::{
    BatchGradients, CacheShape, Call, Compute, Engine, ErrorModel, Gradients, Grads, KeySplit,
    MergePlan, Operands, Output, PagedCache, Saved, View,
};
use faer::{Mat, MatRef};

/// `attn-optimized` with storage type `T` (`f32`, `half::f16` or `half::bf16`): inputs
/// are converted to `T` (exactly: the oracle has already rounded them), outputs widened
/// back to f32.
#[derive(Debug, Clone, Copy, Default)]
pub struct OptimizedEngine<T = f32>(PhantomData<T>);

impl<T> OptimizedEngine<T> {
    /// The engine for storage type `T`.
    pub fn new() -> Self {
        OptimizedEngine(PhantomData)
    }
}

/// The streaming engine's error model for inputs of type `input` and output type
/// `output`: bf16 inputs at native precision round P to bf16 on AVX512_BF16; f16 inputs
/// are split in two bf16 parts on AMX.
pub fn model(input: Dtype, output: Dtype) -> ErrorModel {
    use attn_optimized::Isa;
    let native = input == Dtype::Bf16 && Isa::current().includes(Isa::Avx512Bf16);
    let weights = native.then_some(Dtype::Bf16);
    let split_operands = input == Dtype::F16 && Isa::current() == Isa::Amx;
    ErrorModel {
        // The exp2 polynomial: within 3u, counted as 2 ulp = 4u (attn_optimized::exp).
        compute: Compute::F32 {
            exp_ulps: 2.0,
            split_keys: Some(SPLIT_KEYS),
            weights,
            split_operands,
        },
        output,
    }
}

/// The lengths around which the streaming engine changes behaviour: row kernels up to 4
/// queries, 8-row and 16-key tile granularity, 64-key row blocks, the query and key
/// tiles, and the split-KV chunk.
pub fn tiles() -> Vec<usize> {
    vec![4, 8, 16, 64, QUERY_TILE, KEY_TILE, SPLIT_KEYS]
}

/// `m` in `T`.
pub fn narrow<T: Element>(m: MatRef<'_, f32>) -> Mat<T> {
    Mat::from_fn(m.nrows(), m.ncols(), |i, j| T::from_f32(m[(i, j)]))
}

/// `m` widened to f32.
pub fn widen<T: Element>(m: MatRef<'_, T>) -> Mat<f32> {
    Mat::from_fn(m.nrows(), m.ncols(), |i, j| m[(i, j)].to_f32())
}

/// `t` widened to f32.
pub fn widen_tensor<T: Element>(t: Tensor4<T>) -> Result<Tensor4<f32>> {
    let dims = t.dims();
    Tensor4::from_vec(t.into_vec().into_iter().map(T::to_f32).collect(), dims)
}

/// The same dims and strides as `t`, in `T`; elements outside the view are NaN.
pub fn narrow_tensor<T: Element>(t: Tensor4Ref<'_, f32>) -> Result<Vec<T>> {
    let (dims, s) = (t.dims(), t.strides());
    let [b, h, n, d] = dims;
    let len = if dims.contains(&0) {
        0
    } else {
        (b - 1) * s[0] + (h - 1) * s[1] + (n - 1) * s[2] + d
    };
    let mut data = vec![T::from_f32(f32::NAN); len];
    for bi in 0..b {
        for hi in 0..h {
            let m = t.head(bi, hi)?;
            for i in 0..n {
                for c in 0..d {
                    data[bi * s[0] + hi * s[1] + i * s[2] + c] = T::from_f32(m[(i, c)]);
                }
            }
        }
    }
    Ok(data)
}

/// A view of `data` (built by [`narrow_tensor`] from `like`) with `like`'s dims and strides.
fn view<'a, T>(data: &'a [T], like: Tensor4Ref<'_, f32>) -> Result<Tensor4Ref<'a, T>> {
    Tensor4Ref::new(data, like.dims(), like.strides())
}

/// A head call's operands in `T`.
struct HeadIn<T> {
    q: Mat<T>,
    k: Mat<T>,
    v: Mat<T>,
}

impl<T: Element> HeadIn<T> {
    fn new(q: MatRef<'_, f32>, k: MatRef<'_, f32>, v: MatRef<'_, f32>) -> Self {
        Self {
            q: narrow(q),
            k: narrow(k),
            v: narrow(v),
        }
    }
}

/// A batched or packed call's operands in `T`, with the f32 views they came from.
struct BatchIn<'a, T> {
    data: [Vec<T>; 3],
    like: [Tensor4Ref<'a, f32>; 3],
}

impl<'a, T: Element> BatchIn<'a, T> {
    fn new(q: Tensor4Ref<'a, f32>, k: Tensor4Ref<'a, f32>, v: Tensor4Ref<'a, f32>) -> Result<Self> {
        let [qd, kd, vd] = [q, k, v].map(narrow_tensor::<T>);
        Ok(Self {
            data: [qd?, kd?, vd?],
            like: [q, k, v],
        })
    }

    fn views(&self) -> Result<[Tensor4Ref<'_, T>; 3]> {
        let [q, k, v] = &self.data;
        Ok([
            view(q, self.like[0])?,
            view(k, self.like[1])?,
            view(v, self.like[2])?,
        ])
    }
}

impl<T: Element> OptimizedEngine<T> {
    fn head_forward(
        &self,
        call: &Call<'_>,
        q: MatRef<'_, f32>,
        k: MatRef<'_, f32>,
        v: MatRef<'_, f32>,
    ) -> Result<Output> {
        let options = &call.options;
        if let Some(plan) = call.plan {
            return self.split(q, k, v, options, plan);
        }
        let x = HeadIn::<T>::new(q, k, v);
        let (o, lse) = Attention::head(x.q.as_ref(), x.k.as_ref(), x.v.as_ref(), options)
            .and_then(|call| call.forward(Par::rayon(0)))?
            .into_parts();
        Forward::head(widen(o.as_ref()), lse).map(Output::Head)
    }

    fn split(
        &self,
        q: MatRef<'_, f32>,
        k: MatRef<'_, f32>,
        v: MatRef<'_, f32>,
        options: &attn_core::Options<'_>,
        plan: &MergePlan,
    ) -> Result<Output> {
        let shape = validate_head(q, k, v, options)?;
        let x = HeadIn::<T>::new(q, k, v);
        let state = plan.fold(
            &mut |r: Range<usize>| {
                Attention::keys_of(
                    x.q.as_ref(),
                    x.k.as_ref().subrows(r.start, r.len()),
                    x.v.as_ref().subrows(r.start, r.len()),
                    r,
                    shape.n_k,
                    options,
                )
                .and_then(|call| call.partial_state(Par::rayon(0)))
            },
            &mut || PartialState::empty(shape.n_q, shape.d_v),
            &mut |a: PartialState, b: PartialState| {
                a.merge(&b)
                    .expect("states of the same head have the same shape")
            },
        )?;
        let (o, lse) = state.into_parts();
        Forward::head(o, lse).map(Output::Head)
    }
}

/// The engine's key split for the oracle's.
fn split_kv(split: KeySplit) -> SplitKv {
    match split {
        KeySplit::Auto => SplitKv::Auto,
        KeySplit::Never => SplitKv::Never,
    }
}

/// The engine's call over a batch or packed batch's operands in `U`.
fn batch_call<'c, U: Element>(
    call: &Call<'c>,
    [q, k, v]: [Tensor4Ref<'c, U>; 3],
) -> Result<Attention<'c, U, Batch>> {
    let c = match call.operands {
        Operands::Packed(_, seqs) => Attention::packed(q, k, v, &seqs, &call.options),
        _ => Attention::batched(q, k, v, &call.options),
    };
    c.map(|c| {
        let c = c.split_kv(split_kv(call.split));
        if call.bias_gradient {
            c.with_bias_gradient()
        } else {
            c
        }
    })
}

/// The engine's paged call over operands in `U`, widened.
fn paged_run<U: Element>(
    call: &Call<'_>,
    q: Tensor4Ref<'_, U>,
    cu_q: &[usize],
    kv: PagedKv<'_, U>,
) -> Result<Output> {
    let (o, lse) = Attention::paged(q, cu_q, kv, &call.options)?
        .split_kv(split_kv(call.split))
        .forward(Par::rayon(0))?
        .into_parts();
    Forward::batch(widen_tensor(o)?, lse).map(Output::Batch)
}

/// A paged call: f32 operands as they are (the pools, their NaN, the whole block table);
/// otherwise the queries and pools in `T` (the same strides, NaN where the f32 pools hold
/// NaN) with a block table rebuilt from each sequence's pages.
fn paged_forward<T: Element>(
    call: &Call<'_>,
    q: Tensor4Ref<'_, f32>,
    cu_q: &[usize],
    kv: PagedKv<'_, f32>,
) -> Result<Output> {
    if T::DTYPE == Dtype::F32 {
        return paged_run::<f32>(call, q, cu_q, kv);
    }
    let [qd, kd, vd] = [q, kv.keys(), kv.values()].map(narrow_tensor::<T>);
    let (qd, kd, vd) = (qd?, kd?, vd?);
    let widest = (0..kv.batch())
        .map(|s| kv.pages(s).len())
        .max()
        .unwrap_or(0);
    let mut table = vec![0u32; kv.batch() * widest];
    for s in 0..kv.batch() {
        let pages = kv.pages(s);
        table[s * widest..s * widest + pages.len()].copy_from_slice(pages);
    }
    let pools = (view(&kd, kv.keys())?, view(&vd, kv.values())?);
    let kv_t = PagedKv::new(pools.0, pools.1, &table, kv.lens())?;
    paged_run::<T>(call, view(&qd, q)?, cu_q, kv_t)
}

/// `attn_optimized::PagedKvCache` as the oracle's [`PagedCache`]: the oracle's handles are
/// indices into `ids`; operands narrowed to `T`, results widened.
struct Cache<T> {
    cache: PagedKvCache<T>,
    ids: Vec<SeqId>,
}

impl<T> Cache<T> {
    fn id(&self, seq: usize) -> Result<SeqId> {
        self.ids
            .get(seq)
            .copied()
            .ok_or(attn_core::Error::out_of_range(
                "sequence handle",
                seq,
                self.ids.len(),
            ))
    }

    fn handle(&mut self, id: SeqId) -> usize {
        self.ids.push(id);
        self.ids.len() - 1
    }
}

impl<T: Element> PagedCache for Cache<T> {
    fn add_sequence(&mut self) -> Result<usize> {
        let id = self.cache.add_sequence()?;
        Ok(self.handle(id))
    }

    fn append(&mut self, seq: usize, k: Tensor4Ref<'_, f32>, v: Tensor4Ref<'_, f32>) -> Result<()> {
        let id = self.id(seq)?;
        let (kd, vd) = (narrow_tensor::<T>(k)?, narrow_tensor::<T>(v)?);
        self.cache.append(id, view(&kd, k)?, view(&vd, v)?)
    }

    fn fork(&mut self, seq: usize) -> Result<usize> {
        let id = self.cache.fork(self.id(seq)?)?;
        Ok(self.handle(id))
    }

    fn free(&mut self, seq: usize) -> Result<()> {
        self.cache.free(self.id(seq)?)
    }

    fn len(&self, seq: usize) -> Result<usize> {
        self.cache.len(self.id(seq)?)
    }

    fn pages_of(&self, seq: usize) -> Result<Vec<u32>> {
        self.cache.pages_of(self.id(seq)?).map(<[u32]>::to_vec)
    }

    fn free_pages(&self) -> usize {
        self.cache.free_pages()
    }

    fn attention(
        &self,
        seqs: &[usize],
        q: Tensor4Ref<'_, f32>,
        cu_seqlens_q: &[usize],
        options: &Options<'_>,
    ) -> Result<(Tensor4<f32>, Vec<f32>)> {
        let ids = seqs
            .iter()
            .map(|&s| self.id(s))
            .collect::<Result<Vec<_>>>()?;
        let qd = narrow_tensor::<T>(q)?;
        let batch = self.cache.batch(&ids)?;
        let (o, lse) = batch
            .attention(view(&qd, q)?, cu_seqlens_q, options)?
            .forward(Par::rayon(0))?
            .into_parts();
        Ok((widen_tensor(o)?, lse))
    }
}

/// The forward pass of a batch or packed batch over its operands in `U`, widened.
fn batch_forward<U: Element>(call: &Call<'_>, qkv: [Tensor4Ref<'_, U>; 3]) -> Result<Output> {
    let (o, lse) = batch_call(call, qkv)
        .and_then(|c| c.forward(Par::rayon(0)))?
        .into_parts();
    Forward::batch(widen_tensor(o)?, lse).map(Output::Batch)
}

impl<T: Element> Engine for OptimizedEngine<T> {
    fn name(&self) -> String {
        format!("optimized-{}", T::NAME)
    }

    fn storage(&self) -> Dtype {
        T::DTYPE
    }

    fn error_model(&self) -> ErrorModel {
        model(T::DTYPE, T::DTYPE)
    }

    fn tile_lengths(&self) -> Vec<usize> {
        tiles()
    }

    // The built-in soft-cap is `SoftCap::apply_f32` on the same scores a user's ScoreMod sees.
    fn user_score_mod_bits_match_builtins(&self) -> bool {
        true
    }

    // Only GEMM tiles compute a causal block as a user's mask does: a row tile (at most 4
    // queries, `DECODE_ROWS`) trims the diagonal's key block at the last visible key.
    fn user_mask_mod_bits_match_structural(&self, n_q: usize, n_k: usize) -> bool {
        let br = TilePlan::for_shape(n_q, n_k).br;
        n_q == 0 || n_q - (n_q.div_ceil(br) - 1) * br > 4
    }

    fn forward(&self, call: &Call<'_>) -> Option<Result<Output>> {
        Some(match call.operands {
            Operands::Head([q, k, v]) if T::DTYPE == Dtype::F32 && call.plan.is_none() => {
                // f32 operands run as they are, without a copy.
                Attention::<f32, OneHead>::head(q, k, v, &call.options)
                    .and_then(|c| c.forward(Par::rayon(0)))
                    .map(Output::Head)
            }
            Operands::Head([q, k, v]) => self.head_forward(call, q, k, v),
            Operands::Batched(qkv) if T::DTYPE == Dtype::F32 => batch_forward(call, qkv),
            Operands::Batched([q, k, v]) | Operands::Packed([q, k, v], _) => {
                BatchIn::<T>::new(q, k, v).and_then(|x| batch_forward(call, x.views()?))
            }
            Operands::Paged(q, cu_q, kv) => paged_forward::<T>(call, q, cu_q, kv),
        })
    }

    // The in-place row kernels take a run of rows (pages that follow each other in the
    // pool) by groups of 8 keys and sum every key's products by the same tree, a run's
    // last few keys too: where the pages lie (and so where runs are cut) changes no bit.
    fn paged_bits_ignore_placement(&self, _page_size: usize, _options: &Options<'_>) -> bool {
        true
    }

    // Besides the pages' places (a packed batch is one run), a decoding sequence's query
    // heads of a grouped-query group are stacked into one job, which the packed call does
    // not do: the jobs then differ in number, and with them the automatic key split. With
    // the keys whole, a stack of a few heads (the rows of a row tile) computes each row as
    // the packed call's own row tile does; a group of 16 heads or more (`GEMM_GROUP`) is
    // multiplied as a GEMM tile, other products than the row kernels'.
    fn paged_bits_match_packed(&self, call: &Call<'_>) -> bool {
        let Operands::Paged(q, cu_q, kv) = call.operands else {
            return false;
        };
        if !self.paged_bits_ignore_placement(kv.page_size(), &call.options) {
            return false;
        }
        let group = q.dims()[1] / kv.kv_heads().max(1);
        if group == 1 || !cu_q.windows(2).any(|w| w[1] - w[0] == 1) {
            return true;
        }
        call.split == KeySplit::Never && group < 16
    }

    fn paged_cache(&self, shape: CacheShape) -> Option<Result<Box<dyn PagedCache>>> {
        let (pages, ps, h, d_k, d_v) = (
            shape.pages,
            shape.page_size,
            shape.kv_heads,
            shape.d_k,
            shape.d_v,
        );
        let c = match shape.format {
            Some(format) => PagedKvCache::<T>::quantized(pages, ps, h, d_k, d_v, format),
            None => PagedKvCache::<T>::new(pages, ps, h, d_k, d_v),
        };
        Some(c.map(|cache| {
            Box::new(Cache {
                cache,
                ids: Vec::new(),
            }) as Box<dyn PagedCache>
        }))
    }

    fn backward(&self, d_out: View<'_>, call: &Call<'_>, fwd: Saved<'_>) -> Option<Result<Grads>> {
        let options = &call.options;
        let lse = fwd.lse;
        let run = || -> Result<Grads> {
            match (call.operands, d_out, fwd.output) {
                (Operands::Head([q, k, v]), View::Head(grad_out), View::Head(out)) => {
                    // Operands in T; the gradients are written in f32 by the `_into` form
                    // (T's own rounding is checked by the engine's tests: half gradients
                    // are the f32 ones rounded once).
                    let x = HeadIn::<T>::new(q, k, v);
                    let (dot, ot) = (narrow::<T>(grad_out), narrow::<T>(out));
                    let mut dq = Mat::<f32>::zeros(q.nrows(), q.ncols());
                    let mut dk = Mat::<f32>::zeros(k.nrows(), k.ncols());
                    let mut dv = Mat::<f32>::zeros(v.nrows(), v.ncols());
                    Attention::head(x.q.as_ref(), x.k.as_ref(), x.v.as_ref(), options).and_then(
                        |c| {
                            c.backward_into(
                                ForwardRef::head(ot.as_ref(), lse),
                                dot.as_ref(),
                                GradientsMut {
                                    dq: dq.as_mut(),
                                    dk: dk.as_mut(),
                                    dv: dv.as_mut(),
                                },
                                Par::rayon(0),
                            )
                        },
                    )?;
                    Ok(Grads::Head(Gradients::new(dq, dk, dv)))
                }
                (
                    Operands::Batched([q, k, v]) | Operands::Packed([q, k, v], _),
                    View::Batch(grad_out),
                    View::Batch(out),
                ) => {
                    let x = BatchIn::<T>::new(q, k, v)?;
                    let [dod, od] = [grad_out, out].map(narrow_tensor::<T>);
                    let (dod, od) = (dod?, od?);
                    let g = batch_call(call, x.views()?).and_then(|c| {
                        c.backward(
                            ForwardRef::batch(view(&od, out)?, lse)?,
                            view(&dod, grad_out)?,
                            Par::rayon(0),
                        )
                    })?;
                    Ok(Grads::Batch(
                        BatchGradients::new(
                            widen_tensor(g.dq)?,
                            widen_tensor(g.dk)?,
                            widen_tensor(g.dv)?,
                        )
                        .with_dbias(g.dbias),
                    ))
                }
                _ => Err(attn_core::Error::unsupported(
                    "engine call",
                    "a gradient and output of another kind than the operands",
                )),
            }
        };
        Some(run())
    }
}
