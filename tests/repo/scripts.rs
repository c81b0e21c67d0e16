//! The scripts users are told to run can be run, and the paths that name them are true.
//!
//! Every script lies in a folder of scripts/ by purpose and is listed in that folder's README
//! (one line each), and scripts/README.md links every folder. Every script with a `#!` line
//! is executable, and every `scripts/...` path that the documentation (README, docs/,
//! ARCHITECTURE.md, the READMEs of scripts/, data/ and third_party/, the configs' comments, the
//! scripts' own headers) writes as a command exists, has a `#!` line and is executable. A
//! script committed without its run bit fails on a fresh clone with "Permission denied". Every
//! `scripts/...` path to a `.sh` or `.py` file named anywhere in the repository (documents,
//! code and its comments, configs, CI, the scripts themselves) exists, so that a script moved
//! or renamed without its users fails here.
//!
//! A command is a path at the start of a line or of a code span, or after `;`, `&&`, `|`,
//! `$ `, `$(`, `> ` (a quoted line), `sudo ` or `VAR=value ` assignments; `python3 scripts/x.py`
//! and `. scripts/x.sh` run through an interpreter and need no run bit, and a code span that
//! only names a file (`` (`scripts/x.sh`: ...) ``) is no command.
//!
//! And `scripts/ci/gpu_ci.sh` on a machine without a GPU says why, in its report too, and exits 0,
//! or 1 under ALLGRAD_REQUIRE_GPU=1; with a stand-in GPU and stand-in binaries its report
//! judges each part as the GPU session would (tests by their results, benchmarks by their step
//! table, once per precision, saying when a benchmark flagged a busy machine), and under
//! ALLGRAD_REQUIRE_GPU=1 fails every part that cannot run (a missing test binary, missing
//! PyTorch or weights, a test that skips) where it would otherwise leave a "skipped" row, so
//! that the harness is checked here rather than on a GPU machine's scarce time.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn executable(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.permissions().mode() & 0o111 != 0)
}

fn has_shebang(p: &Path) -> bool {
    std::fs::read(p).is_ok_and(|b| b.starts_with(b"#!"))
}

/// The folders of scripts/, sorted.
fn script_folders() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> =
        std::fs::read_dir(root().join("scripts")).unwrap().flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect();
    dirs.sort();
    dirs
}

/// The files of a folder, sorted.
fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().flatten().map(|e| e.path()).filter(|p| p.is_file()).collect();
    files.sort();
    files
}

/// The scripts: every file in a folder of scripts/ except its README.
fn scripts() -> Vec<PathBuf> {
    script_folders().iter().flat_map(|d| files_in(d)).filter(|p| !p.ends_with("README.md")).collect()
}

/// The documents that tell users what to run.
fn documents() -> Vec<PathBuf> {
    let r = root();
    let mut docs: Vec<PathBuf> = ["README.md", "ARCHITECTURE.md", "scripts/README.md", "third_party/README.md"]
        .iter()
        .map(|f| r.join(f))
        .filter(|p| p.exists())
        .collect();
    for (dir, ext) in [("docs", "md"), ("configs", "yaml")] {
        if let Ok(entries) = std::fs::read_dir(r.join(dir)) {
            docs.extend(entries.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == ext)));
        }
    }
    for dir in script_folders() {
        docs.extend(files_in(&dir).into_iter().filter(|p| p.ends_with("README.md") || p.extension().is_some_and(|x| x == "sh")));
    }
    if let Ok(entries) = std::fs::read_dir(r.join("data")) {
        docs.extend(entries.flatten().map(|e| e.path().join("README.md")).filter(|p| p.exists()));
    }
    docs.sort();
    docs
}

/// The `scripts/...` paths of `text` written as commands (see the module docs), with their
/// line numbers.
fn commands(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let mut from = 0;
        while let Some(at) = line[from..].find("scripts/") {
            let start = from + at;
            from = start + "scripts/".len();
            let name: String =
                line[from..].chars().take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/')).collect();
            if !(name.ends_with(".sh") || name.ends_with(".py")) {
                continue;
            }
            // `scripts/x.sh`: or (`scripts/x.sh`) names a file; it is no command.
            let after = &line[from + name.len()..];
            let named = line[..start].ends_with('`') && (after.starts_with("`:") || after.starts_with("`)"));
            if !named && starts_a_command(&line[..start]) {
                out.push((n + 1, format!("scripts/{name}")));
            }
        }
    }
    out
}

/// Whether a path preceded by `before` (on its line) is the program of a command.
fn starts_a_command(before: &str) -> bool {
    // Strip `VAR=value ` assignments and `sudo ` going backwards.
    let mut b = before.trim_end_matches(' ');
    loop {
        let word_start = b.rfind([' ', '`', ';', '(']).map(|i| i + 1).unwrap_or(0);
        let word = &b[word_start..];
        let is_assignment = word
            .split_once('=')
            .is_some_and(|(k, _)| !k.is_empty() && k.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'));
        if word == "sudo" || is_assignment {
            b = b[..word_start].trim_end_matches(' ');
            continue;
        }
        break;
    }
    let b = b.trim_start_matches(['#', '/']); // a comment's leader, in scripts and YAML
    let t = b.trim();
    t.is_empty() || ["`", ";", "&&", "$", ">", "|", "$("].iter().any(|end| t.ends_with(end))
}

#[test]
fn every_script_with_a_shebang_is_executable() {
    let mut bad = Vec::new();
    for p in scripts() {
        if has_shebang(&p) && !executable(&p) {
            bad.push(p.strip_prefix(root()).unwrap().display().to_string());
        }
    }
    bad.sort();
    assert!(bad.is_empty(), "scripts with a #! line but no run bit (git update-index --chmod=+x FILE): {bad:?}");
}

#[test]
fn every_script_the_documents_tell_users_to_run_is_executable() {
    let mut checked = 0;
    let mut bad = Vec::new();
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for (line, script) in commands(&text) {
            checked += 1;
            let p = root().join(&script);
            let problem = if !p.is_file() {
                "does not exist"
            } else if !has_shebang(&p) {
                "has no #! line"
            } else if !executable(&p) {
                "is not executable"
            } else {
                continue;
            };
            bad.push(format!("{}:{line}: {script} {problem}", doc.strip_prefix(root()).unwrap().display()));
        }
    }
    assert!(checked >= 10, "only {checked} script commands found in the documents: is the scan broken?");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn the_scan_finds_commands_and_leaves_interpreted_and_prose_mentions_alone() {
    let text = "run `scripts/a.sh` then\n\
                ALLGRAD_REQUIRE_GPU=1 scripts/b.sh\n\
                `sudo scripts/c.sh x`; scripts/d.py && scripts/e.sh\n\
                # scripts/f.sh DIR\n\
                > scripts/g.sh\n\
                python3 scripts/h.py, . scripts/i.sh, values from scripts/j.py, x=$(scripts/k.sh)\n\
                the toolchain (`scripts/l.sh`: pinned), the module (`scripts/m.py`), the wheels (scripts/n.sh)\n\
                `scripts/ci/o.sh DIR`, python3 scripts/bench/p.py\n";
    let found: Vec<String> = commands(text).into_iter().map(|(_, s)| s).collect();
    let want = ["a.sh", "b.sh", "c.sh", "d.py", "e.sh", "f.sh", "g.sh", "k.sh", "ci/o.sh"].map(|s| format!("scripts/{s}"));
    assert_eq!(found, want);
}

#[test]
fn every_script_lies_in_a_folder_by_purpose_and_is_listed_in_its_readme() {
    let r = root();
    let name = |p: &Path| p.file_name().unwrap().to_string_lossy().into_owned();
    let loose: Vec<String> = files_in(&r.join("scripts")).iter().map(|p| name(p)).filter(|n| n != "README.md").collect();
    assert!(loose.is_empty(), "scripts outside a folder of scripts/ (move each into the folder of its purpose): {loose:?}");
    let index = std::fs::read_to_string(r.join("scripts/README.md")).unwrap();
    let mut bad = Vec::new();
    for dir in script_folders() {
        let folder = name(&dir);
        if !index.contains(&format!("[`{folder}/`]({folder}/README.md)")) {
            bad.push(format!("scripts/README.md does not link scripts/{folder}/ as [`{folder}/`]({folder}/README.md)"));
        }
        let Ok(readme) = std::fs::read_to_string(dir.join("README.md")) else {
            bad.push(format!("scripts/{folder}/ has no README.md"));
            continue;
        };
        // The first cell of each row of the table headed `| script | ...`: `| `name` | ...`.
        let listed: BTreeSet<String> = readme
            .lines()
            .skip_while(|l| !l.starts_with("| script |"))
            .take_while(|l| l.starts_with('|'))
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|rest| rest.split_once('`').map(|(n, _)| n.to_string()))
            .collect();
        let present: BTreeSet<String> = files_in(&dir).iter().map(|p| name(p)).filter(|n| n != "README.md").collect();
        for n in present.difference(&listed) {
            bad.push(format!("scripts/{folder}/{n} is not listed in the `| script |` table of scripts/{folder}/README.md"));
        }
        for n in listed.difference(&present) {
            bad.push(format!("scripts/{folder}/README.md lists {n}, which is not in scripts/{folder}/"));
        }
    }
    assert!(script_folders().len() >= 3 && scripts().len() >= 20, "scripts/: is the scan broken?");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The `scripts/...` paths to `.sh` and `.py` files that `text` names, anywhere (a glob such as
/// `scripts/bench/bench_*.sh` included), with their line numbers.
fn named_scripts(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let mut from = 0;
        while let Some(at) = line[from..].find("scripts/") {
            let start = from + at;
            from = start + "scripts/".len();
            // `build scripts/`, `$ROOT/scripts/` and `(scripts/` name ours; `myscripts/` does not.
            if line[..start].chars().next_back().is_some_and(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')) {
                continue;
            }
            let rest: String = line[from..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/' | '*'))
                .collect();
            let rest = rest.trim_end_matches(['.', '/']);
            if rest.ends_with(".sh") || rest.ends_with(".py") {
                out.push((n + 1, format!("scripts/{rest}")));
            }
        }
    }
    out
}

/// Whether `path` matches `pattern`, whose `*`s match any run of characters other than `/`.
fn matches_glob(pattern: &str, path: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == path,
        Some((head, tail)) => {
            let Some(rest) = path.strip_prefix(head) else { return false };
            (0..=rest.len())
                .take_while(|&i| !rest[..i].contains('/'))
                .any(|i| rest.is_char_boundary(i) && matches_glob(tail, &rest[i..]))
        }
    }
}

/// The repository's text files that can name a script: Markdown, Rust, shell, Python, YAML,
/// TOML and CI's own files, outside build output, the vendored crate and downloaded data.
pub(crate) fn text_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() {
                let skip = ["target", ".git", "third_party", "runs", "vendor", "node_modules"].contains(&name.as_str())
                    || (dir == root().join("data") && !p.join("README.md").exists());
                if !skip {
                    walk(&p, out);
                }
            } else if ["md", "rs", "sh", "py", "yaml", "yml", "toml"].iter().any(|x| name.ends_with(&format!(".{x}")))
                || dir.file_name().is_some_and(|n| n == ".ci")
            {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(&root(), &mut out);
    out.sort();
    out
}

#[test]
fn every_script_path_named_in_the_repository_exists() {
    let r = root();
    let all: Vec<String> = scripts().iter().map(|p| p.strip_prefix(&r).unwrap().display().to_string()).collect();
    let (mut checked, mut bad) = (0, Vec::new());
    for file in text_files() {
        // This file's own examples of the scan are made up.
        if file == r.join("tests/repo/scripts.rs") {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&file) else { continue };
        for (line, path) in named_scripts(&text) {
            checked += 1;
            let found = if path.contains('*') { all.iter().any(|s| matches_glob(&path, s)) } else { r.join(&path).is_file() };
            if !found {
                bad.push(format!("{}:{line}: {path} does not exist", file.strip_prefix(&r).unwrap().display()));
            }
        }
    }
    assert!(checked >= 100, "only {checked} script paths found in the repository: is the scan broken?");
    assert!(bad.is_empty(), "script paths that name no script (moved or renamed?):\n{}", bad.join("\n"));
}

#[test]
fn the_path_scan_finds_scripts_in_prose_code_and_globs() {
    let text = "run scripts/ci/a.sh, then \"$ROOT/scripts/bench/b.py\" --x\n\
                (scripts/c.sh). myscripts/d.sh scripts/ e scripts/data/ f scripts/reference/ref_*.py\n";
    let found: Vec<(usize, String)> = named_scripts(text);
    let want = [(1, "scripts/ci/a.sh"), (1, "scripts/bench/b.py"), (2, "scripts/c.sh"), (2, "scripts/reference/ref_*.py")]
        .map(|(n, s)| (n, s.to_string()));
    assert_eq!(found, want);
    assert!(matches_glob("scripts/bench/bench_*.sh", "scripts/bench/bench_conv.sh"));
    assert!(!matches_glob("scripts/bench/bench_*.sh", "scripts/bench/bench_conv.py"));
    assert!(!matches_glob("scripts/*.sh", "scripts/bench/bench_conv.sh"));
}

/// Runs scripts/ci/gpu_ci.sh with `smi` in nvidia-smi's place; its exit code, stderr and report.
fn gpu_ci_without_a_gpu(smi: &str, require: bool) -> (Option<i32>, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.md");
    let out = std::process::Command::new(root().join("scripts/ci/gpu_ci.sh"))
        .env("ALLGRAD_NVIDIA_SMI", smi)
        .env("ALLGRAD_GPU_OUT", dir.path())
        .env("ALLGRAD_GPU_REPORT", &report)
        .env("ALLGRAD_REQUIRE_GPU", if require { "1" } else { "0" })
        .output()
        .unwrap();
    let report = std::fs::read_to_string(&report).unwrap_or_default();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned(), report)
}

#[test]
fn gpu_ci_without_a_gpu_says_why_and_exits_0_or_1_when_a_gpu_is_required() {
    let dir = tempfile::tempdir().unwrap();
    // An nvidia-smi that lists no GPU (a driver without devices).
    let empty = dir.path().join("nvidia-smi-without-gpus");
    std::fs::write(&empty, "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(&empty, std::fs::Permissions::from_mode(0o755)).unwrap();
    for (smi, why) in
        [("allgrad-no-such-nvidia-smi", "no allgrad-no-such-nvidia-smi on PATH"), (empty.to_str().unwrap(), "lists no GPU")]
    {
        let (code, err, report) = gpu_ci_without_a_gpu(smi, false);
        assert_eq!(code, Some(0), "{err}");
        assert!(err.contains("SKIPPED") && err.contains(why), "{err}");
        assert!(report.contains("| all | skipped |") && report.contains(why), "{report}");
        let (code, err, _) = gpu_ci_without_a_gpu(smi, true);
        assert_eq!(code, Some(1), "{err}");
        assert!(err.contains("FAILED") && err.contains(why) && err.contains("ALLGRAD_REQUIRE_GPU=1"), "{err}");
    }
}

/// Writes an executable shell script `name` with `body` into `dir`.
fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

#[test]
fn gpu_ci_judges_tests_by_their_results_and_benchmarks_by_their_table_per_precision() {
    let dir = tempfile::tempdir().unwrap();
    let (d, bin) = (dir.path(), dir.path().join("bin"));
    std::fs::create_dir(&bin).unwrap();
    // A stand-in nvidia-smi with one GPU of compute capability 9.0.
    let smi = script(
        d,
        "nvidia-smi",
        r#"case "$*" in
  *compute_cap*) echo "9.0" ;;
  *memory.total*) echo "Stand-in GPU, 1 MiB, 0.0, 9.0" ;;
  *) echo "Stand-in GPU" ;;
esac"#,
    );
    // A Python whose torch "has CUDA" (gpu_ci.sh only asks it that).
    let python = script(d, "python", "exit 0");
    let passing = "echo 'test result: ok. 2 passed; 0 failed; 0 ignored'";
    for name in ["train", "launch", "nccl_ops", "gpu_equivalence", "gpu_faults"] {
        script(&bin, name, passing);
    }
    script(&bin, "optim_cuda", "echo 'test result: FAILED. 1 passed; 1 failed; 0 ignored'; echo 'panicked at optim'; exit 101");
    // A step benchmark that logs its arguments and prints a table per batch, flagging the bf16
    // run as taken on a busy machine.
    script(
        &bin,
        "bench_simclr_step",
        &format!(
            r#"echo "$*" >> {log}
p=; prev=; for a in "$@"; do [ "$prev" = --precision ] && p=$a; prev=$a; done
for b in 256 1024; do echo "== batch $b (2 views), ResNet-18, on cuda, precision $p"; echo "wall s  0.1 0.1 0.1  0.05 0.05 0.05  2.00x"; echo "peak device memory MiB  80 80 80  100 100 100  0.80x"; done
[ "$p" = bf16 ] && echo "WARNING: other processes used 34% of a CPU during the steps (median): these timings are not figures"
exit 0"#,
            log = d.join("bench_args.txt").display()
        ),
    );
    let report = d.join("report.md");
    let out = std::process::Command::new(root().join("scripts/ci/gpu_ci.sh"))
        .env("ALLGRAD_NVIDIA_SMI", &smi)
        .env("ALLGRAD_GPU_OUT", d.join("out"))
        .env("ALLGRAD_GPU_REPORT", &report)
        .env("ALLGRAD_GPU_BIN", &bin)
        .env("ALLGRAD_GPU_PARTS", "collectives,fused_optim,bench_r18")
        .env("ALLGRAD_GPU_BENCH_PRECISIONS", "full bf16")
        .env("PYTHON", &python)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let report = std::fs::read_to_string(&report).unwrap();
    // The failing test part fails the run.
    assert_eq!(out.status.code(), Some(1), "{err}\n{report}");
    let row = |part: &str| {
        report
            .lines()
            .find(|l| l.starts_with(&format!("| {part}")))
            .unwrap_or_else(|| panic!("no row {part}:\n{report}"))
            .to_string()
    };
    assert!(row("collectives").contains("| passed |") && row("collectives").contains("2 test(s)"), "{report}");
    assert!(row("fused_optim").contains("| failed |") && row("fused_optim").contains("exit code 101"), "{report}");
    let bench = row("bench_r18");
    assert!(bench.contains("| passed |"), "{bench}");
    for want in [
        "batch 256 full: 2.00x (memory 0.80x)",
        "batch 1024 full: 2.00x (memory 0.80x)",
        "batch 256 bf16: 2.00x (memory 0.80x)",
        "batch 1024 bf16: 2.00x (memory 0.80x)",
    ] {
        assert!(bench.contains(want), "{want} missing: {bench}");
    }
    assert!(bench.contains("1 warning(s) of a busy machine: not figures"), "{bench}");
    // One run per precision, each on CUDA with its precision.
    let args = std::fs::read_to_string(d.join("bench_args.txt")).unwrap();
    let runs: Vec<&str> = args.lines().collect();
    assert_eq!(runs.len(), 2, "{args}");
    assert!(runs[0].starts_with("--device cuda --precision full --depth 18") && runs[0].ends_with("256 1024"), "{args}");
    assert!(runs[1].starts_with("--device cuda --precision bf16 --depth 18"), "{args}");
}

#[test]
fn gpu_ci_under_require_gpu_fails_every_part_that_cannot_run_instead_of_skipping_it() {
    let dir = tempfile::tempdir().unwrap();
    let (d, bin) = (dir.path(), dir.path().join("bin"));
    std::fs::create_dir(&bin).unwrap();
    let smi = script(
        d,
        "nvidia-smi",
        r#"case "$*" in
  *compute_cap*) echo "9.0" ;;
  *memory.total*) echo "Stand-in GPU, 1 MiB, 0.0, 9.0" ;;
  *) echo "Stand-in GPU" ;;
esac"#,
    );
    // A Python without PyTorch: no peer for the benchmarks.
    let python = script(d, "python", "exit 1");
    let passing = "echo 'test result: ok. 2 passed; 0 failed; 0 ignored'";
    for name in ["train", "launch", "nccl_ops", "gpu_faults", "bench_simclr_step"] {
        script(&bin, name, passing);
    }
    // The equivalence tests run, but one skips (the MiniLM weights are absent).
    script(
        &bin,
        "gpu_equivalence",
        "echo 'SKIPPED gpu_equivalence::simcse_minilm_on_2_ranks_equals_1_rank [minilm]: simcse_minilm: data/models/all-MiniLM-L6-v2 is absent (runs when: ...)'\n\
         echo 'test result: ok. 4 passed; 0 failed; 0 ignored'",
    );
    // No conv_cuda, fused_cuda or optim_cuda: a build without cudnn, or an older one.
    let run = |require: bool| {
        let report = d.join(format!("report-{require}.md"));
        let out = std::process::Command::new(root().join("scripts/ci/gpu_ci.sh"))
            .env("ALLGRAD_NVIDIA_SMI", &smi)
            .env("ALLGRAD_GPU_OUT", d.join(format!("out-{require}")))
            .env("ALLGRAD_GPU_REPORT", &report)
            .env("ALLGRAD_GPU_BIN", &bin)
            .env("ALLGRAD_GPU_PARTS", "collectives,cudnn_conv,fused_ops,fused_optim,equivalence_text,bench_r18")
            .env("ALLGRAD_REQUIRE_GPU", if require { "1" } else { "0" })
            .env("PYTHON", &python)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code(), err, std::fs::read_to_string(&report).unwrap())
    };
    let row = |report: &str, part: &str| {
        report
            .lines()
            .find(|l| l.starts_with(&format!("| {part}")))
            .unwrap_or_else(|| panic!("no row {part}:\n{report}"))
            .to_string()
    };
    let left_out = ["cudnn_conv", "fused_ops", "fused_optim", "equivalence_text", "bench_r18, bench_r50, bench_simcse"];
    // Without ALLGRAD_REQUIRE_GPU: skipped rows, and the run passes.
    let (code, err, report) = run(false);
    assert_eq!(code, Some(0), "{err}\n{report}");
    assert!(row(&report, "collectives").contains("| passed |"), "{report}");
    for part in left_out {
        let r = row(&report, part);
        assert!(r.contains("| skipped |") || r.contains("| passed |"), "{part}: {r}");
    }
    assert!(
        row(&report, "cudnn_conv").contains("| skipped |") && row(&report, "cudnn_conv").contains("no conv_cuda"),
        "{report}"
    );
    // With it: every part that could not run fails, saying why, and so does the run.
    let (code, err, report) = run(true);
    assert_eq!(code, Some(1), "{err}\n{report}");
    assert!(row(&report, "collectives").contains("| passed |"), "{report}");
    for (part, why) in [
        ("cudnn_conv", "no conv_cuda"),
        ("fused_ops", "no fused_cuda"),
        ("fused_optim", "no optim_cuda"),
        ("equivalence_text", "1 of 4 test(s) skipped"),
        ("bench_r18, bench_r50, bench_simcse", "cannot import PyTorch"),
    ] {
        let r = row(&report, part);
        assert!(r.contains("| failed |") && r.contains(why), "{part}: {r}");
    }
    assert!(!report.contains("| skipped |"), "{report}");
}

/// `scripts/ci/test_summary.sh` (CI's closing summary) on a fabricated log of two `cargo test`
/// runs: a test that printed two skip lines is one skipped test, the child helpers are neither
/// passed, ignored nor skipped tests, a test skipped in both runs is counted in each, and a
/// skip for a required need fails the summary.
#[test]
fn the_ci_summary_counts_skipped_tests_not_skip_lines_and_leaves_child_helpers_out() {
    let d = tempfile::tempdir().unwrap();
    let log = d.path().join("test.log");
    // Run 1: two binaries, 12 + 5 passed (3 of them skipped at run time), 1 diagnostic ignored
    // and 2 child helpers. Run 2: 4 passed, 1 of them skipped.
    std::fs::write(
        &log,
        "running 14 tests\n\
         test simd::avx2_and_avx512 ... ok\n\
         test launch::child_rank ... ignored, child helper: run as the ranks of launch::x\n\
         test simclr::diagnostic ... ignored\n\
         test result: ok. 12 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out; finished in 1.00s\n\
         running 6 tests\n\
         test shm_processes::child_rank ... ignored, child helper: run as the ranks of this file's tests\n\
         test result: ok. 5 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 1.00s\n\
         running 4 tests\n\
         test result: ok. 4 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.00s\n",
    )
    .unwrap();
    let run1 = d.path().join("skipped-1.txt");
    let run2 = d.path().join("skipped-2.txt");
    std::fs::write(
        &run1,
        "SKIPPED nn::simd::avx2_and_avx512 [simd]: the CPU lacks AVX-512 (runs when: x)\n\
         SKIPPED nn::simd::avx2_and_avx512 [simd]: the CPU lacks AVX2 (runs when: x)\n\
         SKIPPED repo::two_hosts::a [netns]: not root (runs when: x)\n\
         SKIPPED gpu_faults::b [gpu]: no CUDA (runs when: x)\n",
    )
    .unwrap();
    std::fs::write(&run2, "SKIPPED gpu_faults::b [gpu]: no CUDA device (runs when: x)\n").unwrap();
    let summary = |require: &str| {
        let out = std::process::Command::new(root().join("scripts/ci/test_summary.sh"))
            .arg(&log)
            .arg("0")
            .arg(&run1)
            .arg(&run2)
            .arg(d.path().join("no-such-run.txt"))
            .env("ALLGRAD_REQUIRE", require)
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
    };
    let (code, out) = summary("env,shm");
    assert_eq!(code, Some(0), "{out}");
    // 21 passed by cargo's count, of which 3 + 1 skipped; 1 ignored + 4 skipped.
    assert_eq!(out.lines().last(), Some("tests: 17 passed, 0 failed, 5 skipped"), "{out}");
    for line in [
        "ci: cargo test --workspace, then the GPU tests' harness on the CPU: 3 test runs (test binaries and doc-tests), exit status 0",
        "ci: ignored (#[ignore], diagnostics run by hand): 1",
        "ci:   simclr::diagnostic",
        "ci: child helpers (run by other tests as child processes; not tests, not counted): 2",
        "ci:   launch::child_rank (child helper: run as the ranks of launch::x)",
        "ci: skipped at run time (counted by cargo as passed): 4",
        "ci:   SKIPPED nn::simd::avx2_and_avx512 [simd]: the CPU lacks AVX2 (runs when: x)",
    ] {
        assert!(out.lines().any(|l| l == line), "missing `{line}` in:\n{out}");
    }
    // netns required: the summary fails, naming it.
    let (code, out) = summary("env,netns");
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("ci: error: a test skipped for want of [netns], which this machine provides"), "{out}");
    assert_eq!(out.lines().last(), Some("tests: 17 passed, 0 failed, 5 skipped"), "{out}");
}
