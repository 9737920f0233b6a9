//! `attn-bits`: writes the output bits of every public entry point of attn-optimized to a
//! file, so that a change meant to keep the numbers (a reshaped API, a new key source
//! under the tile loops) can be checked bit for bit against the commit before it, on the
//! same CPU: `cargo xtask bits --out old.bits` in a worktree of the old commit, the same
//! in the new one, then `cmp`. The file is a list of cases, each a header line
//! (`name count fnv64`) followed by its elements' bits as little-endian `u32`s.
//!
//! The cases cover forward and backward, one head, batched (GQA, both layouts, 4-D masks,
//! key lengths), packed, partial states, split-KV, the KV cache, every mask kind and score
//! modifier, f32/f16/bf16 in and out. Inputs come from a fixed generator, so the file
//! depends only on the code and the CPU's instruction set. Each case is labelled with the
//! entry point of the API before the one call (`attention_batched_with_lse`, …) whose
//! outputs it reproduces, so that files written before and after compare line for line.
//!
//! Usage: `attn-bits <OUT>`.

use std::io::Write;
use std::process::ExitCode;

use attn_optimized::{
    Alibi, Attention, BoolMask, BoolMask4, Causal, ColMut, CuSeqlens, Element, GradientsMut,
    KvCache, Layout, Mask4Ref, MaskMod, Mat, MatRef, Options, Par, ScoreMod, SlidingWindow,
    SoftCap, SplitKv, Tensor4Mut, Tensor4Ref, attention, bf16, f16,
};

/// The new calls run on the calling thread, the old ones ran on the pool: the bits must not
/// depend on it.
const PAR: Par = Par::Seq;

/// The cases' outputs, in order.
#[derive(Default)]
struct Bits {
    cases: Vec<(String, Vec<u32>)>,
}

impl Bits {
    fn push(&mut self, name: String, bits: Vec<u32>) {
        self.cases.push((name, bits));
    }

    fn write(&self, path: &str) -> std::io::Result<()> {
        let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
        for (name, bits) in &self.cases {
            writeln!(out, "{name} {} {:016x}", bits.len(), fnv(bits))?;
            for b in bits {
                out.write_all(&b.to_le_bytes())?;
            }
        }
        out.flush()
    }
}

fn fnv(bits: &[u32]) -> u64 {
    bits.iter()
        .flat_map(|b| b.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, byte| {
            (h ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        })
}

/// An element's bits, widened to `u32`.
trait ToBits: Copy {
    fn bits(self) -> u32;
}
impl ToBits for f32 {
    fn bits(self) -> u32 {
        self.to_bits()
    }
}
impl ToBits for f16 {
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
}
impl ToBits for bf16 {
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
}

fn mat_bits<T: ToBits>(m: MatRef<'_, T>) -> Vec<u32> {
    (0..m.nrows())
        .flat_map(|i| (0..m.ncols()).map(move |j| m[(i, j)].bits()))
        .collect()
}

fn slice_bits<T: ToBits>(s: &[T]) -> Vec<u32> {
    s.iter().map(|x| x.bits()).collect()
}

/// A fixed generator of inputs (splitmix64), values in `[-2, 2)`.
struct Gen(u64);
impl Gen {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
    }
    fn vec<T: Element>(&mut self, n: usize) -> Vec<T> {
        (0..n).map(|_| T::from_f32(self.next())).collect()
    }
    fn mat<T: Element>(&mut self, r: usize, c: usize) -> Mat<T> {
        Mat::from_fn(r, c, |_, _| T::from_f32(self.next()))
    }
}

/// A user score modifier depending on every index.
#[derive(Debug)]
struct Relative;
impl ScoreMod for Relative {
    fn score(&self, s: f32, b: usize, h: usize, i: usize, j: usize) -> f32 {
        s + 0.125 * h as f32 - 0.03125 * (i as f32 - j as f32).abs() * (b + 1) as f32
    }
    fn derivative(&self, _: f32, _: usize, _: usize, _: usize, _: usize) -> f32 {
        1.0
    }
}

/// A user mask: every third key hidden, and the keys after the query's position + 5.
#[derive(Debug)]
struct Stripes;
impl MaskMod for Stripes {
    fn visible(&self, _: usize, _: usize, i: usize, j: usize) -> bool {
        j % 3 != 1 && j <= i + 5
    }
}

/// The option sets every head case runs with (masks built for `[n_q, n_k]`).
struct Masks {
    allow: Mat<bool>,
    additive: Mat<f32>,
}

impl Masks {
    fn new(n_q: usize, n_k: usize) -> Self {
        Self {
            allow: Mat::from_fn(n_q, n_k, |i, j| (i * 7 + j * 3) % 5 != 0),
            additive: Mat::from_fn(n_q, n_k, |i, j| {
                if (i + 2 * j) % 7 == 0 {
                    f32::NEG_INFINITY
                } else {
                    ((i * 3 + j) % 11) as f32 * 0.1 - 0.5
                }
            }),
        }
    }

    fn options<'a>(
        &'a self,
        n_k: usize,
        slopes: &'a [f32],
        sinks: &'a [f32],
    ) -> Vec<(&'static str, Options<'a>)> {
        let o = Options::default;
        vec![
            ("plain", o()),
            ("causal-tl", o().with_causal(Causal::TopLeft)),
            (
                "causal-br-window",
                o().with_causal(Causal::BottomRight)
                    .with_window(SlidingWindow::new(Some(17), Some(0), Causal::BottomRight)),
            ),
            (
                "window-tl",
                o().with_window(SlidingWindow::new(Some(40), Some(9), Causal::TopLeft)),
            ),
            (
                "bool-allow",
                o().with_bool_mask(BoolMask::allow(self.allow.as_ref())),
            ),
            (
                "bool-block",
                o().with_bool_mask(BoolMask::block(self.allow.as_ref())),
            ),
            ("additive", o().with_additive_mask(self.additive.as_ref())),
            ("key-length", o().with_key_length(n_k * 2 / 3)),
            ("scale", o().with_scale(0.37).with_causal(Causal::TopLeft)),
            ("softcap", o().with_softcap(SoftCap::new(5.0).expect("cap"))),
            (
                "alibi",
                o().with_alibi(Alibi::new(slopes))
                    .with_causal(Causal::BottomRight),
            ),
            ("sinks", o().with_sinks(sinks)),
            ("user-score", o().with_score_mod(&Relative)),
            ("user-mask", o().with_mask_mod(&Stripes)),
            (
                "mixed",
                o().with_softcap(SoftCap::new(3.0).expect("cap"))
                    .with_alibi(Alibi::new(slopes).with_align(Causal::TopLeft))
                    .with_sinks(sinks)
                    .with_causal(Causal::TopLeft),
            ),
        ]
    }
}

/// One-head shapes `(n_q, n_k, d_k, d_v)`: tiny, ragged, tile edges, GEMM tiles, decoding.
const HEAD_SHAPES: [(usize, usize, usize, usize); 6] = [
    (1, 1, 8, 8),
    (5, 37, 16, 12),
    (130, 70, 32, 32),
    (257, 600, 64, 64),
    (2, 3000, 64, 64),
    (0, 9, 8, 8),
];

fn head_cases<T: Element + ToBits>(bits: &mut Bits, dtype: &str, g: &mut Gen) {
    let (slopes, sinks) = ([0.25f32], [0.5f32]);
    for (n_q, n_k, d_k, d_v) in HEAD_SHAPES {
        let (q, k, v) = (
            g.mat::<T>(n_q, d_k),
            g.mat::<T>(n_k, d_k),
            g.mat::<T>(n_k, d_v),
        );
        let d_out = g.mat::<T>(n_q, d_v);
        let masks = Masks::new(n_q, n_k);
        for (what, opts) in masks.options(n_k, &slopes, &sinks) {
            let tag = format!("{dtype} {n_q}x{n_k}x{d_k}x{d_v} {what}");
            let mut record = |name: &str, r: attn_optimized::Result<Vec<u32>>| {
                let b = r.unwrap_or_else(|e| vec![u32::MAX, e.to_string().len() as u32]);
                bits.push(format!("{name} {tag}"), b);
            };
            let (q, k, v) = (q.as_ref(), k.as_ref(), v.as_ref());
            record(
                "attention",
                attention(q, k, v, &opts).map(|o| mat_bits(o.as_ref())),
            );
            let call = Attention::head(q, k, v, &opts);
            let fwd = call
                .as_ref()
                .map_err(Clone::clone)
                .and_then(|c| c.forward(PAR));
            record(
                "attention_with_lse",
                fwd.as_ref()
                    .map(|f| [mat_bits(f.output().as_ref()), slice_bits(f.lse())].concat())
                    .map_err(Clone::clone),
            );
            record("attention_into", {
                let mut out = Mat::<f32>::zeros(n_q, d_v);
                let mut lse = vec![0.0f32; n_q];
                let lse_view = ColMut::from_slice_mut(&mut lse);
                call.as_ref()
                    .map_err(Clone::clone)
                    .and_then(|c| c.forward_into(out.as_mut(), Some(lse_view), PAR))
                    .map(|()| [mat_bits(out.as_ref()), slice_bits(&lse)].concat())
            });
            if opts.sinks.is_none() && n_k >= 2 {
                record("partial_attention", {
                    let cut = n_k / 3;
                    let shard = |keys: core::ops::Range<usize>| {
                        let (kk, vv) = (
                            k.subrows(keys.start, keys.len()),
                            v.subrows(keys.start, keys.len()),
                        );
                        Attention::keys_of(q, kk, vv, keys, n_k, &opts)?.partial_state(PAR)
                    };
                    let (a, b) = (shard(0..cut), shard(cut..n_k));
                    a.and_then(|a| b.map(|b| (a, b))).map(|(a, b)| {
                        [
                            mat_bits(a.output()),
                            slice_bits(a.lse()),
                            mat_bits(b.output()),
                            slice_bits(b.lse()),
                        ]
                        .concat()
                    })
                });
            }
            let (Ok(call), Ok(fwd)) = (call, fwd) else {
                continue;
            };
            record(
                "attention_backward",
                call.backward(&fwd, d_out.as_ref(), PAR).map(|g| {
                    [
                        mat_bits(g.dq.as_ref()),
                        mat_bits(g.dk.as_ref()),
                        mat_bits(g.dv.as_ref()),
                        g.dsinks.as_deref().map(slice_bits).unwrap_or_default(),
                    ]
                    .concat()
                }),
            );
            record("attention_backward_into", {
                let (mut dq, mut dk, mut dv) = (
                    Mat::<f32>::zeros(n_q, d_k),
                    Mat::<f32>::zeros(n_k, d_k),
                    Mat::<f32>::zeros(n_k, d_v),
                );
                let grads = GradientsMut {
                    dq: dq.as_mut(),
                    dk: dk.as_mut(),
                    dv: dv.as_mut(),
                };
                call.backward_into(&fwd, d_out.as_ref(), grads, PAR)
                    .map(|ds| {
                        [
                            mat_bits(dq.as_ref()),
                            mat_bits(dk.as_ref()),
                            mat_bits(dv.as_ref()),
                            ds.as_deref().map(slice_bits).unwrap_or_default(),
                        ]
                        .concat()
                    })
            });
        }
    }
}

/// Batched shapes `(batch, h_q, h_kv, n_q, n_k, d)`: GQA prefill, MQA decoding (stacked
/// heads, split-KV), cross-attention.
const BATCH_SHAPES: [(usize, usize, usize, usize, usize, usize); 4] = [
    (2, 4, 2, 33, 70, 16),
    (1, 8, 2, 1, 2500, 64),
    (2, 2, 1, 150, 150, 32),
    (3, 6, 3, 4, 1100, 32),
];

fn batched_cases<T: Element + ToBits>(bits: &mut Bits, dtype: &str, g: &mut Gen) {
    for (layout, lname) in [(Layout::Bhsd, "bhsd"), (Layout::Bshd, "bshd")] {
        for (b, h_q, h_kv, n_q, n_k, d) in BATCH_SHAPES {
            let qd = g.vec::<T>(b * h_q * n_q * d);
            let kd = g.vec::<T>(b * h_kv * n_k * d);
            let vd = g.vec::<T>(b * h_kv * n_k * d);
            let dod = g.vec::<T>(b * h_q * n_q * d);
            let q = Tensor4Ref::from_layout(&qd, [b, h_q, n_q, d], layout).expect("q");
            let k = Tensor4Ref::from_layout(&kd, [b, h_kv, n_k, d], layout).expect("k");
            let v = Tensor4Ref::from_layout(&vd, [b, h_kv, n_k, d], layout).expect("v");
            let d_out = Tensor4Ref::from_layout(&dod, [b, h_q, n_q, d], layout).expect("dO");
            let lens: Vec<usize> = (0..b).map(|e| n_k - e * n_k / 4).collect();
            let mask_bits: Vec<bool> = (0..b * h_q * n_q * n_k)
                .map(|i| (i * 13) % 7 != 0)
                .collect();
            let mask4 = Mask4Ref::contiguous(&mask_bits, [b, h_q, n_q, n_k]).expect("mask");
            let add_bits: Vec<f32> = (0..n_q * n_k)
                .map(|i| ((i * 5) % 9) as f32 * 0.2 - 0.8)
                .collect();
            let add4 =
                Mask4Ref::new(&add_bits, [b, h_q, n_q, n_k], [0, 0, n_k, 1]).expect("additive");
            let slopes: Vec<f32> = (0..h_q).map(|h| 0.5f32.powi(h as i32 + 1)).collect();
            let sinks: Vec<f32> = (0..h_q).map(|h| h as f32 * 0.3 - 0.5).collect();
            let o = Options::default;
            let sets = [
                ("plain", o()),
                ("causal-br", o().with_causal(Causal::BottomRight)),
                (
                    "key-lengths",
                    o().with_key_lengths(&lens).with_causal(Causal::TopLeft),
                ),
                ("bool4", o().with_bool_mask_4d(BoolMask4::allow(mask4))),
                ("additive4", o().with_additive_mask_4d(add4)),
                (
                    "alibi-sinks",
                    o().with_alibi(Alibi::new(&slopes)).with_sinks(&sinks),
                ),
                (
                    "user",
                    o().with_score_mod(&Relative).with_mask_mod(&Stripes),
                ),
            ];
            for (what, opts) in sets {
                let tag = format!("{dtype} {lname} {b}x{h_q}/{h_kv}x{n_q}x{n_k}x{d} {what}");
                let mut record = |name: &str, r: attn_optimized::Result<Vec<u32>>| {
                    let bits_ = r.unwrap_or_else(|e| vec![u32::MAX, e.to_string().len() as u32]);
                    bits.push(format!("{name} {tag}"), bits_);
                };
                let call = Attention::batched(q, k, v, &opts);
                let fwd = call
                    .as_ref()
                    .map_err(Clone::clone)
                    .and_then(|c| c.forward(PAR));
                record(
                    "attention_batched",
                    fwd.as_ref()
                        .map(|f| slice_bits(f.output().as_slice()))
                        .map_err(Clone::clone),
                );
                record(
                    "attention_batched_with(Never)",
                    Attention::batched(q, k, v, &opts)
                        .and_then(|c| c.split_kv(SplitKv::Never).forward(PAR))
                        .map(|f| slice_bits(f.output().as_slice())),
                );
                record("attention_batched_into", {
                    let mut out = vec![0.0f32; b * h_q * n_q * d];
                    Tensor4Mut::from_layout(&mut out, [b, h_q, n_q, d], Layout::Bshd)
                        .and_then(|view| {
                            call.as_ref()
                                .map_err(Clone::clone)?
                                .forward_into(view, None, PAR)
                        })
                        .map(|()| slice_bits(&out))
                });
                record(
                    "attention_batched_with_lse",
                    fwd.as_ref()
                        .map(|f| [slice_bits(f.output().as_slice()), slice_bits(f.lse())].concat())
                        .map_err(Clone::clone),
                );
                let (Ok(call), Ok(fwd)) = (call, fwd) else {
                    continue;
                };
                record(
                    "attention_backward_batched",
                    call.backward(&fwd, d_out, PAR).map(|g| {
                        [
                            slice_bits(g.dq.as_slice()),
                            slice_bits(g.dk.as_slice()),
                            slice_bits(g.dv.as_slice()),
                            g.dsinks.as_deref().map(slice_bits).unwrap_or_default(),
                        ]
                        .concat()
                    }),
                );
                record("attention_backward_batched_into", {
                    let (mut dq, mut dk, mut dv) = (
                        vec![0.0f32; b * h_q * n_q * d],
                        vec![0.0f32; b * h_kv * n_k * d],
                        vec![0.0f32; b * h_kv * n_k * d],
                    );
                    let views = Tensor4Mut::from_layout(&mut dq, [b, h_q, n_q, d], Layout::Bshd)
                        .and_then(|dq| {
                            let dk =
                                Tensor4Mut::from_layout(&mut dk, [b, h_kv, n_k, d], Layout::Bhsd)?;
                            let dv =
                                Tensor4Mut::from_layout(&mut dv, [b, h_kv, n_k, d], Layout::Bshd)?;
                            call.backward_into(&fwd, d_out, GradientsMut { dq, dk, dv }, PAR)
                        });
                    views.map(|ds| {
                        [
                            slice_bits(&dq),
                            slice_bits(&dk),
                            slice_bits(&dv),
                            ds.as_deref().map(slice_bits).unwrap_or_default(),
                        ]
                        .concat()
                    })
                });
            }
        }
    }
}

fn packed_cases<T: Element + ToBits>(bits: &mut Bits, dtype: &str, g: &mut Gen) {
    let (h_q, h_kv, d) = (4, 2, 32);
    let cu_q = [0usize, 3, 3, 140, 141, 400];
    let cu_k = [0usize, 5, 9, 146, 1300, 1559];
    let (tq, tk) = (cu_q[5], cu_k[5]);
    let seqs = CuSeqlens::new(&cu_q, &cu_k).expect("offsets");
    let qd = g.vec::<T>(h_q * tq * d);
    let kd = g.vec::<T>(h_kv * tk * d);
    let vd = g.vec::<T>(h_kv * tk * d);
    let dod = g.vec::<T>(h_q * tq * d);
    let q = Tensor4Ref::from_layout(&qd, [1, h_q, tq, d], Layout::Bshd).expect("q");
    let k = Tensor4Ref::from_layout(&kd, [1, h_kv, tk, d], Layout::Bshd).expect("k");
    let v = Tensor4Ref::from_layout(&vd, [1, h_kv, tk, d], Layout::Bshd).expect("v");
    let d_out = Tensor4Ref::from_layout(&dod, [1, h_q, tq, d], Layout::Bshd).expect("dO");
    let slopes: Vec<f32> = (0..h_q).map(|h| 0.5f32.powi(h as i32 + 1)).collect();
    let sinks: Vec<f32> = (0..h_q).map(|h| h as f32 * 0.3 - 0.5).collect();
    let o = Options::default;
    let sets = [
        ("plain", o()),
        ("causal-tl", o().with_causal(Causal::TopLeft)),
        (
            "causal-br-window",
            o().with_causal(Causal::BottomRight)
                .with_window(SlidingWindow::new(Some(30), Some(0), Causal::BottomRight)),
        ),
        (
            "modifiers",
            o().with_softcap(SoftCap::new(4.0).expect("cap"))
                .with_alibi(Alibi::new(&slopes))
                .with_sinks(&sinks),
        ),
        (
            "user",
            o().with_score_mod(&Relative).with_mask_mod(&Stripes),
        ),
    ];
    for (what, opts) in sets {
        let tag = format!("{dtype} packed {what}");
        let mut record = |name: &str, r: attn_optimized::Result<Vec<u32>>| {
            let b = r.unwrap_or_else(|e| vec![u32::MAX, e.to_string().len() as u32]);
            bits.push(format!("{name} {tag}"), b);
        };
        let call = Attention::packed(q, k, v, &seqs, &opts);
        let fwd = call
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|c| c.forward(PAR));
        record(
            "attention_packed",
            fwd.as_ref()
                .map(|f| slice_bits(f.output().as_slice()))
                .map_err(Clone::clone),
        );
        record("attention_packed_into", {
            let mut out = vec![0.0f32; h_q * tq * d];
            let mut lse = vec![0.0f32; h_q * tq];
            Tensor4Mut::from_layout(&mut out, [1, h_q, tq, d], Layout::Bhsd)
                .and_then(|view| {
                    let lse_view =
                        Tensor4Mut::from_layout(&mut lse, [1, h_q, tq, 1], Layout::Bhsd)?;
                    call.as_ref()
                        .map_err(Clone::clone)?
                        .forward_into(view, Some(lse_view), PAR)
                })
                .map(|()| [slice_bits(&out), slice_bits(&lse)].concat())
        });
        record(
            "attention_packed_with_lse",
            fwd.as_ref()
                .map(|f| [slice_bits(f.output().as_slice()), slice_bits(f.lse())].concat())
                .map_err(Clone::clone),
        );
        let (Ok(call), Ok(fwd)) = (call, fwd) else {
            continue;
        };
        record(
            "attention_backward_packed",
            call.backward(&fwd, d_out, PAR).map(|g| {
                [
                    slice_bits(g.dq.as_slice()),
                    slice_bits(g.dk.as_slice()),
                    slice_bits(g.dv.as_slice()),
                    g.dsinks.as_deref().map(slice_bits).unwrap_or_default(),
                ]
                .concat()
            }),
        );
        record("attention_backward_packed_into", {
            let (mut dq, mut dk, mut dv) = (
                vec![0.0f32; h_q * tq * d],
                vec![0.0f32; h_kv * tk * d],
                vec![0.0f32; h_kv * tk * d],
            );
            let r =
                Tensor4Mut::from_layout(&mut dq, [1, h_q, tq, d], Layout::Bhsd).and_then(|dq| {
                    let dk = Tensor4Mut::from_layout(&mut dk, [1, h_kv, tk, d], Layout::Bshd)?;
                    let dv = Tensor4Mut::from_layout(&mut dv, [1, h_kv, tk, d], Layout::Bhsd)?;
                    call.backward_into(&fwd, d_out, GradientsMut { dq, dk, dv }, PAR)
                });
            r.map(|ds| {
                [
                    slice_bits(&dq),
                    slice_bits(&dk),
                    slice_bits(&dv),
                    ds.as_deref().map(slice_bits).unwrap_or_default(),
                ]
                .concat()
            })
        });
    }
}

/// A KV cache filled by a prompt and then decoded token by token, in both alignments that
/// the cache accepts and with split-KV on and off.
fn cache_cases<T: Element + ToBits>(bits: &mut Bits, dtype: &str, g: &mut Gen) {
    let (b, h_q, h_kv, d) = (2, 4, 2, 32);
    let prompt = 1500;
    let Ok(mut cache) = KvCache::<T>::new(b, h_kv, prompt + 8, d, d) else {
        bits.push(format!("cache {dtype} new"), vec![u32::MAX]);
        return;
    };
    let slopes: Vec<f32> = (0..h_q).map(|h| 0.5f32.powi(h as i32 + 1)).collect();
    let sinks: Vec<f32> = (0..h_q).map(|h| h as f32 * 0.3 - 0.5).collect();
    for step in 0..6 {
        let n_new = if step == 0 { prompt } else { 1 };
        let kd = g.vec::<T>(b * h_kv * n_new * d);
        let vd = g.vec::<T>(b * h_kv * n_new * d);
        let k = Tensor4Ref::from_layout(&kd, [b, h_kv, n_new, d], Layout::Bhsd).expect("k");
        let v = Tensor4Ref::from_layout(&vd, [b, h_kv, n_new, d], Layout::Bhsd).expect("v");
        if let Err(e) = cache.append(k, v) {
            bits.push(
                format!("cache {dtype} append {step}"),
                vec![u32::MAX, e.to_string().len() as u32],
            );
            return;
        }
        let n_q = if step == 0 { 3 } else { 1 };
        let qd = g.vec::<T>(b * h_q * n_q * d);
        let q = Tensor4Ref::from_layout(&qd, [b, h_q, n_q, d], Layout::Bshd).expect("q");
        let o = Options::default;
        let sets = [
            ("plain", o()),
            ("causal-br", o().with_causal(Causal::BottomRight)),
            (
                "window",
                o().with_window(SlidingWindow::new(Some(100), Some(0), Causal::BottomRight)),
            ),
            (
                "modifiers",
                o().with_alibi(Alibi::new(&slopes))
                    .with_sinks(&sinks)
                    .with_score_mod(&Relative),
            ),
        ];
        for (what, opts) in sets {
            let tag = format!("{dtype} step {step} {what}");
            let mut record = |name: &str, r: attn_optimized::Result<Vec<u32>>| {
                let b = r.unwrap_or_else(|e| vec![u32::MAX, e.to_string().len() as u32]);
                bits.push(format!("{name} {tag}"), b);
            };
            let fwd = cache.attention(q, &opts).and_then(|c| c.forward(PAR));
            record(
                "KvCache::attend",
                fwd.as_ref()
                    .map(|f| slice_bits(f.output().as_slice()))
                    .map_err(Clone::clone),
            );
            record(
                "KvCache::attend_with_lse",
                fwd.map(|f| [slice_bits(f.output().as_slice()), slice_bits(f.lse())].concat()),
            );
            record(
                "KvCache::attend_with(Never)",
                cache
                    .attention(q, &opts)
                    .and_then(|c| c.split_kv(SplitKv::Never).forward(PAR))
                    .map(|f| slice_bits(f.output().as_slice())),
            );
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [path] = args.as_slice() else {
        eprintln!("usage: attn-bits <OUT>");
        return ExitCode::from(2);
    };
    let mut bits = Bits::default();
    let mut g = Gen(0x5eed);
    head_cases::<f32>(&mut bits, "f32", &mut g);
    head_cases::<f16>(&mut bits, "f16", &mut g);
    head_cases::<bf16>(&mut bits, "bf16", &mut g);
    batched_cases::<f32>(&mut bits, "f32", &mut g);
    batched_cases::<bf16>(&mut bits, "bf16", &mut g);
    batched_cases::<f16>(&mut bits, "f16", &mut g);
    packed_cases::<f32>(&mut bits, "f32", &mut g);
    packed_cases::<f16>(&mut bits, "f16", &mut g);
    cache_cases::<f32>(&mut bits, "f32", &mut g);
    cache_cases::<bf16>(&mut bits, "bf16", &mut g);
    let total: usize = bits.cases.iter().map(|(_, b)| b.len()).sum();
    match bits.write(path) {
        Ok(()) => {
            println!(
                "attn-bits: {} cases, {total} elements, written to {path}",
                bits.cases.len()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("attn-bits: cannot write {path}: {e}");
            ExitCode::FAILURE
        }
    }
}
