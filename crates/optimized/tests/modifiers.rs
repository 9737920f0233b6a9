//! Score modifiers in the streaming engine's forward pass — soft-cap, ALiBi, sink logits and
//! the user's `ScoreMod` / `MaskMod` — against the f64 reference, through the GEMM tiles
//! (prefill), the row tiles (decoding), split-KV, the KV cache and packed calls; and the
//! identities the contract promises bit for bit.

mod common;

use attn_oracle::user_mods::{TopLeftMask, UserSoftCap};
use core::ops::Range;

use attn_core::{
    Alibi, Causal, CuSeqlens, Error, Layout, MaskMod, Options, ScoreMod, SoftCap, Tensor4Ref,
};
use attn_optimized::{Element, KvCache, SplitKv};

/// The storage types both engines take.
trait Both: Element + attn_reference::Element + Default {}
impl<T: Element + attn_reference::Element + Default> Both for T {}
use common::data;
use half::{bf16, f16};

/// A position- and head-dependent user modifier: `s + 0.05·h − 0.01·|i − j|·(b + 1)`.
#[derive(Debug)]
struct Bias;

impl ScoreMod for Bias {
    fn score(&self, s: f32, b: usize, h: usize, i: usize, j: usize) -> f32 {
        s + 0.05 * h as f32 - 0.01 * (i as f32 - j as f32).abs() * (b + 1) as f32
    }
    fn derivative(&self, _: f32, _: usize, _: usize, _: usize, _: usize) -> f32 {
        1.0
    }
}

/// Hides every third key from odd heads, the first keys from batch entry 1 (no block answer).
#[derive(Debug)]
struct Stripes;

impl MaskMod for Stripes {
    fn visible(&self, b: usize, h: usize, _: usize, j: usize) -> bool {
        let striped = h % 2 == 1 && j.is_multiple_of(3);
        !(striped || b == 1 && j < 2)
    }
}

struct Case {
    dims: (usize, usize, usize, usize, usize, usize), // b, h_q, h_kv, n_q, n_k, d
    layout: Layout,
}

/// The optimized engine's output and LSE against the reference's for `opts`, within `tol`.
fn compare<T: Both>(case: &Case, opts: &Options<'_>, split: SplitKv, tol: f32) {
    let (b, hq, hkv, nq, nk, d) = case.dims;
    let qd = data::<T>(b * hq * nq * d, 1, 1.5);
    let kd = data::<T>(b * hkv * nk * d, 2, 1.5);
    let vd = data::<T>(b * hkv * nk * d, 3, 1.0);
    let q = Tensor4Ref::from_layout(&qd, [b, hq, nq, d], case.layout).unwrap();
    let k = Tensor4Ref::from_layout(&kd, [b, hkv, nk, d], case.layout).unwrap();
    let v = Tensor4Ref::from_layout(&vd, [b, hkv, nk, d], case.layout).unwrap();
    let (o, lse) = match split {
        SplitKv::Auto => attn_optimized::Attention::batched(q, k, v, opts)
            .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
            .map(|f| f.into_parts())
            .unwrap(),
        _ => {
            let o = attn_optimized::Attention::batched(q, k, v, opts)
                .and_then(|call| call.split_kv(split).forward(attn_optimized::Par::rayon(0)))
                .map(|f| f.into_output())
                .unwrap();
            let lse = attn_reference::Attention::batched(q, k, v, opts)
                .and_then(|call| call.forward())
                .map(|f| f.into_parts())
                .unwrap()
                .1;
            (o, lse)
        }
    };
    let (r, rlse) = attn_reference::Attention::batched(q, k, v, opts)
        .and_then(|call| call.forward())
        .map(|f| f.into_parts())
        .unwrap();
    for (x, y) in o.as_slice().iter().zip(r.as_slice()) {
        let (x, y) = (x.to_f32(), y.to_f32());
        assert!(
            (x - y).abs() <= tol,
            "{}: {x} vs {y} ({:?})",
            T::NAME,
            case.dims
        );
    }
    for (x, y) in lse.iter().zip(&rlse) {
        let ok = x == y || (x - y).abs() <= tol * (1.0 + y.abs());
        assert!(ok, "{}: LSE {x} vs {y} ({:?})", T::NAME, case.dims);
    }
}

fn every_modifier<T: Both>(tol: f32) {
    let cap = SoftCap::new(3.0).unwrap();
    let slopes = [0.5f32, 0.25, 0.125, 0.0625];
    let slopes_b: Vec<f32> = (0..8).map(|i| 0.3 / (i + 1) as f32).collect();
    let sinks = [0.5f32, f32::NEG_INFINITY, -1.0, 3.0];
    let (user_cap, bias) = (UserSoftCap(cap), Bias);
    let options = [
        Options::default().with_softcap(cap),
        Options::default().with_alibi(Alibi::new(&slopes)),
        Options::default().with_alibi(Alibi::new(&slopes_b).with_align(Causal::TopLeft)),
        Options::default().with_sinks(&sinks),
        Options::default().with_score_mod(&user_cap),
        Options::default().with_score_mod(&bias),
        Options::default().with_mask_mod(&Stripes),
        Options::default()
            .with_causal(Causal::BottomRight)
            .with_softcap(cap)
            .with_alibi(Alibi::new(&slopes))
            .with_sinks(&sinks)
            .with_score_mod(&bias)
            .with_mask_mod(&Stripes),
        Options::default()
            .with_causal(Causal::TopLeft)
            .with_sinks(&sinks)
            .with_alibi(Alibi::new(&slopes)),
    ];
    let cases = [
        (2, 4, 2, 150, 300, 32, Layout::Bhsd), // GEMM tiles
        (2, 4, 4, 3, 400, 16, Layout::Bshd),   // row tiles
        (2, 4, 1, 1, 3000, 32, Layout::Bshd),  // decoding, split-KV, GQA
        (2, 4, 2, 70, 5, 8, Layout::Bhsd),     // more queries than keys (empty causal rows)
    ];
    for (b, hq, hkv, nq, nk, d, layout) in cases {
        let case = Case {
            dims: (b, hq, hkv, nq, nk, d),
            layout,
        };
        for opts in &options {
            for split in [SplitKv::Auto, SplitKv::Never] {
                compare::<T>(&case, opts, split, tol);
            }
        }
    }
}

#[test]
fn every_modifier_matches_the_reference_f32() {
    every_modifier::<f32>(2e-5);
}

#[test]
fn every_modifier_matches_the_reference_half() {
    every_modifier::<f16>(4e-3);
    every_modifier::<bf16>(3e-2);
}

/// The output bits of `opts` against those of `other`.
fn same_bits(what: &str, a: &Options<'_>, b: &Options<'_>, dims: [usize; 6]) {
    let [bt, hq, hkv, nq, nk, d] = dims;
    let qd = data::<f32>(bt * hq * nq * d, 4, 2.0);
    let kd = data::<f32>(bt * hkv * nk * d, 5, 2.0);
    let vd = data::<f32>(bt * hkv * nk * d, 6, 1.0);
    let q = Tensor4Ref::from_layout(&qd, [bt, hq, nq, d], Layout::Bhsd).unwrap();
    let k = Tensor4Ref::from_layout(&kd, [bt, hkv, nk, d], Layout::Bhsd).unwrap();
    let v = Tensor4Ref::from_layout(&vd, [bt, hkv, nk, d], Layout::Bhsd).unwrap();
    let (x, lx) = attn_optimized::Attention::batched(q, k, v, a)
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap();
    let (y, ly) = attn_optimized::Attention::batched(q, k, v, b)
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap();
    let first_difference = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .position(|(x, y)| x.to_bits() != y.to_bits())
            .map(|i| (i, a[i], b[i]))
    };
    assert_eq!(
        first_difference(x.as_slice(), y.as_slice()),
        None,
        "{what} {dims:?}"
    );
    assert_eq!(first_difference(&lx, &ly), None, "{what}: LSE {dims:?}");
}

#[test]
fn identities_hold_bit_for_bit() {
    let zeros = [0.0f32; 4];
    let no_sinks = [f32::NEG_INFINITY; 4];
    let cap = SoftCap::new(4.0).unwrap();
    let user = UserSoftCap(cap);
    for dims in [
        [2, 4, 2, 300, 500, 32],
        [1, 4, 4, 1, 5000, 64],
        [1, 4, 2, 2, 700, 16],
    ] {
        let plain = Options::default().with_causal(Causal::BottomRight);
        same_bits(
            "zero slopes",
            &plain.with_alibi(Alibi::new(&zeros)),
            &plain,
            dims,
        );
        same_bits("-inf sinks", &plain.with_sinks(&no_sinks), &plain, dims);
        same_bits(
            "user soft-cap",
            &plain.with_score_mod(&user),
            &plain.with_softcap(cap),
            dims,
        );
        // Prefill: the same tiles, the same bits. (Decoding trims the causal diagonal's key
        // block at the last visible key, which a user's mask cannot tell, and the row
        // kernels' dot products round by the block's width: there the rounding differs.)
        if dims[3] > 16 {
            let top_left = Options::default().with_causal(Causal::TopLeft);
            let user = Options::default().with_mask_mod(&TopLeftMask);
            same_bits("user causal", &user, &top_left, dims);
        }
    }
}

#[test]
fn a_row_that_sees_nothing_returns_zero_and_the_sink_as_its_lse() {
    // 8 queries against 3 keys, causal bottom-right: the first 5 rows see nothing.
    let sinks = [0.75f32];
    let opts = Options::default()
        .with_causal(Causal::BottomRight)
        .with_sinks(&sinks);
    let (q, k) = (data::<f32>(8 * 4, 7, 1.0), data::<f32>(3 * 4, 8, 1.0));
    let q = faer::MatRef::from_row_major_slice(&q, 8, 4);
    let k = faer::MatRef::from_row_major_slice(&k, 3, 4);
    let (o, lse) = attn_optimized::Attention::head(q, k, k, &opts)
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap();
    for (i, &l) in lse.iter().enumerate().take(5) {
        assert_eq!(l, 0.75);
        assert!(o.row(i).iter().all(|&x| x == 0.0));
    }
    assert!(lse[5..].iter().all(|&l| l > 0.75));
}

#[test]
fn kv_cache_decoding_with_modifiers_matches_one_pass() {
    let (b, hq, hkv, n, d) = (2, 4, 2, 200, 16);
    let (slopes, sinks) = ([0.2f32, 0.1, 0.05, 0.3], [0.0f32, 1.0, -2.0, 0.5]);
    let opts = Options::default()
        .with_causal(Causal::BottomRight)
        .with_softcap(SoftCap::new(5.0).unwrap())
        .with_alibi(Alibi::new(&slopes))
        .with_sinks(&sinks)
        .with_score_mod(&Bias);
    let qd = data::<f32>(b * n * hq * d, 9, 1.0);
    let kd = data::<f32>(b * n * hkv * d, 10, 1.0);
    let vd = data::<f32>(b * n * hkv * d, 11, 1.0);
    let q = Tensor4Ref::from_layout(&qd, [b, hq, n, d], Layout::Bshd).unwrap();
    let k = Tensor4Ref::from_layout(&kd, [b, hkv, n, d], Layout::Bshd).unwrap();
    let v = Tensor4Ref::from_layout(&vd, [b, hkv, n, d], Layout::Bshd).unwrap();
    let full = attn_reference::Attention::batched(q, k, v, &opts)
        .and_then(|call| call.forward())
        .map(|f| f.into_output())
        .unwrap();
    let mut cache = KvCache::<f32>::new(b, hkv, n, d, d).unwrap();
    // Positions `t` of a `[B, S, H, D]` buffer with `h` heads.
    let step = |buf: &'static [f32], h: usize, t: Range<usize>| {
        Tensor4Ref::new(
            &buf[t.start * h * d..],
            [b, h, t.len(), d],
            [n * h * d, d, h * d],
        )
        .unwrap()
    };
    let (qd, kd, vd): (&'static [f32], &'static [f32], &'static [f32]) =
        (qd.leak(), kd.leak(), vd.leak());
    cache
        .append(step(kd, hkv, 0..120), step(vd, hkv, 0..120))
        .unwrap();
    let first = cache
        .attention(step(qd, hq, 0..120), &opts)
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_output())
        .unwrap();
    let mut outs = vec![first];
    for t in 120..n {
        cache
            .append(step(kd, hkv, t..t + 1), step(vd, hkv, t..t + 1))
            .unwrap();
        outs.push(
            cache
                .attention(step(qd, hq, t..t + 1), &opts)
                .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
                .map(|f| f.into_output())
                .unwrap(),
        );
    }
    for bb in 0..b {
        for h in 0..hq {
            for t in 0..n {
                let (o, row) = if t < 120 {
                    (&outs[0], t)
                } else {
                    (&outs[t - 119], 0)
                };
                let (o, want) = (
                    o.as_ref().head(bb, h).unwrap(),
                    full.as_ref().head(bb, h).unwrap(),
                );
                for c in 0..d {
                    let (x, y) = (o[(row, c)], want[(t, c)]);
                    assert!((x - y).abs() < 2e-5, "b {bb} h {h} t {t}: {x} vs {y}");
                }
            }
        }
    }
}

#[test]
fn packed_sequences_see_their_own_positions() {
    let cu = [0usize, 5, 5, 130, 131];
    let seqs = CuSeqlens::new(&cu, &cu).unwrap();
    let (hq, hkv, d, total) = (4, 2, 16, 131);
    let slopes = [0.3f32, 0.2, 0.1, 0.05];
    let sinks = [0.1f32, 0.2, 0.3, 0.4];
    let opts = Options::default()
        .with_causal(Causal::BottomRight)
        .with_alibi(Alibi::new(&slopes))
        .with_sinks(&sinks)
        .with_score_mod(&Bias)
        .with_mask_mod(&Stripes);
    let qd = data::<f32>(total * hq * d, 12, 1.0);
    let kd = data::<f32>(total * hkv * d, 13, 1.0);
    let vd = data::<f32>(total * hkv * d, 14, 1.0);
    let q = Tensor4Ref::from_layout(&qd, [1, hq, total, d], Layout::Bshd).unwrap();
    let k = Tensor4Ref::from_layout(&kd, [1, hkv, total, d], Layout::Bshd).unwrap();
    let v = Tensor4Ref::from_layout(&vd, [1, hkv, total, d], Layout::Bshd).unwrap();
    let (o, lse) = attn_optimized::Attention::packed(q, k, v, &seqs, &opts)
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap();
    let (r, rlse) = attn_reference::Attention::packed(q, k, v, &seqs, &opts)
        .and_then(|call| call.forward())
        .map(|f| f.into_parts())
        .unwrap();
    for (x, y) in o.as_slice().iter().zip(r.as_slice()) {
        assert!((x - y).abs() < 2e-5, "{x} vs {y}");
    }
    for (x, y) in lse.iter().zip(&rlse) {
        assert!(
            x == y || (x - y).abs() < 2e-5 * (1.0 + y.abs()),
            "{x} vs {y}"
        );
    }
}

#[test]
fn a_row_the_user_mask_hides_from_a_whole_block_sees_none_of_it() {
    // Found by the oracle's split properties: in a row tile, a row whose user-mask coverage
    // of the key block is Hidden (here row 0 against keys 1..3, causal top-left) while the
    // tile's is Partial must see none of the block.
    let q = faer::mat![[0.5f32], [-0.25]];
    let k = faer::mat![[1.0f32], [0.75], [-0.5]];
    let v = faer::mat![[1.0f32], [2.0], [4.0]];
    let opts = Options::default().with_mask_mod(&TopLeftMask);
    let shard = |o: &Options<'_>| {
        attn_optimized::Attention::keys_of(
            q.as_ref(),
            k.as_ref().subrows(1, 2),
            v.as_ref().subrows(1, 2),
            1..3,
            3,
            o,
        )
        .and_then(|call| call.partial_state(attn_optimized::Par::rayon(0)))
        .unwrap()
        .into_parts()
    };
    let (o, lse) = shard(&opts);
    assert_eq!((o[(0, 0)], lse[0]), (0.0, f32::NEG_INFINITY));
    let (oc, lc) = shard(&Options::default().with_causal(Causal::TopLeft));
    assert_eq!((o[(1, 0)], lse[1]), (oc[(1, 0)], lc[1]));
}

#[test]
fn sinks_cannot_be_counted_once_per_shard() {
    let x = faer::Mat::<f32>::from_fn(4, 4, |i, j| (i + j) as f32 * 0.1);
    let sinks = [0.5f32];
    let opts = Options::default().with_sinks(&sinks);
    let r = attn_optimized::Attention::keys_of(x.as_ref(), x.as_ref(), x.as_ref(), 0..4, 4, &opts)
        .and_then(|call| call.partial_state(attn_optimized::Par::rayon(0)));
    assert!(matches!(r, Err(Error::Unsupported { .. })));
}

#[test]
fn huge_scores_are_capped_not_overflowed() {
    // q·k overflows f32 (1e30 · 1e30): the exact rescore runs before the cap, which then
    // brings every score to ±c: the row is the average of the values at the cap.
    let cap = SoftCap::new(2.0).unwrap();
    let q = faer::mat![[1e30f32, 0.0]];
    let k = faer::mat![[1e30f32, 0.0], [-1e30, 0.0]];
    let v = faer::mat![[1.0f32, 0.0], [0.0, 1.0]];
    let opts = Options::default().with_softcap(cap).with_scale(1.0);
    let o = attn_optimized::attention(q.as_ref(), k.as_ref(), v.as_ref(), &opts).unwrap();
    let r = attn_reference::attention(q.as_ref(), k.as_ref(), v.as_ref(), &opts).unwrap();
    let want = 1.0 / (1.0 + (-4.0f32).exp());
    assert!((o[(0, 0)] - want).abs() < 1e-6 && (r[(0, 0)] - want).abs() < 1e-6);
}

#[test]
fn overflowed_scores_under_alibi_are_recomputed_before_the_bias() {
    // Scores overflow f32 in a tile with nothing hidden: ALiBi keeps them non-finite, so
    // the softmax's own check finds them, and the tile is recomputed from its raw scores.
    let (n, d) = (40, 2);
    let q = faer::Mat::<f32>::from_fn(n, d, |i, c| {
        if c == 0 {
            1e30 * (1.0 + i as f32 * 0.01)
        } else {
            0.5
        }
    });
    let k = faer::Mat::<f32>::from_fn(n, d, |j, c| {
        if c == 0 {
            if j % 2 == 0 { 1e30 } else { -1e30 }
        } else {
            j as f32 * 0.1
        }
    });
    let v = faer::Mat::<f32>::from_fn(n, d, |j, c| (j * 3 + c) as f32 * 0.05);
    let slopes = [0.5f32];
    let opts = Options::default()
        .with_scale(1.0)
        .with_alibi(Alibi::new(&slopes));
    let (o, lse) = attn_optimized::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap();
    let (r, rlse) = attn_reference::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
        .and_then(|call| call.forward())
        .map(|f| f.into_parts())
        .unwrap();
    for i in 0..n {
        for c in 0..d {
            assert!(
                (o[(i, c)] - r[(i, c)]).abs() < 1e-5,
                "({i}, {c}): {} vs {}",
                o[(i, c)],
                r[(i, c)]
            );
        }
        assert!(
            lse[i].is_finite() && (lse[i] - rlse[i]).abs() <= 1e-6 * rlse[i].abs(),
            "{} vs {}",
            lse[i],
            rlse[i]
        );
    }
}
