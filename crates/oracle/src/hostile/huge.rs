//! Huge shapes (up to `usize::MAX`, through zero-stride views) that must fail before any work.

use super::*;

/// A length for a huge shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Len {
    /// A small length.
    Small(u8),
    /// `2^p` (`p` in 40..=63).
    Pow(u8),
    /// `usize::MAX − x`.
    NearMax(u8),
}

impl Len {
    /// The length.
    pub fn get(self) -> usize {
        match self {
            Len::Small(n) => usize::from(n),
            Len::Pow(p) => 1usize << p.clamp(40, 63),
            Len::NearMax(x) => usize::MAX - usize::from(x),
        }
    }

    /// Whether it is one of the huge lengths.
    pub fn is_huge(self) -> bool {
        !matches!(self, Len::Small(_))
    }
}

/// Small or huge lengths (huge ones at least `2^40`).
pub fn len(small_max: u8) -> BoxedStrategy<Len> {
    prop_oneof![
        2 => (0..=small_max).prop_map(Len::Small),
        2 => (40u8..=63).prop_map(Len::Pow),
        1 => (0u8..=3).prop_map(Len::NearMax),
    ]
    .boxed()
}

/// A defect that makes a huge call invalid whatever its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HugeDefect {
    /// None: the call is valid, so it must fail for its size (or succeed with no work).
    None,
    /// An invalid scale.
    Scale(u8),
    /// A key length beyond `n_k` (`usize::MAX`, or `n_k + 1`).
    KeyLength,
    /// K one column wider than Q.
    KeyWidth,
    /// V one row longer than K (a row stride of 0 makes that free).
    ValueRows,
    /// An additive mask of the wrong shape.
    AdditiveShape,
}

/// A huge single-head case: every operand is one row of memory broadcast to its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HugeHead {
    /// Queries.
    pub n_q: Len,
    /// Keys.
    pub n_k: Len,
    /// Key width (small).
    pub d_k: usize,
    /// Value width (small).
    pub d_v: usize,
    /// The defect.
    pub defect: HugeDefect,
    /// Storage type.
    pub dtype: Dtype,
}

/// Huge single-head cases.
pub fn huge_head() -> BoxedStrategy<HugeHead> {
    (
        len(5),
        len(5),
        1..=4usize,
        0..=3usize,
        prop_oneof![
            3 => Just(HugeDefect::None),
            1 => (0u8..4).prop_map(HugeDefect::Scale),
            1 => Just(HugeDefect::KeyLength),
            1 => Just(HugeDefect::KeyWidth),
            1 => Just(HugeDefect::ValueRows),
            1 => Just(HugeDefect::AdditiveShape),
        ],
        dtypes(),
    )
        .prop_map(|(n_q, n_k, d_k, d_v, defect, dtype)| HugeHead {
            n_q,
            n_k,
            d_k,
            d_v,
            defect,
            dtype,
        })
        .boxed()
}

/// The rows and options of a [`HugeHead`]: one row each of Q, K and V (to broadcast with
/// [`broadcast_rows`]), their lengths, and the mask and options.
#[derive(Debug, Clone, PartialEq)]
pub struct HugeHeadInputs {
    /// The row of Q.
    pub q_row: Vec<f32>,
    /// The row of K.
    pub k_row: Vec<f32>,
    /// The row of V.
    pub v_row: Vec<f32>,
    /// `[n_q, n_k, n_v]` (`n_v ≠ n_k` for [`HugeDefect::ValueRows`]).
    pub lens: [usize; 3],
    /// Explicit scale.
    pub scale: Option<f32>,
    /// Key length.
    pub key_len: Option<usize>,
    /// A (small, hence mis-shaped when `n_q` or `n_k` is huge) additive mask.
    pub additive: Option<Mat<f32>>,
}

impl HugeHead {
    /// Builds the rows and options.
    pub fn build(&self) -> HugeHeadInputs {
        let (n_q, n_k) = (self.n_q.get(), self.n_k.get());
        let row = |d: usize, x: f32| vec![self.dtype.round(x); d];
        let d_k_k = self.d_k + usize::from(self.defect == HugeDefect::KeyWidth);
        let n_v = if self.defect == HugeDefect::ValueRows {
            n_k.wrapping_add(1)
        } else {
            n_k
        };
        HugeHeadInputs {
            q_row: row(self.d_k, 0.5),
            k_row: row(d_k_k, 0.25),
            v_row: row(self.d_v, 1.0),
            lens: [n_q, n_k, n_v],
            scale: match self.defect {
                HugeDefect::Scale(s) => Some([f32::NAN, 0.0, -1.0, f32::MAX][usize::from(s) % 4]),
                _ => None,
            },
            key_len: (self.defect == HugeDefect::KeyLength).then(|| n_k.saturating_add(1)),
            additive: (self.defect == HugeDefect::AdditiveShape)
                .then(|| Mat::zeros(n_q.min(3), n_k.min(3) + 1)),
        }
    }
}

impl HugeHeadInputs {
    /// The options.
    pub fn options(&self) -> Options<'_> {
        options_of(
            self.scale,
            None,
            None,
            self.key_len.map(KeyPadding::Uniform),
            None,
            self.additive.as_ref(),
        )
    }

    /// Q, K and V as broadcast f32 views (for [`expect_head`]).
    pub fn views(&self) -> [MatRef<'_, f32>; 3] {
        let [n_q, n_k, n_v] = self.lens;
        [
            broadcast_rows(&self.q_row, n_q),
            broadcast_rows(&self.k_row, n_k),
            broadcast_rows(&self.v_row, n_v),
        ]
    }
}

/// A huge batched case: one row of memory per operand, zero strides, dims up to
/// `usize::MAX` on every axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HugeBatch {
    /// Batch entries.
    pub batch: Len,
    /// Query heads.
    pub h_q: Len,
    /// Key/value heads (small, or equal to `h_q`).
    pub h_kv: Len,
    /// Queries.
    pub n_q: Len,
    /// Keys.
    pub n_k: Len,
    /// Key width (small).
    pub d_k: usize,
    /// Value width (small).
    pub d_v: usize,
    /// The defect.
    pub defect: HugeDefect,
    /// Storage type.
    pub dtype: Dtype,
}

/// Huge batched cases.
pub fn huge_batch() -> BoxedStrategy<HugeBatch> {
    (
        (
            len(3),
            len(3),
            prop_oneof![Just(None), len(2).prop_map(Some)],
        ),
        (len(3), len(3), 1..=4usize, 0..=3usize),
        prop_oneof![
            3 => Just(HugeDefect::None),
            1 => (0u8..4).prop_map(HugeDefect::Scale),
            1 => Just(HugeDefect::KeyLength),
            1 => Just(HugeDefect::KeyWidth),
            1 => Just(HugeDefect::ValueRows),
        ],
        dtypes(),
    )
        .prop_map(
            |((batch, h_q, h_kv), (n_q, n_k, d_k, d_v), defect, dtype)| HugeBatch {
                batch,
                h_q,
                h_kv: h_kv.unwrap_or(h_q),
                n_q,
                n_k,
                d_k,
                d_v,
                defect,
                dtype,
            },
        )
        .boxed()
}

impl HugeBatch {
    /// `[q, k, v]` dims.
    pub fn dims(&self) -> [[usize; 4]; 3] {
        let (b, h_q, h_kv) = (self.batch.get(), self.h_q.get(), self.h_kv.get());
        let (n_q, n_k) = (self.n_q.get(), self.n_k.get());
        let dk_k = self.d_k + usize::from(self.defect == HugeDefect::KeyWidth);
        let n_v = if self.defect == HugeDefect::ValueRows {
            n_k.wrapping_add(1)
        } else {
            n_k
        };
        [
            [b, h_q, n_q, self.d_k],
            [b, h_kv, n_k, dk_k],
            [b, h_kv, n_v, self.d_v],
        ]
    }

    /// The scale and key length of the defect.
    pub fn options(&self) -> Options<'static> {
        let mut o = Options::default();
        match self.defect {
            HugeDefect::Scale(s) => {
                o = o.with_scale([f32::NAN, 0.0, -1.0, f32::MAX][usize::from(s) % 4])
            }
            HugeDefect::KeyLength => o = o.with_key_length(usize::MAX),
            _ => {}
        }
        o
    }
}

/// A `[b, h, s, d]` view of `row` (`d` elements) with every stride 0.
pub fn broadcast_tensor<T>(row: &[T], dims: [usize; 4]) -> attn_core::Result<Tensor4Ref<'_, T>> {
    Tensor4Ref::new(row, dims, [0, 0, 0])
}
