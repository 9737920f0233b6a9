//! `cargo xtask bench --doc`: the benchmark page of the machine kind it runs on, made by
//! one command. It runs every sweep the page shows in turn (each exactly as its own
//! `cargo xtask bench …` command would), then writes `docs/benchmarks/<machine>.md` from
//! their reports: each table under the command that made it, with the commit, the CPU and
//! the instruction sets in use (the reports' own lines). A session on another kind of
//! machine runs the same command and gets its own page.

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;

use crate::child::workspace_root;
use crate::cli::{Cli, Command as XtaskCommand};
use crate::sweep;

/// The page's sections: a title and the flags of `cargo xtask bench` that measure it.
const SECTIONS: [(&str, &str, &[&str]); 5] = [
    ("none", "Self-attention, no mask, every engine (f32)", &[]),
    (
        "causal",
        "Self-attention, causal (top-left), every engine (f32)",
        &["--causal"],
    ),
    (
        "half",
        "Half-precision storage, the streaming engine (f32, f16, bf16 at native precision)",
        &["--engines", "optimized", "--dtype", "f32,f16,bf16"],
    ),
    (
        "backward",
        "Forward and backward passes, the streaming engine (f32, f16, bf16)",
        &[
            "--engines",
            "optimized",
            "--dtype",
            "f32,f16,bf16",
            "--backward",
            "--max-n",
            "8192",
        ],
    ),
    (
        "decode",
        "Decoding: one query against n cached keys, the streaming engine",
        &[
            "--decode",
            "--engines",
            "optimized",
            "--dtype",
            "f32,f16,bf16",
        ],
    ),
];

/// Runs every section's sweep into `<target>/bench-doc/<section>/` and writes the page.
pub fn run() -> Result<(), String> {
    let root = workspace_root();
    let commit = git(&root, &["rev-parse", "--short=12", "HEAD"])?;
    let dirty = !git(&root, &["status", "--porcelain", "--untracked-files=no"])?.is_empty();
    let commit = if dirty {
        format!("{commit} (with uncommitted changes)")
    } else {
        commit
    };
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), |t| root.join(t));
    let mut body = String::new();
    let mut cpu = None;
    for (name, title, flags) in SECTIONS {
        let out = target.join("bench-doc").join(name);
        let mut argv = vec!["xtask", "bench"];
        argv.extend_from_slice(flags);
        let out_arg = out.to_string_lossy().into_owned();
        let parsed = Cli::try_parse_from(argv.iter().copied().chain(["--out", &out_arg]))
            .map_err(|e| format!("section {name}: {e}"))?;
        let XtaskCommand::Bench(args) = parsed.command else {
            return Err(format!("section {name}: not a bench command"));
        };
        eprintln!("xtask bench --doc: {title}");
        sweep::run(&args.resolve())?;
        let report = std::fs::read_to_string(out.join("report.md"))
            .map_err(|e| format!("cannot read the {name} report: {e}"))?;
        cpu = cpu.or_else(|| machine_line(&report));
        body.push_str(&section(title, &argv.join(" "), &commit, &report));
    }
    let cpu = cpu.unwrap_or_else(|| "an unnamed CPU".into());
    let page = root
        .join("docs/benchmarks")
        .join(format!("{}.md", slug(&cpu)));
    let head = format!(
        "# Benchmarks on {cpu}\n\n\
         Written by `cargo xtask bench --doc` at commit {commit}: every table below is the \
         report of the command above it, run on this kind of machine in one session (the \
         plots stay in `target/bench-doc/`). Rerun the command on the same kind of machine \
         to regenerate this page; on another kind it writes that machine's page. How the \
         figures are taken and what they mean: `docs/benchmarks.md`.\n"
    );
    write(&page, &(head + &body))?;
    eprintln!("xtask bench --doc: wrote {}", page.display());
    Ok(())
}

/// A section of the page: the report under its title and command, its own title dropped
/// and its headings one level down.
fn section(title: &str, command: &str, commit: &str, report: &str) -> String {
    let mut out = format!("\n## {title}\n\n`cargo {command}` at commit {commit}.\n");
    for line in report
        .lines()
        .skip_while(|l| l.starts_with("# ") || l.is_empty())
    {
        out.push('\n');
        if line.starts_with('#') {
            out.push('#');
        }
        out.push_str(line);
    }
    out.push('\n');
    out
}

/// The CPU a report names (its `CPU:` line, up to the instruction sets).
fn machine_line(report: &str) -> Option<String> {
    let line = report.lines().find(|l| l.starts_with("CPU: "))?;
    let cpu = line["CPU: ".len()..].split(" · ").next()?;
    Some(cpu.trim().to_string())
}

/// A file name for a CPU: its words in lower case, joined by hyphens, trademarks dropped.
fn slug(cpu: &str) -> String {
    let cleaned = cpu.replace("(R)", "").replace("(TM)", "").to_lowercase();
    let words: Vec<&str> = cleaned
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    words.join("-")
}

fn git(root: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(root)
        .output()
        .map_err(|e| format!("cannot run git: {e}"))?;
    if !out.status.success() {
        return Err(format!("git {} failed", args.join(" ")));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn write(path: &PathBuf, text: &str) -> Result<(), String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_gets_a_file_name_of_its_words() {
        let cpu = "Intel(R) Xeon(R) Processor (family 6, model 167)";
        assert_eq!(slug(cpu), "intel-xeon-processor-family-6-model-167");
        assert_eq!(
            slug("AMD EPYC 9R14 (family 25, model 17)"),
            "amd-epyc-9r14-family-25-model-17"
        );
    }

    #[test]
    fn a_section_names_its_command_and_demotes_the_report() {
        let report = "# attn scaling report\n\nCPU: X (family 1, model 2) · attn kernels: AVX2\n\n## Cases\n\n| a |\n";
        let s = section("T", "xtask bench --causal", "abc", report);
        assert!(s.starts_with("\n## T\n\n`cargo xtask bench --causal` at commit abc.\n"));
        assert!(s.contains("\n### Cases\n") && !s.contains("# attn scaling report"));
        assert_eq!(
            machine_line(report).as_deref(),
            Some("X (family 1, model 2)")
        );
    }
}
