//! The worked examples of `docs/attention.md`, as inputs: the walkthrough example prints
//! them step by step and the tests assert their numbers.

use faer::{Mat, mat};

/// One head's operands.
#[derive(Debug, Clone)]
pub struct Example {
    /// What the example shows.
    pub title: &'static str,
    /// Queries `[n_q, d_k]`.
    pub q: Mat<f32>,
    /// Keys `[n_k, d_k]`.
    pub k: Mat<f32>,
    /// Values `[n_k, d_v]`.
    pub v: Mat<f32>,
}

/// Two tokens, `Q = K = I₂`, `V = [[2,0],[0,4]]`, `d_k = 2`: each token scores itself
/// `1/√2` and the other `0`, so it keeps ≈ 0.6698 of its own value.
///
/// ```
/// let ex = attn_reference::worked::two_tokens();
/// assert_eq!(ex.v[(1, 1)], 4.0);
/// ```
pub fn two_tokens() -> Example {
    let eye = mat![[1.0f32, 0.0], [0.0, 1.0]];
    Example {
        title: "two tokens, Q = K = I2, V = [[2,0],[0,4]]",
        q: eye.clone(),
        k: eye,
        v: mat![[2.0f32, 0.0], [0.0, 4.0]],
    }
}

/// One query against three keys whose scaled scores are `2, 0, 1` (`d_k = 4`, scale ½):
/// the weights are ≈ 0.665, 0.090, 0.245.
///
/// ```
/// let ex = attn_reference::worked::three_positions();
/// assert_eq!((ex.q.nrows(), ex.k.nrows()), (1, 3));
/// ```
pub fn three_positions() -> Example {
    Example {
        title: "one query, three keys with scaled scores 2, 0, 1",
        q: mat![[1.0f32, 1.0, 1.0, 1.0]],
        k: mat![
            [1.0f32, 1.0, 1.0, 1.0],
            [1.0, -1.0, 1.0, -1.0],
            [1.0, 1.0, 0.0, 0.0]
        ],
        v: mat![[1.0f32, 0.0], [0.0, 1.0], [1.0, 1.0]],
    }
}
