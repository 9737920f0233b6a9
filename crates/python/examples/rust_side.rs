//! The Rust side of `bench/overhead.py`: the same attention calls, made from Rust, timed
//! in this process so that the Python script can interleave them with its own.
//!
//! It builds the inputs once, then answers lines on stdin: `big N` or `tiny N` runs the
//! call `N` times and prints one line, the nanoseconds of each call separated by spaces;
//! `quit` (or the end of stdin) exits. The cases match the script's:
//!
//! - `big`: `[1, 8, 4096, 64]` f32 query, key and value (`[B,H,S,D]`, contiguous);
//! - `tiny`: a `[1, 32, 1, 128]` query against `[1, 32, 16, 128]` keys and values.
//!
//! Each call is `attention_batched`, which allocates its output as the Python call does.
//! Run it as the script does: `cargo run --release -p attn-python --example rust_side`.

use std::io::{BufRead, Write};
use std::time::Instant;

use attn_optimized::{Attention, Layout, Options, Par, Tensor4Ref};

/// Deterministic inputs in [-1, 1) (the values do not change the timing).
fn filled(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

struct Case {
    q: Vec<f32>,
    kv: Vec<f32>,
    q_dims: [usize; 4],
    kv_dims: [usize; 4],
}

impl Case {
    fn new(q_dims: [usize; 4], kv_dims: [usize; 4]) -> Self {
        Case {
            q: filled(q_dims.iter().product(), 1),
            kv: filled(kv_dims.iter().product(), 2),
            q_dims,
            kv_dims,
        }
    }

    /// One call, in nanoseconds.
    fn run(&self) -> u128 {
        let q = Tensor4Ref::from_layout(&self.q, self.q_dims, Layout::Bhsd).expect("q fits");
        let kv = Tensor4Ref::from_layout(&self.kv, self.kv_dims, Layout::Bhsd).expect("kv fits");
        let start = Instant::now();
        let out = Attention::batched(q, kv, kv, &Options::default())
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_output())
            .expect("valid call");
        let ns = start.elapsed().as_nanos();
        std::hint::black_box(out);
        ns
    }
}

fn main() {
    let big = Case::new([1, 8, 4096, 64], [1, 8, 4096, 64]);
    let tiny = Case::new([1, 32, 1, 128], [1, 32, 16, 128]);
    // Warm-up: the thread pool, page faults, the kernels' first dispatch.
    big.run();
    for _ in 0..1000 {
        tiny.run();
    }
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout().lock();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let mut words = line.split_whitespace();
        let case = match words.next() {
            Some("big") => &big,
            Some("tiny") => &tiny,
            _ => break,
        };
        let n: usize = words.next().and_then(|w| w.parse().ok()).unwrap_or(1);
        let times: Vec<String> = (0..n).map(|_| case.run().to_string()).collect();
        writeln!(stdout, "{}", times.join(" ")).expect("stdout is open");
        stdout.flush().expect("stdout is open");
    }
}
