//! Workspace automation for attn, in the rust-analyzer `xtask` style: ordinary Rust run by
//! `cargo xtask <command>` (an alias for `cargo run --package xtask --`).
//!
//! `cargo xtask bench` is the scaling report: it sweeps the sequence length over every
//! engine, measures time and peak memory per case in child processes, measures the
//! machine's roofs in the same run, fits the growth exponents and writes
//! `target/bench-report/` (`report.md`, `report.json`, SVG plots).
//!
//! `cargo xtask bench --doc` runs every sweep of the benchmark page in turn and writes the
//! page of the machine kind it runs on, `docs/benchmarks/<cpu>.md` (`doc.rs`).
//!
//! `cargo xtask test` runs every test: `cargo test --workspace`, then the Python
//! extension's pytest suite in a virtualenv it creates (`test.rs`).
//!
//! `cargo xtask bits` writes the output bits of every public entry point of the streaming
//! engine to a file (the release-built `attn-bits`), for bit-for-bit comparisons of two
//! commits on one CPU.
//!
//! This binary is built in debug by the alias, so it never times anything itself: it builds
//! the `attn-bench-runner` binary of `attn-benches` in release and runs it once per case.
#![forbid(unsafe_code)]

mod child;
mod cli;
mod doc;
mod fit;
mod machine;
mod plot;
mod report;
mod setup;
mod sweep;
mod test;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    match cli.command {
        cli::Command::Bench(args) => {
            let result = match args.replot.clone() {
                Some(dir) => sweep::replot(&dir),
                None if args.doc => doc::run(),
                None => sweep::run(&args.resolve()),
            };
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("xtask bench: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        cli::Command::Bits(args) => match bits(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("xtask bits: {e}");
                ExitCode::FAILURE
            }
        },
        cli::Command::Test(args) => match test::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("xtask test: {e}");
                ExitCode::FAILURE
            }
        },
    }
}

/// `cargo xtask bits`: builds `attn-bits` in release and runs it.
fn bits(args: &cli::BitsArgs) -> Result<(), String> {
    let exe = child::build_release_bin("attn-bits")?;
    let out = child::workspace_root().join(&args.out);
    let status = std::process::Command::new(exe)
        .arg(&out)
        .status()
        .map_err(|e| format!("cannot start attn-bits: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("attn-bits failed ({status})"))
    }
}
