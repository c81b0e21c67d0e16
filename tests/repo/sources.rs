//! Every Rust file of the workspace is compiled: each `.rs` file under a package's `src/`,
//! `tests/`, `examples/` and `benches/` is a target's root (Cargo's automatic targets:
//! `src/lib.rs`, `src/main.rs`, `src/bin/*.rs`, `tests/*.rs`, `examples/*.rs`, `benches/*.rs`,
//! each also as `<name>/main.rs`, and `build.rs`) or is reached from one through `mod` lines.
//! A test file added to a merged test binary's folder (`tests/<name>/`, one binary per folder)
//! without a `mod` line in its `main.rs` is never compiled, so its tests would never run and
//! nothing else would notice.
//!
//! `mod` lines are followed as the compiler does: `mod x;` in a crate root or a `mod.rs` is
//! `x.rs` or `x/mod.rs` beside it, in any other file `foo.rs` it is under `foo/`; inline
//! modules add their name to the folder; `#[path = "..."]` is relative to the declaring file's
//! folder (inside inline modules, to the folder those modules name). A `mod` behind a `#[cfg]`
//! counts as declared: some build compiles it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The packages of the workspace: the root and every folder of `crates/` with a Cargo.toml.
fn packages() -> Vec<PathBuf> {
    let mut out = vec![repo()];
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(repo().join("crates")).unwrap().flatten().map(|e| e.path()).collect();
    dirs.sort();
    out.extend(dirs.into_iter().filter(|d| d.join("Cargo.toml").exists()));
    out
}

/// The target roots Cargo finds by itself in package `pkg`.
fn target_roots(pkg: &Path) -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> =
        ["src/lib.rs", "src/main.rs", "build.rs"].iter().map(|f| pkg.join(f)).filter(|p| p.is_file()).collect();
    for dir in ["src/bin", "tests", "examples", "benches"] {
        let Ok(entries) = std::fs::read_dir(pkg.join(dir)) else { continue };
        for p in entries.flatten().map(|e| e.path()) {
            if p.is_file() && p.extension().is_some_and(|x| x == "rs") {
                roots.push(p);
            } else if p.join("main.rs").is_file() {
                roots.push(p.join("main.rs"));
            }
        }
    }
    roots.sort();
    roots
}

/// Every `.rs` file under the package's source folders.
fn rust_files(pkg: &Path) -> BTreeSet<PathBuf> {
    fn walk(dir: &Path, out: &mut BTreeSet<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for p in entries.flatten().map(|e| e.path()) {
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.insert(p);
            }
        }
    }
    let mut out = BTreeSet::new();
    for dir in ["src", "tests", "examples", "benches"] {
        walk(&pkg.join(dir), &mut out);
    }
    out
}

fn path_attr(attrs: &[syn::Attribute]) -> Option<String> {
    attrs.iter().find(|a| a.path().is_ident("path")).map(|a| {
        let syn::Meta::NameValue(nv) = &a.meta else { panic!("#[path] without a value") };
        let syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Str(s), .. }) = &nv.value else { panic!("#[path] not a string") };
        s.value()
    })
}

/// Adds `file` and every file its `mod` lines reach to `seen`. `is_mod_rs`: a crate root or a
/// `mod.rs`, whose children lie beside it.
fn reach(file: &Path, is_mod_rs: bool, seen: &mut BTreeSet<PathBuf>) -> Result<(), String> {
    if !seen.insert(file.to_path_buf()) {
        return Ok(());
    }
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let parsed = syn::parse_file(&text).map_err(|e| format!("{}: {e}", file.display()))?;
    let here = file.parent().unwrap();
    let dir = if is_mod_rs { here.to_path_buf() } else { here.join(file.file_stem().unwrap()) };
    items(&parsed.items, &dir, here, file, seen)
}

/// The `mod` items of one module body. `dir`: where `mod x;` looks for `x.rs`; `path_dir`:
/// where a `#[path]` is relative to.
fn items(items: &[syn::Item], dir: &Path, path_dir: &Path, file: &Path, seen: &mut BTreeSet<PathBuf>) -> Result<(), String> {
    for item in items {
        let syn::Item::Mod(m) = item else { continue };
        let name = m.ident.to_string();
        match (&m.content, path_attr(&m.attrs)) {
            (Some((_, inner)), explicit) => {
                // An inline module: its children lie under its name (or its #[path] folder).
                let sub = explicit.map(|p| path_dir.join(p)).unwrap_or_else(|| dir.join(&name));
                self::items(inner, &sub, &sub, file, seen)?;
            }
            (None, Some(p)) => {
                let target = path_dir.join(p);
                let mod_rs = target.file_name().is_some_and(|f| f == "mod.rs");
                reach(&target, mod_rs, seen)?;
            }
            (None, None) => {
                let flat = dir.join(format!("{name}.rs"));
                let nested = dir.join(&name).join("mod.rs");
                match (flat.is_file(), nested.is_file()) {
                    (true, false) => reach(&flat, false, seen)?,
                    (false, true) => reach(&nested, true, seen)?,
                    (true, true) => {
                        return Err(format!(
                            "{}: `mod {name};` finds both {} and {}",
                            file.display(),
                            flat.display(),
                            nested.display()
                        ))
                    }
                    (false, false) => {
                        return Err(format!(
                            "{}: `mod {name};` finds neither {} nor {}",
                            file.display(),
                            flat.display(),
                            nested.display()
                        ))
                    }
                }
            }
        }
    }
    Ok(())
}

/// The `.rs` files of package `pkg` that no target compiles, relative to `pkg`.
fn uncompiled(pkg: &Path) -> Result<Vec<String>, String> {
    let mut seen = BTreeSet::new();
    for root in target_roots(pkg) {
        reach(&root, true, &mut seen)?;
    }
    let seen: BTreeSet<PathBuf> = seen.iter().map(|p| normalize(p)).collect();
    Ok(rust_files(pkg)
        .into_iter()
        .filter(|f| !seen.contains(&normalize(f)))
        .map(|f| f.strip_prefix(pkg).unwrap_or(&f).display().to_string())
        .collect())
}

/// `a/b/../c` -> `a/c` (a `#[path = "../common/mod.rs"]` leaves a `..`).
fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

#[test]
fn every_rust_file_of_every_package_is_compiled_by_some_target() {
    let mut problems = Vec::new();
    let mut merged = 0;
    for pkg in packages() {
        merged += target_roots(&pkg)
            .iter()
            .filter(|r| r.ends_with("main.rs") && r.parent().unwrap().parent().unwrap().ends_with("tests"))
            .count();
        match uncompiled(&pkg) {
            Ok(files) => problems.extend(files.into_iter().map(|f| {
                format!(
                    "{}: {f} is declared by no `mod` line of any target (add it to its binary's main.rs or lib.rs)",
                    pkg.strip_prefix(repo()).unwrap_or(&pkg).display()
                )
            })),
            Err(e) => problems.push(e),
        }
    }
    // The merged test binaries: the root's `repo` and one per crate that has integration tests.
    assert!(merged >= 6, "only {merged} merged test binaries (tests/<name>/main.rs) found");
    assert!(problems.is_empty(), "Rust files that nothing compiles:\n{}", problems.join("\n"));
}

/// The check itself, on a copy of the layouts it must handle: a merged test binary with a
/// file its `main.rs` declares, a nested module, a shared folder reached by `#[path]` and an
/// inline module; then a file nobody declares, which it must name.
#[test]
fn a_test_file_without_a_mod_line_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = dir.path();
    let write = |rel: &str, text: &str| {
        let p = pkg.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    write("src/lib.rs", "pub mod a;\nmod inline { mod deep; }\n");
    write("src/a.rs", "mod b;\n");
    write("src/a/b.rs", "");
    write("src/inline/deep.rs", "");
    write("tests/merged/main.rs", "#[path = \"../common/mod.rs\"]\nmod common;\nmod one;\nmod nested;\n");
    write("tests/merged/one.rs", "#[test]\nfn t() {}\n");
    write("tests/merged/nested/mod.rs", "mod leaf;\n");
    write("tests/merged/nested/leaf.rs", "");
    write("tests/common/mod.rs", "mod util;\n");
    write("tests/common/util.rs", "");
    write("tests/alone.rs", "");
    assert_eq!(uncompiled(pkg).unwrap(), Vec::<String>::new());

    write("tests/merged/forgotten.rs", "#[test]\nfn never_runs() { panic!() }\n");
    write("tests/merged/nested/stray.rs", "");
    write("src/orphan.rs", "");
    assert_eq!(uncompiled(pkg).unwrap(), ["src/orphan.rs", "tests/merged/forgotten.rs", "tests/merged/nested/stray.rs"]);

    // A `mod` line whose file is missing is an error naming it, not a pass.
    write("tests/merged/main.rs", "mod one;\nmod gone;\n");
    let e = uncompiled(pkg).unwrap_err();
    assert!(e.contains("tests/merged/main.rs: `mod gone;` finds neither"), "{e}");
}

/// Whether `tokens` read an environment variable whose name has `CHILD` in it
/// (`std::env::var("ALLGRAD_TEST_CHILD")`).
fn reads_a_child_variable(tokens: proc_macro2::TokenStream) -> bool {
    use proc_macro2::TokenTree;
    let trees: Vec<TokenTree> = tokens.into_iter().collect();
    trees.iter().enumerate().any(|(i, t)| match t {
        TokenTree::Group(g) => {
            let called = i > 0 && matches!(&trees[i - 1], TokenTree::Ident(id) if id == "var");
            let first = g.stream().into_iter().next().map(|t| t.to_string()).unwrap_or_default();
            (called && first.starts_with('"') && first.contains("CHILD")) || reads_a_child_variable(g.stream())
        }
        _ => false,
    })
}

/// A `#[test]` that does its work only when a test runs it again as a child process (it reads
/// an `..._CHILD` variable and returns without it) is a child helper, not a test: it is marked
/// `#[ignore = "child helper: ..."]`, so that it counts as no passed test (`.ci/run`'s summary
/// leaves such helpers out of every count), and the test that starts it runs it with
/// `--ignored` (or it would run nothing).
#[test]
fn child_helpers_are_ignored_and_run_with_ignored() {
    use quote::ToTokens;
    let mut problems = Vec::new();
    let mut helpers = 0;
    for pkg in packages() {
        for file in rust_files(&pkg).into_iter().filter(|f| f.strip_prefix(&pkg).unwrap().starts_with("tests")) {
            let text = std::fs::read_to_string(&file).unwrap();
            let parsed = syn::parse_file(&text).unwrap();
            let rel = file.strip_prefix(repo()).unwrap().display().to_string();
            for item in &parsed.items {
                let syn::Item::Fn(f) = item else { continue };
                if !f.attrs.iter().any(|a| a.path().is_ident("test")) || !reads_a_child_variable(f.block.to_token_stream()) {
                    continue;
                }
                helpers += 1;
                let name = f.sig.ident.to_string();
                let marked = f
                    .attrs
                    .iter()
                    .any(|a| a.path().is_ident("ignore") && a.to_token_stream().to_string().contains("\"child helper: "));
                if !marked {
                    problems.push(format!("{rel}: `{name}` is a child helper without #[ignore = \"child helper: ...\"]"));
                }
                if !text.contains(&format!("{name}\", \"--ignored\"")) {
                    problems.push(format!("{rel}: nothing in this file runs `{name}` with `--ignored`"));
                }
            }
        }
    }
    assert!(helpers >= 4, "only {helpers} child helpers found: is the scan broken?");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
