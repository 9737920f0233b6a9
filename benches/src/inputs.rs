//! Deterministic benchmark inputs: the same seed gives the same bits on every machine.
//!
//! A SplitMix64 stream is enough: the benchmarks need reproducible, well-spread values,
//! not statistical quality, and it keeps the crate free of a random-number dependency.

use attn_core::{Layout, Tensor4Ref};
use faer::Mat;

/// The SplitMix64 generator (Steele, Lea and Flood, 2014).
///
/// ```
/// use attn_benches::inputs::SplitMix64;
/// let mut a = SplitMix64::new(7);
/// let mut b = SplitMix64::new(7);
/// assert_eq!(a.next_u64(), b.next_u64());
/// let x = a.next_f32();
/// assert!((-1.0..1.0).contains(&x));
/// ```
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator started at `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform value in `[-1, 1)` with 24 random bits (every value exact in f32).
    pub fn next_f32(&mut self) -> f32 {
        let bits = (self.next_u64() >> 40) as u32; // 24 bits
        (bits as f32) * (2.0 / (1u32 << 24) as f32) - 1.0
    }
}

/// `len` uniform values in `[-1, 1)` from `seed`.
///
/// ```
/// use attn_benches::inputs::random_vec;
/// assert_eq!(random_vec(5, 1), random_vec(5, 1));
/// assert_ne!(random_vec(5, 1), random_vec(5, 2));
/// ```
pub fn random_vec(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..len).map(|_| rng.next_f32()).collect()
}

/// A `rows × cols` matrix of uniform values in `[-1, 1)` from `seed`, filled row by row.
///
/// ```
/// use attn_benches::inputs::random_mat;
/// let m = random_mat(3, 2, 9);
/// assert_eq!((m.nrows(), m.ncols()), (3, 2));
/// assert_eq!(m, random_mat(3, 2, 9));
/// ```
pub fn random_mat(rows: usize, cols: usize, seed: u64) -> Mat<f32> {
    let data = random_vec(rows * cols, seed);
    Mat::from_fn(rows, cols, |i, j| data[i * cols + j])
}

/// Q, K and V of one batch entry with `heads` query heads (and as many K/V heads, or
/// fewer for grouped-query attention), stored contiguously in the `[B,H,S,D]` layout, in
/// any element type that f32 values convert into.
///
/// ```
/// use attn_benches::inputs::Qkv;
/// let x = Qkv::<f32>::random(2, 16, 32, 8, 1);
/// assert_eq!(x.q().dims(), [1, 2, 16, 8]);
/// assert_eq!(x.k().dims(), [1, 2, 32, 8]);
/// let h = x.map(half::f16::from_f32);
/// assert_eq!(h.v().dims(), [1, 2, 32, 8]);
/// let g = Qkv::<f32>::random_grouped([4, 2], 16, 32, 8, 1);
/// assert_eq!((g.q().dims(), g.k().dims()), ([1, 4, 16, 8], [1, 2, 32, 8]));
/// ```
#[derive(Debug, Clone)]
pub struct Qkv<T> {
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    heads: usize,
    kv_heads: usize,
    n_q: usize,
    n_k: usize,
    d: usize,
}

impl Qkv<f32> {
    /// Uniform values in `[-1, 1)`; Q, K and V use seeds `seed`, `seed + 1`, `seed + 2`.
    pub fn random(heads: usize, n_q: usize, n_k: usize, d: usize, seed: u64) -> Self {
        Self::random_grouped([heads, heads], n_q, n_k, d, seed)
    }

    /// [`Qkv::random`] with `[heads, kv_heads]` query and K/V heads.
    pub fn random_grouped(
        [heads, kv_heads]: [usize; 2],
        n_q: usize,
        n_k: usize,
        d: usize,
        seed: u64,
    ) -> Self {
        Self {
            q: random_vec(heads * n_q * d, seed),
            k: random_vec(kv_heads * n_k * d, seed.wrapping_add(1)),
            v: random_vec(kv_heads * n_k * d, seed.wrapping_add(2)),
            heads,
            kv_heads,
            n_q,
            n_k,
            d,
        }
    }
}

impl<T> Qkv<T> {
    /// The same inputs converted element by element (e.g. rounded to f16).
    pub fn map<U>(&self, f: impl Fn(f32) -> U + Copy) -> Qkv<U>
    where
        T: Copy + Into<f32>,
    {
        let conv = |x: &[T]| x.iter().map(|&e| f(e.into())).collect();
        Qkv {
            q: conv(&self.q),
            k: conv(&self.k),
            v: conv(&self.v),
            heads: self.heads,
            kv_heads: self.kv_heads,
            n_q: self.n_q,
            n_k: self.n_k,
            d: self.d,
        }
    }

    fn view<'a>(&self, data: &'a [T], heads: usize, seq: usize) -> Tensor4Ref<'a, T> {
        Tensor4Ref::from_layout(data, [1, heads, seq, self.d], Layout::Bhsd)
            .expect("the buffer was sized for these dims")
    }

    /// Q as `[1, heads, n_q, d]`.
    pub fn q(&self) -> Tensor4Ref<'_, T> {
        self.view(&self.q, self.heads, self.n_q)
    }

    /// K as `[1, kv_heads, n_k, d]`.
    pub fn k(&self) -> Tensor4Ref<'_, T> {
        self.view(&self.k, self.kv_heads, self.n_k)
    }

    /// V as `[1, kv_heads, n_k, d]`.
    pub fn v(&self) -> Tensor4Ref<'_, T> {
        self.view(&self.v, self.kv_heads, self.n_k)
    }
}
