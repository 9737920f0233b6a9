//! The ring forward on synthetic data, timed:
//!
//! ```text
//! mpirun -np P target/release/examples/ring --n N --heads H --d D [--kv-heads G]
//!        [--causal] [--dtype f32|f16|bf16] [--no-check] [--single] [--repeat R]
//! ```
//!
//! Each rank prints its time, the bytes it sent, the time it waited on the ring (the
//! communication not hidden behind compute) and its peak resident memory. Rank 0 then
//! compares its rows with one-process attention over the whole sequence (computed on rank 0
//! on the ring's threads; `--no-check` skips it, as it must on a memory run). `--single`
//! times that one-process attention on all the machine's cores, alone (run it with
//! `-np 1`), for the ratio against the ring. Causal runs use the zigzag split.

use std::process::ExitCode;
use std::time::Instant;

use attn_core::Tensor4;
use attn_ring::mpi::traits::*;
use attn_ring::{Ring, RingElement, RingOptions, Split, contiguous_rows, zigzag_rows};
use half::{bf16, f16};

struct Args {
    n: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    causal: bool,
    dtype: String,
    check: bool,
    single: bool,
    repeat: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        n: 8192,
        heads: 1,
        kv_heads: 0,
        d: 64,
        causal: false,
        dtype: "f32".into(),
        check: true,
        single: false,
        repeat: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut num = |name: &str| -> Result<usize, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("{name} needs a number"))
        };
        match flag.as_str() {
            "--n" => a.n = num("--n")?,
            "--heads" => a.heads = num("--heads")?,
            "--kv-heads" => a.kv_heads = num("--kv-heads")?,
            "--d" => a.d = num("--d")?,
            "--repeat" => a.repeat = num("--repeat")?.max(1),
            "--causal" => a.causal = true,
            "--no-check" => a.check = false,
            "--single" => a.single = true,
            "--dtype" => a.dtype = it.next().ok_or("--dtype needs f32, f16 or bf16")?,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.kv_heads == 0 {
        a.kv_heads = a.heads;
    }
    Ok(a)
}

/// Peak resident memory of this process (VmHWM), in MiB.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kib| kib / 1024.0)
}

/// This rank's rows of a synthetic tensor, generated in place (no whole tensor needed).
fn shard_of<T: RingElement>(
    seed: u64,
    dims: [usize; 4],
    rows: &[std::ops::Range<usize>],
) -> Tensor4<T> {
    let [b, h, _, d] = dims;
    let len: usize = rows.iter().map(|r| r.len()).sum();
    let mut data = Vec::with_capacity(b * h * len * d);
    for bi in 0..b {
        for hi in 0..h {
            for i in rows.iter().flat_map(|r| r.clone()) {
                for c in 0..d {
                    let x = ((bi * h + hi) * dims[2] + i) * d + c;
                    data.push(T::from_f32(synthetic(seed, x)));
                }
            }
        }
    }
    Tensor4::from_vec(data, [b, h, len, d]).expect("dims match")
}

fn synthetic(seed: u64, i: usize) -> f32 {
    let mut x = (i as u64 ^ (seed << 48)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 31;
    (x % 2048) as f32 / 1024.0 - 1.0
}

fn run<T: RingElement>(world: &impl Communicator, a: &Args) -> Result<(), String> {
    let ring = Ring::new(world).map_err(|e| e.to_string())?;
    let (p, r) = (ring.size(), ring.rank());
    let split = if a.causal {
        Split::Zigzag
    } else {
        Split::Contiguous
    };
    let rows = match split {
        Split::Zigzag => zigzag_rows(a.n, p, r).to_vec(),
        Split::Contiguous => vec![contiguous_rows(a.n, p, r)],
    };
    let qd = [1, a.heads, a.n, a.d];
    let kd = [1, a.kv_heads, a.n, a.d];
    let opts = RingOptions::default()
        .with_causal(a.causal)
        .with_split(split);
    if a.single {
        if p != 1 {
            return Err("--single runs one process: use -np 1".into());
        }
        let (q, k, v) = (
            shard_of::<T>(1, qd, std::slice::from_ref(&(0..a.n))),
            shard_of::<T>(2, kd, std::slice::from_ref(&(0..a.n))),
            shard_of::<T>(3, kd, std::slice::from_ref(&(0..a.n))),
        );
        for _ in 0..a.repeat {
            let t = Instant::now();
            attn_optimized::Attention::batched(q.as_ref(), k.as_ref(), v.as_ref(), &opts.options())
                .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
                .map(|f| f.into_parts())
                .map_err(|e| e.to_string())?;
            println!(
                "single process: n {} heads {} d {} {} causal {}: {:.3} s on {} threads, peak RSS {:.1} MiB",
                a.n,
                a.heads,
                a.d,
                T::NAME,
                a.causal,
                t.elapsed().as_secs_f64(),
                rayon::current_num_threads(),
                peak_rss_mib()
            );
        }
        return Ok(());
    }
    let (q, k, v) = (
        shard_of::<T>(1, qd, &rows),
        shard_of::<T>(2, kd, &rows),
        shard_of::<T>(3, kd, &rows),
    );
    let shard_mib = (q.as_slice().len() + k.as_slice().len() + v.as_slice().len()) as f64
        * size_of::<T>() as f64
        / (1 << 20) as f64;
    let kv_bytes_total = 2.0 * (a.kv_heads * a.n * a.d * size_of::<T>()) as f64;
    let mut last = None;
    for rep in 0..a.repeat {
        world.barrier();
        let f = ring
            .forward(q.as_ref(), k.as_ref(), v.as_ref(), &opts)
            .map_err(|e| e.to_string())?;
        let s = &f.stats;
        println!(
            "rank {r}/{p} run {rep}: {:.3} s (compute {:.3} s, waiting on the ring {:.4} s), {} threads, \
             sent {:.1} MiB = {:.3} of the K/V bytes ((P−1)/P = {:.3}), {} of {p} steps computed, \
             shards {:.1} MiB, peak RSS {:.1} MiB",
            s.total.as_secs_f64(),
            s.compute.as_secs_f64(),
            s.wait.as_secs_f64(),
            s.threads,
            s.bytes_sent as f64 / (1 << 20) as f64,
            s.bytes_sent as f64 / kv_bytes_total,
            (p - 1) as f64 / p as f64,
            s.steps_computed,
            shard_mib,
            peak_rss_mib()
        );
        last = Some(f);
    }
    let f = last.expect("at least one run");
    if !a.check {
        return Ok(());
    }
    // Rank 0 checks its rows against one-process attention on the whole sequence.
    if r == 0 {
        let whole = |seed, dims| shard_of::<T>(seed, dims, std::slice::from_ref(&(0..a.n)));
        let (qa, ka, va) = (whole(1, qd), whole(2, kd), whole(3, kd));
        let (want, want_lse) = attn_optimized::Attention::batched(
            qa.as_ref(),
            ka.as_ref(),
            va.as_ref(),
            &opts.options(),
        )
        .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
        .map(|f| f.into_parts())
        .map_err(|e| e.to_string())?;
        let mine: Vec<usize> = rows.iter().flat_map(|x| x.clone()).collect();
        let (mut err, mut lse_err) = (0f64, 0f64);
        for h in 0..a.heads {
            let got = f.out.as_ref().head(0, h).map_err(|e| e.to_string())?;
            let w = want.as_ref().head(0, h).map_err(|e| e.to_string())?;
            for (i, &g) in mine.iter().enumerate() {
                for c in 0..a.d {
                    err = err.max((got[(i, c)].to_f32() as f64 - w[(g, c)].to_f32() as f64).abs());
                }
                let l = f.lse[h * mine.len() + i] as f64 - want_lse[h * a.n + g] as f64;
                lse_err = lse_err.max(l.abs());
            }
        }
        println!(
            "rank 0: max |ring − one process| over its rows: output {err:.3e}, LSE {lse_err:.3e}"
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("ring: {e}");
            return ExitCode::FAILURE;
        }
    };
    let universe = match attn_ring::initialize() {
        Ok(u) => u,
        Err(e) => {
            eprintln!("ring: {e}");
            return ExitCode::FAILURE;
        }
    };
    let world = universe.world();
    let result = match args.dtype.as_str() {
        "f32" => run::<f32>(&world, &args),
        "f16" => run::<f16>(&world, &args),
        "bf16" => run::<bf16>(&world, &args),
        other => Err(format!("unknown dtype {other}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ring (rank {}): {e}", world.rank());
            ExitCode::FAILURE
        }
    }
}
