//! Batched, grouped-query hostile problems.

use super::*;

/// How a batched operand is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorView {
    /// Contiguous `[B,H,S,D]`.
    Bhsd,
    /// Contiguous `[B,S,H,D]`.
    Bshd,
    /// `[B,S,H,D]` with NaN gaps after every row and batch entry.
    Padded,
    /// Zero batch and head strides: every (batch, head) is the same matrix (and a zero
    /// sequence stride too when its rows are equal).
    Broadcast,
}

/// A batched operand, owned: its buffer (f32, already rounded to the storage type) and how
/// to view it.
#[derive(Debug, Clone, PartialEq)]
pub struct HostileTensor {
    /// The buffer (gaps hold NaN).
    pub data: Vec<f32>,
    /// `[batch, heads, seq, dim]`.
    pub dims: [usize; 4],
    /// Element strides of batch, head, seq.
    pub strides: [usize; 3],
}

impl HostileTensor {
    /// A tensor whose (batch, head) matrix is `head(b, h)`; with [`TensorView::Broadcast`]
    /// only `head(0, 0)` is stored.
    pub fn new(
        view: TensorView,
        dims: [usize; 4],
        mut head: impl FnMut(usize, usize) -> Mat<f32>,
    ) -> Self {
        let [b, h, s, d] = dims;
        if dims.contains(&0) {
            return Self {
                data: Vec::new(),
                dims,
                strides: attn_core::Layout::Bhsd.strides(dims),
            };
        }
        let strides = match view {
            TensorView::Bhsd => attn_core::Layout::Bhsd.strides(dims),
            TensorView::Bshd => attn_core::Layout::Bshd.strides(dims),
            TensorView::Padded => [s * h * (d + 3) + 5, d + 3, h * (d + 3)],
            TensorView::Broadcast => {
                let m = head(0, 0);
                let same = rows_equal(m.as_ref());
                let rows = if same { 1 } else { s };
                let data = (0..rows)
                    .flat_map(|i| (0..d).map(move |c| (i, c)))
                    .map(|(i, c)| m[(i, c)])
                    .collect();
                return Self {
                    data,
                    dims,
                    strides: [0, 0, if same { 0 } else { d }],
                };
            }
        };
        let len = (b - 1) * strides[0] + (h - 1) * strides[1] + (s - 1) * strides[2] + d;
        let mut data = vec![f32::NAN; len];
        for bi in 0..b {
            for hi in 0..h {
                let m = head(bi, hi);
                for si in 0..s {
                    for di in 0..d {
                        data[bi * strides[0] + hi * strides[1] + si * strides[2] + di] =
                            m[(si, di)];
                    }
                }
            }
        }
        Self {
            data,
            dims,
            strides,
        }
    }

    /// The view.
    pub fn view(&self) -> Tensor4Ref<'_, f32> {
        Tensor4Ref::new(&self.data, self.dims, self.strides).expect("built to fit")
    }

    /// The buffer converted to a storage type (same dims and strides).
    pub fn convert<T>(&self, convert: impl Fn(f32) -> T) -> Vec<T> {
        self.data.iter().map(|&x| convert(x)).collect()
    }
}

/// A defect of a batched call's operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BatchDefect {
    /// K and V have one batch entry more than Q.
    KvBatch,
    /// V has one head more than K.
    VHeads,
    /// `h_q` is not a multiple of `h_kv` (one query head more).
    Grouping,
    /// One per-batch key length too many.
    LensCount,
}

/// A batched, grouped-query hostile problem.
#[derive(Debug, Clone, PartialEq)]
pub struct HostileBatch {
    /// Batch entries.
    pub batch: usize,
    /// Key/value heads.
    pub h_kv: usize,
    /// Query heads per kv head.
    pub group: usize,
    /// Per-head shape, values, options and plants (its key length applies to every entry
    /// unless `key_lens` is set).
    pub head: HostileHead,
    /// Layouts of Q, K, V.
    pub layouts: [TensorView; 3],
    /// Per-batch key lengths.
    pub key_lens: Option<Vec<KeyLen>>,
    /// A defect, if any.
    pub defect: Option<BatchDefect>,
}

/// The inputs of a [`HostileBatch`].
#[derive(Debug, Clone, PartialEq)]
pub struct HostileBatchInputs {
    /// `[batch, h_q, n_q, d_k]`.
    pub q: HostileTensor,
    /// `[batch, h_kv, n_k, d_k]`.
    pub k: HostileTensor,
    /// `[batch, h_kv, n_k, d_v]`.
    pub v: HostileTensor,
    /// The masks and scalar options (its `q`, `k`, `v` are head (0, 0)'s).
    pub head: HostileInputs,
    /// Per-batch key lengths.
    pub key_lens: Option<Vec<usize>>,
}

impl HostileBatchInputs {
    /// The options of the call.
    pub fn options(&self) -> Options<'_> {
        let h = &self.head;
        let padding = match &self.key_lens {
            Some(ls) => Some(KeyPadding::PerBatch(ls.as_slice())),
            None => h.key_len.map(KeyPadding::Uniform),
        };
        options_of(
            h.scale,
            h.causal,
            h.window,
            padding,
            h.bool_mask.as_ref(),
            h.additive.as_ref(),
        )
    }
}

impl HostileBatch {
    /// Builds the inputs: head `(b, h)` of Q and `(b, kv)` of K/V are built from the head
    /// recipe with their own seeds (the same for every head under a broadcast layout), and
    /// the head recipe's plants are applied to each.
    pub fn build(&self) -> HostileBatchInputs {
        let h = &self.head;
        let base = h.build();
        let h_q = self.h_kv * self.group + usize::from(self.defect == Some(BatchDefect::Grouping));
        let kv_batch = self.batch + usize::from(self.defect == Some(BatchDefect::KvBatch));
        let v_heads = self.h_kv + usize::from(self.defect == Some(BatchDefect::VHeads));
        let head_of = |layout: TensorView, b: usize, hh: usize| -> HostileInputs {
            let (b, hh) = if layout == TensorView::Broadcast {
                (0, 0)
            } else {
                (b, hh)
            };
            let mut r = h.clone();
            r.seed = h.seed ^ ((b as u64) << 32 | hh as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            r.build()
        };
        let q = HostileTensor::new(self.layouts[0], [self.batch, h_q, h.n_q, h.d_k], |b, hh| {
            head_of(self.layouts[0], b, hh).q
        });
        let k = HostileTensor::new(
            self.layouts[1],
            [kv_batch, self.h_kv, h.n_k, h.d_k],
            |b, hh| head_of(self.layouts[1], b, hh).k,
        );
        let v = HostileTensor::new(
            self.layouts[2],
            [kv_batch, v_heads, h.n_k, h.d_v],
            |b, hh| head_of(self.layouts[2], b, hh).v,
        );
        let mut key_lens: Option<Vec<usize>> = self
            .key_lens
            .as_ref()
            .map(|ls| ls.iter().map(|l| l.resolve(h.n_k)).collect());
        if self.defect == Some(BatchDefect::LensCount) {
            key_lens
                .get_or_insert_with(|| vec![h.n_k; self.batch])
                .push(h.n_k);
        }
        HostileBatchInputs {
            q,
            k,
            v,
            head: base,
            key_lens,
        }
    }
}

/// The generator of batched hostile cases for `profile` (the head part as
/// [`hostile_head`], shorter).
pub fn hostile_batch(profile: Profile, tiles: &[usize]) -> BoxedStrategy<HostileBatch> {
    let layout = || {
        select(vec![
            TensorView::Bhsd,
            TensorView::Bshd,
            TensorView::Padded,
            TensorView::Broadcast,
        ])
    };
    let defects = profile == Profile::Anything;
    (
        0..=3usize,
        prop_oneof![6 => 1..=2usize, 1 => Just(0usize)],
        1..=3usize,
        hostile_head(profile, tiles).prop_map(|mut h| {
            h.n_q = h.n_q.min(65);
            h.n_k = h.n_k.min(129);
            h
        }),
        [layout(), layout(), layout()],
        proptest::option::weighted(
            0.35,
            proptest::collection::vec(
                prop_oneof![
                    6 => (0u16..=1000).prop_map(KeyLen::Permille),
                    1 => any::<u8>().prop_map(KeyLen::Beyond),
                ],
                3,
            ),
        ),
        if defects {
            proptest::option::weighted(
                0.3,
                select(vec![
                    BatchDefect::KvBatch,
                    BatchDefect::VHeads,
                    BatchDefect::Grouping,
                    BatchDefect::LensCount,
                ]),
            )
            .boxed()
        } else {
            Just(None).boxed()
        },
    )
        .prop_map(move |(batch, h_kv, group, head, layouts, lens, defect)| {
            let invalid_lens = defects || profile == Profile::Windows;
            HostileBatch {
                batch,
                h_kv,
                group,
                head,
                layouts,
                key_lens: lens.map(|mut l| {
                    l.truncate(batch);
                    if !invalid_lens {
                        for x in &mut l {
                            if let KeyLen::Beyond(_) = x {
                                *x = KeyLen::Permille(1000);
                            }
                        }
                    }
                    l
                }),
                defect,
            }
        })
        .boxed()
}

/// What a batched call must do: the errors it must fail with, or the checks of each head.
#[derive(Debug, Clone)]
pub enum BatchExpected {
    /// Fail with an error that one of these recognises.
    Reject(Vec<Rejection>),
    /// Succeed with `[batch, h_q, n_q, d_v]` (each head checked by [`check_batched`]); an
    /// error is accepted only if one of `may_reject` recognises it.
    Accept {
        /// `[batch, h_q, n_q, d_v]`.
        dims: [usize; 4],
        /// Errors accepted instead.
        may_reject: Vec<Rejection>,
    },
    /// A valid problem larger than [`MAX_WORK`]: not to be run.
    TooMuchWork,
}

/// Validates a batched call by the contract's rules (the oracle's own): `q : [batch, h_q,
/// n_q, d_k]`, `k : [batch, h_kv, n_k, d_k]`, `v : [batch, h_kv, n_k, d_v]`, for an entry
/// point that allocates `outputs`.
pub fn expect_batched(
    q: [usize; 4],
    k: [usize; 4],
    v: [usize; 4],
    options: &Options<'_>,
    outputs: Outputs,
) -> BatchExpected {
    let ([b, h_q, n_q, d_k], [bk, h_kv, n_k, dk], [bv, hv, nv, d_v]) = (q, k, v);
    let mut reject = Vec::new();
    let mut may_reject = Vec::new();
    if bk != b {
        reject.push(Rejection::named("batch must match", &["K"]));
    }
    if bv != b {
        reject.push(Rejection::named("batch must match", &["V"]));
    }
    if hv != h_kv {
        reject.push(Rejection::named("K and V share their heads", &["V", "K"]));
    }
    shape_rejections([n_q, d_k], [n_k, dk], [nv, d_v], &mut reject);
    if (h_kv == 0 && h_q != 0) || (h_kv != 0 && !h_q.is_multiple_of(h_kv)) {
        reject.push(Rejection::named(
            "h_q is a multiple of h_kv",
            &["heads", "head", "K/V"],
        ));
    }
    option_rejections(options, b, n_q, n_k, &mut reject, &mut may_reject);
    let rows = product(&[b, h_q, n_q]);
    let elems = product(&[b, h_q, n_q, d_v]);
    if outputs.output && elems.is_none_or(|e| e >= UNALLOCATABLE) {
        reject.push(Rejection::allocation(&["output", "tensor"]));
    }
    if outputs.lse && rows.is_none_or(|r| r >= UNALLOCATABLE) {
        reject.push(Rejection::allocation(&["LSE", "output"]));
    }
    let Some(rows) = rows else {
        reject.push(Rejection::allocation(&["output", "LSE", "rows"]));
        return BatchExpected::Reject(reject);
    };
    if !reject.is_empty() {
        return BatchExpected::Reject(reject);
    }
    if rows > 0 && work(rows, n_k, d_k, d_v) > MAX_WORK {
        return BatchExpected::TooMuchWork;
    }
    BatchExpected::Accept {
        dims: [b, h_q, n_q, d_v],
        may_reject,
    }
}

/// Checks a batched result: the output `[batch, h_q, n_q, d_v]` (widened to f32) and, if
/// returned, the LSE in `[batch][h_q][n_q]` order, head by head against [`expect_head`]
/// (query head `h` reads kv head `h / (h_q / h_kv)`, entry `b` its own key length).
pub fn check_batched(
    expected: &BatchExpected,
    inputs: [Tensor4Ref<'_, f32>; 3],
    options: &Options<'_>,
    model: &ErrorModel,
    got: Result<(Tensor4Ref<'_, f32>, Option<&[f32]>), Error>,
) -> Result<(), String> {
    check_batched_released(expected, inputs, options, model, &Planted::default(), got)
}

/// [`check_batched`] with the promises about rows that see `planted` given up in every
/// head ([`HeadExpectation::release`]).
pub fn check_batched_released(
    expected: &BatchExpected,
    inputs: [Tensor4Ref<'_, f32>; 3],
    options: &Options<'_>,
    model: &ErrorModel,
    planted: &Planted,
    got: Result<(Tensor4Ref<'_, f32>, Option<&[f32]>), Error>,
) -> Result<(), String> {
    let (dims, (out, lse)) = match (expected, got) {
        (BatchExpected::TooMuchWork, _) => return Ok(()),
        (BatchExpected::Reject(rules), Err(e)) => {
            return check_error(&Expected::Reject(rules.clone()), &e);
        }
        (BatchExpected::Reject(rules), Ok(_)) => {
            return Err(format!(
                "an invalid batched call succeeded: it breaks {}",
                rules.iter().map(|r| r.rule).collect::<Vec<_>>().join(", ")
            ));
        }
        (BatchExpected::Accept { may_reject, .. }, Err(e)) => {
            return match rejected_by(may_reject, &e) {
                Some(_) => Ok(()),
                None => Err(format!("a valid batched call was rejected: `{e}` ({e:?})")),
            };
        }
        (BatchExpected::Accept { dims, .. }, Ok(got)) => (*dims, got),
    };
    let [b, h_q, n_q, _] = dims;
    if out.dims() != dims {
        return Err(format!(
            "the output has dims {:?} but must be {dims:?}",
            out.dims()
        ));
    }
    let rows = product(&[b, h_q, n_q]).expect("accepted calls have a row count");
    if let Some(l) = lse
        && l.len() != rows
    {
        return Err(format!("{} LSE values for {rows} rows", l.len()));
    }
    if rows == 0 {
        return Ok(());
    }
    let [q, k, v] = inputs;
    let h_kv = k.dims()[1];
    let group = h_q / h_kv.max(1);
    for bi in 0..b {
        let mut opts = *options;
        opts.key_padding = options.key_length(bi).map(KeyPadding::Uniform);
        for h in 0..h_q {
            let kv = h / group.max(1);
            let (qh, kh, vh) = (head_of(q, bi, h), head_of(k, bi, kv), head_of(v, bi, kv));
            let mut want = expect_head(qh, kh, vh, &opts, model, Outputs::NONE, 0);
            want.release(planted);
            let o = out.head(bi, h).map_err(|e| e.to_string())?;
            let row = (bi * h_q + h) * n_q;
            let l = lse.map(|l| &l[row..row + n_q]);
            check_head(&want, Ok((o, l)))
                .map_err(|m| format!("batch entry {bi}, head {h}: {m}"))?;
        }
    }
    Ok(())
}

pub(super) fn head_of<'a>(t: Tensor4Ref<'a, f32>, b: usize, h: usize) -> MatRef<'a, f32> {
    t.head(b, h).expect("validated dims")
}
