//! What the reference's test files share: the generator of their exact inputs.

use faer::Mat;

/// SplitMix64: the same values on every machine.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A multiple of `2⁻²⁰` in `[−amp, amp]` (`amp` a power of two): `x ± h` is exact
    /// for the finite-difference steps `h` the tests take.
    pub fn entry(&mut self, amp: f64) -> f64 {
        amp * (((self.next() % (2 * (1 << 20) + 1)) as f64 - (1 << 20) as f64) / (1 << 20) as f64)
    }

    /// `n` entries in `[−amp, amp]`.
    #[allow(dead_code)] // not every test file draws vectors
    pub fn vec(&mut self, n: usize, amp: f64) -> Vec<f64> {
        (0..n).map(|_| self.entry(amp)).collect()
    }

    /// A `rows × cols` matrix of entries in `[−1, 1]`, row by row.
    #[allow(dead_code)] // not every test file draws matrices
    pub fn mat(&mut self, rows: usize, cols: usize) -> Mat<f64> {
        let data: Vec<f64> = (0..rows * cols).map(|_| self.entry(1.0)).collect();
        Mat::from_fn(rows, cols, |i, j| data[i * cols + j])
    }

    /// A sink logit: a multiple of `2⁻¹⁰` in `[−2, 2]`, so `σ ± h` is exact in f32.
    #[allow(dead_code)] // not every test file draws sinks
    pub fn sink(&mut self) -> f32 {
        ((self.next() % 4097) as f32 - 2048.0) / 1024.0
    }
}
