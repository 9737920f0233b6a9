//! The contract's own rules: visibility, tile coverage, layouts, validation.

use attn_core::{
    BoolMask, Causal, Error, HeadMask, Layout, Options, SlidingWindow, Tensor4, Tensor4Mut,
    Tensor4Ref, TileCoverage, validate_batch,
};
use faer::Mat;

fn brute_visible(mask: &HeadMask<'_>, i: usize, j: usize) -> bool {
    mask.allows(i, j)
}

#[test]
fn key_range_matches_the_definitions_of_each_constraint() {
    for (n_q, n_k) in [(5usize, 5usize), (3, 8), (8, 3), (1, 7), (7, 1)] {
        let off = n_k as i64 - n_q as i64;
        let opts = Options::default()
            .with_causal(Causal::BottomRight)
            .with_window(SlidingWindow::new(Some(2), Some(1), Causal::TopLeft))
            .with_key_length(n_k.saturating_sub(1));
        let mask = HeadMask::new(&opts, n_q, n_k, opts.key_length(0));
        for i in 0..n_q {
            for j in 0..n_k {
                let (ii, jj) = (i as i64, j as i64);
                let want = jj <= ii + off && ii - 2 <= jj && jj <= ii + 1 && j + 1 < n_k;
                assert_eq!(
                    brute_visible(&mask, i, j),
                    want,
                    "n_q={n_q} n_k={n_k} i={i} j={j}"
                );
            }
        }
    }
}

#[test]
fn tile_coverage_agrees_with_entrywise_visibility() {
    let opts = Options::default()
        .with_causal(Causal::TopLeft)
        .with_window(SlidingWindow::new(Some(9), None, Causal::TopLeft));
    let (n_q, n_k) = (40, 37);
    let mask = HeadMask::new(&opts, n_q, n_k, None);
    for (br, bc) in [(4, 8), (7, 5), (16, 16)] {
        for r0 in (0..n_q).step_by(br) {
            for c0 in (0..n_k).step_by(bc) {
                let rows = r0..(r0 + br).min(n_q);
                let cols = c0..(c0 + bc).min(n_k);
                let seen: Vec<bool> = rows
                    .clone()
                    .flat_map(|i| cols.clone().map(move |j| (i, j)))
                    .map(|(i, j)| mask.allows(i, j))
                    .collect();
                let want = if seen.iter().all(|&x| x) {
                    TileCoverage::Full
                } else if seen.iter().any(|&x| x) {
                    TileCoverage::Partial
                } else {
                    TileCoverage::Hidden
                };
                assert_eq!(mask.tile_coverage(rows, cols), want);
            }
        }
    }
}

#[test]
fn both_layouts_view_the_same_logical_element() {
    let dims = [2, 3, 4, 5];
    for layout in [Layout::Bhsd, Layout::Bshd] {
        let [sb, sh, ss] = layout.strides(dims);
        let mut data = vec![0.0f32; 120];
        for b in 0..2 {
            for h in 0..3 {
                for s in 0..4 {
                    for d in 0..5 {
                        data[b * sb + h * sh + s * ss + d] =
                            (1000 * b + 100 * h + 10 * s + d) as f32;
                    }
                }
            }
        }
        let t = Tensor4Ref::from_layout(&data, dims, layout).unwrap();
        assert_eq!(t.head(1, 2).unwrap()[(3, 4)], 1234.0);
        let mut data2 = data.clone();
        let mut tm = Tensor4Mut::from_layout(&mut data2, dims, layout).unwrap();
        tm.head_mut(0, 1).unwrap()[(2, 3)] = -1.0;
        assert_eq!(data2[sh + 2 * ss + 3], -1.0);
    }
}

#[test]
fn views_that_do_not_fit_are_rejected() {
    let data = vec![0.0f32; 10];
    assert!(matches!(
        Tensor4Ref::from_layout(&data, [1, 1, 3, 4], Layout::Bhsd),
        Err(Error::Layout { .. })
    ));
    assert!(
        Tensor4Ref::new(&data, [4, 1, 1, 10], [0, 0, 0]).is_ok(),
        "broadcast reads are fine"
    );
    assert!(matches!(
        Tensor4Ref::new(&data, [1, 1, 1, 2], [0, 0, 0])
            .unwrap()
            .head(1, 0),
        Err(Error::OutOfRange { .. })
    ));
}

#[test]
fn batch_validation_names_operands() {
    let q = vec![0.0f32; 2 * 4 * 3 * 8];
    let k = vec![0.0f32; 2 * 2 * 5 * 8];
    let q = Tensor4Ref::from_layout(&q, [2, 4, 3, 8], Layout::Bhsd).unwrap();
    let k = Tensor4Ref::from_layout(&k, [2, 2, 5, 8], Layout::Bhsd).unwrap();
    let k1 = Tensor4Ref::new(k_slice(), [1, 2, 5, 8], [0, 0, 8]).unwrap();
    assert!(validate_batch(q, k, k, &Options::default()).is_ok());
    assert_eq!(
        validate_batch(q, k1, k1, &Options::default())
            .unwrap_err()
            .to_string(),
        "K has 1 batch entries but Q has 2 (batch must match)"
    );
    let lens = [5];
    assert!(matches!(
        validate_batch(q, k, k, &Options::default().with_key_lengths(&lens)),
        Err(Error::DimensionMismatch {
            operand: "key lengths",
            ..
        })
    ));
    let bm = Mat::from_fn(3, 4, |_, _| true);
    assert!(matches!(
        validate_batch(
            q,
            k,
            k,
            &Options::default().with_bool_mask(BoolMask::allow(bm.as_ref()))
        ),
        Err(Error::ShapeMismatch {
            operand: "boolean mask",
            ..
        })
    ));
}

fn k_slice() -> &'static [f32] {
    &[0.0; 40]
}

/// The panic message of `f`, which must panic.
fn panic_message(f: impl FnOnce() + std::panic::UnwindSafe) -> String {
    let payload = std::panic::catch_unwind(f).expect_err("must panic");
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn tensor4_from_vec_rejects_dims_whose_product_overflows() {
    // 2^32 · 2^32 wraps to 0 in release: an empty buffer must not pass for 2^64 elements.
    let err = Tensor4::from_vec(Vec::<f32>::new(), [1 << 32, 1 << 32, 1, 1]).unwrap_err();
    assert!(matches!(err, Error::Layout { .. }), "{err}");
    assert!(err.to_string().contains("overflow"), "{err}");
    // A zero dim makes the product 0 whatever the others are.
    let dims = [1 << 40, 1 << 40, 0, 1 << 40];
    let t = Tensor4::from_vec(Vec::<f32>::new(), dims).unwrap();
    assert_eq!(t.dims(), dims);
    let head = t.as_ref().head((1 << 40) - 1, 7).unwrap();
    assert_eq!((head.nrows(), head.ncols()), (0, 1 << 40));
}

#[test]
fn tensor4_zeros_of_a_size_that_cannot_exist_panics_with_a_message() {
    let msg = panic_message(|| {
        Tensor4::<f32>::zeros([1 << 32, 1 << 32, 1, 1]);
    });
    assert!(msg.contains("could not allocate"), "{msg}");
}

#[test]
fn layout_strides_saturate_and_such_views_are_rejected() {
    assert_eq!(Layout::Bhsd.strides([2, 3, 4, 5]), [60, 20, 5]);
    assert_eq!(Layout::Bshd.strides([2, 3, 4, 5]), [60, 5, 15]);
    let dims = [2, 1 << 32, 1 << 32, 1 << 32];
    for layout in [Layout::Bhsd, Layout::Bshd] {
        assert!(layout.strides(dims).contains(&usize::MAX), "{layout:?}");
        assert!(matches!(
            Tensor4Ref::<f32>::from_layout(&[], dims, layout),
            Err(Error::Layout { .. })
        ));
        assert!(matches!(
            Tensor4Mut::<f32>::from_layout(&mut [], dims, layout),
            Err(Error::Layout { .. })
        ));
    }
}

#[test]
fn empty_views_with_huge_strides_have_empty_heads() {
    // No element is reached, so any strides fit; indexing a head must not overflow.
    let dims = [2, 2, 0, 4];
    let strides = [usize::MAX, usize::MAX, 0];
    let t = Tensor4Ref::<f32>::new(&[], dims, strides).unwrap();
    let h = t.head(1, 1).unwrap();
    assert_eq!((h.nrows(), h.ncols()), (0, 4));
    let mut buf: [f32; 0] = [];
    let mut m = Tensor4Mut::new(&mut buf, dims, strides).unwrap();
    let h = m.head_mut(1, 1).unwrap();
    assert_eq!((h.nrows(), h.ncols()), (0, 4));
}

#[test]
fn a_reversed_head_range_of_a_view_with_usize_max_heads_is_an_error() {
    let t = Tensor4Ref::new(&[0.0f32; 2], [1, usize::MAX, 1, 2], [0, 0, 0]).unwrap();
    #[expect(clippy::reversed_empty_ranges, reason = "the hostile input under test")]
    let err = t.heads_at(0, 5..3, 0).unwrap_err();
    assert!(matches!(err, Error::OutOfRange { .. }), "{err}");
    assert_eq!(t.heads_at(0, 3..5, 0).unwrap().nrows(), 2);
}

#[test]
fn a_tile_the_boolean_mask_hides_entirely_is_hidden() {
    // Keys 4..8 are blocked for every query; causal leaves key 0..=i visible.
    let allow = Mat::from_fn(8, 8, |_, j| j < 4);
    let opts = Options::default()
        .with_causal(Causal::TopLeft)
        .with_bool_mask(BoolMask::allow(allow.as_ref()));
    let mask = HeadMask::new(&opts, 8, 8, None);
    assert_eq!(mask.tile_coverage(4..8, 4..8), TileCoverage::Hidden);
    assert_eq!(mask.tile_coverage(4..8, 0..4), TileCoverage::Full);
    // One allowed entry inside the structure keeps the tile.
    let one = Mat::from_fn(8, 8, |i, j| j < 4 || (i, j) == (7, 5));
    let opts = opts.with_bool_mask(BoolMask::allow(one.as_ref()));
    let mask = HeadMask::new(&opts, 8, 8, None);
    assert_eq!(mask.tile_coverage(4..8, 4..8), TileCoverage::Partial);
    // An allowed entry that the structure hides does not.
    let hidden = Mat::from_fn(8, 8, |i, j| j < 4 || (i, j) == (4, 6));
    let opts = opts.with_bool_mask(BoolMask::allow(hidden.as_ref()));
    let mask = HeadMask::new(&opts, 8, 8, None);
    assert_eq!(mask.tile_coverage(4..8, 4..8), TileCoverage::Hidden);
}

#[test]
fn four_d_masks_resolve_per_head_with_every_broadcast() {
    use attn_core::{BoolMask4, Mask4Ref};
    // [B=2, H=3, n_q=2, n_k=4], row-major, every entry distinct.
    let bits: Vec<bool> = (0..2 * 3 * 2 * 4).map(|e| (e * 7) % 5 < 2).collect();
    let at = |b: usize, h: usize, i: usize, j: usize| bits[((b * 3 + h) * 2 + i) * 4 + j];
    let full = Mask4Ref::contiguous(&bits, [2, 3, 2, 4]).unwrap();
    // Column-major inner axes over the same logical entries.
    let transposed: Vec<bool> = (0..2 * 3 * 4 * 2)
        .map(|e| {
            let (bh, rest) = (e / 8, e % 8);
            at(bh / 3, bh % 3, rest % 2, rest / 2)
        })
        .collect();
    let col = Mask4Ref::new(&transposed, [2, 3, 2, 4], [24, 8, 1, 2]).unwrap();
    // Batch entry 1 broadcast by a stride of 0, and by a length of 1.
    let stride0 = Mask4Ref::new(&bits[24..], [2, 3, 2, 4], [0, 8, 4, 1]).unwrap();
    let len1 = Mask4Ref::new(&bits[24..], [1, 3, 2, 4], [0, 8, 4, 1]).unwrap();
    for b in 0..2 {
        for h in 0..3 {
            let opts = |m| Options::default().with_bool_mask_4d(BoolMask4::allow(m));
            for (i, j) in (0..2).flat_map(|i| (0..4).map(move |j| (i, j))) {
                for (view, want) in [
                    (full, at(b, h, i, j)),
                    (col, at(b, h, i, j)),
                    (stride0, at(1, h, i, j)),
                    (len1, at(1, h, i, j)),
                ] {
                    let o = opts(view);
                    let m = HeadMask::for_head(&o, b, h, 2, 4, None).unwrap();
                    assert_eq!(m.allows(i, j), want, "b {b} h {h} [{i}, {j}]");
                }
            }
        }
    }
    // Query and key axes broadcast: one bit per (b, h).
    let one = Mask4Ref::new(&bits, [2, 3, 1, 1], [3, 1, 0, 0]).unwrap();
    let o = Options::default().with_bool_mask_4d(BoolMask4::block(one));
    let m = HeadMask::for_head(&o, 1, 2, 5, 6, None).unwrap();
    assert_eq!(m.allows(4, 5), !bits[5]);
}
