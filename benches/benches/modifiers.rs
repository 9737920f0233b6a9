//! The score modifiers' targets, 2 threads, 8 heads, n = 4096, d = 64, f32:
//!
//! - soft-capping ([`SoftCap`]) costs at most 15 % over plain attention, ALiBi ([`Alibi`])
//!   at most 5 %, a sink logit per head at most 2 % (no mask; the same three with the
//!   top-left causal mask are printed too);
//! - a user-defined [`ScoreMod`] of the same arithmetic as a built-in costs at most 5 % over
//!   the built-in: a soft-cap written as `SoftCap::apply_f32(s).0` against
//!   `Options::with_softcap`, and ALiBi written naively as `s − m_h·|i + off − j|` against
//!   `Options::with_alibi`;
//! - a user [`MaskMod`] that re-implements causal (`j <= i`, with an exact
//!   [`MaskMod::coverage`]) costs at most 5 % over [`Causal::TopLeft`].
//!
//! Criterion times each kernel; the ratios come from a loop that interleaves the two sides
//! of each target (a, b, then b, a in the next round, so that neither side always runs
//! first) and prints the median of the per-round ratios, because rates drift by several
//! per cent within a run on these machines. Under `cargo test --benches` the shapes shrink
//! to a toy size.

mod common;

use std::time::Duration;

use attn_benches::protocol::median;
use attn_benches::roof::pool;
use attn_core::{Alibi, ScoreMod, ScoreTile, SoftCap};
use attn_optimized::{Attention, Causal, Layout, Options, Par, Tensor4Ref};
use attn_oracle::user_mods::{TopLeftMask, UserSoftCap};
use criterion::Criterion;

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 2654435761 + seed) % 1000) as f32 / 1000.0) - 0.5)
        .collect()
}

/// ALiBi as a user writes it, naively: `s − m_h·|i + off − j|`, the slope looked up per
/// score.
#[derive(Debug)]
struct UserAlibi<'a> {
    slopes: &'a [f32],
    off: i32,
}

/// The built-in's arithmetic: the distance in i32 lanes, then its magnitude in f32.
fn distance(i: usize, j: usize, off: i32) -> f32 {
    ((i as i32).wrapping_add(off).wrapping_sub(j as i32) as f32).abs()
}

impl ScoreMod for UserAlibi<'_> {
    fn score(&self, s: f32, _b: usize, h: usize, i: usize, j: usize) -> f32 {
        s - self.slopes[h] * distance(i, j, self.off)
    }
    fn derivative(&self, _s: f32, _b: usize, _h: usize, _i: usize, _j: usize) -> f32 {
        1.0
    }
    /// The head's slope looked up once per tile, as the built-in does: a slice index per
    /// score (`score` above) carries a bounds check that keeps the loop from vectorising.
    fn modify(&self, tile: &mut ScoreTile<'_>) {
        let (m, off) = (self.slopes[tile.head()], self.off);
        tile.map(move |s, i, j| s - m * distance(i, j, off));
    }
}

/// [`UserAlibi`] with the default `modify`: the slope looked up per score.
#[derive(Debug)]
struct NaiveUserAlibi<'a>(UserAlibi<'a>);

impl ScoreMod for NaiveUserAlibi<'_> {
    fn score(&self, s: f32, b: usize, h: usize, i: usize, j: usize) -> f32 {
        self.0.score(s, b, h, i, j)
    }
    fn derivative(&self, s: f32, b: usize, h: usize, i: usize, j: usize) -> f32 {
        self.0.derivative(s, b, h, i, j)
    }
}

/// One target: the kernel `a` over the kernel `b`, and the bound on the ratio.
struct Pair {
    label: &'static str,
    a: usize,
    b: usize,
    target: f64,
}

fn main() {
    common::print_platform();
    let full = common::full_size();
    let (heads, n, d, threads, rounds) = if full {
        (8, 4096, 64, 2, 21)
    } else {
        (2, 64, 16, 2, 1)
    };
    let pool = pool(threads);
    let mut c = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(if full { 6 } else { 1 }))
        .configure_from_args();

    let x = values(heads * n * d, 1);
    let x = Tensor4Ref::from_layout(&x, [1, heads, n, d], Layout::Bhsd).expect("fits");
    let cap = SoftCap::new(50.0).expect("a valid cap");
    // The slopes of the ALiBi paper for 8 heads, 2^(−8(h+1)/H).
    let slopes: Vec<f32> = (0..heads)
        .map(|h| 2f32.powf(-8.0 * (h + 1) as f32 / heads as f32))
        .collect();
    let sinks: Vec<f32> = (0..heads).map(|h| 0.25 * h as f32 - 0.5).collect();
    let user_cap = UserSoftCap(cap);
    // Self-attention: the default bottom-right alignment has offset n_k − n_q = 0.
    let user_alibi = UserAlibi {
        slopes: &slopes,
        off: 0,
    };
    let naive_alibi = NaiveUserAlibi(UserAlibi {
        slopes: &slopes,
        off: 0,
    });
    let causal = Options::default().with_causal(Causal::TopLeft);
    let plain = Options::default();

    // The kernels, by index; the pairs below refer to them.
    let kernels: Vec<(&str, Options<'_>)> = vec![
        ("plain", plain),
        ("softcap", plain.with_softcap(cap)),
        ("alibi", plain.with_alibi(Alibi::new(&slopes))),
        ("sink", plain.with_sinks(&sinks)),
        ("user_softcap", plain.with_score_mod(&user_cap)),
        ("user_alibi", plain.with_score_mod(&user_alibi)),
        ("user_alibi_naive", plain.with_score_mod(&naive_alibi)),
        ("causal", causal),
        ("causal_softcap", causal.with_softcap(cap)),
        ("causal_alibi", causal.with_alibi(Alibi::new(&slopes))),
        ("causal_sink", causal.with_sinks(&sinks)),
        ("user_causal_mask", plain.with_mask_mod(&TopLeftMask)),
    ];
    let index = |name: &str| {
        kernels
            .iter()
            .position(|(k, _)| *k == name)
            .expect("a kernel")
    };
    let pair = |label, a, b, target| Pair {
        label,
        a: index(a),
        b: index(b),
        target,
    };
    let pairs = [
        pair("soft-cap ÷ plain", "softcap", "plain", 1.15),
        pair("ALiBi ÷ plain", "alibi", "plain", 1.05),
        pair("sink ÷ plain", "sink", "plain", 1.02),
        pair(
            "user ScoreMod soft-cap ÷ with_softcap",
            "user_softcap",
            "softcap",
            1.05,
        ),
        pair(
            "user ScoreMod ALiBi ÷ with_alibi",
            "user_alibi",
            "alibi",
            1.05,
        ),
        pair(
            "(no target) naive user ALiBi ÷ with_alibi",
            "user_alibi_naive",
            "alibi",
            f64::INFINITY,
        ),
        pair(
            "user MaskMod causal ÷ Causal::TopLeft",
            "user_causal_mask",
            "causal",
            1.05,
        ),
        pair("causal soft-cap ÷ causal", "causal_softcap", "causal", 1.15),
        pair("causal ALiBi ÷ causal", "causal_alibi", "causal", 1.05),
        pair("causal sink ÷ causal", "causal_sink", "causal", 1.02),
    ];
    let run = |k: usize| {
        pool.install(|| {
            Attention::batched(x, x, x, &kernels[k].1)
                .and_then(|call| call.forward(Par::rayon(0)))
                .map(|f| f.into_output())
                .expect("runs")
        });
    };

    {
        let mut group = c.benchmark_group(format!("modifiers_h{heads}_n{n}_d{d}_t{threads}"));
        for (k, (name, _)) in kernels.iter().enumerate() {
            group.bench_function(*name, |b| b.iter(|| run(k)));
        }
        group.finish();
    }
    c.final_summary();
    if common::criterion_only() {
        return;
    }

    // Interleaved ratios, everything warmed once first.
    (0..kernels.len()).for_each(run);
    let mut ratios = vec![Vec::with_capacity(rounds); pairs.len()];
    for round in 0..rounds {
        for (p, r) in pairs.iter().zip(&mut ratios) {
            let (t_a, t_b) = if round % 2 == 0 {
                let t_a = common::seconds(|| run(p.a));
                (t_a, common::seconds(|| run(p.b)))
            } else {
                let t_b = common::seconds(|| run(p.b));
                (common::seconds(|| run(p.a)), t_b)
            };
            r.push(t_a / t_b);
        }
    }
    println!(
        "\nmodifiers: interleaved ratios, median of {rounds} rounds (h={heads}, n={n}, d={d}, threads={threads}; isa {:?})",
        attn_optimized::exp::isa()
    );
    for (p, r) in pairs.iter().zip(&ratios) {
        let (lo, hi) = common::range(r);
        let m = median(r).unwrap_or(f64::NAN);
        let verdict = match (full, m <= p.target) {
            (false, _) => "toy size, not judged",
            (true, true) => "met",
            (true, false) => "MISSED",
        };
        println!(
            "  {:<40} = {m:.3}  (range {lo:.3}–{hi:.3}, target ≤ {:.2}: {verdict})",
            p.label, p.target
        );
    }
}
