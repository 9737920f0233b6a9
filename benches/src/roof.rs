//! The machine's limits, measured in the same run as the engines they judge.
//!
//! Attention is two GEMMs and a softmax, so the compute roof is faer's own f32 GEMM rate at
//! the same thread count; decoding streams K and V once, so its roof is the memory read
//! bandwidth. Both drift by several per cent within a run on shared machines, which is why
//! they are measured next to the kernels rather than once and for all.

use std::time::Instant;

use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, Par};
use rayon::prelude::*;

use crate::inputs::random_mat;

/// A rayon pool of exactly `threads` threads (at least one).
///
/// ```
/// let pool = attn_benches::roof::pool(2);
/// assert_eq!(pool.install(rayon::current_num_threads), 2);
/// ```
pub fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .expect("the OS can start the benchmark threads")
}

/// Square f32 GEMM operands, kept so the product can be timed again and again:
/// `C = A·B` with `A, B, C : n × n`.
///
/// ```
/// use attn_benches::roof::{pool, GemmRoof};
/// let mut g = GemmRoof::new(64, 1);
/// assert_eq!(g.flops(), 2.0 * 64.0 * 64.0 * 64.0);
/// let seconds = pool(1).install(|| g.time());
/// assert!(seconds > 0.0);
/// ```
#[derive(Debug)]
pub struct GemmRoof {
    a: Mat<f32>,
    b: Mat<f32>,
    c: Mat<f32>,
    par: Par,
}

impl GemmRoof {
    /// Random `n × n` operands; the product is split over `threads` rayon tasks
    /// (`Par::rayon(threads)`), so run it inside a pool of that many threads.
    pub fn new(n: usize, threads: usize) -> Self {
        Self {
            a: random_mat(n, n, 11),
            b: random_mat(n, n, 12),
            c: Mat::zeros(n, n),
            par: if threads <= 1 {
                Par::Seq
            } else {
                Par::rayon(threads)
            },
        }
    }

    /// Floating-point operations of one product: `2n³`.
    pub fn flops(&self) -> f64 {
        2.0 * (self.a.nrows() as f64).powi(3)
    }

    /// Computes `C = A·B` once.
    pub fn run(&mut self) {
        matmul(
            self.c.as_mut(),
            Accum::Replace,
            self.a.as_ref(),
            self.b.as_ref(),
            1.0,
            self.par,
        );
        std::hint::black_box(&self.c);
    }

    /// Seconds of one product.
    pub fn time(&mut self) -> f64 {
        let start = Instant::now();
        self.run();
        start.elapsed().as_secs_f64()
    }
}

/// GFLOP/s of `runs` timed `n³` f32 products on a fresh pool of `threads` threads, after
/// one warm-up product.
///
/// ```
/// let rates = attn_benches::roof::gemm_gflops(64, 1, 3);
/// assert_eq!(rates.len(), 3);
/// assert!(rates.iter().all(|&r| r > 0.0));
/// ```
pub fn gemm_gflops(n: usize, threads: usize, runs: usize) -> Vec<f64> {
    let mut g = GemmRoof::new(n, threads);
    pool(threads).install(|| {
        g.run();
        (0..runs).map(|_| g.flops() / g.time() / 1e9).collect()
    })
}

/// A large buffer of f32 whose pages are really written (a zeroed allocation would map
/// every page to the kernel's shared zero page, and a sum over it would measure the cache).
///
/// ```
/// use attn_benches::roof::{pool, ReadBuffer};
/// let buf = ReadBuffer::new(1 << 20);
/// assert_eq!(buf.bytes(), 1 << 20);
/// assert!(pool(2).install(|| buf.sum()) > 0.0);
/// ```
#[derive(Debug)]
pub struct ReadBuffer {
    data: Vec<f32>,
}

/// Elements per rayon task of the parallel sum (1 MiB): large enough that task overhead is
/// noise, small enough to balance two threads over any buffer worth measuring.
const SUM_CHUNK: usize = 1 << 18;

impl ReadBuffer {
    /// A buffer of `bytes` bytes (rounded down to whole f32), written in parallel on the
    /// current rayon pool so its pages are spread the way the readers will touch them.
    pub fn new(bytes: usize) -> Self {
        let mut data = Vec::<f32>::with_capacity(bytes / 4);
        data.resize(bytes / 4, 0.0);
        data.par_chunks_mut(SUM_CHUNK)
            .enumerate()
            .for_each(|(c, chunk)| {
                for (i, x) in chunk.iter_mut().enumerate() {
                    *x = 1.0 + ((c + i) % 7) as f32;
                }
            });
        Self { data }
    }

    /// The size of the buffer in bytes.
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }

    /// The sum of every element, in parallel on the current rayon pool: one read pass.
    pub fn sum(&self) -> f32 {
        self.data.par_chunks(SUM_CHUNK).map(sum_chunk).sum()
    }

    /// Seconds of one read pass.
    pub fn time(&self) -> f64 {
        let start = Instant::now();
        std::hint::black_box(self.sum());
        start.elapsed().as_secs_f64()
    }
}

/// Sums with 32 independent accumulators so that the loop vectorises and is bound by
/// memory rather than by the latency of one chain of additions.
fn sum_chunk(x: &[f32]) -> f32 {
    const LANES: usize = 32;
    let mut acc = [0.0f32; LANES];
    let mut blocks = x.chunks_exact(LANES);
    for block in &mut blocks {
        for (a, &v) in acc.iter_mut().zip(block) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + blocks.remainder().iter().sum::<f32>()
}

/// Read bandwidth in GB/s (10⁹ bytes per second) of `runs` timed passes over a buffer of
/// `mib` MiB on a fresh pool of `threads` threads, after one warm-up pass.
///
/// ```
/// let rates = attn_benches::roof::read_bandwidth_gbs(4, 2, 2);
/// assert_eq!(rates.len(), 2);
/// assert!(rates.iter().all(|&r| r > 0.0));
/// ```
pub fn read_bandwidth_gbs(mib: usize, threads: usize, runs: usize) -> Vec<f64> {
    pool(threads).install(|| {
        let buf = ReadBuffer::new(mib << 20);
        buf.time();
        (0..runs)
            .map(|_| buf.bytes() as f64 / buf.time() / 1e9)
            .collect()
    })
}
