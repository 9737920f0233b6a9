//! The in-process simulation of the ring (no MPI): shards long enough that a step is cut
//! into several engine calls (query chunks forward, key chunks backward, the diagonal
//! among them), against the f64 reference within the derived bounds, and its bits against
//! a shuffled thread count.

use attn_core::{Tensor4, Tensor4Ref};
use attn_ring::{RingElement, Split, shard, simulate_backward, simulate_forward};

mod common;
use common::{Case, Inputs, check_reference, same_bits, tensor};

/// Simulates `c` over `p` ranks and checks every rank against the reference.
fn check<T: RingElement>(c: &Case, p: usize) {
    let q = tensor::<T>(11, [c.batch, c.h_q, c.n, c.d_k], 1.5);
    let k = tensor::<T>(12, [c.batch, c.h_kv, c.n, c.d_k], 1.5);
    let v = tensor::<T>(13, [c.batch, c.h_kv, c.n, c.d_v], 1.0);
    let d_out = tensor::<T>(14, [c.batch, c.h_q, c.n, c.d_v], 1.0);
    let rows: Vec<_> = (0..p).map(|r| c.rows(p, r)).collect();
    let cut = |t: &Tensor4<T>| -> Vec<Tensor4<T>> {
        rows.iter()
            .map(|rs| shard(t.as_ref(), rs).unwrap())
            .collect()
    };
    fn views<T>(s: &[Tensor4<T>]) -> Vec<Tensor4Ref<'_, T>> {
        s.iter().map(|t| t.as_ref()).collect()
    }
    let (qs, ks, vs, dos) = (cut(&q), cut(&k), cut(&v), cut(&d_out));
    let (qv, kv, vv, dov) = (views(&qs), views(&ks), views(&vs), views(&dos));
    let opts = c.options();
    let f = simulate_forward(&qv, &kv, &vv, &opts).unwrap();
    let outs: Vec<_> = f.iter().map(|s| s.out.as_ref()).collect();
    let lses: Vec<&[f32]> = f.iter().map(|s| &s.lse[..]).collect();
    let b = simulate_backward(&dov, &qv, &kv, &vv, &outs, &lses, &opts).unwrap();
    // One thread gives the same bits as the default pool.
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let f1 = one.install(|| simulate_forward(&qv, &kv, &vv, &opts).unwrap());
    for r in 0..p {
        assert!(
            same_bits(f[r].out.as_slice(), f1[r].out.as_slice()),
            "rank {r}: thread count changed the bits"
        );
        let mine: Vec<usize> = rows[r].iter().flat_map(|x| x.clone()).collect();
        let x = Inputs {
            q: &q,
            k: &k,
            v: &v,
            d_out: &d_out,
        };
        let got = check_reference(
            c,
            p,
            &mine,
            x,
            (&f[r].out, &f[r].lse),
            (&b[r].dq, &b[r].dk, &b[r].dv),
        );
        if let Err(m) = got {
            panic!("{} over {p} ranks, rank {r}: {m}", c.name);
        }
    }
}

#[test]
fn one_rank_causal_cuts_the_diagonal_into_query_and_key_chunks() {
    // 1300 rows: query chunks 512 + 512 + 276, key chunks 1024 + 276, on the diagonal.
    check::<f32>(
        &Case::new("one rank", 1300, (1, 1), (8, 8)).causal(Split::Contiguous),
        1,
    );
}

#[test]
fn two_ranks_zigzag_with_chunks_longer_than_a_call() {
    // Chunks of 1100/4 = 275 rows: every query run is one call; contiguous halves of 1100
    // rows below are two.
    check::<f32>(
        &Case::new("zigzag", 1100, (2, 1), (8, 4)).causal(Split::Zigzag),
        2,
    );
    check::<f32>(
        &Case::new("contiguous", 2100, (1, 1), (4, 4)).causal(Split::Contiguous),
        2,
    );
}

#[test]
fn half_precision_non_causal_over_three_ranks() {
    check::<half::f16>(&Case::new("f16", 700, (2, 2), (8, 8)), 3);
}

#[test]
fn simulation_rejects_what_the_ring_rejects() {
    let a = tensor::<f32>(1, [1, 1, 4, 8], 1.0);
    let b = tensor::<f32>(1, [1, 1, 4, 16], 1.0);
    let e = simulate_forward(
        &[a.as_ref(), b.as_ref()],
        &[a.as_ref(), b.as_ref()],
        &[a.as_ref(), b.as_ref()],
        &Default::default(),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "rank 1 has d_k 16 but rank 0 has 8 (every rank must pass the same shapes and options)"
    );
}
