//! The ring's MPI tests: every case on every rank, over the real MPI.
//!
//! `cargo test` runs this binary as one process, a singleton MPI job (P = 1); `cargo xtask
//! test` runs it again under `mpirun -np P` for P = 1..4. Each rank checks its own rows
//! against the f64 reference within the oracle's derived bound (forward and backward),
//! against the in-process simulation bit for bit, and against a second run bit for bit;
//! error cases must fail on every rank. Rank 0 prints the totals of all ranks; the process
//! exits non-zero on any failure.

use std::ops::Range;
use std::process::ExitCode;

use attn_core::{Tensor4, Tensor4Ref};
use attn_ring::mpi::traits::*;
use attn_ring::{
    Ring, RingElement, RingError, RingOptions, Split, contiguous_rows, shard, simulate_backward,
    simulate_forward,
};
use half::f16;

mod common;
use common::{Case, Inputs, check_reference, same_bits, same_f32_bits, tensor};

/// Runs one case on this rank; `Err` says what failed.
fn run_case<T: RingElement>(ring: &Ring, c: &Case) -> Result<String, String> {
    let (p, r) = (ring.size(), ring.rank());
    let qd = [c.batch, c.h_q, c.n, c.d_k];
    let kd = [c.batch, c.h_kv, c.n, c.d_k];
    let vd = [c.batch, c.h_kv, c.n, c.d_v];
    let od = [c.batch, c.h_q, c.n, c.d_v];
    let (q, k, v) = (
        tensor::<T>(1, qd, 1.5),
        tensor::<T>(2, kd, 1.5),
        tensor::<T>(3, vd, 1.0),
    );
    let d_out = tensor::<T>(4, od, 1.0);
    let opts = c.options();
    let rows: Vec<Vec<Range<usize>>> = (0..p).map(|rank| c.rows(p, rank)).collect();
    let cut = |t: &Tensor4<T>| -> Vec<Tensor4<T>> {
        rows.iter()
            .map(|rs| shard(t.as_ref(), rs).unwrap())
            .collect()
    };
    let (qs, ks, vs, dos) = (cut(&q), cut(&k), cut(&v), cut(&d_out));
    fn views<T>(s: &[Tensor4<T>]) -> Vec<Tensor4Ref<'_, T>> {
        s.iter().map(|t| t.as_ref()).collect()
    }
    let (qv, kv, vv, dov) = (views(&qs), views(&ks), views(&vs), views(&dos));

    // Forward: twice, and the simulation.
    let f = ring
        .forward(qv[r], kv[r], vv[r], &opts)
        .map_err(|e| format!("forward: {e}"))?;
    let again = ring
        .forward(qv[r], kv[r], vv[r], &opts)
        .map_err(|e| format!("forward: {e}"))?;
    if !same_bits(f.out.as_slice(), again.out.as_slice()) || !same_f32_bits(&f.lse, &again.lse) {
        return Err("two runs of the forward differ".into());
    }
    let sim = simulate_forward(&qv, &kv, &vv, &opts).map_err(|e| format!("simulation: {e}"))?;
    if !same_bits(f.out.as_slice(), sim[r].out.as_slice()) || !same_f32_bits(&f.lse, &sim[r].lse) {
        return Err("the forward differs from the in-process simulation".into());
    }

    // Backward: twice, and the simulation (fed the simulation's forward, equal to the ring's).
    let b = ring
        .backward(dov[r], qv[r], kv[r], vv[r], f.out.as_ref(), &f.lse, &opts)
        .map_err(|e| format!("backward: {e}"))?;
    let b2 = ring
        .backward(dov[r], qv[r], kv[r], vv[r], f.out.as_ref(), &f.lse, &opts)
        .map_err(|e| format!("backward: {e}"))?;
    for (x, y, what) in [
        (&b.dq, &b2.dq, "dQ"),
        (&b.dk, &b2.dk, "dK"),
        (&b.dv, &b2.dv, "dV"),
    ] {
        if !same_bits(x.as_slice(), y.as_slice()) {
            return Err(format!("two runs of the backward differ in {what}"));
        }
    }
    let outs: Vec<_> = sim.iter().map(|s| s.out.as_ref()).collect();
    let lses: Vec<&[f32]> = sim.iter().map(|s| &s.lse[..]).collect();
    let sb = simulate_backward(&dov, &qv, &kv, &vv, &outs, &lses, &opts)
        .map_err(|e| format!("backward simulation: {e}"))?;
    for (x, y, what) in [
        (&b.dq, &sb[r].dq, "dQ"),
        (&b.dk, &sb[r].dk, "dK"),
        (&b.dv, &sb[r].dv, "dV"),
    ] {
        if !same_bits(x.as_slice(), y.as_slice()) {
            return Err(format!(
                "the backward differs from the simulation in {what}"
            ));
        }
    }

    // Against the f64 reference, within the derived bounds.
    let mine: Vec<usize> = rows[r].iter().flat_map(|x| x.clone()).collect();
    let inputs = Inputs {
        q: &q,
        k: &k,
        v: &v,
        d_out: &d_out,
    };
    let (fwd, bwd) = check_reference(c, p, &mine, inputs, (&f.out, &f.lse), (&b.dq, &b.dk, &b.dv))?;
    Ok(format!(
        "{} rows, worst |error|/bound forward {fwd:.3}, backward {bwd:.3}, {} of {} steps computed",
        mine.len(),
        f.stats.steps_computed,
        p
    ))
}

/// A rank whose shard has another width: the same error on every rank.
fn differing_width(ring: &Ring) -> Result<String, String> {
    let (p, r) = (ring.size(), ring.rank());
    if p < 2 {
        return Ok("needs two ranks: skipped".into());
    }
    let d = if r + 1 == p { 9 } else { 8 };
    let x = tensor::<f32>(5, [1, 2, 6, d], 1.0);
    match ring.forward(x.as_ref(), x.as_ref(), x.as_ref(), &RingOptions::default()) {
        Err(
            e @ RingError::Mismatch {
                rank,
                what: "d_k",
                found: 9,
                expected: 8,
            },
        ) if rank == p - 1 => Ok(format!("error: {e}")),
        Err(e) => Err(format!("wrong error: {e}")),
        Ok(_) => Err("no error".into()),
    }
}

/// Rank 0's inputs are invalid (3 query heads over 2 kv heads): its own error there, and
/// the others name it.
fn rejected_input(ring: &Ring) -> Result<String, String> {
    let r = ring.rank();
    let q = tensor::<f32>(6, [1, if r == 0 { 3 } else { 2 }, 5, 8], 1.0);
    let kv = tensor::<f32>(7, [1, 2, 5, 8], 1.0);
    let got = ring.backward(
        q.as_ref(),
        q.as_ref(),
        kv.as_ref(),
        kv.as_ref(),
        q.as_ref(),
        &[0.0; 10],
        &RingOptions::default(),
    );
    match (r, got) {
        (0, Err(RingError::Input(attn_core::Error::HeadGrouping { .. }))) => Ok("own error".into()),
        (_, Err(RingError::Peer { rank: 0 })) if r > 0 => Ok("peer error".into()),
        (_, Err(e)) => Err(format!("wrong error: {e}")),
        (_, Ok(_)) => Err("no error".into()),
    }
}

/// Query heads broadcast by a zero head stride to `heads` (from a buffer of one head):
/// sizes that do not fit (2^62 heads) or that no allocator grants (2^40) are an error on
/// every rank, forward and backward — not an overflow, an abort or a hang.
fn broadcast_heads(ring: &Ring, heads: usize) -> Result<String, String> {
    let (p, r) = (ring.size(), ring.rank());
    let (n, d) = (7, 4);
    let rows = contiguous_rows(n, p, r).len();
    let data = tensor::<f32>(9, [1, 1, rows, d], 1.0);
    let q = Tensor4Ref::new(data.as_slice(), [1, heads, rows, d], [0, 0, d])
        .map_err(|e| format!("view: {e}"))?;
    let kv = data.as_ref();
    let opts = RingOptions::default();
    let f = ring.forward(q, kv, kv, &opts);
    let b = ring.backward(q, q, kv, kv, q, &[0.0; 8], &opts);
    match (f, b) {
        (Err(RingError::Input(attn_core::Error::Allocation { what, .. })), Err(eb)) => Ok(format!(
            "forward: {what} cannot be allocated; backward: {eb}"
        )),
        (Err(e), _) => Err(format!("wrong forward error: {e}")),
        (Ok(_), _) => Err("no error from the forward".into()),
    }
}

fn zigzag_with_wrong_rows(ring: &Ring) -> Result<String, String> {
    let (p, r) = (ring.size(), ring.rank());
    // Every rank passes 3 rows: right only when 3·P splits evenly into 2P chunks' pairs.
    let x = tensor::<f32>(8, [1, 1, if r == 0 { 4 } else { 3 }, 4], 1.0);
    let opts = RingOptions::default()
        .with_causal(true)
        .with_split(Split::Zigzag);
    match ring.forward(x.as_ref(), x.as_ref(), x.as_ref(), &opts) {
        Err(RingError::Split {
            rank: 0, rows: 4, ..
        }) if p > 1 => Ok("split error".into()),
        Ok(_) if p == 1 => Ok("one rank: any count is its zigzag".into()),
        Err(e) => Err(format!("wrong error: {e}")),
        Ok(_) => Err("no error".into()),
    }
}

fn main() -> ExitCode {
    let universe = match attn_ring::initialize() {
        Ok(u) => u,
        Err(e) => {
            eprintln!("ring_mpi: {e}");
            return ExitCode::FAILURE;
        }
    };
    let world = universe.world();
    let ring = match Ring::new(&world) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ring_mpi: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (p, r) = (ring.size(), ring.rank());
    let cases = [
        Case::new(
            "non-causal, GQA 4/2, n = 37 (not divisible), f32",
            37,
            (4, 2),
            (16, 8),
        ),
        Case::new(
            "causal zigzag, GQA 2/1, batch 2, n = 45, f32",
            45,
            (2, 1),
            (8, 8),
        )
        .causal(Split::Zigzag)
        .batch(2),
        Case::new(
            "causal contiguous (unbalanced), n = 33, f32",
            33,
            (1, 1),
            (8, 4),
        )
        .causal(Split::Contiguous),
        Case::new(
            "zigzag with more chunks than positions, n = 3",
            3,
            (1, 1),
            (4, 4),
        )
        .causal(Split::Zigzag),
        Case {
            last_empty: true,
            ..Case::new(
                "the last rank's shard is empty, causal, n = 29",
                29,
                (2, 2),
                (8, 8),
            )
            .causal(Split::Contiguous)
        },
        Case::new("the whole sequence is empty, n = 0", 0, (2, 1), (8, 8)),
    ];
    let half_cases = [
        Case::new("non-causal, GQA 4/1, n = 41, f16", 41, (4, 1), (16, 16)),
        Case::new("causal zigzag, n = 50, f16", 50, (2, 2), (16, 8)).causal(Split::Zigzag),
    ];
    let mut results: Vec<(String, Result<String, String>)> = vec![];
    for c in cases {
        results.push((c.name.into(), run_case::<f32>(&ring, &c)));
    }
    for c in &half_cases {
        results.push((c.name.into(), run_case::<f16>(&ring, c)));
    }
    results.push((
        "a differing d_k is an error on every rank".into(),
        differing_width(&ring),
    ));
    results.push((
        "a rejected input is an error on every rank".into(),
        rejected_input(&ring),
    ));
    results.push((
        "2^62 query heads (stride 0) are an error on every rank".into(),
        broadcast_heads(&ring, 1 << 62),
    ));
    results.push((
        "2^40 query heads (stride 0) are an error on every rank".into(),
        broadcast_heads(&ring, 1 << 40),
    ));
    results.push((
        "zigzag rows not the split's are an error on every rank".into(),
        zigzag_with_wrong_rows(&ring),
    ));
    // The ring still turns after the errors.
    results.push((
        "after the errors: non-causal, n = 37".into(),
        run_case::<f32>(&ring, &cases_first()),
    ));

    let failed = results.iter().filter(|(_, r)| r.is_err()).count();
    for (name, res) in &results {
        match res {
            Ok(m) => println!("rank {r}/{p} ok   {name}: {m}"),
            Err(m) => println!("rank {r}/{p} FAIL {name}: {m}"),
        }
    }
    let mine = [(results.len() - failed) as u64, failed as u64];
    let mut all = vec![0u64; 2 * p];
    world.all_gather_into(&mine[..], &mut all[..]);
    let passed: u64 = all.iter().step_by(2).sum();
    let failed_all: u64 = all.iter().skip(1).step_by(2).sum();
    if r == 0 {
        println!(
            "ring_mpi with {p} ranks, {} threads each (cases × ranks):",
            ring.threads()
        );
        println!("{passed} passed, {failed_all} failed");
    }
    if failed_all > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn cases_first() -> Case {
    Case::new(
        "non-causal, GQA 4/2, n = 37 (not divisible), f32",
        37,
        (4, 2),
        (16, 8),
    )
}
