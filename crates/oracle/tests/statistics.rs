//! Property 4: the √d_k variance argument, checked on the reference's scores.

use attn_core::Options;
use attn_oracle::stats::{check_score_variance, score_variance_with};

#[test]
fn dot_product_variance_is_d_k_and_scaled_scores_unit() {
    let samples = check_score_variance(0x5eed).unwrap();
    for s in &samples {
        eprintln!("{s:?}");
    }
}

#[test]
fn variance_check_rejects_a_missing_or_wrong_scale() {
    for d in [4, 64, 1024] {
        let unscaled = score_variance_with(1, &[d], 512, &|_| Options::default().with_scale(1.0));
        assert!(unscaled.is_err(), "a missing scale passed at d_k = {d}");
        let by_d = score_variance_with(1, &[d], 512, &|d| {
            Options::default().with_scale(1.0 / d as f32)
        });
        assert!(by_d.is_err(), "a 1/d_k scale passed at d_k = {d}");
    }
}
