//! The documentation cannot go stale unnoticed: every relative link in the README, the docs
//! and the other Markdown files of the repository points at a file (and heading) that
//! exists; every flag quoted with one of allgrad's commands (`train`, `launch`, `embed`,
//! `export`, `export-hf`) is one that command's `--help` lists; every script and config a document
//! names exists; every `--set key=` in the README and docs/ names a key of the configuration
//! reference (docs/configuration.md); every figure row of the README's performance table has
//! its command in docs/performance.md, and the rows whose tables are there give its newest
//! figures. (That the scripts the documents run are executable is
//! `scripts.rs`.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The repository's Markdown files, outside build output and the vendored crate.
fn markdown_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() {
                if !["target", ".git", "third_party", "runs", "models", "node_modules"].contains(&name.as_str()) {
                    walk(&p, out);
                }
            } else if name.ends_with(".md") {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(&repo(), &mut out);
    out.sort();
    out
}

/// A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    let mut fenced = false;
    text.lines()
        .filter(|l| {
            if l.starts_with("```") {
                fenced = !fenced;
            }
            !fenced && l.starts_with('#')
        })
        .map(|l| slug(l.trim_start_matches('#')))
        .collect()
}

/// `[text](target)` links outside code.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn relative_links_point_at_files_and_headings_that_exist() {
    let files = markdown_files();
    assert!(files.iter().any(|f| f.ends_with("README.md")), "{files:?}");
    let mut broken = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = link.split_once('#').map_or((link.as_str(), None), |(p, a)| (p, Some(a)));
            let target = if path.is_empty() { file.clone() } else { file.parent().unwrap().join(path) };
            if !target.exists() {
                broken.push(format!("{}: {link} (no {})", file.display(), target.display()));
                continue;
            }
            if let Some(a) = anchor.filter(|_| target.extension().is_some_and(|e| e == "md")) {
                if !anchors(&std::fs::read_to_string(&target).unwrap()).contains(a) {
                    broken.push(format!("{}: {link} (no heading #{a} in {})", file.display(), target.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// Code in a Markdown text: fenced blocks and inline `code` spans.
fn code(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut block = None::<String>;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            match block.take() {
                Some(b) => out.push(b),
                None => block = Some(String::new()),
            }
            continue;
        }
        if let Some(b) = block.as_mut() {
            b.push_str(line);
            b.push('\n');
            continue;
        }
        let mut parts = line.split('`');
        parts.next();
        while let Some(span) = parts.next() {
            out.push(span.to_string());
            parts.next();
        }
    }
    out
}

/// The long flags each of our commands' `--help` lists.
fn help_flags() -> BTreeMap<&'static str, BTreeSet<String>> {
    let bins = [
        ("train", env!("CARGO_BIN_EXE_train")),
        ("launch", env!("CARGO_BIN_EXE_launch")),
        ("embed", env!("CARGO_BIN_EXE_embed")),
        ("export", env!("CARGO_BIN_EXE_export")),
        ("export-hf", env!("CARGO_BIN_EXE_export-hf")),
        ("write-shards", env!("CARGO_BIN_EXE_write-shards")),
    ];
    bins.iter()
        .map(|(name, exe)| {
            let out = Command::new(exe).arg("--help").output().unwrap();
            assert!(out.status.success(), "{name} --help failed");
            let help = String::from_utf8_lossy(&out.stdout).into_owned();
            let flags = help
                .split(|c: char| c.is_whitespace() || c == ',' || c == '=' || c == '[' || c == ']')
                .filter(|t| t.starts_with("--"))
                .map(|t| t.trim_end_matches(|c: char| !c.is_alphanumeric()).to_string())
                .collect();
            (*name, flags)
        })
        .collect()
}

/// Programs after which a flag is not ours to check.
const OTHER_PROGRAMS: &[&str] = &[
    "torchrun",
    "srun",
    "sbatch",
    "cargo",
    "python",
    "python3",
    "sudo",
    "pip",
    "ip",
    "nvidia-smi",
    "bench_simclr_step",
    "bench_conv",
];

#[test]
fn flags_quoted_with_our_commands_exist_and_named_scripts_and_configs_are_there() {
    let flags = help_flags();
    let mut bad = Vec::new();
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        for snippet in code(&text) {
            let mut current: Option<&str> = None;
            let mut previous = "";
            for token in snippet.split(|c: char| c.is_whitespace() || c == '(' || c == ')' || c == '"') {
                // `cargo build --bin train`: a name after these flags is not a command line.
                let named_by_flag = ["--bin", "--example", "-p", "--package"].contains(&previous);
                previous = token;
                let token =
                    token.trim_matches(|c: char| c == ',' || c == ';' || c == '`' || c == '.' && !token.starts_with("./"));
                if token.is_empty() {
                    continue;
                }
                if ["|", "&&", "||", ";", "\\"].contains(&token) {
                    current = None;
                    continue;
                }
                let base = token.rsplit('/').next().unwrap_or(token);
                if let Some(name) = flags.keys().find(|n| **n == base).filter(|_| !named_by_flag) {
                    current = Some(name);
                    continue;
                }
                if OTHER_PROGRAMS.contains(&base) || token.starts_with("scripts/") || token.ends_with(".py") {
                    current = None;
                }
                if let (Some(name), Some(flag)) = (current, token.strip_prefix("--").map(|_| token.split('=').next().unwrap())) {
                    if flag.len() > 2
                        && flag[2..].chars().all(|c| c.is_ascii_lowercase() || c == '-')
                        && !flags[name].contains(flag)
                    {
                        bad.push(format!("{}: `{name} {flag}`: not in `{name} --help`", file.display()));
                    }
                }
                for prefix in ["scripts/", "configs/"] {
                    if let Some(i) = token.find(prefix) {
                        let path = &token[i..];
                        let path = path.trim_end_matches(|c: char| !(c.is_alphanumeric() || c == '_'));
                        if path.contains('*') || path.contains('<') || path.ends_with('/') || path == prefix.trim_end_matches('/')
                        {
                            continue;
                        }
                        if !repo().join(path).exists() {
                            bad.push(format!("{}: {path} does not exist", file.display()));
                        }
                    }
                }
            }
        }
    }
    bad.sort();
    bad.dedup();
    assert!(bad.is_empty(), "stale commands in the docs:\n{}", bad.join("\n"));
}

/// The keys of the configuration reference: the first cell of its tables, `| `key` |`.
fn reference_keys() -> BTreeSet<String> {
    let text = std::fs::read_to_string(repo().join("docs/configuration.md")).unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|rest| rest.split_once('`').map(|(k, _)| k.to_string()))
        .collect()
}

/// The keys of `--set key=value` in `text` (the value may be quoted: `--set "key={...}"`).
fn set_keys(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("--set ") {
        rest = &rest[i + "--set ".len()..];
        let token = rest.trim_start_matches(['"', '\'']);
        if let Some((key, _)) = token.split_once('=') {
            if key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.') && !key.is_empty() {
                out.push(key.to_string());
            }
        }
    }
    out
}

#[test]
fn every_set_key_in_the_readme_and_docs_is_a_key_of_the_configuration_reference() {
    let keys = reference_keys();
    assert!(keys.len() > 50 && keys.contains("train.global_batch") && keys.contains("dist.device_ids"), "{keys:?}");
    // Placeholders of the syntax itself, and the key of the example's own method (not allgrad's).
    let placeholders = ["key", "key.path"];
    let example = std::fs::read_to_string(repo().join("examples/custom_loss.rs")).unwrap();
    let mut docs = vec![repo().join("README.md")];
    docs.extend(markdown_files().into_iter().filter(|p| p.parent() == Some(&repo().join("docs"))));
    let (mut checked, mut bad) = (0, Vec::new());
    for file in docs {
        for key in set_keys(&std::fs::read_to_string(&file).unwrap()) {
            checked += 1;
            let ok = keys.contains(&key)
                || placeholders.contains(&key.as_str())
                || (key == "points.tile" && example.contains("points") && example.contains("tile"));
            if !ok {
                bad.push(format!("{}: --set {key}=: not a key of docs/configuration.md", file.display()));
            }
        }
    }
    assert!(checked >= 10, "only {checked} --set keys found: is the scan broken?");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    assert_eq!(set_keys("a `--set optim.lr=0.5 --set \"optim={kind: sgd}\"` b --set x y"), ["optim.lr", "optim"]);
}

/// The first cell of each row of the table under `heading` in `text` (header and rule left out).
fn table_rows(text: &str, heading: &str) -> Vec<(String, String)> {
    let mut rows = Vec::new();
    let mut inside = false;
    for line in text.lines() {
        if line.starts_with('#') {
            inside = line.trim_start_matches('#').trim() == heading;
            continue;
        }
        if inside && line.starts_with("| ") && !line.starts_with("|---") {
            let cells: Vec<&str> = line.trim_matches('|').split(" | ").map(str::trim).collect();
            rows.push((cells[0].to_string(), cells.get(1).unwrap_or(&"").to_string()));
        }
    }
    // The header row.
    if !rows.is_empty() {
        rows.remove(0);
    }
    rows
}

#[test]
fn every_figure_of_the_readme_performance_table_has_its_command_in_docs_performance() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let performance = std::fs::read_to_string(repo().join("docs/performance.md")).unwrap();
    let figures = table_rows(&readme, "Performance");
    assert!(figures.len() >= 5, "the README's performance table: {figures:?}");
    let commands: BTreeMap<String, String> = table_rows(&performance, "The README's figures").into_iter().collect();
    let mut bad = Vec::new();
    for (what, _) in &figures {
        match commands.get(what) {
            None => bad.push(format!("README row `{what}` is not in docs/performance.md's \"The README's figures\"")),
            Some(c) if !c.contains("scripts/") => bad.push(format!("`{what}`: no scripts/ command in docs/performance.md: {c}")),
            Some(_) => {}
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The cells of every row of the first table after the heading that satisfies `pick`
/// (header and rule included), and that heading.
fn first_table_after(text: &str, pick: impl Fn(&str) -> bool) -> Option<(String, Vec<Vec<String>>)> {
    let mut heading = None;
    let mut rows = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') {
            if heading.is_some() && !rows.is_empty() {
                break;
            }
            let h = line.trim_start_matches('#').trim();
            heading = pick(h).then(|| h.to_string());
            continue;
        }
        if heading.is_some() {
            if line.starts_with('|') {
                rows.push(line.trim().trim_matches('|').split(" | ").map(|c| c.trim().to_string()).collect());
            } else if !rows.is_empty() {
                break;
            }
        }
    }
    heading.filter(|_| !rows.is_empty()).map(|h| (h, rows))
}

/// The README's performance rows whose tables are in docs/performance.md give that page's
/// newest figures: the step rows (SimCLR, SimCSE) the ratios at batch 64 and 256 of the newest
/// dated step table (`### Measured on <machine> (<date>)`, columns `step | batch | ... | step
/// | ...`) with its machine and date; the collectives row the smallest and largest ratio of the
/// "Collectives (CPU)" table; the loader row the ratio at 1 and 2 workers of the loader table.
/// (The rows whose tables are on other pages, face.md, tiled_loss.md and gpu.md, are not
/// compared here.)
#[test]
fn the_readme_performance_rows_give_the_newest_figures_of_docs_performance() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let performance = std::fs::read_to_string(repo().join("docs/performance.md")).unwrap();
    let problems = compare_performance_rows(&readme, &performance);
    assert!(problems.is_empty(), "README.md's performance table against docs/performance.md:\n{}", problems.join("\n"));
}

/// Adds a line to `problems` unless the README's figure `got` starts with `want`.
fn check_figure(problems: &mut Vec<String>, what: &str, got: Option<&String>, want: String) {
    match got {
        Some(g) if g.starts_with(&want) => {}
        Some(g) => problems.push(format!("`{what}`: the README says `{g}`, docs/performance.md's newest figures give `{want}`")),
        None => problems.push(format!("`{what}`: no such row in the README's performance table")),
    }
}

/// What differs between the README's performance rows and docs/performance.md's newest
/// figures, one line each.
fn compare_performance_rows(readme: &str, performance: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let Some((_, readme_rows)) = first_table_after(readme, |h| h == "Performance") else {
        return vec!["README.md: no table under \"Performance\"".into()];
    };
    let readme_row = |prefix: &str| readme_rows.iter().find(|r| r[0].starts_with(prefix)).cloned();

    // The newest dated step table.
    let mut dated: Vec<(String, String, Vec<Vec<String>>)> = Vec::new();
    let mut rest = performance;
    while let Some((heading, rows)) = first_table_after(rest, |h| h.starts_with("Measured on ") && h.ends_with(')')) {
        let at = rest.find(&format!(" {heading}")).unwrap() + heading.len();
        rest = &rest[at..];
        if rows[0].first().map(String::as_str) == Some("step") && rows[0].get(1).map(String::as_str) == Some("batch") {
            let (machine, date) = heading["Measured on ".len()..heading.len() - 1].rsplit_once(" (").unwrap();
            dated.push((date.to_string(), machine.to_string(), rows));
        }
    }
    dated.sort();
    let Some((date, machine, rows)) = dated.last() else {
        return vec!["docs/performance.md: no dated step table (`### Measured on <machine> (<date>)`)".into()];
    };
    let step_col = rows[0].iter().skip(2).position(|c| c == "step").map(|i| i + 2).unwrap();
    let ratio = |name: &str, batch: &str| {
        rows.iter()
            .find(|r| r[0].starts_with(name) && r[1] == batch)
            .map(|r| r[step_col].clone())
            .unwrap_or_else(|| panic!("docs/performance.md, Measured on {machine} ({date}): no {name} row at batch {batch}"))
    };
    for (row, name, peer) in [
        ("SimCLR step, ResNet-18", "SimCLR", "PyTorch's time"),
        ("SimCSE step, all-MiniLM-L6-v2", "SimCSE", "PyTorch + transformers' time"),
    ] {
        let r = readme_row(row);
        check_figure(
            &mut problems,
            row,
            r.as_ref().map(|r| &r[1]),
            format!("{} / {} {peer}", ratio(name, "64"), ratio(name, "256")),
        );
        let at = r.as_ref().map(|r| r[2].clone());
        match at {
            Some(at) if at.contains(machine.as_str()) && at.ends_with(date.as_str()) => {}
            Some(at) => problems.push(format!("`{row}`: the README says `{at}`, the newest table is {machine}, {date}")),
            None => {}
        }
    }

    // The collectives: every ratio of the table, smallest to largest.
    if let Some((_, rows)) = first_table_after(performance, |h| h == "Collectives (CPU)") {
        let mut ratios: Vec<(f64, String)> = rows
            .iter()
            .skip(2)
            .flat_map(|r| r.iter().skip(1))
            .filter_map(|c| c.rsplit_once(" (").map(|(_, x)| x.trim_end_matches(')').trim_end_matches('x').to_string()))
            .map(|x| (x.parse::<f64>().unwrap(), x))
            .collect();
        ratios.sort_by(|a, b| a.0.total_cmp(&b.0));
        let row = "all_reduce, all_gather, reduce_scatter";
        match (ratios.first(), ratios.last()) {
            (Some(lo), Some(hi)) => {
                check_figure(&mut problems, row, readme_row(row).as_ref().map(|r| &r[1]), format!("{}-{}x ", lo.1, hi.1));
            }
            _ => problems.push("docs/performance.md: the \"Collectives (CPU)\" table has no ratios".into()),
        }
    } else {
        problems.push("docs/performance.md: no table under \"Collectives (CPU)\"".into());
    }

    // The loader: the last column at 1 and 2 workers.
    if let Some((_, rows)) = first_table_after(performance, |h| h.starts_with("Loader")) {
        let at = |w: &str| rows.iter().find(|r| r[0] == w).and_then(|r| r.last().cloned()).unwrap_or_default();
        let row = "loader, SimCLR's two views";
        check_figure(&mut problems, row, readme_row(row).as_ref().map(|r| &r[1]), format!("{} / {} ", at("1"), at("2")));
    } else {
        problems.push("docs/performance.md: no loader table".into());
    }
    problems
}

/// The comparison reports a README row that quotes older figures, and passes the right ones.
#[test]
fn an_older_figure_in_the_readme_is_reported() {
    let performance = "## Collectives (CPU)\n\n| size | all_reduce |\n|---|---|\n| 1 MiB | 7.59 / 0.32 (23.9x) |\n| 16 MiB | 4.49 / 0.74 (6.1x) |\n\n\
        ## Loader\n\n| workers | allgrad / torchvision |\n|---|---|\n| 1 | 3.59x |\n| 2 | 3.73x |\n\n\
        ### Measured on AMD EPYC (2026-11-20)\n\n| step | batch | s | step | forward |\n|---|---|---|---|---|\n\
        | SimCLR ResNet-18 | 64 | 1 / 1 | 0.90x | 1x |\n| SimCLR ResNet-18 | 256 | 1 / 1 | 0.60x | 1x |\n\
        | SimCSE all-MiniLM-L6-v2 | 64 | 1 / 1 | 1.01x | 1x |\n| SimCSE all-MiniLM-L6-v2 | 256 | 1 / 1 | 0.95x | 1x |\n\n\
        ### Measured on AMD EPYC (2026-11-28)\n\n| step | batch | s | step | forward |\n|---|---|---|---|---|\n\
        | SimCLR ResNet-18 | 64 | 1 / 1 | 0.75x | 1x |\n| SimCLR ResNet-18 | 256 | 1 / 1 | 0.52x | 1x |\n\
        | SimCSE all-MiniLM-L6-v2 | 64 | 1 / 1 | 0.85x | 1x |\n| SimCSE all-MiniLM-L6-v2 | 256 | 1 / 1 | 0.80x | 1x |\n";
    let readme = |simcse: &str| {
        format!(
            "## Performance\n\n| what | figure | machine, date |\n|---|---|---|\n\
             | all_reduce, all_gather, reduce_scatter, 2 ranks | 6.1-23.9x the bus bandwidth | x |\n\
             | SimCLR step, ResNet-18, batch 64 / 256 | 0.75x / 0.52x PyTorch's time | 2-core AMD EPYC, 2026-11-28 |\n\
             | SimCSE step, all-MiniLM-L6-v2, batch 64 / 256 | {simcse} |\n\
             | loader, SimCLR's two views at 224 | 3.59x / 3.73x torchvision's samples/s | x |\n"
        )
    };
    let good = readme("0.85x / 0.80x PyTorch + transformers' time | 2-core AMD EPYC, 2026-11-28");
    assert_eq!(compare_performance_rows(&good, performance), Vec::<String>::new());
    let old = readme("1.01x / 0.95x PyTorch + transformers' time | 2-vCPU AMD EPYC, 2026-11-23");
    assert_eq!(
        compare_performance_rows(&old, performance),
        [
            "`SimCSE step, all-MiniLM-L6-v2`: the README says `1.01x / 0.95x PyTorch + transformers' time`, docs/performance.md's newest figures give `0.85x / 0.80x PyTorch + transformers' time`",
            "`SimCSE step, all-MiniLM-L6-v2`: the README says `2-vCPU AMD EPYC, 2026-11-23`, the newest table is AMD EPYC, 2026-11-28",
        ]
    );
}

/// Every `ALLGRAD_*` name in `text` (a name ending in `_` is a prefix being assembled, not a
/// variable, and is left out).
fn allgrad_variables(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut from = 0;
    while let Some(at) = text[from..].find("ALLGRAD_") {
        let start = from + at;
        let before_ok = start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let end =
            start + text[start..].bytes().take_while(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || *b == b'_').count();
        let name = &text[start..end];
        if before_ok && !name.ends_with('_') {
            out.insert(name.to_string());
        }
        from = end;
    }
    out
}

/// The code that can read an environment variable: Rust sources, shell and Python scripts, and
/// CI's own files (documentation left out), among the repository's text files
/// ([`crate::scripts::text_files`]), each variable with the first file that names it.
fn variables_in_code() -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    for f in crate::scripts::text_files() {
        let code = f.extension().is_some_and(|e| e == "rs" || e == "sh" || e == "py")
            || f.parent().and_then(|d| d.file_name()).is_some_and(|n| n == ".ci");
        if !code {
            continue;
        }
        for v in allgrad_variables(&std::fs::read_to_string(&f).unwrap()) {
            out.entry(v).or_insert_with(|| f.strip_prefix(repo()).unwrap().to_path_buf());
        }
    }
    out
}

#[test]
fn docs_environment_lists_every_variable_the_code_reads_and_no_other() {
    let doc = std::fs::read_to_string(repo().join("docs/environment.md")).unwrap();
    // The variables a table row of docs/environment.md documents (its first cell).
    let documented: BTreeSet<String> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("| `")?.split('`').next())
        .filter(|v| v.starts_with("ALLGRAD_"))
        .map(String::from)
        .collect();
    assert!(documented.len() >= 20, "docs/environment.md: only {} variables found in its tables", documented.len());
    let in_code = variables_in_code();
    let missing: Vec<String> = in_code
        .iter()
        .filter(|(v, _)| !documented.contains(*v))
        .map(|(v, f)| format!("{v} (named in {})", f.display()))
        .collect();
    let stale: Vec<&String> = documented.iter().filter(|v| !in_code.contains_key(*v)).collect();
    assert!(missing.is_empty(), "docs/environment.md has no row for: {}", missing.join(", "));
    assert!(stale.is_empty(), "docs/environment.md documents variables no code reads: {stale:?}");
}

#[test]
fn allgrad_variables_are_found_whole_and_prefixes_left_out() {
    // Assembled, so that this file names no variable itself.
    let p = "ALLGRAD_";
    let found = allgrad_variables(&format!("x {p}A_B=1 \"{p}C\" MY_{p}D {p}E_${{i}} ${p}F2"));
    assert_eq!(found, [format!("{p}A_B"), format!("{p}C"), format!("{p}F2")].into_iter().collect());
}

// ------------------------------------------------------------ which tests need what

/// The needs `allgrad_testkit::Need` names, by their variant.
const NEEDS: [(&str, &str); 6] =
    [("MiniLm", "minilm"), ("DevShm", "shm"), ("NetNs", "netns"), ("Torch", "torch"), ("Unset", "env"), ("Simd", "simd")];

/// The GPU test binaries (their tests skip by name in a build without CUDA; docs/testing.md
/// lists them by file): left out of the scan below.
const GPU_FILES: [&str; 7] = [
    "tests/gpu_equivalence.rs",
    "tests/gpu_faults.rs",
    "crates/allgrad-nn/tests/conv_cuda.rs",
    "crates/allgrad-nn/tests/fused_cuda.rs",
    "crates/allgrad-train/tests/optim_cuda.rs",
    "crates/allgrad-data/tests/loader_cuda.rs",
    "crates/allgrad-dist/tests/nccl_ops.rs",
];

/// One function of a source file: its module path in its binary, whether it is a `#[test]`,
/// the needs it names itself and the names it calls.
struct Func {
    path: String,
    test: bool,
    needs: BTreeSet<&'static str>,
    calls: BTreeSet<String>,
}

/// The needs named in the arguments of a `skip(...)` call in `tokens` (`in_skip`: inside one
/// already), and the names `tokens` call.
fn scan_tokens(
    tokens: proc_macro2::TokenStream,
    in_skip: bool,
    needs: &mut BTreeSet<&'static str>,
    calls: &mut BTreeSet<String>,
) {
    use proc_macro2::TokenTree;
    let trees: Vec<TokenTree> = tokens.into_iter().collect();
    for (i, t) in trees.iter().enumerate() {
        match t {
            TokenTree::Group(g) => {
                let mut skip_call = false;
                if let (Some(TokenTree::Ident(id)), proc_macro2::Delimiter::Parenthesis) =
                    (i.checked_sub(1).map(|j| &trees[j]), g.delimiter())
                {
                    calls.insert(id.to_string());
                    skip_call = id == "skip";
                }
                scan_tokens(g.stream(), in_skip || skip_call, needs, calls);
            }
            TokenTree::Ident(id) if in_skip && id == "Need" => {
                if let Some(TokenTree::Ident(v)) = trees.get(i + 3) {
                    if let Some((_, key)) = NEEDS.iter().find(|(variant, _)| v == variant) {
                        needs.insert(key);
                    }
                }
            }
            _ => {}
        }
    }
}

fn collect_funcs(items: &[syn::Item], module: &str, out: &mut Vec<Func>) {
    use quote::ToTokens;
    for item in items {
        match item {
            syn::Item::Fn(f) => {
                let mut needs = BTreeSet::new();
                let mut calls = BTreeSet::new();
                scan_tokens(f.block.to_token_stream(), false, &mut needs, &mut calls);
                let name = f.sig.ident.to_string();
                out.push(Func {
                    path: if module.is_empty() { name } else { format!("{module}::{name}") },
                    // A child helper (`#[ignore = "child helper: ..."]`) is no test of its own.
                    test: f.attrs.iter().any(|a| a.path().is_ident("test"))
                        && !f
                            .attrs
                            .iter()
                            .any(|a| a.path().is_ident("ignore") && a.to_token_stream().to_string().contains("child helper")),
                    needs,
                    calls,
                });
            }
            syn::Item::Mod(m) => {
                if let Some((_, inner)) = &m.content {
                    let sub = if module.is_empty() { m.ident.to_string() } else { format!("{module}::{}", m.ident) };
                    collect_funcs(inner, &sub, out);
                }
            }
            _ => {}
        }
    }
}

/// Every test of the workspace that skips for want of something the machine may lack, as its
/// skip line names it (`<binary>::<test>`), by need: a test that names the need itself or
/// calls a function of its own file that does (helpers such as `hosts_or_skip`, followed
/// through the file's functions); a need counts where it is an argument of a `skip(...)` call.
fn tests_by_need() -> BTreeMap<&'static str, BTreeSet<String>> {
    let mut out: BTreeMap<&'static str, BTreeSet<String>> = BTreeMap::new();
    let mut packages = vec![(repo(), "allgrad".to_string())];
    for e in std::fs::read_dir(repo().join("crates")).unwrap().flatten() {
        packages.push((e.path(), e.file_name().to_string_lossy().replace('-', "_")));
    }
    for (pkg, lib) in packages {
        let mut files = Vec::new();
        fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
            for p in std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path()) {
                if p.is_dir() {
                    walk(&p, out);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    out.push(p);
                }
            }
        }
        walk(&pkg.join("src"), &mut files);
        walk(&pkg.join("tests"), &mut files);
        for file in files {
            let rel = file.strip_prefix(repo()).unwrap().to_string_lossy().into_owned();
            if GPU_FILES.contains(&rel.as_str()) {
                continue;
            }
            let in_pkg = file.strip_prefix(&pkg).unwrap();
            let mut parts: Vec<String> = in_pkg.iter().map(|s| s.to_string_lossy().into_owned()).collect();
            let last = parts.pop().unwrap();
            let stem = last.trim_end_matches(".rs").to_string();
            // The binary and the module path within it, as the test harness names tests.
            let (binary, mut module): (String, Vec<String>) = match parts[0].as_str() {
                "src" => (lib.clone(), parts[1..].to_vec()),
                _ if parts.len() == 1 => (stem.clone(), vec![]),
                _ => (parts[1].clone(), parts[2..].to_vec()),
            };
            // A file's own name is a module, except a root's or a `mod.rs`'s.
            let top_level_test = parts.len() == 1 && parts[0] == "tests";
            if !(["lib", "main", "mod"].contains(&stem.as_str()) || top_level_test) {
                module.push(stem);
            }
            let parsed = syn::parse_file(&std::fs::read_to_string(&file).unwrap()).unwrap();
            let mut funcs = Vec::new();
            collect_funcs(&parsed.items, &module.join("::"), &mut funcs);
            // Needs through the file's own functions, to a fixed point.
            let mut needs: BTreeMap<String, BTreeSet<&'static str>> = BTreeMap::new();
            for f in &funcs {
                needs.entry(f.path.rsplit("::").next().unwrap().to_string()).or_default().extend(&f.needs);
            }
            loop {
                let mut changed = false;
                for f in &funcs {
                    let name = f.path.rsplit("::").next().unwrap().to_string();
                    let mut got = needs[&name].clone();
                    for c in &f.calls {
                        if let Some(n) = needs.get(c) {
                            got.extend(n);
                        }
                    }
                    if got.len() > needs[&name].len() {
                        needs.insert(name, got);
                        changed = true;
                    }
                }
                if !changed {
                    break;
                }
            }
            for f in funcs.iter().filter(|f| f.test) {
                for need in &needs[f.path.rsplit("::").next().unwrap()] {
                    out.entry(need).or_default().insert(format!("{binary}::{}", f.path));
                }
            }
        }
    }
    out
}

/// docs/testing.md's table of needs names exactly the tests that skip for each (root,
/// network namespaces, `/dev/shm`, the SIMD levels, the MiniLM weights, PyTorch, an unset
/// variable): a test that gains or loses a skip changes the table in the same commit.
#[test]
fn docs_testing_names_exactly_the_tests_that_skip_for_each_need() {
    let text = std::fs::read_to_string(repo().join("docs/testing.md")).unwrap();
    let (_, rows) = first_table_after(&text, |h| h == "Skips").expect("docs/testing.md: no table under \"Skips\"");
    let found = tests_by_need();
    assert!(found.get("shm").is_some_and(|t| t.len() >= 5), "the scan found too few shm tests: {found:?}");
    let mut problems = Vec::new();
    for (_, key) in NEEDS {
        let Some(row) = rows.iter().find(|r| r[0] == format!("`{key}`")) else {
            problems.push(format!("docs/testing.md: no row for `{key}`"));
            continue;
        };
        let documented: BTreeSet<String> = row[1]
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|s| {
                s.contains("::")
                    && !GPU_FILES.iter().any(|g| s.starts_with(g.rsplit('/').next().unwrap().trim_end_matches(".rs")))
            })
            .map(str::to_string)
            .collect();
        let want = found.get(key).cloned().unwrap_or_default();
        for t in want.difference(&documented) {
            problems.push(format!("`{key}`: {t} skips without it, but docs/testing.md does not name it"));
        }
        for t in documented.difference(&want) {
            problems.push(format!("`{key}`: docs/testing.md names {t}, which does not skip for it"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
