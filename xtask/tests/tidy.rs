//! Tidy: the invariants of `ARCHITECTURE.md` that a machine can check, run by
//! `cargo test --workspace` (rust-analyzer's `xtask/src/tidy.rs` is the model).
//!
//! | test | rule |
//! |---|---|
//! | [`unsafe_only_in_kernel_and_ffi_crates`] | `unsafe` code appears only under [`UNSAFE_ALLOWED`] |
//! | [`every_unsafe_block_has_a_safety_comment`] | every `unsafe` block and `unsafe impl` has a `// SAFETY:` comment, every `unsafe fn` a `# Safety` doc section |
//! | [`crate_lint_attributes`] | `forbid(unsafe_code)` in the safe crates ([`FORBID_UNSAFE`]); `deny(unsafe_code)` in attn-optimized, allowed only on its `kernel` module |
//! | [`dependency_directions`] | each crate depends only on the workspace crates [`DEPENDENCY_RULES`] allows (the graph read from `cargo metadata`) |
//! | [`dependency_rules_keep_benches_and_xtask_leaves`] | the table itself keeps attn-benches and xtask leaves |
//! | [`no_reference_to_design_md`] | no source or doc refers to a `DESIGN.md` that is not in the repository |
//! | [`code_map_names_every_source_file`] | `ARCHITECTURE.md`'s code map names every file of `crates/*/src`, and every path it names exists |
//! | [`no_issue_numbers`] | no comment or doc cites an issue by number (a reader cannot open it) |
//!
//! The checks read the files with `std::fs` and a small lexer ([`scan`]) that separates code
//! from comments and string literals; the `checker_*` tests run each check on small
//! strings, so that a check that stopped seeing anything would fail too.

use std::collections::BTreeSet;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

// ---------------------------------------------------------------------------------------
// The rules, as data.

/// Where `unsafe` may appear (paths relative to the workspace root, `/`-separated): the
/// kernels of attn-optimized, and the Python module's FFI boundary (DLPack, NumPy).
const UNSAFE_ALLOWED: &[&str] = &["crates/optimized/src/kernel/", "crates/python/"];

/// The crate roots that must carry `#![forbid(unsafe_code)]`: every crate but
/// attn-optimized (its kernels) and attn-python (the FFI boundary).
const FORBID_UNSAFE: &[&str] = &[
    "crates/core/src/lib.rs",
    "crates/reference/src/lib.rs",
    "crates/oracle/src/lib.rs",
    "crates/candle/src/lib.rs",
    "crates/ring/src/lib.rs",
    "benches/src/lib.rs",
    "xtask/src/main.rs",
];

/// The crate whose `lib.rs` carries `#![deny(unsafe_code)]`, and the one module of it on
/// which `allow(unsafe_code)` may appear.
const DENY_UNSAFE: (&str, &str) = ("crates/optimized", "kernel");

/// One crate's allowed dependencies among the workspace's crates.
struct DepRule {
    /// The package name.
    krate: &'static str,
    /// Workspace crates allowed in `[dependencies]` (and `[build-dependencies]`).
    normal: &'static [&'static str],
    /// Workspace crates allowed in `[dev-dependencies]`, besides `normal`.
    dev: &'static [&'static str],
}

/// The dependency directions (ARCHITECTURE.md's invariants). A crate missing from this
/// table fails [`dependency_directions`]: add its row. No row lists `xtask`, and only
/// `xtask` lists `attn-benches`: both are leaves nobody else depends on.
const DEPENDENCY_RULES: &[DepRule] = &[
    // The contract depends on nothing of ours.
    DepRule {
        krate: "attn-core",
        normal: &[],
        dev: &[],
    },
    // The ground truth: the contract only, never the engine it judges.
    DepRule {
        krate: "attn-reference",
        normal: &["attn-core"],
        dev: &[],
    },
    // The oracle knows no engine but the reference, its ground truth.
    DepRule {
        krate: "attn-oracle",
        normal: &["attn-core", "attn-reference"],
        dev: &[],
    },
    // The streaming engine: the contract; its tests compare with the reference and run
    // the oracle's suite.
    DepRule {
        krate: "attn-optimized",
        normal: &["attn-core"],
        dev: &["attn-reference", "attn-oracle"],
    },
    // Measures engines; never used by them. Its benches time the oracle's user modifiers.
    DepRule {
        krate: "attn-benches",
        normal: &["attn-core", "attn-reference", "attn-optimized"],
        dev: &["attn-oracle"],
    },
    DepRule {
        krate: "xtask",
        normal: &["attn-benches"],
        dev: &[],
    },
    // The FFI boundaries to come.
    DepRule {
        krate: "attn-candle",
        normal: &["attn-core", "attn-optimized"],
        dev: &["attn-reference", "attn-oracle"],
    },
    DepRule {
        krate: "attn-python",
        normal: &["attn-core", "attn-optimized"],
        dev: &["attn-reference", "attn-oracle"],
    },
    DepRule {
        krate: "attn-ring",
        normal: &["attn-core", "attn-optimized"],
        dev: &["attn-reference", "attn-oracle"],
    },
];

// ---------------------------------------------------------------------------------------
// The tests on the workspace.

/// Rule 1: `unsafe` code (`unsafe {`, `unsafe fn`, `unsafe impl`, `unsafe extern`,
/// `unsafe trait`, `#[unsafe(..)]`) only under [`UNSAFE_ALLOWED`].
#[test]
fn unsafe_only_in_kernel_and_ffi_crates() {
    let mut violations = Vec::new();
    for file in workspace_rust_files() {
        violations.extend(unsafe_location_violations(&file.rel, &file.lines));
    }
    report(violations);
}

/// Rule 2: a `// SAFETY:` comment on every `unsafe` block and `unsafe impl` (on its line,
/// within the three lines above, or on the block's first line), a `# Safety` doc section
/// on every `unsafe fn`.
#[test]
fn every_unsafe_block_has_a_safety_comment() {
    let mut violations = Vec::new();
    for file in workspace_rust_files() {
        violations.extend(safety_comment_violations(&file.rel, &file.lines));
    }
    report(violations);
}

/// Rule 3: the crate-level `unsafe_code` lints.
#[test]
fn crate_lint_attributes() {
    let root = workspace_root();
    let mut violations = Vec::new();
    for rel in FORBID_UNSAFE {
        let lines = scan(&read(&root.join(rel)));
        violations.extend(forbid_violations(rel, &lines));
    }
    let (krate, module) = DENY_UNSAFE;
    let lib = format!("{krate}/src/lib.rs");
    violations.extend(deny_violations(&lib, &scan(&read(&root.join(&lib)))));
    for path in files_under(&root.join(krate).join("src"), "rs") {
        let rel = relative(&root, &path);
        violations.extend(allow_unsafe_violations(
            &rel,
            &scan(&read(&path)),
            &lib,
            module,
            &format!("{krate}/src/{module}"),
        ));
    }
    report(violations);
}

/// Rule 4: dependency directions between the workspace's crates, as `cargo metadata`
/// reads them, against [`DEPENDENCY_RULES`].
#[test]
fn dependency_directions() {
    let manifests = workspace_manifests();
    assert!(
        manifests.len() >= 6,
        "cargo metadata: rule `workspace members`: found only {:?}",
        manifests.iter().map(|m| &m.name).collect::<Vec<_>>()
    );
    let ours: BTreeSet<String> = manifests.iter().map(|m| m.name.clone()).collect();
    let violations: Vec<Violation> = manifests
        .iter()
        .flat_map(|m| dependency_violations(m, &ours))
        .collect();
    report(violations);
}

/// Rule 4, on the table itself: `attn-benches` and `xtask` stay leaves (nothing depends on
/// xtask, only xtask on attn-benches), whatever rows are added.
#[test]
fn dependency_rules_keep_benches_and_xtask_leaves() {
    let mut violations = Vec::new();
    for rule in DEPENDENCY_RULES {
        for dep in rule.normal.iter().chain(rule.dev) {
            let leaf = *dep == "xtask" || (*dep == "attn-benches" && rule.krate != "xtask");
            if leaf {
                violations.push(violation(
                    "xtask/tests/tidy.rs",
                    0,
                    "dependency directions",
                    format!(
                        "DEPENDENCY_RULES lets {} depend on {dep}: attn-benches and xtask are leaves (only xtask uses attn-benches)",
                        rule.krate
                    ),
                ));
            }
        }
    }
    report(violations);
}

/// Rule 5: the docs stand alone: nothing under `crates/*/src`, no crate-level Markdown
/// file (they are included in the crate docs), nothing in `docs/`, `README.md` or
/// `ARCHITECTURE.md` refers to `DESIGN.md` (or `DESIGN §n`).
#[test]
fn no_reference_to_design_md() {
    let root = workspace_root();
    let mut files = Vec::new();
    for krate in dirs_in(&root.join("crates")) {
        files.extend(files_under(&krate.join("src"), ""));
        files.extend(files_in(&krate, "md"));
    }
    files.extend(files_under(&root.join("docs"), "md"));
    files.push(root.join("README.md"));
    files.push(root.join("ARCHITECTURE.md"));
    let mut violations = Vec::new();
    for path in files.iter().filter(|p| p.is_file()) {
        let Ok(text) = fs::read_to_string(path) else {
            continue; // not text (images)
        };
        violations.extend(design_md_violations(&relative(&root, path), &text));
    }
    report(violations);
}

/// Rule 6: `ARCHITECTURE.md`'s code map stays true. Each crate's section (`### \`crates/x\``)
/// names every file of its `src/` (by its path below `src/` or its file name; a `mod.rs`
/// also by its folder, `forward/`), and every path it names in backticks (`gemm_tile.rs`,
/// `kernel/rows/`, `tests/ring_mpi.rs`) exists in the crate.
#[test]
fn code_map_names_every_source_file() {
    let root = workspace_root();
    let arch = read(&root.join("ARCHITECTURE.md"));
    let mut violations = Vec::new();
    let crates = dirs_in(&root.join("crates"));
    assert!(crates.len() >= 6, "found only {crates:?}");
    for krate in crates {
        let src = krate.join("src");
        let sources: Vec<String> = files_under(&src, "rs")
            .iter()
            .map(|p| relative(&src, p))
            .collect();
        let mut present: Vec<String> = files_under(&krate, "")
            .iter()
            .map(|p| relative(&krate, p))
            .collect();
        present.extend(present.clone().iter().flat_map(|f| folders_of(f)));
        violations.extend(code_map_violations(
            &arch,
            &relative(&root, &krate),
            &sources,
            &present,
            &|path| path.contains('/') && root.join(path).exists(),
        ));
    }
    report(violations);
}

/// Rule 7: no comment or doc cites an issue by number (`issue 13`, `issues 5 and 6`,
/// `#27`): the reader has the code and its docs, not the tracker. Comments of Rust and
/// Python sources, and Markdown files.
#[test]
fn no_issue_numbers() {
    let root = workspace_root();
    let mut violations = Vec::new();
    for file in workspace_rust_files() {
        for (i, line) in file.lines.iter().enumerate() {
            violations.extend(issue_number_violation(&file.rel, i + 1, &line.comment));
        }
    }
    let mut texts = Vec::new();
    for dir in ["crates", "benches", "xtask", "docs"] {
        texts.extend(files_under(&root.join(dir), "md"));
        texts.extend(files_under(&root.join(dir), "py"));
    }
    texts.extend(files_in(&root, "md"));
    for path in texts {
        let rel = relative(&root, &path);
        if rel == "CHANGELOG.md" {
            continue; // history: what was done when, in the words of its time
        }
        for (i, line) in read(&path).lines().enumerate() {
            violations.extend(issue_number_violation(&rel, i + 1, line));
        }
    }
    report(violations);
}

// ---------------------------------------------------------------------------------------
// Violations.

/// A broken rule at a place.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Violation {
    file: String,
    /// 1-based; 0 for the whole file.
    line: usize,
    rule: &'static str,
    message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}: rule `{}`: {}",
            self.file, self.line, self.rule, self.message
        )
    }
}

fn violation(file: &str, line: usize, rule: &'static str, message: impl Into<String>) -> Violation {
    Violation {
        file: file.to_string(),
        line,
        rule,
        message: message.into(),
    }
}

fn report(violations: Vec<Violation>) {
    if !violations.is_empty() {
        let list: Vec<String> = violations.iter().map(ToString::to_string).collect();
        panic!(
            "{} tidy violation(s):\n{}\n",
            violations.len(),
            list.join("\n")
        );
    }
}

// ---------------------------------------------------------------------------------------
// Files.

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace root")
        .to_path_buf()
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn relative(root: &Path, path: &Path) -> String {
    let rel = path.strip_prefix(root).unwrap_or(path);
    rel.components()
        .map(|c| c.as_os_str().to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

/// Sub-directories of `dir`, sorted (none if it does not exist).
fn dirs_in(dir: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// Files of `dir` (not recursive) ending in `.ext`.
fn files_in(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == ext))
        .collect();
    files.sort();
    files
}

/// Every file under `dir` ending in `.ext` (any file for `""`), recursively, skipping
/// `target` and hidden directories; sorted.
fn files_under(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if path.is_dir() {
                if name != "target" && !name.starts_with('.') {
                    stack.push(path);
                }
            } else if ext.is_empty() || path.extension().is_some_and(|e| e == ext) {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

struct SourceFile {
    rel: String,
    lines: Vec<Line>,
}

/// Every `.rs` file under `crates/`, `benches/` and `xtask/`, scanned.
fn workspace_rust_files() -> Vec<SourceFile> {
    let root = workspace_root();
    let files: Vec<SourceFile> = ["crates", "benches", "xtask"]
        .iter()
        .flat_map(|d| files_under(&root.join(d), "rs"))
        .map(|path| SourceFile {
            rel: relative(&root, &path),
            lines: scan(&read(&path)),
        })
        .collect();
    assert!(
        files.len() > 20,
        "found only {} Rust files under {}",
        files.len(),
        root.display()
    );
    files
}

// ---------------------------------------------------------------------------------------
// The lexer: code and comments, line by line.

/// One source line, split into its code (string and character literals emptied, comments
/// removed) and its comment text (with the comment markers, `//`, `///`, `/*`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Line {
    code: String,
    comment: String,
}

impl Line {
    fn has_code(&self) -> bool {
        !self.code.trim().is_empty()
    }
}

enum State {
    Code,
    LineComment,
    BlockComment(usize),
    Str,
    RawStr(usize),
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Splits Rust source into lines of code and comment text. Good enough for tidy checks:
/// strings (with escapes, raw, byte), characters versus lifetimes, nested block comments.
fn scan(src: &str) -> Vec<Line> {
    let chars: Vec<char> = src.chars().collect();
    let mut lines = vec![Line::default()];
    let mut state = State::Code;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '\n' {
            lines.push(Line::default());
            if matches!(state, State::LineComment) {
                state = State::Code;
            }
            i += 1;
            continue;
        }
        let line = lines.last_mut().expect("one line at least");
        match state {
            State::Code => {
                if c == '/' && next == Some('/') {
                    state = State::LineComment;
                    line.comment.push_str("//");
                    i += 2;
                } else if c == '/' && next == Some('*') {
                    state = State::BlockComment(1);
                    line.comment.push_str("/*");
                    i += 2;
                } else if c == '"' {
                    state = State::Str;
                    line.code.push('"');
                    i += 1;
                } else if c == 'r'
                    && !line
                        .code
                        .chars()
                        .last()
                        .is_some_and(|p| is_ident(p) && p != 'b')
                    && matches!(next, Some('"' | '#'))
                {
                    // r"…", r#"…"#, br"…" (the `b` is already in the code).
                    let hashes = chars[i + 1..].iter().take_while(|&&h| h == '#').count();
                    if chars.get(i + 1 + hashes) == Some(&'"') {
                        state = State::RawStr(hashes);
                        line.code.push('"');
                        i += 2 + hashes;
                    } else {
                        line.code.push(c);
                        i += 1;
                    }
                } else if c == '\'' {
                    // A character literal ('x', '\n', '\u{..}') or a lifetime ('a).
                    if next == Some('\\') {
                        let mut j = i + 3; // past the quote, the backslash, the escaped char
                        while j < chars.len() && chars[j] != '\'' && chars[j] != '\n' {
                            j += 1;
                        }
                        line.code.push_str("''");
                        i = j + 1;
                    } else if next.is_some() && chars.get(i + 2) == Some(&'\'') {
                        line.code.push_str("''");
                        i += 3;
                    } else {
                        line.code.push(c);
                        i += 1;
                    }
                } else {
                    line.code.push(c);
                    i += 1;
                }
            }
            State::LineComment => {
                line.comment.push(c);
                i += 1;
            }
            State::BlockComment(depth) => {
                if c == '*' && next == Some('/') {
                    line.comment.push_str("*/");
                    state = if depth == 1 {
                        State::Code
                    } else {
                        State::BlockComment(depth - 1)
                    };
                    i += 2;
                } else if c == '/' && next == Some('*') {
                    line.comment.push_str("/*");
                    state = State::BlockComment(depth + 1);
                    i += 2;
                } else {
                    line.comment.push(c);
                    i += 1;
                }
            }
            State::Str => {
                if c == '\\' {
                    i += if next == Some('\n') { 1 } else { 2 };
                } else {
                    if c == '"' {
                        line.code.push('"');
                        state = State::Code;
                    }
                    i += 1;
                }
            }
            State::RawStr(hashes) => {
                let closes = c == '"'
                    && chars[i + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == '#')
                        .count()
                        == hashes;
                if closes {
                    line.code.push('"');
                    state = State::Code;
                    i += 1 + hashes;
                } else {
                    i += 1;
                }
            }
        }
    }
    lines
}

// ---------------------------------------------------------------------------------------
// Rules 1 and 2: where `unsafe` is, and its justification.

/// What an `unsafe` keyword introduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UnsafeKind {
    /// `unsafe {`
    Block,
    /// `unsafe fn name` (a declaration; not a function-pointer type).
    Fn,
    /// `unsafe impl`
    Impl,
    /// `unsafe extern "C" {` (or `unsafe extern "C" fn name`, counted as [`UnsafeKind::Fn`]).
    Extern,
    /// `unsafe trait`
    Trait,
    /// `#[unsafe(no_mangle)]` and the like.
    Attribute,
    /// Anything else: a function-pointer type, a keyword at the end of a line.
    Other,
}

/// The `unsafe` keywords in one line of code, in order.
fn unsafe_keywords(code: &str) -> Vec<UnsafeKind> {
    let mut kinds = Vec::new();
    let mut rest = code;
    let mut before: Option<char> = None;
    while let Some(at) = rest.find("unsafe") {
        let prev = rest[..at].chars().last().or(before);
        let after = &rest[at + "unsafe".len()..];
        let boundary = !prev.is_some_and(is_ident) && !after.chars().next().is_some_and(is_ident);
        if boundary {
            kinds.push(classify(after.trim_start()));
        }
        before = rest[..at + "unsafe".len()].chars().last();
        rest = after;
    }
    kinds
}

/// Strips the keyword `word` (followed by a non-identifier character) from the front.
fn strip_word<'a>(s: &'a str, word: &str) -> Option<&'a str> {
    s.strip_prefix(word)
        .filter(|r| !r.chars().next().is_some_and(is_ident))
        .map(str::trim_start)
}

fn classify(after: &str) -> UnsafeKind {
    let fn_decl = |s: &str| match strip_word(s, "fn") {
        Some(r) if r.chars().next().is_some_and(is_ident) => UnsafeKind::Fn,
        Some(_) => UnsafeKind::Other,
        None => UnsafeKind::Other,
    };
    if after.starts_with('{') {
        UnsafeKind::Block
    } else if after.starts_with('(') {
        UnsafeKind::Attribute
    } else if strip_word(after, "fn").is_some() {
        fn_decl(after)
    } else if strip_word(after, "impl").is_some() {
        UnsafeKind::Impl
    } else if strip_word(after, "trait").is_some() {
        UnsafeKind::Trait
    } else if let Some(r) = strip_word(after, "extern") {
        let r = r.strip_prefix("\"\"").map_or(r, str::trim_start); // the ABI string, emptied
        if strip_word(r, "fn").is_some() {
            fn_decl(r)
        } else {
            UnsafeKind::Extern
        }
    } else {
        UnsafeKind::Other
    }
}

/// Rule 1 for one file: its `unsafe` code, unless the file is under [`UNSAFE_ALLOWED`].
fn unsafe_location_violations(rel: &str, lines: &[Line]) -> Vec<Violation> {
    if UNSAFE_ALLOWED.iter().any(|p| rel.starts_with(p)) {
        return Vec::new();
    }
    lines
        .iter()
        .enumerate()
        .filter(|(_, l)| !unsafe_keywords(&l.code).is_empty())
        .map(|(i, l)| {
            violation(
                rel,
                i + 1,
                "unsafe only in kernel/ and the FFI crates",
                format!(
                    "`{}`: unsafe code belongs under one of {UNSAFE_ALLOWED:?}",
                    l.code.trim()
                ),
            )
        })
        .collect()
}

fn is_safety_comment(l: &Line) -> bool {
    l.comment.contains("SAFETY:")
}

/// Whether the unsafe block or impl on line `i` has a `// SAFETY:` comment: on its line,
/// on the block's first line, or above it: through the comment lines just above and at most
/// three other lines (attributes, a `match` arm's pattern, the start of a multi-line
/// statement), stopping at a line that holds another `unsafe` (its comment is its own).
fn has_safety_comment(lines: &[Line], i: usize) -> bool {
    if is_safety_comment(&lines[i]) {
        return true;
    }
    if lines[i].code.trim_end().ends_with('{')
        && lines
            .get(i + 1)
            .is_some_and(|l| !l.has_code() && is_safety_comment(l))
    {
        return true;
    }
    let mut budget = 3;
    for l in lines[..i].iter().rev() {
        if is_safety_comment(l) {
            return true;
        }
        if l.has_code() && !unsafe_keywords(&l.code).is_empty() {
            return false;
        }
        if l.has_code() || l.comment.trim().is_empty() {
            budget -= 1;
            if budget == 0 {
                return false;
            }
        }
    }
    false
}

/// Whether the `unsafe fn` on line `i` has a `# Safety` section in its doc comment: the
/// comment and attribute lines above it, up to the end of the previous item.
fn has_safety_section(lines: &[Line], i: usize) -> bool {
    for l in lines[..i].iter().rev() {
        let doc = l.comment.trim_start_matches(['/', '!', '*']).trim();
        if doc.starts_with("# Safety") {
            return true;
        }
        let code = l.code.trim();
        if code.ends_with(';') || code.ends_with('}') || code.ends_with('{') {
            return false;
        }
    }
    false
}

/// Rule 2 for one file.
fn safety_comment_violations(rel: &str, lines: &[Line]) -> Vec<Violation> {
    const RULE: &str = "SAFETY comment on every unsafe block";
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let kinds = unsafe_keywords(&l.code);
        let needs_comment = kinds
            .iter()
            .any(|k| matches!(k, UnsafeKind::Block | UnsafeKind::Impl));
        if needs_comment && !has_safety_comment(lines, i) {
            out.push(violation(
                rel,
                i + 1,
                RULE,
                format!(
                    "`{}` needs a `// SAFETY:` comment (on the line, within the 3 lines above, or on the block's first line)",
                    l.code.trim()
                ),
            ));
        }
        let declares_fn = kinds.contains(&UnsafeKind::Fn) && !l.code.trim_end().ends_with(';');
        if declares_fn && !has_safety_section(lines, i) {
            out.push(violation(
                rel,
                i + 1,
                RULE,
                format!(
                    "`{}` needs a `# Safety` section in its doc comment",
                    l.code.trim()
                ),
            ));
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// Rule 3: crate-level lint attributes.

/// The lint names in an attribute `#![level(..)]` (`inner`) or `#[level(..)]` on a line of
/// code, e.g. `unsafe_code` in `#![forbid(unsafe_code, missing_docs)]`.
fn lint_attribute(code: &str, level: &str, inner: bool) -> Option<Vec<String>> {
    let compact: String = code.chars().filter(|c| !c.is_whitespace()).collect();
    let open = format!("{}[{level}(", if inner { "#!" } else { "#" });
    let start = compact.find(&open)? + open.len();
    let end = compact[start..].find(")]")? + start;
    Some(compact[start..end].split(',').map(str::to_string).collect())
}

fn has_lint(lines: &[Line], level: &str, inner: bool, lint: &str) -> bool {
    lines.iter().any(|l| {
        lint_attribute(&l.code, level, inner).is_some_and(|lints| lints.iter().any(|x| x == lint))
    })
}

/// `#![forbid(unsafe_code)]` in a safe crate's `lib.rs`.
fn forbid_violations(rel: &str, lines: &[Line]) -> Vec<Violation> {
    if has_lint(lines, "forbid", true, "unsafe_code") {
        Vec::new()
    } else {
        vec![violation(
            rel,
            1,
            "forbid(unsafe_code) in the safe crates",
            "the crate root must carry `#![forbid(unsafe_code)]`",
        )]
    }
}

/// `#![deny(unsafe_code)]` in attn-optimized's `lib.rs`.
fn deny_violations(rel: &str, lines: &[Line]) -> Vec<Violation> {
    if has_lint(lines, "deny", true, "unsafe_code") {
        Vec::new()
    } else {
        vec![violation(
            rel,
            1,
            "deny(unsafe_code) in attn-optimized",
            "the crate root must carry `#![deny(unsafe_code)]` (unsafe is allowed only on the kernel module)",
        )]
    }
}

/// Whether the code after line `i` (skipping attributes, comments and blank lines)
/// declares `mod <module>`.
fn next_item_is_mod(lines: &[Line], i: usize, module: &str) -> bool {
    for l in &lines[i + 1..] {
        let code = l.code.trim();
        if code.is_empty() || code.starts_with("#[") {
            continue;
        }
        let item = code
            .strip_prefix("pub(crate)")
            .or_else(|| code.strip_prefix("pub(super)"))
            .or_else(|| strip_word(code, "pub"))
            .unwrap_or(code)
            .trim_start();
        return strip_word(item, "mod").is_some_and(|r| {
            r.strip_prefix(module)
                .is_some_and(|r| r.trim_start().starts_with([';', '{']))
        });
    }
    false
}

/// Every `allow(unsafe_code)` (or `expect`) in the deny crate's sources must sit on the
/// kernel module: `#[allow(unsafe_code)] mod kernel;` in `lib_rel`, or `#![allow(..)]`
/// inside the module's own file (`module_path` + `.rs` or `/mod.rs`).
fn allow_unsafe_violations(
    rel: &str,
    lines: &[Line],
    lib_rel: &str,
    module: &str,
    module_path: &str,
) -> Vec<Violation> {
    let module_root = rel == format!("{module_path}.rs") || rel == format!("{module_path}/mod.rs");
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        for level in ["allow", "expect"] {
            let outer = lint_attribute(&l.code, level, false)
                .is_some_and(|lints| lints.iter().any(|x| x == "unsafe_code"));
            let inner = lint_attribute(&l.code, level, true)
                .is_some_and(|lints| lints.iter().any(|x| x == "unsafe_code"));
            let ok = (outer && rel == lib_rel && next_item_is_mod(lines, i, module))
                || (inner && module_root);
            if (outer || inner) && !ok {
                out.push(violation(
                    rel,
                    i + 1,
                    "allow(unsafe_code) only on the kernel module",
                    format!(
                        "`{}`: the only `{level}(unsafe_code)` in the crate is the one on `mod {module}` in {lib_rel}",
                        l.code.trim()
                    ),
                ));
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// Rule 4: dependency directions, from `cargo metadata`.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DepKind {
    Normal,
    Dev,
    Build,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Dep {
    /// The package depended on (`package = ".."` if renamed).
    name: String,
    kind: DepKind,
    /// 1-based line in the manifest.
    line: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Manifest {
    rel: String,
    name: String,
    deps: Vec<Dep>,
}

/// Every workspace member with its dependencies, from `cargo metadata --no-deps` (cargo's
/// own reading of the manifests: renames, `workspace = true`, target tables).
fn workspace_manifests() -> Vec<Manifest> {
    let root = workspace_root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let output = std::process::Command::new(&cargo)
        .current_dir(&root)
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run `{cargo} metadata`: {e}"));
    assert!(
        output.status.success(),
        "`cargo metadata` failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("cargo metadata prints JSON");
    manifests_from_metadata(&metadata, &root)
}

/// The packages of a `cargo metadata` document, each with its manifest's path relative to
/// `root` and its dependencies (the package names, renames undone).
fn manifests_from_metadata(metadata: &serde_json::Value, root: &Path) -> Vec<Manifest> {
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
    metadata["packages"]
        .as_array()
        .expect("cargo metadata lists `packages`")
        .iter()
        .map(|p| {
            let manifest = PathBuf::from(text(&p["manifest_path"]));
            let toml = fs::read_to_string(&manifest).unwrap_or_default();
            let deps = p["dependencies"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|d| {
                    let name = text(&d["name"]);
                    let kind = match d["kind"].as_str() {
                        Some("dev") => DepKind::Dev,
                        Some("build") => DepKind::Build,
                        _ => DepKind::Normal,
                    };
                    // The manifest line that names it (the renamed key, or the package).
                    let key = d["rename"].as_str().unwrap_or(&name);
                    let line = toml
                        .lines()
                        .position(|l| l.trim_start().starts_with(key) || l.contains(&name))
                        .map_or(0, |i| i + 1);
                    Dep { name, kind, line }
                })
                .collect();
            Manifest {
                rel: relative(root, &manifest),
                name: text(&p["name"]),
                deps,
            }
        })
        .collect()
}

/// Rule 4 for one manifest: its dependencies on workspace crates (`ours`, plus anything
/// named `attn-*` or in the table) against its row of [`DEPENDENCY_RULES`].
fn dependency_violations(m: &Manifest, ours: &BTreeSet<String>) -> Vec<Violation> {
    const RULE: &str = "dependency directions";
    let Some(rule) = DEPENDENCY_RULES.iter().find(|r| r.krate == m.name) else {
        return vec![violation(
            &m.rel,
            1,
            RULE,
            format!(
                "crate `{}` has no row in DEPENDENCY_RULES (xtask/tests/tidy.rs): say which workspace crates it may depend on",
                m.name
            ),
        )];
    };
    let is_ours = |name: &str| {
        ours.contains(name)
            || name.starts_with("attn-")
            || DEPENDENCY_RULES.iter().any(|r| r.krate == name)
    };
    m.deps
        .iter()
        .filter(|d| is_ours(&d.name))
        .filter_map(|d| {
            let allowed = match d.kind {
                DepKind::Normal | DepKind::Build => rule.normal.contains(&d.name.as_str()),
                DepKind::Dev => {
                    rule.normal.contains(&d.name.as_str()) || rule.dev.contains(&d.name.as_str())
                }
            };
            (!allowed).then(|| {
                let (table, list): (&str, Vec<&str>) = match d.kind {
                    DepKind::Dev => (
                        "dev-dependencies",
                        rule.normal.iter().chain(rule.dev).copied().collect(),
                    ),
                    DepKind::Normal => ("dependencies", rule.normal.to_vec()),
                    DepKind::Build => ("build-dependencies", rule.normal.to_vec()),
                };
                violation(
                    &m.rel,
                    d.line,
                    RULE,
                    format!(
                        "{} must not depend on {} ([{table}]); its workspace dependencies may be only {list:?}",
                        m.name, d.name
                    ),
                )
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Rule 5: no DESIGN.md.

/// Lines of `text` that refer to `DESIGN.md` or to a section of it (`DESIGN §3`).
fn design_md_violations(rel: &str, text: &str) -> Vec<Violation> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| {
            l.match_indices("DESIGN").any(|(at, _)| {
                let after = &l[at + "DESIGN".len()..];
                after.starts_with(".md") || after.trim_start().starts_with('§')
            })
        })
        .map(|(i, l)| {
            violation(
                rel,
                i + 1,
                "docs stand alone (no DESIGN.md)",
                format!(
                    "`{}` refers to DESIGN.md, which is not in the repository: say it here or link a doc that is",
                    l.trim()
                ),
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Rule 6: the code map.

/// `path`'s folders, each with a trailing `/`: `a/b/c.rs` → `a/`, `a/b/`.
fn folders_of(path: &str) -> Vec<String> {
    path.match_indices('/')
        .map(|(at, _)| path[..=at].to_string())
        .collect()
}

/// The section of `arch` headed `### \`dir\`…`: its first line (1-based) and its lines.
fn code_map_section<'a>(arch: &'a str, dir: &str) -> Option<(usize, Vec<&'a str>)> {
    let heading = format!("### `{dir}`");
    let lines: Vec<&str> = arch.lines().collect();
    let start = lines.iter().position(|l| l.starts_with(&heading))?;
    let end = lines[start + 1..]
        .iter()
        .position(|l| l.starts_with("## ") || l.starts_with("### "))
        .map_or(lines.len(), |n| start + 1 + n);
    Some((start + 1, lines[start..end].to_vec()))
}

/// The backticked words of a line that name a Rust file or a folder: `x.rs`, `a/b.rs`,
/// `kernel/` (no spaces, no patterns).
fn named_paths(line: &str) -> Vec<&str> {
    line.split('`')
        .skip(1)
        .step_by(2)
        .filter(|t| !t.is_empty() && !t.contains([' ', '*', '{', '<', ':']))
        .filter(|t| t.ends_with(".rs") || (t.ends_with('/') && t.len() > 1))
        .collect()
}

/// Rule 6 for one crate: `sources` are the paths below its `src/`, `present` every file
/// and folder below the crate's directory (`src/lib.rs`, `src/`, `tests/x.rs`, …);
/// `in_repo` says whether a path from the repository's root exists (a section may name
/// another crate's file, `crates/optimized/tests/robustness.rs`).
fn code_map_violations(
    arch: &str,
    dir: &str,
    sources: &[String],
    present: &[String],
    in_repo: &dyn Fn(&str) -> bool,
) -> Vec<Violation> {
    const RULE: &str = "the code map is true";
    let Some((first, section)) = code_map_section(arch, dir) else {
        return vec![violation(
            "ARCHITECTURE.md",
            0,
            RULE,
            format!("the code map has no section `### `{dir}``"),
        )];
    };
    let mut named: BTreeSet<&str> = BTreeSet::new();
    let mut violations = Vec::new();
    for (i, line) in section.iter().enumerate() {
        for path in named_paths(line) {
            named.insert(path);
            let exists = present
                .iter()
                .any(|p| p == path || p.ends_with(&format!("/{path}")))
                || in_repo(path);
            if !exists {
                violations.push(violation(
                    "ARCHITECTURE.md",
                    first + i,
                    RULE,
                    format!("`{path}` is named in the section of {dir} but no such file or folder is in it"),
                ));
            }
        }
    }
    for file in sources {
        let name = file.rsplit('/').next().unwrap_or(file);
        let folder_named = name == "mod.rs"
            && folders_of(file).last().is_some_and(|f| {
                named
                    .iter()
                    .any(|n| f == n || f.ends_with(&format!("/{n}")))
            });
        if !(named.contains(file.as_str()) || named.contains(name) || folder_named) {
            violations.push(violation(
                "ARCHITECTURE.md",
                first,
                RULE,
                format!("{dir}/src/{file} is not named in the code map's section of {dir}: say what it holds"),
            ));
        }
    }
    violations
}

// ---------------------------------------------------------------------------------------
// Rule 7: no issue numbers.

/// A violation if `text` cites an issue by number: the word `issue` (or `issues`)
/// followed by a number, or a `#` followed by digits (the checker's test spells them out).
fn issue_number_violation(rel: &str, line: usize, text: &str) -> Option<Violation> {
    let lower = text.to_lowercase();
    let words: Vec<&str> = lower
        .split(|c: char| c.is_whitespace() || matches!(c, '(' | ')' | ',' | ';' | '\'' | '"'))
        .filter(|w| !w.is_empty())
        .collect();
    // `13`, `13.`, `13:`, `13s` (as in `13's`, the apostrophe split off).
    let digits = |w: &str| {
        let w = w.trim_end_matches(['.', ':', 's']);
        !w.is_empty() && w.chars().all(|c| c.is_ascii_digit())
    };
    let cites = words.windows(2).any(|p| {
        (p[0] == "issue" || p[0] == "issues") && digits(p[1].strip_prefix('#').unwrap_or(p[1]))
    }) || words
        .iter()
        .any(|w| w.strip_prefix('#').is_some_and(digits));
    cites.then(|| {
        violation(
            rel,
            line,
            "no issue numbers",
            format!(
                "`{}` cites an issue by number: say what it is about instead",
                text.trim()
            ),
        )
    })
}

// ---------------------------------------------------------------------------------------
// The checks themselves, on small inputs.

fn code_lines(src: &str) -> Vec<String> {
    scan(src).into_iter().map(|l| l.code).collect()
}

#[test]
fn checker_lexer_separates_code_comments_and_literals() {
    let src = r####"let a = "unsafe { in a string }"; // unsafe { in a comment }
let b = r#"raw "unsafe {" string"#; let c = '"'; let d = '\'';
/* block /* nested unsafe { */ still comment */ let e = unsafe { 1 };
fn f<'a>(x: &'a str) -> &'a str { x }
let g = "multi
line unsafe { string";
let h = br"bytes"; let i = b'x';"####;
    let lines = scan(src);
    assert_eq!(lines.len(), 7);
    assert_eq!(lines[0].code.trim(), r#"let a = "";"#);
    assert_eq!(lines[0].comment, "// unsafe { in a comment }");
    assert_eq!(
        lines[1].code.trim(),
        r#"let b = ""; let c = ''; let d = '';"#
    );
    assert_eq!(lines[2].code.trim(), "let e = unsafe { 1 };");
    assert!(lines[2].comment.contains("nested unsafe"));
    assert_eq!(lines[3].code, "fn f<'a>(x: &'a str) -> &'a str { x }");
    assert_eq!(lines[4].code, r#"let g = ""#);
    assert_eq!(lines[5].code, r#"";"#);
    assert_eq!(lines[6].code, r#"let h = b""; let i = b'';"#);
}

#[test]
fn checker_finds_unsafe_keywords_and_only_those() {
    use UnsafeKind::*;
    let kinds = |s: &str| unsafe_keywords(&code_lines(s)[0]);
    assert_eq!(kinds("let x = unsafe { *p };"), [Block]);
    assert_eq!(kinds("pub unsafe fn f(p: *const u8) {"), [Fn]);
    assert_eq!(kinds("pub(crate) const unsafe fn f() {}"), [Fn]);
    assert_eq!(kinds("unsafe impl Send for X {}"), [Impl]);
    assert_eq!(kinds("unsafe extern \"C\" {"), [Extern]);
    assert_eq!(kinds("pub unsafe extern \"C\" fn f() {"), [Fn]);
    assert_eq!(kinds("unsafe trait T {}"), [Trait]);
    assert_eq!(kinds("#[unsafe(no_mangle)]"), [Attribute]);
    assert_eq!(kinds("type F = unsafe fn(u8);"), [Other]);
    assert_eq!(kinds("a(unsafe { x }, unsafe { y })"), [Block, Block]);
    assert!(kinds("#![forbid(unsafe_code)]").is_empty());
    assert!(kinds("#![deny(unsafe_op_in_unsafe_fn)] let not_unsafe = 1;").is_empty());
    assert!(kinds("// unsafe { x }").is_empty());
    assert!(kinds("let s = \"unsafe { x }\";").is_empty());
}

#[test]
fn checker_flags_unsafe_outside_the_allowed_places() {
    let lines = scan("fn f(p: *const u8) -> u8 {\n    // SAFETY: p is valid\n    unsafe { *p }\n}");
    let found = unsafe_location_violations("crates/core/src/tensor.rs", &lines);
    assert_eq!(found.len(), 1);
    assert_eq!(
        (found[0].file.as_str(), found[0].line),
        ("crates/core/src/tensor.rs", 3)
    );
    assert!(
        found[0]
            .to_string()
            .starts_with("crates/core/src/tensor.rs:3: rule `unsafe only")
    );
    for ok in [
        "crates/optimized/src/kernel/rows/avx2.rs",
        "crates/optimized/src/kernel/mod.rs",
        "crates/python/src/lib.rs",
        "crates/python/src/dlpack.rs",
    ] {
        assert!(unsafe_location_violations(ok, &lines).is_empty(), "{ok}");
    }
    for bad in [
        "crates/optimized/src/forward/row_tile.rs",
        "crates/optimized/src/kernel.rs",
        "crates/ring/src/ring.rs",
        "crates/candle/src/lib.rs",
        "crates/optimized/tests/kernels.rs",
        "benches/src/memory.rs",
        "xtask/src/main.rs",
    ] {
        assert_eq!(unsafe_location_violations(bad, &lines).len(), 1, "{bad}");
    }
    let safe = scan("#![forbid(unsafe_code)]\n// unsafe { no }\nlet s = \"unsafe {\";");
    assert!(unsafe_location_violations("crates/core/src/lib.rs", &safe).is_empty());
}

fn safety(src: &str) -> Vec<usize> {
    safety_comment_violations("x.rs", &scan(src))
        .iter()
        .map(|v| v.line)
        .collect()
}

#[test]
fn checker_requires_a_safety_comment_on_unsafe_blocks() {
    // Without, and with the comment above, on the line, or inside the block.
    assert_eq!(safety("let x = unsafe { *p };"), [1]);
    assert!(safety("// SAFETY: p points to a live u8.\nlet x = unsafe { *p };").is_empty());
    assert!(safety("let x = unsafe { *p }; // SAFETY: p is live").is_empty());
    assert!(safety("unsafe {\n    // SAFETY: p is live\n    *p\n}").is_empty());
    // A two-line comment, an attribute and a match arm's line in between (element.rs).
    let arm = "match isa {\n    // SAFETY: the CPU has AVX-512F;\n    // detected above.\n    #[cfg(x)]\n    Isa::Avx512 => unsafe { f() },\n}";
    assert!(safety(arm).is_empty());
    // A multi-line statement opened above (kernels.rs).
    let stmt = "// SAFETY: row r holds d floats.\n*x = mul(alpha, unsafe {\n    load(p)\n});";
    assert!(safety(stmt).is_empty());
    // A comment that is not a SAFETY comment, or one too far above.
    assert_eq!(safety("// p is live\nlet x = unsafe { *p };"), [2]);
    assert_eq!(
        safety("// SAFETY: far away\nlet a = 1;\nlet b = 2;\nlet c = 3;\nlet x = unsafe { *p };"),
        [5]
    );
    // Each block needs its own: the comment of the first does not cover the second.
    assert_eq!(
        safety("// SAFETY: p is live\nlet x = unsafe { *p };\nlet y = unsafe { *q };"),
        [3]
    );
    // `unsafe impl` too.
    assert_eq!(safety("unsafe impl Send for Scratch {}"), [1]);
    assert!(
        safety("// SAFETY: only raw pointers to owned data\nunsafe impl Send for Scratch {}")
            .is_empty()
    );
    // Strings and comments that mention unsafe blocks are not blocks.
    assert!(safety("let s = \"unsafe { x }\"; // unsafe { y }").is_empty());
}

#[test]
fn checker_requires_a_safety_section_on_unsafe_fns() {
    let undocumented = "/// Loads.\n#[inline]\n#[target_feature(enable = \"avx2\")]\nunsafe fn load8(p: *const f32) -> __m256 {";
    assert_eq!(safety(undocumented), [4]);
    let documented = "/// Loads.\n///\n/// # Safety\n/// Eight floats must be readable at `p`.\n#[inline]\n#[target_feature(enable = \"avx2\")]\nunsafe fn load8(p: *const f32) -> __m256 {";
    assert!(safety(documented).is_empty());
    // The previous item's section does not count.
    let previous =
        "/// # Safety\n/// p readable.\nunsafe fn a(p: *const u8) {}\nunsafe fn b(p: *const u8) {}";
    assert_eq!(safety(previous), [4]);
    // Declarations without a body (foreign functions, trait methods) and safe
    // `#[target_feature]` functions are not checked.
    assert!(safety("unsafe extern \"C\" {\n    // SAFETY: the C signature.\n    pub unsafe fn c_fn(x: i32);\n}").is_empty());
    assert!(safety("#[target_feature(enable = \"avx2\")]\nfn v3(x: &mut [f32]) {").is_empty());
}

#[test]
fn checker_lint_attributes() {
    let lib = |s: &str| scan(s);
    assert!(forbid_violations("l.rs", &lib("//! Docs.\n\n#![forbid(unsafe_code)]\n")).is_empty());
    assert!(forbid_violations("l.rs", &lib("#![forbid(missing_docs, unsafe_code)]")).is_empty());
    assert_eq!(
        forbid_violations("l.rs", &lib("#![deny(unsafe_code)]")).len(),
        1
    );
    assert_eq!(
        forbid_violations("l.rs", &lib("// #![forbid(unsafe_code)]")).len(),
        1
    );
    assert_eq!(
        forbid_violations("l.rs", &lib("#![forbid(unsafe_op_in_unsafe_fn)]")).len(),
        1
    );
    assert!(deny_violations("l.rs", &lib("#![deny(unsafe_code)]\nmod a;")).is_empty());
    assert_eq!(
        deny_violations("l.rs", &lib("#![allow(unsafe_code)]")).len(),
        1
    );

    let (lib_rel, m, mp) = (
        "crates/optimized/src/lib.rs",
        "kernel",
        "crates/optimized/src/kernel",
    );
    let allow = |rel: &str, s: &str| allow_unsafe_violations(rel, &scan(s), lib_rel, m, mp);
    assert!(
        allow(
            lib_rel,
            "#![deny(unsafe_code)]\nmod forward;\n#[allow(unsafe_code)]\nmod kernel;\nmod mask;"
        )
        .is_empty()
    );
    assert!(
        allow(
            lib_rel,
            "#[allow(unsafe_code)]\n// the kernels\npub(crate) mod kernel;"
        )
        .is_empty()
    );
    assert!(
        allow(
            "crates/optimized/src/kernel/mod.rs",
            "#![allow(unsafe_code)]\nmod rows;"
        )
        .is_empty()
    );
    let bad = allow(
        lib_rel,
        "#[allow(unsafe_code)]\nmod forward;\n#[allow(unsafe_code)]\nmod kernel;",
    );
    assert_eq!(bad.iter().map(|v| v.line).collect::<Vec<_>>(), [1]);
    assert_eq!(allow(lib_rel, "#![allow(unsafe_code)]").len(), 1);
    assert_eq!(
        allow(lib_rel, "#[allow(unsafe_code)]\nmod kernels;").len(),
        1
    );
    assert_eq!(
        allow(
            "crates/optimized/src/forward/row_tile.rs",
            "#[allow(unsafe_code)]\nfn f() {}"
        )
        .len(),
        1
    );
    assert_eq!(
        allow("crates/optimized/src/schedule.rs", "#![allow(unsafe_code)]").len(),
        1
    );
    assert_eq!(
        allow(
            "crates/optimized/src/kernel/exp2.rs",
            "#[expect(unsafe_code)]\nfn f() {}"
        )
        .len(),
        1
    );
    assert!(
        allow(
            "crates/optimized/src/lib.rs",
            "// #[allow(unsafe_code)]\nmod x;"
        )
        .is_empty()
    );
}

#[test]
fn checker_reads_metadata() {
    let dir = std::env::temp_dir().join(format!("attn-tidy-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let manifest = dir.join("Cargo.toml");
    fs::write(
        &manifest,
        "[package]\nname = \"attn-oracle\"\n\n[dependencies]\nattn-core.workspace = true\nengine = { path = \"../optimized\", package = \"attn-optimized\" }\nfaer = \"0.23\"\n\n[dev-dependencies]\nattn-benches = \"0.1\"\n\n[build-dependencies]\nxtask = \"0.1\"\n",
    )
    .unwrap();
    let metadata = serde_json::json!({
        "packages": [{
            "name": "attn-oracle",
            "manifest_path": manifest.to_string_lossy(),
            "dependencies": [
                { "name": "attn-core", "kind": null, "rename": null },
                { "name": "attn-optimized", "kind": null, "rename": "engine" },
                { "name": "faer", "kind": null, "rename": null },
                { "name": "attn-benches", "kind": "dev", "rename": null },
                { "name": "xtask", "kind": "build", "rename": null },
            ],
        }],
    });
    let manifests = manifests_from_metadata(&metadata, &dir);
    fs::remove_dir_all(&dir).unwrap();
    assert_eq!(manifests.len(), 1);
    let m = &manifests[0];
    assert_eq!(
        (m.rel.as_str(), m.name.as_str()),
        ("Cargo.toml", "attn-oracle")
    );
    let deps: Vec<(&str, DepKind, usize)> = m
        .deps
        .iter()
        .map(|d| (d.name.as_str(), d.kind, d.line))
        .collect();
    use DepKind::*;
    assert_eq!(
        deps,
        [
            ("attn-core", Normal, 5),
            ("attn-optimized", Normal, 6),
            ("faer", Normal, 7),
            ("attn-benches", Dev, 10),
            ("xtask", Build, 13),
        ]
    );
    let ours: BTreeSet<String> = [
        "attn-core",
        "attn-reference",
        "attn-optimized",
        "attn-oracle",
    ]
    .map(String::from)
    .into();
    let bad: Vec<(usize, String)> = dependency_violations(m, &ours)
        .into_iter()
        .map(|v| (v.line, v.to_string()))
        .collect();
    let lines: Vec<usize> = bad.iter().map(|b| b.0).collect();
    assert_eq!(lines, [6, 10, 13], "{bad:#?}");
    assert!(bad[0].1.starts_with(
        "Cargo.toml:6: rule `dependency directions`: attn-oracle must not depend on attn-optimized"
    ));
}

#[test]
fn checker_dependency_table() {
    let ours: BTreeSet<String> = DEPENDENCY_RULES
        .iter()
        .map(|r| r.krate.to_string())
        .collect();
    let manifest = |name: &str, deps: &[(&str, DepKind)]| Manifest {
        rel: format!("{name}/Cargo.toml"),
        name: name.to_string(),
        deps: deps
            .iter()
            .enumerate()
            .map(|(i, (n, k))| Dep {
                name: n.to_string(),
                kind: *k,
                line: i + 1,
            })
            .collect(),
    };
    use DepKind::*;
    let count = |m: &Manifest| dependency_violations(m, &ours).len();
    // Today's graph passes.
    assert_eq!(count(&manifest("attn-core", &[("faer", Normal)])), 0);
    assert_eq!(
        count(&manifest("attn-reference", &[("attn-core", Normal)])),
        0
    );
    assert_eq!(
        count(&manifest(
            "attn-oracle",
            &[("attn-core", Normal), ("attn-reference", Normal)]
        )),
        0
    );
    assert_eq!(
        count(&manifest(
            "attn-optimized",
            &[
                ("attn-core", Normal),
                ("attn-reference", Dev),
                ("attn-oracle", Dev)
            ]
        )),
        0
    );
    assert_eq!(count(&manifest("xtask", &[("attn-benches", Normal)])), 0);
    assert_eq!(
        count(&manifest(
            "attn-python",
            &[("attn-optimized", Normal), ("attn-oracle", Dev)]
        )),
        0
    );
    // Broken directions.
    assert_eq!(count(&manifest("attn-core", &[("attn-reference", Dev)])), 1);
    assert_eq!(
        count(&manifest("attn-reference", &[("attn-optimized", Normal)])),
        1
    );
    assert_eq!(
        count(&manifest("attn-oracle", &[("attn-optimized", Normal)])),
        1
    );
    assert_eq!(
        count(&manifest("attn-oracle", &[("attn-optimized", Dev)])),
        1
    );
    assert_eq!(
        count(&manifest("attn-optimized", &[("attn-oracle", Normal)])),
        1
    );
    assert_eq!(
        count(&manifest("attn-optimized", &[("attn-benches", Dev)])),
        1
    );
    assert_eq!(count(&manifest("attn-optimized", &[("xtask", Build)])), 1);
    assert_eq!(count(&manifest("attn-benches", &[("xtask", Normal)])), 1);
    assert_eq!(count(&manifest("attn-ring", &[("attn-future", Normal)])), 1);
    // A crate the table does not know.
    assert_eq!(count(&manifest("attn-cuda", &[])), 1);
}

#[test]
fn checker_finds_design_md() {
    let text = "fine\n/// per-call cost (DESIGN.md §5).\n//! see DESIGN §3\nthe DESIGNER's notes\n";
    let found: Vec<usize> = design_md_violations("x.rs", text)
        .iter()
        .map(|v| v.line)
        .collect();
    assert_eq!(found, [2, 3]);
}

#[test]
fn checker_code_map() {
    let arch = "# A\n## Code map\n### `crates/x` (`x`)\n`lib.rs`, `call/`: `one.rs`; `kernel/rows/avx2.rs`.\n`gone.rs` and `tests/t.rs`, `crates/z/a.rs`.\n### `crates/y`\n`mod.rs`\n## Invariants\n`z.rs`\n";
    let sources: Vec<String> = [
        "lib.rs",
        "call/mod.rs",
        "call/one.rs",
        "call/two.rs",
        "kernel/rows/avx2.rs",
    ]
    .map(String::from)
    .into();
    let mut present: Vec<String> = sources.iter().map(|f| format!("src/{f}")).collect();
    present.push("tests/t.rs".into());
    present.extend(present.clone().iter().flat_map(|f| folders_of(f)));
    let found: Vec<String> = code_map_violations(arch, "crates/x", &sources, &present, &|p| {
        p == "crates/z/a.rs"
    })
    .iter()
    .map(|v| format!("{}:{}", v.line, v.message.split(' ').next().unwrap_or("")))
    .collect();
    // `gone.rs` does not exist; `call/two.rs` is not named (`call/mod.rs` is, by its folder).
    assert_eq!(found, ["5:`gone.rs`", "3:crates/x/src/call/two.rs"]);
    let nowhere = |_: &str| false;
    assert_eq!(
        code_map_violations(arch, "crates/w", &[], &[], &nowhere).len(),
        1
    );
    assert_eq!(
        code_map_violations(arch, "crates/y", &[], &[], &nowhere).len(),
        1
    ); // no `mod.rs`
    assert_eq!(folders_of("a/b/c.rs"), ["a/", "a/b/"]);
    assert_eq!(
        named_paths("`a.rs`, `Options`, `b/`, `x y.rs`, `c/d.rs`"),
        ["a.rs", "b/", "c/d.rs"]
    );
}

#[test]
fn checker_finds_issue_numbers() {
    let hits = |t: &str| issue_number_violation("x.rs", 1, t).is_some();
    assert!(hits(
        "//! The robustness suite (issue 13): generated inputs"
    ));
    assert!(hits("//! Issue 5's and 6's decoding targets"));
    assert!(hits("// Issues 16 and 17"));
    assert!(hits("// see #27."));
    assert!(hits("(#27)"));
    assert!(!hits("// the issue is the 2 cores"));
    assert!(!hits("// task 5 of 8"));
    assert!(!hits("// #[derive(Debug)]"));
    assert!(!hits("# A heading"));
    assert!(!hits("// 3 issues remain"));
}
