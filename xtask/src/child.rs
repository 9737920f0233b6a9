//! Building the release `attn-bench-runner` and running it as a child process with a
//! deadline.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

/// The workspace root: xtask lives one directory below it (rust-analyzer's pattern).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask is a directory of the workspace")
        .to_path_buf()
}

/// The cargo that runs us (`cargo xtask` sets `CARGO`), or the one on the path.
fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// Builds `attn-bench-runner` in release (one build of the release profile, shared with
/// `cargo build --release`) and returns the path of the executable. Compiler output goes
/// to the terminal as usual.
pub fn build_runner() -> Result<PathBuf, String> {
    build_release_bin("attn-bench-runner")
}

/// Builds the binary `name` of `attn-benches` in release and returns the path of the
/// executable.
pub fn build_release_bin(name: &str) -> Result<PathBuf, String> {
    let output = Command::new(cargo())
        .current_dir(workspace_root())
        .args([
            "build",
            "--release",
            "--package",
            "attn-benches",
            "--bin",
            name,
            "--message-format=json-render-diagnostics",
        ])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot start cargo: {e}"))?;
    if !output.status.success() {
        return Err(format!("building {name} failed ({})", output.status));
    }
    // Cargo's JSON messages name the executable wherever the target directory is.
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == name)
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .ok_or_else(|| format!("cargo built {name} but did not name its executable"))
}

/// How a child run ended, when it did not answer.
#[derive(Debug)]
pub enum ChildError {
    /// Killed at the deadline.
    Timeout(Duration),
    /// Exited without a parsable answer (crash, out of memory, protocol error).
    Failed(String),
}

/// Runs `runner <kind> <request JSON>` and parses its one-line JSON answer, killing the
/// child if it has not finished by `deadline`.
pub fn ask<Req: Serialize, Ans: DeserializeOwned>(
    runner: &Path,
    kind: &str,
    request: &Req,
    deadline: Duration,
) -> Result<Ans, ChildError> {
    let request = serde_json::to_string(request).expect("requests serialise");
    let mut child = Command::new(runner)
        .args([kind, &request])
        // glibc raises its mmap threshold (up to 32 MiB) after the first large free and
        // then keeps freed matrices in the heap, so a materialising engine's peak would
        // depend on allocation history. A fixed 1 MiB threshold returns every large buffer
        // to the OS when it is freed: the peak is the engine's working set. Ignored by
        // other allocators.
        .env("MALLOC_MMAP_THRESHOLD_", "1048576")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| ChildError::Failed(format!("cannot start {}: {e}", runner.display())))?;
    // Drain both pipes on threads so a chatty child cannot block on a full pipe.
    let drain = |mut pipe: Box<dyn Read + Send>| {
        thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let stdout = drain(Box::new(child.stdout.take().expect("piped")));
    let stderr = drain(Box::new(child.stderr.take().expect("piped")));
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if start.elapsed() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(ChildError::Timeout(deadline));
            }
            Ok(None) => thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(ChildError::Failed(format!("waiting for the runner: {e}"))),
        }
    };
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    let answer = stdout.lines().rev().find(|l| l.starts_with('{'));
    match answer.map(serde_json::from_str::<Ans>) {
        Some(Ok(answer)) if status.success() => Ok(answer),
        _ => {
            let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            Err(ChildError::Failed(format!(
                "runner exited with {status}: {}",
                tail.join(" | ")
            )))
        }
    }
}
