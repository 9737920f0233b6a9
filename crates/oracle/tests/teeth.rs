//! The suite has teeth: a small streaming f32 engine passes every property, and each of
//! the classic kernel bugs planted in it is caught by the properties that should catch
//! it. Run with `--nocapture` to see each failure and its shrunk input.

use attn_core::{HeadMask, Options, Result, Tensor4, Tensor4Ref, validate_batch, validate_head};
use attn_oracle::{Compute, Dtype, Engine, ErrorModel, Failure, Property, SuiteConfig};
use faer::{Mat, MatRef};

/// A bug planted in the toy engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bug {
    None,
    /// The online softmax forgets `α = exp(m_old − m_new)` when the maximum moves.
    SkipRescale,
    /// The causal diagonal is one key too far (`j ≤ i + offset + 1`).
    CausalOffByOne,
    /// The softmax normalises along the query axis.
    WrongAxis,
    /// A row with no visible key computes `0 / 0` and `-inf − -inf`.
    NoEmptyRowGuard,
    /// Hidden keys are multiplied by 0 instead of skipped.
    ZeroTimesHiddenV,
    /// The exponentials are not shifted by the running maximum.
    NoMaxSubtraction,
}

/// Online softmax over key blocks of 4, in f32.
struct Toy(Bug);

const BLOCK: usize = 4;

impl Toy {
    fn visible(
        &self,
        options: &Options<'_>,
        n_q: usize,
        n_k: usize,
        key_len: Option<usize>,
    ) -> Mat<bool> {
        let mask = HeadMask::new(options, n_q, n_k, key_len);
        match (self.0, options.causal) {
            (Bug::CausalOffByOne, Some(c)) => {
                let relaxed = Options {
                    causal: None,
                    ..*options
                };
                let m = HeadMask::new(&relaxed, n_q, n_k, key_len);
                let off = c.offset(n_q, n_k);
                Mat::from_fn(n_q, n_k, |i, j| {
                    m.allows(i, j) && (j as i64) <= i as i64 + off + 1
                })
            }
            _ => Mat::from_fn(n_q, n_k, |i, j| mask.allows(i, j)),
        }
    }

    fn head(
        &self,
        q: MatRef<'_, f32>,
        k: MatRef<'_, f32>,
        v: MatRef<'_, f32>,
        options: &Options<'_>,
        key_len: Option<usize>,
    ) -> Result<(Mat<f32>, Vec<f32>)> {
        let (n_q, n_k, d_k, d_v) = (q.nrows(), k.nrows(), q.ncols(), v.ncols());
        let scale = options.scale_for(d_k)?;
        let visible = self.visible(options, n_q, n_k, key_len);
        let bias = |i: usize, j: usize| options.additive_mask.map_or(0.0, |m| m[(i, j)]);
        let score = |i: usize, j: usize| {
            let dot: f32 = (0..d_k).map(|t| q[(i, t)] * k[(j, t)]).sum();
            scale * dot + bias(i, j)
        };
        let mut out = Mat::<f32>::zeros(n_q, d_v);
        let mut lse = vec![f32::NEG_INFINITY; n_q];
        if self.0 == Bug::WrongAxis {
            // Softmax down each column (over queries) instead of along each row.
            let s = Mat::from_fn(n_q, n_k, |i, j| {
                if visible[(i, j)] {
                    score(i, j)
                } else {
                    f32::NEG_INFINITY
                }
            });
            for j in 0..n_k {
                let m = (0..n_q)
                    .map(|i| s[(i, j)])
                    .fold(f32::NEG_INFINITY, f32::max);
                if m == f32::NEG_INFINITY {
                    continue;
                }
                let l: f32 = (0..n_q).map(|i| (s[(i, j)] - m).exp()).sum();
                for i in 0..n_q {
                    let a = (s[(i, j)] - m).exp() / l;
                    if s[(i, j)] != f32::NEG_INFINITY {
                        for c in 0..d_v {
                            out[(i, c)] += a * v[(j, c)];
                        }
                    }
                }
            }
            return Ok((out, lse));
        }
        for i in 0..n_q {
            let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
            let mut acc = vec![0.0f32; d_v];
            for start in (0..n_k).step_by(BLOCK) {
                let keys = start..(start + BLOCK).min(n_k);
                let s: Vec<f32> = keys
                    .clone()
                    .map(|j| {
                        if visible[(i, j)] {
                            score(i, j)
                        } else {
                            f32::NEG_INFINITY
                        }
                    })
                    .collect();
                let m_new = s.iter().copied().fold(m, f32::max);
                if m_new == f32::NEG_INFINITY && self.0 != Bug::NoEmptyRowGuard {
                    continue; // nothing visible yet: no -inf − -inf
                }
                let alpha = if self.0 == Bug::SkipRescale {
                    1.0
                } else {
                    (m - m_new).exp()
                };
                let shift = if self.0 == Bug::NoMaxSubtraction {
                    0.0
                } else {
                    m_new
                };
                l *= alpha;
                acc.iter_mut().for_each(|a| *a *= alpha);
                for (j, &sj) in keys.zip(&s) {
                    if sj == f32::NEG_INFINITY && self.0 != Bug::ZeroTimesHiddenV {
                        continue; // a hidden key contributes nothing
                    }
                    let p = (sj - shift).exp();
                    l += p;
                    for (c, a) in acc.iter_mut().enumerate() {
                        *a += p * v[(j, c)];
                    }
                }
                m = m_new;
            }
            if l == 0.0 && self.0 != Bug::NoEmptyRowGuard {
                continue;
            }
            let m_used = if self.0 == Bug::NoMaxSubtraction {
                0.0
            } else {
                m
            };
            lse[i] = m_used + l.ln();
            for (c, a) in acc.iter().enumerate() {
                out[(i, c)] = a / l;
            }
        }
        Ok((out, lse))
    }
}

impl Engine for Toy {
    fn name(&self) -> String {
        format!("toy-{:?}", self.0)
    }

    fn error_model(&self) -> ErrorModel {
        ErrorModel {
            compute: Compute::F32 {
                exp_ulps: 1.0,
                split_keys: None,
            },
            output: Dtype::F32,
        }
    }

    fn tile_lengths(&self) -> Vec<usize> {
        vec![BLOCK, 16, 64]
    }

    fn attention_with_lse(
        &self,
        q: MatRef<'_, f32>,
        k: MatRef<'_, f32>,
        v: MatRef<'_, f32>,
        options: &Options<'_>,
    ) -> Result<(Mat<f32>, Vec<f32>)> {
        validate_head(q, k, v, options)?;
        self.head(q, k, v, options, options.key_length(0))
    }

    fn attention_batched(
        &self,
        q: Tensor4Ref<'_, f32>,
        k: Tensor4Ref<'_, f32>,
        v: Tensor4Ref<'_, f32>,
        options: &Options<'_>,
    ) -> Result<Tensor4<f32>> {
        let shape = validate_batch(q, k, v, options)?;
        let mut out = Tensor4::zeros([shape.batch, shape.h_q, shape.head.n_q, shape.head.d_v]);
        for b in 0..shape.batch {
            for h in 0..shape.h_q {
                let kv = shape.kv_head(h);
                let (o, _) = self.head(
                    q.head(b, h)?,
                    k.head(b, kv)?,
                    v.head(b, kv)?,
                    options,
                    options.key_length(b),
                )?;
                let mut view = out.as_mut();
                view.head_mut(b, h)?.copy_from(&o);
            }
        }
        Ok(out)
    }
}

/// Every property against the toy with `bug`; returns the failures.
fn failures(bug: Bug) -> Vec<Failure> {
    let config = SuiteConfig::quick(96);
    Property::ALL
        .iter()
        .filter_map(|&p| attn_oracle::check_property(&Toy(bug), p, &config).err())
        .collect()
}

fn caught_by(bug: Bug, expected: &[Property]) {
    let found = failures(bug);
    for f in &found {
        eprintln!("--- {f}\n");
    }
    let names: Vec<Property> = found.iter().map(|f| f.property).collect();
    eprintln!("{bug:?} is caught by {names:?}");
    for p in expected {
        assert!(
            names.contains(p),
            "{bug:?} should fail {p} but only fails {names:?}"
        );
    }
}

#[test]
fn toy_engine_without_bugs_passes_every_property() {
    let found = failures(Bug::None);
    assert!(
        found.is_empty(),
        "{}",
        found
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn skipped_rescale_is_caught() {
    caught_by(
        Bug::SkipRescale,
        &[Property::Equivalence, Property::BatchedEquivalence],
    );
}

#[test]
fn causal_off_by_one_is_caught() {
    caught_by(
        Bug::CausalOffByOne,
        &[Property::MaskedWeightsAreZero, Property::Equivalence],
    );
}

#[test]
fn softmax_along_the_wrong_axis_is_caught() {
    caught_by(
        Bug::WrongAxis,
        &[Property::RowsSumToOne, Property::Equivalence],
    );
}

#[test]
fn missing_empty_row_guard_is_caught() {
    caught_by(Bug::NoEmptyRowGuard, &[Property::FullyMaskedRows]);
}

#[test]
fn zero_times_hidden_value_is_caught() {
    caught_by(Bug::ZeroTimesHiddenV, &[Property::HiddenKeysNeverLeak]);
}

#[test]
fn missing_max_subtraction_is_caught() {
    caught_by(
        Bug::NoMaxSubtraction,
        &[Property::Adversarial, Property::RowShift],
    );
}
