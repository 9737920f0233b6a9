//! `attn-bench-runner`: measures one case or one roof and prints the result as one JSON
//! line. `cargo xtask bench` builds it in release and runs it once per case, so every case
//! has its own address space (its peak memory is its own) and can be killed on overrun.
//!
//! Usage: `attn-bench-runner case '<CaseRequest JSON>'`,
//! `attn-bench-runner roof '<RoofRequest JSON>'` (see `attn_benches::protocol`) or
//! `attn-bench-runner platform` (the `attn_benches::platform::Platform` it runs on).

use std::process::ExitCode;

use attn_benches::platform::Platform;
use attn_benches::protocol::{CaseRequest, RoofRequest};
use attn_benches::runner::{run_case, run_roof};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let answer = match args.as_slice() {
        // `platform` takes no request (`xtask` sends `null`).
        [kind, ..] if kind == "platform" => Ok(serde_json::to_string(&Platform::detect())),
        [kind, json] if kind == "case" => serde_json::from_str::<CaseRequest>(json)
            .map(|req| serde_json::to_string(&run_case(&req))),
        [kind, json] if kind == "roof" => serde_json::from_str::<RoofRequest>(json)
            .map(|req| serde_json::to_string(&run_roof(&req))),
        _ => {
            eprintln!("usage: attn-bench-runner (case|roof) '<request JSON>' | platform");
            return ExitCode::from(2);
        }
    };
    match answer {
        Ok(Ok(line)) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Ok(Err(e)) | Err(e) => {
            eprintln!("attn-bench-runner: bad request: {e}");
            ExitCode::from(2)
        }
    }
}
