//! One multi-head attention layer of a candle model, computed the naive way (candle ops:
//! `softmax(QKᵀ·scale + mask) V`, the fused softmax of candle-nn, as candle-transformers
//! writes it) and through attn's op; prints the largest difference and both times. Then the
//! attention alone at the issue's size (8 heads, n = 4096, d = 64, f32), non-causal and
//! causal: candle's naive attention, the op, and attn called directly on the same buffers,
//! with peak memory, in the same run; and one training step through the op (forward with
//! the LSE kept, backward), with what recomputing the LSE instead would add.
//!
//! ```text
//! cargo run --release -p attn-candle --example candle_layer                # n = 4096
//! cargo run --release -p attn-candle --example candle_layer -- --n 1024 --reps 3
//! cargo run --release -p attn-candle --example candle_layer -- --naive-backward
//! ```
//!
//! Threads: candle and attn both use the global rayon pool (`RAYON_NUM_THREADS`, else one
//! thread per core).

use std::time::{Duration, Instant};

use attn_candle::attn_optimized::{self, Options, Tensor4Ref};
use attn_candle::candle_core::{D, Device, Result, Tensor, Var};
use attn_candle::{AttentionOptions, Causal, Layout, scaled_dot_product_attention};

struct Args {
    n: usize,
    heads: usize,
    dim: usize,
    reps: usize,
    naive_backward: bool,
    /// Child mode: run one call of this path (`naive`, `op`, `naive-causal`, `op-causal`)
    /// and print the peak RSS it added.
    peak_of: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        n: 4096,
        heads: 8,
        dim: 64,
        reps: 7,
        naive_backward: false,
        peak_of: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut num = || -> usize {
            it.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{flag} takes a number"))
        };
        match flag.as_str() {
            "--n" => a.n = num(),
            "--heads" => a.heads = num(),
            "--dim" => a.dim = num(),
            "--reps" => a.reps = num().max(1),
            "--naive-backward" => a.naive_backward = true,
            "--peak-of" => a.peak_of = it.next(),
            other => panic!("unknown flag {other} (--n, --heads, --dim, --reps, --naive-backward)"),
        }
    }
    a
}

/// Deterministic values in `[-amp, amp)`.
fn random(dims: &[usize], seed: u64, amp: f32) -> Result<Tensor> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let n = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * amp
        })
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu)
}

/// candle's naive attention over `[b, h, n, d]` (contiguous) tensors, the way
/// candle-transformers writes it: scores, masked_fill for causal, fused softmax, PV.
fn naive_attention(q: &Tensor, k: &Tensor, v: &Tensor, causal: Option<&Tensor>) -> Result<Tensor> {
    let scale = 1.0 / (q.dim(D::Minus1)? as f64).sqrt();
    let att = (q.matmul(&k.t()?)? * scale)?;
    let att = match causal {
        None => att,
        Some(mask) => {
            let minf = Tensor::new(f32::NEG_INFINITY, att.device())?.broadcast_as(att.shape())?;
            mask.broadcast_as(att.shape())?.where_cond(&minf, &att)?
        }
    };
    let att = candle_nn::ops::softmax_last_dim(&att)?;
    att.matmul(v)
}

/// The causal mask of candle-transformers: `1` where key `j` is after query `i`.
fn causal_mask(n: usize) -> Result<Tensor> {
    let m: Vec<u8> = (0..n * n).map(|x| u8::from(x % n > x / n)).collect();
    Tensor::from_vec(m, (n, n), &Device::Cpu)
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Peak resident memory of the process, in MiB (Linux: `VmHWM`); `None` where /proc does
/// not have it.
fn peak_rss_mib() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn current_rss_mib() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// Child mode: the inputs, then one call of `path` between two reads of the RSS; prints
/// how far the peak rose above the RSS before the call, in MiB.
fn child_peak(a: &Args, path: &str) -> Result<()> {
    let (q, k, v) = inputs(a)?;
    let causal = path.ends_with("causal");
    let mask = causal.then(|| causal_mask(a.n)).transpose()?;
    let opts = if causal {
        AttentionOptions::default().with_causal(Causal::TopLeft)
    } else {
        AttentionOptions::default()
    };
    let before = current_rss_mib().unwrap_or(f64::NAN);
    let out = if path.starts_with("naive") {
        naive_attention(&q, &k, &v, mask.as_ref())?
    } else {
        scaled_dot_product_attention(&q, &k, &v, &opts)?
    };
    let peak = peak_rss_mib().unwrap_or(f64::NAN);
    println!("{}", peak - before);
    drop(out);
    Ok(())
}

/// The peak RSS one call of `path` adds, measured in a fresh process (this example, run
/// with `--peak-of`), so that no freed memory of another path is reused.
fn peak_in_child(a: &Args, path: &str) -> Option<f64> {
    let exe = std::env::current_exe().ok()?;
    let out = std::process::Command::new(exe)
        .args(["--n", &a.n.to_string(), "--heads", &a.heads.to_string()])
        .args(["--dim", &a.dim.to_string(), "--peak-of", path])
        .output()
        .ok()?;
    String::from_utf8(out.stdout)
        .ok()?
        .trim()
        .parse()
        .ok()
        .filter(|m: &f64| m.is_finite())
}

/// The attention inputs `[1, heads, n, dim]`.
fn inputs(a: &Args) -> Result<(Tensor, Tensor, Tensor)> {
    let dims = [1, a.heads, a.n, a.dim];
    Ok((
        random(&dims, 11, 1.0)?,
        random(&dims, 12, 1.0)?,
        random(&dims, 13, 1.0)?,
    ))
}

fn fmt_mib(m: Option<f64>) -> String {
    m.map_or_else(|| "n/a".into(), |m| format!("{m:.0} MiB"))
}

fn flat_f32(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

fn main() -> Result<()> {
    let a = args();
    if let Some(path) = &a.peak_of {
        return child_peak(&a, path);
    }
    let (b, h, n, d) = (1, a.heads, a.n, a.dim);
    println!(
        "attn {:?} kernels, {} rayon threads; batch {b}, {h} heads, n = {n}, d = {d}, f32, median of {}",
        attn_optimized::exp::isa(),
        rayon::current_num_threads(),
        a.reps
    );

    // ---- One layer: projections, attention, output projection; causal.
    let d_model = h * d;
    let x = random(&[b, n, d_model], 1, 1.0)?;
    let w = |seed| random(&[d_model, d_model], seed, (3.0 / d_model as f32).sqrt());
    let (wq, wk, wv, wo) = (w(2)?, w(3)?, w(4)?, w(5)?);
    let mask = causal_mask(n)?;
    let project =
        |x: &Tensor, w: &Tensor| -> Result<Tensor> { x.broadcast_matmul(w)?.reshape((b, n, h, d)) };
    let naive_layer = || -> Result<Tensor> {
        let q = project(&x, &wq)?.transpose(1, 2)?.contiguous()?;
        let k = project(&x, &wk)?.transpose(1, 2)?.contiguous()?;
        let v = project(&x, &wv)?.transpose(1, 2)?.contiguous()?;
        let o = naive_attention(&q, &k, &v, Some(&mask))?;
        o.transpose(1, 2)?
            .reshape((b, n, d_model))?
            .broadcast_matmul(&wo)
    };
    let attn_opts = AttentionOptions::default()
        .with_causal(Causal::TopLeft)
        .with_output_layout(Layout::Bshd);
    let attn_layer = || -> Result<Tensor> {
        // [B, S, H, D] projections viewed as [B, H, S, D]: no copy in, none out.
        let q = project(&x, &wq)?.transpose(1, 2)?;
        let k = project(&x, &wk)?.transpose(1, 2)?;
        let v = project(&x, &wv)?.transpose(1, 2)?;
        let o = scaled_dot_product_attention(&q, &k, &v, &attn_opts)?;
        o.reshape((b, n, d_model))?.broadcast_matmul(&wo)
    };
    let (mut t_naive, mut t_attn) = (Vec::new(), Vec::new());
    let (mut y_naive, mut y_attn) = (None, None);
    for _ in 0..a.reps {
        let t = Instant::now();
        y_naive = Some(naive_layer()?);
        t_naive.push(t.elapsed());
        let t = Instant::now();
        y_attn = Some(attn_layer()?);
        t_attn.push(t.elapsed());
    }
    let (y_naive, y_attn) = (y_naive.unwrap(), y_attn.unwrap());
    println!("\none causal attention layer (d_model = {d_model}, projections included)");
    println!(
        "  naive {:8.1} ms   attn {:8.1} ms   ×{:.2}   max |difference| {:.2e} (outputs up to {:.2})",
        ms(median(t_naive.clone())),
        ms(median(t_attn.clone())),
        median(t_naive).as_secs_f64() / median(t_attn).as_secs_f64(),
        max_diff(&y_naive, &y_attn)?,
        y_naive.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?,
    );

    // ---- The attention alone: naive, the op, attn directly, same inputs.
    let (q, k, v) = inputs(&a)?;
    let (qd, kd, vd) = (flat_f32(&q)?, flat_f32(&k)?, flat_f32(&v)?);
    let dims = [b, h, n, d];
    fn view(x: &[f32], dims: [usize; 4]) -> Result<Tensor4Ref<'_, f32>> {
        Tensor4Ref::from_layout(x, dims, attn_optimized::Layout::Bhsd)
            .map_err(|e| attn_candle::Error::Msg(e.to_string()))
    }
    println!(
        "\nattention alone, [{b}, {h}, {n}, {d}] f32 (median ms of {} naive calls and {} op and direct calls each;\n  peak RSS one call adds, in a fresh process)",
        a.reps,
        3 * a.reps
    );
    println!(
        "  {:<10} {:>9} {:>9} {:>9} {:>11} {:>12} {:>11} {:>11}",
        "", "naive", "op", "direct", "naive/op", "op/direct-1", "naive mem", "op mem"
    );
    for causal in [false, true] {
        let mask = causal.then(|| causal_mask(n)).transpose()?;
        let opts = if causal {
            AttentionOptions::default().with_causal(Causal::TopLeft)
        } else {
            AttentionOptions::default()
        };
        let direct_opts = if causal {
            Options::default().with_causal(Causal::TopLeft)
        } else {
            Options::default()
        };
        let direct = || -> Result<attn_optimized::Tensor4<f32>> {
            let e = |e: attn_optimized::Error| attn_candle::Error::Msg(e.to_string());
            attn_optimized::Attention::batched(
                view(&qd, dims)?,
                view(&kd, dims)?,
                view(&vd, dims)?,
                &direct_opts,
            )
            .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
            .map(|f| f.into_output())
            .map_err(e)
        };
        let (mut tn, mut to, mut td) = (Vec::new(), Vec::new(), Vec::new());
        let mut diff = 0f32;
        for rep in 0..a.reps {
            let t = Instant::now();
            let yn = naive_attention(&q, &k, &v, mask.as_ref())?;
            tn.push(t.elapsed());
            // The op and the direct call, three pairs per naive call, alternating which
            // runs first (they do the same work: their difference is the op's overhead).
            for pair in 0..6 {
                if (pair + rep) % 2 == 0 {
                    let t = Instant::now();
                    let yo = scaled_dot_product_attention(&q, &k, &v, &opts)?;
                    to.push(t.elapsed());
                    if rep == 0 && pair == 0 {
                        diff = max_diff(&yn, &yo)?;
                        let yd = direct()?;
                        assert_eq!(
                            flat_f32(&yo)?,
                            yd.as_slice(),
                            "the op computes what attn computes"
                        );
                    }
                } else {
                    let t = Instant::now();
                    let _ = direct()?;
                    td.push(t.elapsed());
                }
            }
        }
        let suffix = if causal { "-causal" } else { "" };
        let mem_naive = peak_in_child(&a, &format!("naive{suffix}"));
        let mem_op = peak_in_child(&a, &format!("op{suffix}"));
        let min_ratio =
            to.iter().min().unwrap().as_secs_f64() / td.iter().min().unwrap().as_secs_f64();
        let (tn, to, td) = (median(tn), median(to), median(td));
        println!(
            "  {:<10} {:>9.1} {:>9.1} {:>9.1} {:>10.2}× {:>+11.1}% {:>11} {:>11}   fastest op/direct−1 {:+.1}%, max |naive − op| {diff:.1e}",
            if causal { "causal" } else { "non-causal" },
            ms(tn),
            ms(to),
            ms(td),
            tn.as_secs_f64() / to.as_secs_f64(),
            (to.as_secs_f64() / td.as_secs_f64() - 1.0) * 100.0,
            fmt_mib(mem_naive),
            fmt_mib(mem_op),
            (min_ratio - 1.0) * 100.0,
        );
    }
    println!(
        "  (the output alone is {:.0} MiB; the naive scores are {:.0} MiB)",
        (b * h * n * d * 4) as f64 / (1 << 20) as f64,
        (b * h * n * n * 4) as f64 / (1 << 20) as f64
    );

    // ---- One training step through the op: forward (LSE kept) and backward.
    println!("\ntraining step through the op (loss = Σ out ∘ w), median ms");
    let w_out = random(&[b, h, n, d], 14, 1.0)?;
    for causal in [false, true] {
        let opts = if causal {
            AttentionOptions::default().with_causal(Causal::TopLeft)
        } else {
            AttentionOptions::default()
        };
        let direct_opts = if causal {
            Options::default().with_causal(Causal::TopLeft)
        } else {
            Options::default()
        };
        let (qv, kv, vv) = (
            Var::from_tensor(&q)?,
            Var::from_tensor(&k)?,
            Var::from_tensor(&v)?,
        );
        let (mut tf, mut tb, mut tl) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..a.reps {
            let t = Instant::now();
            let out = scaled_dot_product_attention(&qv, &kv, &vv, &opts)?;
            tf.push(t.elapsed());
            let loss = (out * &w_out)?.sum_all()?;
            let t = Instant::now();
            let grads = loss.backward()?;
            tb.push(t.elapsed());
            assert!(grads.get(&qv).is_some());
            // What `bwd` would spend first if it recomputed the LSE: one more forward.
            let t = Instant::now();
            let e = |e: attn_optimized::Error| attn_candle::Error::Msg(e.to_string());
            let _ = attn_optimized::Attention::batched(
                view(&qd, dims)?,
                view(&kd, dims)?,
                view(&vd, dims)?,
                &direct_opts,
            )
            .and_then(|call| call.forward(attn_optimized::Par::rayon(0)))
            .map_err(e)?;
            tl.push(t.elapsed());
        }
        let (tf, tb, tl) = (median(tf), median(tb), median(tl));
        println!(
            "  {:<10} forward {:8.1}   backward {:8.1}   recomputing the LSE would add {:8.1} (+{:.0}% of the backward; keeping it costs {:.0} KiB)",
            if causal { "causal" } else { "non-causal" },
            ms(tf),
            ms(tb),
            ms(tl),
            tl.as_secs_f64() / tb.as_secs_f64() * 100.0,
            (b * h * n * 4) as f64 / 1024.0,
        );
        if a.naive_backward {
            let t = Instant::now();
            let s = (qv.matmul(&kv.t()?)? * (1.0 / (d as f64).sqrt()))?;
            let s = if causal {
                let m = causal_mask(n)?.broadcast_as(s.shape())?;
                let minf = Tensor::new(f32::NEG_INFINITY, s.device())?.broadcast_as(s.shape())?;
                m.where_cond(&minf, &s)?
            } else {
                s
            };
            let out = candle_nn::ops::softmax(&s, D::Minus1)?.matmul(&vv)?;
            let tnf = t.elapsed();
            let t = Instant::now();
            let _ = (out * &w_out)?.sum_all()?.backward()?;
            let tnb = t.elapsed();
            println!(
                "  {:<10} naive forward {:8.1}   naive backward {:8.1}   (once) ×{:.2} for the step",
                "",
                ms(tnf),
                ms(tnb),
                (tnf + tnb).as_secs_f64() / (tf + tb).as_secs_f64()
            );
        }
    }
    Ok(())
}
