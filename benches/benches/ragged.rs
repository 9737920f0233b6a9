//! The targets of per-head masks and packed batches, 2 threads, f32, d = 64:
//!
//! - a boolean mask per head (`[1, 8, n, n]`, [`BoolMask4`]) costs at most 10 % over one
//!   shared `[n, n]` mask ([`BoolMask`]) at 8 heads, n = 4096, with the same density;
//! - a packed batch of 8 sequences of 64 to 4096 tokens ([`attention_packed`]) takes at
//!   most 1.05× the sum of the separate calls on each sequence (batched calls on views of
//!   the same packed buffer).
//!
//! Criterion times each kernel; the ratios come from a loop that interleaves the two sides
//! (a, b, a, b, …) and prints the median of the per-round ratios, because rates drift by
//! several per cent within a run on these machines. Under `cargo test --benches` the
//! shapes shrink to a toy size.

mod common;

use std::time::Duration;

use attn_benches::protocol::median;
use attn_benches::roof::pool;
use attn_optimized::{
    Attention, BoolMask, BoolMask4, CuSeqlens, Layout, Mask4Ref, Options, Par, Tensor4Ref,
};
use criterion::Criterion;
use faer::MatRef;

/// The mask pattern of head `h`: about 90 % of the keys allowed, a different 10 % per head.
fn allowed(h: usize, i: usize, j: usize) -> bool {
    !(i * 7 + j * 13 + h * 3).is_multiple_of(10)
}

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 2654435761 + seed) % 1000) as f32 / 1000.0) - 0.5)
        .collect()
}

fn main() {
    common::print_platform();
    let full = common::full_size();
    let (heads, n, d, threads, rounds) = if full {
        (8, 4096, 64, 2, 11)
    } else {
        (2, 64, 16, 2, 1)
    };
    let lens: Vec<usize> = if full {
        vec![64, 4096, 128, 2048, 256, 3072, 512, 1024]
    } else {
        vec![8, 64, 16, 1]
    };
    let pool = pool(threads);
    let mut c = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(if full { 10 } else { 1 }))
        .configure_from_args();

    // Per-head against shared boolean masks.
    let x = values(heads * n * d, 1);
    let x = Tensor4Ref::from_layout(&x, [1, heads, n, d], Layout::Bhsd).expect("fits");
    let shared_bits: Vec<bool> = (0..n * n).map(|e| allowed(0, e / n, e % n)).collect();
    let per_head_bits: Vec<bool> = (0..heads * n * n)
        .map(|e| allowed(e / (n * n), e / n % n, e % n))
        .collect();
    let shared = Options::default().with_bool_mask(BoolMask::allow(MatRef::from_row_major_slice(
        &shared_bits,
        n,
        n,
    )));
    let per_head_view = Mask4Ref::contiguous(&per_head_bits, [1, heads, n, n]).expect("fits");
    let per_head = Options::default().with_bool_mask_4d(BoolMask4::allow(per_head_view));
    let masked = |o: &Options<'_>| {
        pool.install(|| {
            Attention::batched(x, x, x, o)
                .and_then(|call| call.forward(Par::rayon(0)))
                .map(|f| f.into_output())
                .expect("runs")
        })
    };

    // Packed against separate calls, over one [total, heads, d] buffer.
    let total: usize = lens.iter().sum();
    let mut cu = vec![0];
    for l in &lens {
        cu.push(cu[cu.len() - 1] + l);
    }
    let seqs = CuSeqlens::new(&cu, &cu).expect("valid offsets");
    let p = values(total * heads * d, 2);
    let packed = Tensor4Ref::from_layout(&p, [1, heads, total, d], Layout::Bshd).expect("fits");
    let strides = packed.strides();
    let pieces: Vec<Tensor4Ref<'_, f32>> = (0..lens.len())
        .map(|s| {
            let r = seqs.queries(s);
            Tensor4Ref::new(&p[r.start * strides[2]..], [1, heads, r.len(), d], strides)
                .expect("a sub-view fits")
        })
        .collect();
    let opts = Options::default();
    let run_packed = || {
        pool.install(|| {
            Attention::packed(packed, packed, packed, &seqs, &opts)
                .and_then(|call| call.forward(Par::rayon(0)))
                .map(|f| f.into_output())
                .expect("runs")
        })
    };
    let run_separate = || {
        pool.install(|| {
            for t in &pieces {
                Attention::batched(*t, *t, *t, &opts)
                    .and_then(|call| call.forward(Par::rayon(0)))
                    .map(|f| f.into_output())
                    .expect("runs");
            }
        })
    };

    {
        let mut group = c.benchmark_group(format!("ragged_h{heads}_n{n}_d{d}_t{threads}"));
        group.bench_function("bool_mask_shared", |b| b.iter(|| masked(&shared)));
        group.bench_function("bool_mask_per_head", |b| b.iter(|| masked(&per_head)));
        group.bench_function("packed_8_sequences", |b| b.iter(run_packed));
        group.bench_function("separate_8_sequences", |b| b.iter(run_separate));
        group.finish();
    }
    c.final_summary();
    if common::criterion_only() {
        return;
    }

    // Interleaved ratios, everything warmed once first.
    masked(&shared);
    masked(&per_head);
    run_packed();
    run_separate();
    let (mut mask_ratio, mut packed_ratio) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t_shared = common::seconds(|| {
            masked(&shared);
        });
        let t_per_head = common::seconds(|| {
            masked(&per_head);
        });
        mask_ratio.push(t_per_head / t_shared);
        let t_packed = common::seconds(|| {
            run_packed();
        });
        let t_separate = common::seconds(run_separate);
        packed_ratio.push(t_packed / t_separate);
    }
    println!(
        "\nragged: interleaved ratios, median of {rounds} rounds (h={heads}, d={d}, threads={threads}; isa {:?})",
        attn_optimized::exp::isa()
    );
    let (lo, hi) = common::range(&mask_ratio);
    println!(
        "  per-head [1,{heads},{n},{n}] bool mask ÷ shared [{n},{n}] one = {:.3}  (range {lo:.3}–{hi:.3}, target ≤ 1.10)",
        median(&mask_ratio).unwrap_or(f64::NAN)
    );
    let (lo, hi) = common::range(&packed_ratio);
    println!(
        "  packed {lens:?} ÷ sum of separate calls = {:.3}  (range {lo:.3}–{hi:.3}, target ≤ 1.05)",
        median(&packed_ratio).unwrap_or(f64::NAN)
    );
}
