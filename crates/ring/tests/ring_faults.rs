//! One rank fails at a chosen point of a chosen step of the ring (a fault planted through
//! the test-only `fault-injection` feature), forward and backward: every rank must return
//! an error — the failed rank its own, every other one [`RingError::Failed`] naming it —
//! within a time limit, and the ring must still turn afterwards, bit for bit as before.
//!
//! `cargo xtask test` builds it with the feature and runs it under `mpirun -np P` for
//! P = 2, 3, 4. A hang fails it: a watchdog thread ends the process when a case has not
//! finished within [`LIMIT`] (mpirun then ends the others, and its own `--timeout` is the
//! last resort).

use std::process::ExitCode;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use attn_core::{Error, Tensor4, Tensor4Ref};
use attn_ring::faults::{Fault, FaultPass, FaultPoint, plant};
use attn_ring::mpi::traits::*;
use attn_ring::{Ring, RingError, RingOptions, Split, shard, zigzag_rows};

mod common;
use common::{same_bits, tensor};

/// How long a case may take, failure included (a healthy case takes milliseconds).
const LIMIT: Duration = Duration::from_secs(60);

/// The passes' inputs on this rank: a causal zigzag problem, so that steps differ.
struct Inputs {
    q: Tensor4<f32>,
    k: Tensor4<f32>,
    v: Tensor4<f32>,
    d_out: Tensor4<f32>,
}

impl Inputs {
    fn new(p: usize, r: usize) -> Self {
        let n = 41;
        let rows = zigzag_rows(n, p, r);
        let cut = |t: Tensor4<f32>| shard(t.as_ref(), &rows).unwrap();
        Self {
            q: cut(tensor(1, [1, 4, n, 8], 1.5)),
            k: cut(tensor(2, [1, 2, n, 8], 1.5)),
            v: cut(tensor(3, [1, 2, n, 8], 1.0)),
            d_out: cut(tensor(4, [1, 4, n, 8], 1.0)),
        }
    }
}

fn options() -> RingOptions {
    RingOptions::default()
        .with_causal(true)
        .with_split(Split::Zigzag)
}

/// Every fault of a ring of `p` ranks: each rank, each point, each step where it applies.
fn faults(p: usize) -> Vec<Fault> {
    let mut all = vec![];
    for pass in [FaultPass::Forward, FaultPass::Backward] {
        for rank in 0..p {
            let mut at = |point, step| {
                all.push(Fault {
                    rank,
                    pass,
                    step,
                    point,
                })
            };
            at(FaultPoint::SetUp, 0);
            // A receive buffer is grown before every step but the last.
            (0..p - 1).for_each(|s| at(FaultPoint::Grow, s));
            (0..p).for_each(|s| at(FaultPoint::Compute, s));
            at(FaultPoint::Finish, 0);
        }
    }
    all
}

/// What this rank returned for `fault`, checked: `Err` says what is wrong.
fn check(
    ring: &Ring,
    x: &Inputs,
    fwd: (Tensor4Ref<'_, f32>, &[f32]),
    f: Fault,
) -> Result<(), String> {
    let opts = options();
    plant(Some(f));
    let start = Instant::now();
    let got = match f.pass {
        FaultPass::Forward => ring
            .forward(x.q.as_ref(), x.k.as_ref(), x.v.as_ref(), &opts)
            .map(|_| ()),
        FaultPass::Backward => ring
            .backward(
                x.d_out.as_ref(),
                x.q.as_ref(),
                x.k.as_ref(),
                x.v.as_ref(),
                fwd.0,
                fwd.1,
                &opts,
            )
            .map(|_| ()),
    };
    plant(None);
    let took = start.elapsed();
    if took > LIMIT {
        return Err(format!("took {took:?}, over the limit of {LIMIT:?}"));
    }
    match (ring.rank() == f.rank, got) {
        (
            true,
            Err(RingError::Input(Error::Allocation {
                what: "planted fault",
                ..
            })),
        ) => Ok(()),
        (false, Err(RingError::Failed { rank })) if rank == f.rank => Ok(()),
        (_, Err(e)) => Err(format!("wrong error: {e}")),
        (_, Ok(())) => Err("no error".into()),
    }
}

fn main() -> ExitCode {
    let universe = match attn_ring::initialize() {
        Ok(u) => u,
        Err(e) => {
            eprintln!("ring_faults: {e}");
            return ExitCode::FAILURE;
        }
    };
    let world = universe.world();
    let ring = match Ring::new(&world) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ring_faults: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (p, r) = (ring.size(), ring.rank());

    // The watchdog: each case names itself on the channel; silence longer than LIMIT is a
    // hang, and the process ends with a message (mpirun then ends the job).
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        let mut current = String::from("the first pass");
        loop {
            match rx.recv_timeout(LIMIT) {
                Ok(name) => current = name,
                Err(RecvTimeoutError::Timeout) => {
                    eprintln!("rank {r}/{p}: `{current}` did not finish within {LIMIT:?}: a hang");
                    std::process::exit(3);
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    });

    let x = Inputs::new(p, r);
    let opts = options();
    let clean = |ring: &Ring| {
        let f = ring
            .forward(x.q.as_ref(), x.k.as_ref(), x.v.as_ref(), &opts)
            .expect("a pass without a fault");
        let b = ring
            .backward(
                x.d_out.as_ref(),
                x.q.as_ref(),
                x.k.as_ref(),
                x.v.as_ref(),
                f.out.as_ref(),
                &f.lse,
                &opts,
            )
            .expect("a pass without a fault");
        (f, b)
    };
    let (f, b) = clean(&ring);

    let mut failed = 0u64;
    let all = faults(p);
    for fault in &all {
        let name = format!("{fault:?}");
        let _ = tx.send(name.clone());
        if let Err(m) = check(&ring, &x, (f.out.as_ref(), &f.lse), *fault) {
            println!("rank {r}/{p} FAIL {name}: {m}");
            failed += 1;
        }
    }
    // The ring still turns, to the same bits: no message of a stopped pass was left behind.
    let _ = tx.send("a pass after the faults".into());
    let (f2, b2) = clean(&ring);
    let same = same_bits(f.out.as_slice(), f2.out.as_slice())
        && same_bits(b.dq.as_slice(), b2.dq.as_slice())
        && same_bits(b.dk.as_slice(), b2.dk.as_slice())
        && same_bits(b.dv.as_slice(), b2.dv.as_slice());
    if !same {
        println!("rank {r}/{p} FAIL the passes after the faults differ from those before");
        failed += 1;
    }
    drop(tx);

    let mut total = 0u64;
    world.all_reduce_into(
        &failed,
        &mut total,
        attn_ring::mpi::collective::SystemOperation::sum(),
    );
    if r == 0 {
        println!(
            "ring_faults with {p} ranks: {} planted faults, each an error on every rank; {total} failures",
            all.len()
        );
    }
    if total > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
