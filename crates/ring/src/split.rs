//! Which positions of the sequence each rank holds: the contiguous split and the zigzag.

use core::ops::Range;

use attn_core::{Error, Tensor4, Tensor4Ref};

/// How the sequence is split across the ranks of a ring.
///
/// A rank's shard is the rows it holds, in increasing position order, as one
/// `[batch, heads, rows, dim]` view (the same rows of Q, K and V, and of dO and O in the
/// backward pass).
///
/// - [`Split::Contiguous`]: rank `r` holds the positions that follow rank `r − 1`'s, as many
///   as its shard has rows (any counts, empty shards included; [`contiguous_rows`] is the
///   even split). Right for non-causal attention; causal attention works too but rank `r`
///   then does about `2r + 1` times the work of rank 0.
/// - [`Split::Zigzag`]: the sequence is cut into `2P` chunks ([`zigzag_chunk`]) and rank `r`
///   holds chunks `r` and `2P − 1 − r`, concatenated: its shard is exactly the rows
///   [`zigzag_rows`] names, and the ring checks the counts. Under a causal mask every rank
///   then does the same work.
///
/// The caller lays out its shards; [`shard`] gathers one from a whole tensor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Split {
    /// Consecutive positions per rank, in rank order.
    #[default]
    Contiguous,
    /// Chunks `r` and `2P − 1 − r` of `2P` on rank `r` (load balance under a causal mask).
    Zigzag,
}

impl Split {
    pub(crate) fn code(self) -> u64 {
        match self {
            Split::Contiguous => 0,
            Split::Zigzag => 1,
        }
    }
}

/// Chunk `c` of `2·ranks` equal chunks of `n` positions: the first `n mod 2P` chunks hold
/// one position more than the others.
///
/// ```
/// use attn_ring::zigzag_chunk;
/// assert_eq!([0, 1, 2, 3].map(|c| zigzag_chunk(10, 2, c)), [0..3, 3..6, 6..8, 8..10]);
/// assert_eq!(zigzag_chunk(3, 2, 3), 3..3); // fewer positions than chunks: empty chunks
/// ```
pub fn zigzag_chunk(n: usize, ranks: usize, c: usize) -> Range<usize> {
    let chunks = 2 * ranks.max(1);
    let (base, extra) = (n / chunks, n % chunks);
    let start = c * base + c.min(extra);
    let len = base + usize::from(c < extra);
    start..start + len
}

/// The positions rank `rank` holds under [`Split::Zigzag`]: chunks `rank` and
/// `2P − 1 − rank` of [`zigzag_chunk`], in that order (its shard is their rows,
/// concatenated).
///
/// ```
/// use attn_ring::zigzag_rows;
/// assert_eq!(zigzag_rows(16, 2, 0), [0..4, 12..16]);
/// assert_eq!(zigzag_rows(16, 2, 1), [4..8, 8..12]);
/// ```
pub fn zigzag_rows(n: usize, ranks: usize, rank: usize) -> [Range<usize>; 2] {
    let p = ranks.max(1);
    [
        zigzag_chunk(n, p, rank),
        zigzag_chunk(n, p, 2 * p - 1 - rank.min(2 * p - 1)),
    ]
}

/// The even contiguous split: rank `rank` holds `n / P` positions, one more for the first
/// `n mod P` ranks.
///
/// ```
/// use attn_ring::contiguous_rows;
/// assert_eq!([0, 1, 2].map(|r| contiguous_rows(10, 3, r)), [0..4, 4..7, 7..10]);
/// ```
pub fn contiguous_rows(n: usize, ranks: usize, rank: usize) -> Range<usize> {
    let p = ranks.max(1);
    let (base, extra) = (n / p, n % p);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// A shard: the rows `rows` (ranges of the sequence axis, in order) of `global`,
/// gathered into a new `[batch, heads, Σ len, dim]` tensor in the `[B,H,S,D]` layout.
///
/// ```
/// use attn_ring::{shard, zigzag_rows};
/// use attn_core::{Layout, Tensor4Ref};
/// let x: Vec<f32> = (0..8).map(|i| i as f32).collect(); // [1, 1, 8, 1]
/// let x = Tensor4Ref::from_layout(&x, [1, 1, 8, 1], Layout::Bhsd)?;
/// let s = shard(x, &zigzag_rows(8, 2, 1))?; // chunks 1 and 2 of 4
/// assert_eq!(s.as_slice(), &[2.0, 3.0, 4.0, 5.0]);
/// # Ok::<(), attn_core::Error>(())
/// ```
pub fn shard<T: Copy + Default>(
    global: Tensor4Ref<'_, T>,
    rows: &[Range<usize>],
) -> attn_core::Result<Tensor4<T>> {
    let [b, h, s, d] = global.dims();
    let mut total = 0usize;
    for r in rows {
        if r.start > r.end || r.end > s {
            return Err(Error::out_of_range("shard row", r.end.max(r.start), s + 1));
        }
        total += r.len();
    }
    let mut out = Tensor4::try_zeros([b, h, total, d])?;
    let mut view = out.as_mut();
    for bi in 0..b {
        for hi in 0..h {
            let src = global.head(bi, hi)?;
            let mut dst = view.head_mut(bi, hi)?;
            let mut at = 0;
            for r in rows {
                for i in r.clone() {
                    for c in 0..d {
                        dst[(at, c)] = src[(i, c)];
                    }
                    at += 1;
                }
            }
        }
    }
    Ok(out)
}

/// One run of consecutive positions of a rank's shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Segment {
    /// Its first row in the shard.
    pub local: usize,
    /// The positions it holds.
    pub global: Range<usize>,
}

impl Segment {
    pub fn len(&self) -> usize {
        self.global.len()
    }
}

/// The segments of every rank, given every rank's row count: `None` when a count is not
/// the one the split gives that rank (`Some(expected)` in the error slot).
pub(crate) fn segments(split: Split, rows: &[usize]) -> Result<Vec<Vec<Segment>>, (usize, usize)> {
    let p = rows.len();
    let n: usize = rows.iter().sum();
    let mut out = Vec::with_capacity(p);
    match split {
        Split::Contiguous => {
            let mut start = 0;
            for &r in rows {
                out.push(vec![Segment {
                    local: 0,
                    global: start..start + r,
                }]);
                start += r;
            }
        }
        Split::Zigzag => {
            for (rank, &r) in rows.iter().enumerate() {
                let [a, b] = zigzag_rows(n, p, rank);
                if a.len() + b.len() != r {
                    return Err((rank, a.len() + b.len()));
                }
                let first = Segment {
                    local: 0,
                    global: a.clone(),
                };
                let second = Segment {
                    local: a.len(),
                    global: b,
                };
                out.push(vec![first, second]);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zigzag_chunks_tile_the_sequence() {
        for n in 0..40 {
            for p in 1..6 {
                let mut next = 0;
                for c in 0..2 * p {
                    let r = zigzag_chunk(n, p, c);
                    assert_eq!(r.start, next, "n {n} p {p} c {c}");
                    assert!(r.len() == n / (2 * p) || r.len() == n / (2 * p) + 1);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn zigzag_ranks_hold_every_position_once_with_balanced_causal_work() {
        for p in 1..6 {
            let n = 2 * p * 7;
            let mut seen = vec![0; n];
            let mut work = vec![];
            for r in 0..p {
                let rows = zigzag_rows(n, p, r);
                assert_eq!(rows[0].start / 7, r);
                assert_eq!(rows[1].start / 7, 2 * p - 1 - r);
                for i in rows.iter().flat_map(|x| x.clone()) {
                    seen[i] += 1;
                }
                // Causal work of a rank: the keys its queries see.
                work.push(
                    rows.iter()
                        .flat_map(|x| x.clone())
                        .map(|i| i + 1)
                        .sum::<usize>(),
                );
            }
            assert!(seen.iter().all(|&c| c == 1));
            assert!(work.iter().all(|&w| w == work[0]), "p {p}: {work:?}");
        }
    }

    #[test]
    fn contiguous_rows_tile_the_sequence() {
        for n in 0..30 {
            for p in 1..6 {
                let ranges: Vec<_> = (0..p).map(|r| contiguous_rows(n, p, r)).collect();
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[p - 1].end, n);
                assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
    }

    #[test]
    fn segments_follow_the_split_and_reject_wrong_counts() {
        let s = segments(Split::Contiguous, &[3, 0, 2]).unwrap();
        assert_eq!(s[1][0].global, 3..3);
        assert_eq!(s[2][0].global, 3..5);
        let z = segments(Split::Zigzag, &[5, 5]).unwrap(); // n = 10: chunks 3,3,2,2
        assert_eq!(
            z[0],
            [
                Segment {
                    local: 0,
                    global: 0..3
                },
                Segment {
                    local: 3,
                    global: 8..10
                }
            ]
        );
        assert_eq!(
            z[1][1],
            Segment {
                local: 3,
                global: 6..8
            }
        );
        assert_eq!(segments(Split::Zigzag, &[6, 4]), Err((0, 5)));
    }

    #[test]
    fn shard_gathers_rows_and_rejects_ranges_outside() {
        let x: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let t = Tensor4Ref::from_layout(&x, [1, 2, 3, 2], attn_core::Layout::Bhsd).unwrap();
        let s = shard(t, &[2..3, 0..1]).unwrap();
        assert_eq!(s.as_slice(), &[4.0, 5.0, 0.0, 1.0, 10.0, 11.0, 6.0, 7.0]);
        assert!(shard(t, std::slice::from_ref(&(2..4))).is_err());
    }
}
