//! Score modifiers (issue 16) are not in the streaming engine yet: every entry point says
//! so with a typed error rather than ignoring them.

use attn_core::{Alibi, Error, Layout, Options, SoftCap, Tensor4Ref};
use faer::Mat;

#[test]
fn every_entry_point_rejects_score_modifiers_it_does_not_compute() {
    let x = Mat::<f32>::from_fn(4, 4, |i, j| (i + j) as f32 * 0.1);
    let (slope, sink) = ([0.5f32], [0.5f32]);
    let cap = SoftCap::new(5.0).unwrap();
    let all = [
        Options::default().with_softcap(cap),
        Options::default().with_alibi(Alibi::new(&slope)),
        Options::default().with_sinks(&sink),
    ];
    let flat: Vec<f32> = (0..16).map(|i| i as f32 * 0.1).collect();
    let t = Tensor4Ref::from_layout(&flat, [1, 1, 4, 4], Layout::Bhsd).unwrap();
    for opts in &all {
        let unsupported = |r: Result<(), Error>| matches!(r, Err(Error::Unsupported { .. }));
        assert!(unsupported(
            attn_optimized::attention(x.as_ref(), x.as_ref(), x.as_ref(), opts).map(|_| ())
        ));
        assert!(unsupported(
            attn_optimized::attention_batched(t, t, t, opts).map(|_| ())
        ));
        assert!(unsupported(
            attn_optimized::partial_attention(x.as_ref(), x.as_ref(), x.as_ref(), 0..4, 4, opts)
                .map(|_| ())
        ));
    }
}
