//! What the ranks agree on before the ring turns: every rank's shape, exchanged in one
//! allgather and checked identically everywhere, so that a disagreement is the same error on
//! every rank instead of a hang.

use attn_core::{Dtype, Error, Tensor4Ref};
use attn_optimized::Element;

use crate::split::{Segment, segments};
use crate::{RingError, RingOptions};

/// The shape every rank shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    pub batch: usize,
    pub h_q: usize,
    pub h_kv: usize,
    pub d_k: usize,
    pub d_v: usize,
}

impl Shape {
    /// Elements of one rank's K then V block of `rows` positions.
    pub fn kv_len(&self, rows: usize) -> (usize, usize) {
        let heads = self.batch * self.h_kv * rows;
        (heads * self.d_k, heads * self.d_v)
    }

    pub fn group(&self) -> usize {
        self.h_q / self.h_kv.max(1)
    }

    /// Checks that every buffer a rank of `rows` positions holds, or receives from another,
    /// has a size that fits: [`Shape::kv_len`] and the other products are unchecked after
    /// this. Counted in f32s (the widest element a ring stores: the states, the gradients),
    /// so that the bytes fit an allocation too (at most `isize::MAX`). A broadcast (stride 0)
    /// axis makes huge shapes from small buffers: 2^62 query heads must be this error, on
    /// every rank alike, not an overflow inside the ring.
    pub fn check_sizes(&self, rows: usize) -> attn_core::Result<()> {
        let fits = |what: &'static str, factors: &[usize]| {
            let n = factors.iter().try_fold(1usize, |a, &f| a.checked_mul(f));
            match n.and_then(|n| n.checked_mul(size_of::<f32>())) {
                Some(bytes) if bytes <= isize::MAX as usize => Ok(()),
                _ => Err(Error::allocation_of::<f32>(what, n)),
            }
        };
        let kv_width = self.d_k.checked_add(self.d_v);
        let kv_width = kv_width.ok_or_else(|| Error::allocation_of::<f32>("K/V block", None))?;
        fits("K/V block", &[self.batch, self.h_kv, rows, kv_width])?;
        fits("output", &[self.batch, self.h_q, rows, self.d_v])?;
        fits("dQ", &[self.batch, self.h_q, rows, self.d_k])?;
        fits("LSE", &[self.batch, self.h_q, rows])
    }
}

/// Which pass a descriptor was made for (ranks calling different passes disagree).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    Forward = 0,
    Backward = 1,
}

/// The fields of a descriptor, in order, and their names in errors.
const FIELDS: [&str; 11] = [
    "valid inputs",
    "pass",
    "batch",
    "query heads",
    "key/value heads",
    "d_k",
    "d_v",
    "element type",
    "causal",
    "scale",
    "split",
];
/// Descriptor length: the fields and the row count.
pub(crate) const DESC_LEN: usize = FIELDS.len() + 1;

/// One rank's descriptor: the fields, then its row count.
pub(crate) type Desc = [u64; DESC_LEN];

fn element_code<T: Element>() -> u64 {
    match T::DTYPE {
        Dtype::F32 => 1,
        Dtype::F16 => 2,
        Dtype::Bf16 => 3,
    }
}

/// The local checks of a forward call's shards: their shape, and the rows they hold.
pub(crate) fn check_forward<T>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    options: &RingOptions,
) -> attn_core::Result<(Shape, usize)> {
    let [b, h_q, n, d_k] = q.dims();
    let [bk, h_kv, nk, dk2] = k.dims();
    let [bv, h_v, nv, d_v] = v.dims();
    let same = "every rank's shards hold the same positions of Q, K and V";
    for (operand, axis, found, expected) in [
        ("K", "batch entries", bk, b),
        ("V", "batch entries", bv, b),
        ("K", "rows", nk, n),
        ("V", "rows", nv, n),
        ("K", "columns", dk2, d_k),
    ] {
        if found != expected {
            return Err(Error::mismatch(operand, axis, found, "Q", expected, same));
        }
    }
    if h_v != h_kv {
        return Err(Error::mismatch(
            "V",
            "heads",
            h_v,
            "K",
            h_kv,
            "K and V have the same heads",
        ));
    }
    if h_kv == 0 || h_q % h_kv != 0 {
        return Err(Error::head_grouping(h_q, h_kv));
    }
    options.options().scale_for(d_k)?; // rejects d_k = 0 and a bad scale
    let shape = Shape {
        batch: b,
        h_q,
        h_kv,
        d_k,
        d_v,
    };
    Ok((shape, n))
}

/// A descriptor of this rank's call (`None`: its inputs were rejected).
pub(crate) fn describe<T: Element>(
    local: Option<(Shape, usize)>,
    pass: Pass,
    options: &RingOptions,
) -> Desc {
    let mut d = [0u64; DESC_LEN];
    if let Some((s, rows)) = local {
        d = [
            1,
            pass as u64,
            s.batch as u64,
            s.h_q as u64,
            s.h_kv as u64,
            s.d_k as u64,
            s.d_v as u64,
            element_code::<T>(),
            u64::from(options.causal),
            options.scale.map_or(u64::MAX, |s| u64::from(s.to_bits())),
            options.split.code(),
            rows as u64,
        ];
    }
    d
}

/// What every rank agreed on.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub shape: Shape,
    pub scale: f32,
    pub causal: bool,
    /// Row count of every rank.
    pub rows: Vec<usize>,
    /// The segments of every rank's shard.
    pub segments: Vec<Vec<Segment>>,
}

/// Checks the descriptors of every rank (`all[r]` is rank `r`'s) the same way on every
/// rank: the verdict does not depend on `rank`, which is taken only to say so. `own` is
/// this rank's local error, returned as it is.
pub(crate) fn agree(
    all: &[Desc],
    rank: usize,
    own: Option<attn_core::Error>,
    options: &RingOptions,
) -> Result<Plan, RingError> {
    if let Some(e) = own {
        return Err(RingError::Input(e));
    }
    if let Some(bad) = all.iter().position(|d| d[0] != 1) {
        return Err(RingError::Peer { rank: bad });
    }
    let first = &all[0];
    for (r, d) in all.iter().enumerate() {
        if let Some(f) = (1..FIELDS.len()).find(|&f| d[f] != first[f]) {
            return Err(RingError::Mismatch {
                rank: r,
                what: FIELDS[f],
                found: d[f],
                expected: first[f],
            });
        }
    }
    let rows: Vec<usize> = all.iter().map(|d| d[FIELDS.len()] as usize).collect();
    let segments = segments(options.split, &rows).map_err(|(r, expected)| RingError::Split {
        rank: r,
        rows: rows[r],
        expected,
        n: rows.iter().sum(),
        ranks: rows.len(),
    })?;
    let shape = Shape {
        batch: first[2] as usize,
        h_q: first[3] as usize,
        h_kv: first[4] as usize,
        d_k: first[5] as usize,
        d_v: first[6] as usize,
    };
    let _same_on_every_rank = rank;
    for &r in &rows {
        shape.check_sizes(r)?;
    }
    Ok(Plan {
        shape,
        scale: options.options().scale_for(shape.d_k)?,
        causal: options.causal,
        rows,
        segments,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Split;

    fn desc(rows: usize, d_k: usize) -> Desc {
        let s = Shape {
            batch: 1,
            h_q: 4,
            h_kv: 2,
            d_k,
            d_v: 8,
        };
        describe::<f32>(Some((s, rows)), Pass::Forward, &RingOptions::default())
    }

    #[test]
    fn agreeing_ranks_get_one_plan() {
        let all = [desc(3, 8), desc(0, 8), desc(5, 8)];
        let p = agree(&all, 1, None, &RingOptions::default()).unwrap();
        assert_eq!(p.rows, [3, 0, 5]);
        assert_eq!(p.segments[2][0].global, 3..8);
        assert_eq!(p.scale, 8f32.sqrt().recip());
    }

    #[test]
    fn a_differing_width_is_the_same_error_on_every_rank() {
        let all = [desc(3, 8), desc(3, 8), desc(3, 16)];
        for rank in 0..3 {
            let e = agree(&all, rank, None, &RingOptions::default()).unwrap_err();
            assert_eq!(
                e.to_string(),
                "rank 2 has d_k 16 but rank 0 has 8 (every rank must pass the same shapes and options)"
            );
        }
    }

    #[test]
    fn a_rejected_rank_is_named_by_the_others() {
        let mut all = [desc(3, 8), desc(3, 8)];
        all[1] = describe::<f32>(None, Pass::Forward, &RingOptions::default());
        let e = agree(&all, 0, None, &RingOptions::default()).unwrap_err();
        assert!(matches!(e, RingError::Peer { rank: 1 }));
        let own = Error::head_grouping(3, 2);
        let e = agree(&all, 1, Some(own.clone()), &RingOptions::default()).unwrap_err();
        assert_eq!(e.to_string(), own.to_string());
    }

    #[test]
    fn sizes_that_overflow_are_the_same_error_on_every_rank() {
        let s = Shape {
            batch: 1,
            h_q: 1 << 62,
            h_kv: 1,
            d_k: 4,
            d_v: 4,
        };
        let opts = RingOptions::default();
        let all = [
            describe::<f32>(Some((s, 3)), Pass::Forward, &opts),
            describe::<f32>(Some((s, 4)), Pass::Forward, &opts),
        ];
        for rank in 0..2 {
            let e = agree(&all, rank, None, &opts).unwrap_err();
            assert!(
                matches!(
                    e,
                    RingError::Input(Error::Allocation {
                        what: "output",
                        bytes: usize::MAX
                    })
                ),
                "{e}"
            );
        }
        // A width that overflows with the other's.
        let wide = Shape {
            h_q: 1,
            d_k: usize::MAX,
            ..s
        };
        let all = [describe::<f32>(Some((wide, 1)), Pass::Forward, &opts)];
        assert!(agree(&all, 0, None, &opts).is_err());
    }

    #[test]
    fn zigzag_counts_are_checked() {
        let opts = RingOptions::default().with_split(Split::Zigzag);
        let d = |rows| {
            let s = Shape {
                batch: 1,
                h_q: 1,
                h_kv: 1,
                d_k: 4,
                d_v: 4,
            };
            describe::<f32>(Some((s, rows)), Pass::Forward, &opts)
        };
        assert!(agree(&[d(5), d(5)], 0, None, &opts).is_ok());
        let e = agree(&[d(6), d(4)], 1, None, &opts).unwrap_err();
        assert!(matches!(
            e,
            RingError::Split {
                rank: 0,
                rows: 6,
                expected: 5,
                ..
            }
        ));
    }

    #[test]
    fn local_checks_name_the_operand() {
        let x = vec![0f32; 64];
        let t = |dims| Tensor4Ref::from_layout(&x, dims, attn_core::Layout::Bhsd).unwrap();
        let opts = RingOptions::default();
        let e = check_forward(t([1, 2, 4, 4]), t([1, 2, 3, 4]), t([1, 2, 4, 4]), &opts);
        assert!(e.unwrap_err().to_string().contains("K has 3 rows"));
        let e = check_forward(t([1, 3, 4, 4]), t([1, 2, 4, 4]), t([1, 2, 4, 4]), &opts);
        assert!(matches!(e, Err(Error::HeadGrouping { .. })));
        assert!(check_forward(t([1, 4, 4, 4]), t([1, 2, 4, 4]), t([1, 2, 4, 2]), &opts).is_ok());
    }
}
