//! Sizes a caller can ask for with safe code (broadcast views, zero strides, empty axes) that
//! no buffer can hold: every entry point returns an error before any work, never a panic or
//! an abort; and `Element`'s widening on mismatched lengths.

use attn_optimized::{Attention, Element, Error, Options, Par, Tensor4Mut, Tensor4Ref, attention};
use faer::{Mat, MatRef};
use half::{bf16, f16};

/// `rows` copies of the row `row`: a zero-row-stride view, free to build for any `rows`.
fn repeated<T>(row: &[T], rows: usize) -> MatRef<'_, T> {
    MatRef::from_row_major_slice_with_stride(row, rows, row.len(), 0)
}

/// A `[b, h, s, row.len()]` view of one repeated row.
fn broadcast<T>(row: &[T], [b, h, s]: [usize; 3]) -> Tensor4Ref<'_, T> {
    Tensor4Ref::new(row, [b, h, s, row.len()], [0, 0, 0]).unwrap()
}

fn is_allocation(r: Result<impl Sized, Error>, what: &str) {
    match r {
        Err(e @ Error::Allocation { .. }) => assert!(e.to_string().contains(what), "{e}"),
        Err(e) => panic!("expected an allocation error for {what}, got {e}"),
        Ok(_) => panic!("expected an allocation error for {what}, got Ok"),
    }
}

#[test]
fn single_head_outputs_that_cannot_be_allocated_are_errors() {
    // 2^44 queries × 64 floats = 2^52 bytes of output: more than any address space here.
    let row = vec![0.5f32; 64];
    let (q, kv) = (repeated(&row, 1 << 44), repeated(&row, 3));
    let opts = Options::default();
    is_allocation(attention(q, kv, kv, &opts), "attention output");
    is_allocation(
        Attention::head(q, kv, kv, &opts)
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_parts()),
        "attention output",
    );
    is_allocation(
        Attention::keys_of(q, kv, kv, 0..3, 3, &opts)
            .and_then(|call| call.partial_state(Par::rayon(0))),
        "output",
    );
    let half: Vec<f16> = row.iter().map(|&x| f16::from_f32(x)).collect();
    let (q, kv) = (repeated(&half, 1 << 44), repeated(&half, 3));
    is_allocation(attention(q, kv, kv, &opts), "attention output");
    // An output whose byte size overflows usize.
    let (q, kv) = (repeated(&row, usize::MAX / 2), repeated(&row, 3));
    is_allocation(attention(q, kv, kv, &opts), "attention output");
}

#[test]
fn single_head_lse_that_cannot_be_allocated_is_an_error() {
    // Values of width 0: the output holds nothing, but 2^50 LSE floats (2^52 bytes) do not
    // fit.
    let row = [0.5f32; 4];
    let (q, k) = (repeated(&row, 1 << 50), repeated(&row, 3));
    let v = repeated(&row[..0], 3);
    let opts = Options::default();
    is_allocation(
        Attention::head(q, k, v, &opts)
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_parts()),
        "LSE",
    );
    is_allocation(
        Attention::keys_of(q, k, v, 0..3, 3, &opts)
            .and_then(|call| call.partial_state(Par::rayon(0))),
        "LSE",
    );
}

#[test]
fn batched_outputs_that_cannot_be_allocated_are_errors() {
    let row = [0.5f32; 4];
    let kv = broadcast(&row, [1, 1, 3]);
    let opts = Options::default();
    // 2^62 positions × 4 floats: the output's size overflows usize.
    let q = broadcast(&row, [1, 1, 1 << 62]);
    is_allocation(
        Attention::batched(q, kv, kv, &opts)
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_output()),
        "attention output",
    );
    is_allocation(
        Attention::batched(q, kv, kv, &opts)
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_parts()),
        "attention output",
    );
    // 2^42 positions × 4 floats = 2^46 elements, 2^48 bytes: representable, not allocatable.
    let q = broadcast(&row, [1, 1, 1 << 42]);
    is_allocation(
        Attention::batched(q, kv, kv, &opts)
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_output()),
        "attention output",
    );
}

#[test]
fn batched_lse_whose_length_overflows_is_an_error() {
    // Values of width 0 make the output empty; batch · heads · positions = 2^64 rows of LSE.
    let row = [0.5f32; 4];
    let q = broadcast(&row, [1 << 32, 1 << 32, 1]);
    let k = broadcast(&row, [1 << 32, 1, 1]);
    let v = broadcast(&row[..0], [1 << 32, 1, 1]);
    let opts = Options::default();
    is_allocation(
        Attention::batched(q, k, v, &opts)
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_parts()),
        "rows",
    );
    is_allocation(
        Attention::batched(q, k, v, &opts)
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_output()),
        "rows",
    );
    // 2^50 rows of LSE: a count that fits, 2^52 bytes that do not.
    let q = broadcast(&row, [1, 1, 1 << 50]);
    let (k, v) = (broadcast(&row, [1, 1, 1]), broadcast(&row[..0], [1, 1, 1]));
    is_allocation(
        Attention::batched(q, k, v, &opts)
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_parts()),
        "LSE",
    );
}

#[test]
fn huge_but_empty_batched_problems_are_fine() {
    // No query position: 2^40 batch entries of 2^40 heads have an empty output.
    let row = [0.5f32; 4];
    let q = broadcast(&row, [1 << 40, 1 << 40, 0]);
    let kv = broadcast(&row, [1 << 40, 1, 3]);
    let opts = Options::default();
    let o = Attention::batched(q, kv, kv, &opts)
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_output())
        .unwrap();
    assert_eq!(o.dims(), [1 << 40, 1 << 40, 0, 4]);
    assert!(o.as_slice().is_empty());
    let (o, lse) = Attention::batched(q, kv, kv, &opts)
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap();
    assert_eq!((o.dims()[2], lse.len()), (0, 0));
    let mut none: [f32; 0] = [];
    let out = Tensor4Mut::new(&mut none, [1 << 40, 1 << 40, 0, 4], [0, 0, 4]).unwrap();
    Attention::batched(q, kv, kv, &opts)
        .and_then(|call| call.forward_into(out, None, Par::rayon(0)))
        .unwrap();
}

/// `widen` converts `min(src.len(), dst.len())` elements, returns how many, and leaves the
/// rest of `dst` alone; `widen_rows` writes row `i` into the `i`-th whole chunk of `d`
/// floats, at most `d` of its elements, and skips rows that have no whole chunk.
fn widening_takes_what_fits<T: Element>() {
    let src: Vec<T> = (0..37).map(|i| T::from_f32(i as f32 - 3.0)).collect();
    let want = |i: usize| i as f32 - 3.0;
    for dst_len in [0, 5, 16, 36, 37, 40, 80] {
        let mut dst = vec![-100.0f32; dst_len];
        let n = T::widen(&src, &mut dst);
        assert_eq!(n, dst_len.min(37), "{} into {dst_len}", T::NAME);
        for (i, &x) in dst.iter().enumerate() {
            let expect = if i < n { want(i) } else { -100.0 };
            assert_eq!(x, expect, "{} into {dst_len}: element {i}", T::NAME);
        }
    }
    // Rows longer than d, shorter than d, and more rows than whole chunks of dst.
    let d = 20;
    let rows: [&[T]; 4] = [&src[..], &src[..7], &src[3..23], &src[..d]];
    let mut dst = vec![-100.0f32; 3 * d - 1]; // two whole chunks
    T::widen_rows(&rows, d, &mut dst);
    for c in 0..d {
        assert_eq!(dst[c], want(c), "{}: row 0 (longer than d)", T::NAME);
        let short = if c < 7 { want(c) } else { -100.0 };
        assert_eq!(dst[d + c], short, "{}: row 1 (shorter than d)", T::NAME);
    }
    assert!(dst[2 * d..].iter().all(|&x| x == -100.0), "{}", T::NAME);
    // d = 0 writes nothing, whatever the rows.
    let mut dst = vec![-100.0f32; 3];
    T::widen_rows(&rows, 0, &mut dst);
    assert_eq!(dst, [-100.0; 3]);
}

#[test]
fn widening_f32_takes_what_fits() {
    widening_takes_what_fits::<f32>();
}

#[test]
fn widening_f16_takes_what_fits() {
    widening_takes_what_fits::<f16>();
}

#[test]
fn widening_bf16_takes_what_fits() {
    widening_takes_what_fits::<bf16>();
}

#[test]
fn small_problems_still_allocate_and_compute() {
    let q = Mat::<f32>::from_fn(5, 4, |i, j| (i + j) as f32 * 0.1);
    let (o, lse) = Attention::head(q.as_ref(), q.as_ref(), q.as_ref(), &Options::default())
        .and_then(|call| call.forward(Par::rayon(0)))
        .map(|f| f.into_parts())
        .unwrap();
    assert_eq!((o.nrows(), o.ncols(), lse.len()), (5, 4, 5));
    assert!(lse.iter().all(|l| l.is_finite()));
}

#[test]
fn a_layer_whose_projections_cannot_be_allocated_is_an_error() {
    use attn_core::MultiHeadWeights;
    use attn_optimized::MultiHeadAttention;
    let w = |r, c| Mat::<f32>::from_fn(r, c, |i, j| ((i + j) % 3) as f32 * 0.25);
    let layer = MultiHeadAttention::new(
        MultiHeadWeights::new(w(8, 8), w(8, 8), w(8, 8), w(8, 8), 2, 2).unwrap(),
    );
    // 2^46 tokens of one repeated row: the projections alone would need 2 PiB.
    let row = [0.5f32; 8];
    let x = repeated(&row, 1 << 46);
    is_allocation(layer.forward(x, &Options::default()), "projection");
}
