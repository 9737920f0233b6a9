//! A score modifier with learnable parameters: the backward pass hands it the gradient of
//! the scores it produced ([`ScoreMod::score_gradient`]), from which learned ALiBi slopes
//! get theirs — equal to the reference's `Σ dS_ij·(j − i)` over its materialised `dS`.

mod common;

use std::sync::Mutex;

use attn_core::{Causal, Options, ScoreGradient, ScoreMod, Tensor4};
use attn_optimized::{Attention, Par};

/// ALiBi with a learnable slope per query head: `s + m_h·(j − i)`.
#[derive(Debug)]
struct LearnedAlibi {
    slopes: Vec<f32>,
    grads: Mutex<Vec<f64>>,
}

impl ScoreMod for LearnedAlibi {
    fn score(&self, s: f32, _: usize, h: usize, i: usize, j: usize) -> f32 {
        s + self.slopes[h] * (j as f32 - i as f32)
    }
    fn derivative(&self, _: f32, _: usize, _: usize, _: usize, _: usize) -> f32 {
        1.0
    }
    fn score_gradient(&self, g: &ScoreGradient<'_>) {
        let mut sum = 0.0f64;
        g.for_each(|ds, i, j| sum += f64::from(ds) * (j as f64 - i as f64));
        self.grads.lock().expect("not poisoned")[g.head()] += sum;
    }
}

#[test]
fn learned_alibi_slopes_get_the_references_gradient() {
    let (b, h, n, d) = (2, 3, 300, 16);
    let dims = [b, h, n, d];
    let t = |seed| {
        Tensor4::from_vec(common::data::<f32>(b * h * n * d, seed, 1.0), dims).expect("sized")
    };
    let (q, k, v, d_out) = (t(1), t(2), t(3), t(4));
    let alibi = LearnedAlibi {
        slopes: vec![-0.05, -0.01, 0.02],
        grads: Mutex::new(vec![0.0; h]),
    };
    let opts = Options::default()
        .with_causal(Causal::TopLeft)
        .with_score_mod(&alibi);
    let call = Attention::batched(q.as_ref(), k.as_ref(), v.as_ref(), &opts).expect("valid");
    let fwd = call.forward(Par::rayon(0)).expect("runs");
    call.backward(&fwd, d_out.as_ref(), Par::rayon(0))
        .expect("runs");
    let got = alibi.grads.lock().expect("not poisoned").clone();

    // The reference's dS, summed over batch entries, rows and keys.
    let reference = attn_reference::Attention::batched(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
        .expect("valid");
    let heads = reference
        .backward_materialized(d_out.as_ref())
        .expect("runs");
    let mut want = vec![0.0f64; h];
    let mut scale = vec![0.0f64; h];
    for per_head in &heads {
        for (hh, m) in per_head.iter().enumerate() {
            for i in 0..n {
                for j in 0..n {
                    let x = m.ds_modified[(i, j)] * (j as f64 - i as f64);
                    want[hh] += x;
                    scale[hh] += x.abs();
                }
            }
        }
    }
    for hh in 0..h {
        let err = (got[hh] - want[hh]).abs();
        assert!(
            err <= 1e-4 * scale[hh],
            "head {hh}: {} but the reference says {} (Σ|terms| {})",
            got[hh],
            want[hh],
            scale[hh]
        );
    }
}
