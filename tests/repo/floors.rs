//! Imports inside each crate go one way. Within every module, its child modules import each
//! other without a cycle: if `a` names anything of `b` (a `use`, a path in code or in a
//! macro's tokens, through `pub use` re-exports followed to where the item is defined), then
//! nothing under `b` names anything of `a`. And the top-level modules of each library crate sit
//! on the floors that ARCHITECTURE.md draws ("Floors inside the crates"): every module is
//! listed once, and each imports only from floors below its own.
//!
//! Test code (`#[cfg(test)]` items) is left out: a test may reach anywhere. A path is followed
//! by name through modules, item definitions, `use` declarations and glob imports, which is
//! all this code base needs; a name that cannot be followed further counts as defined where
//! the walk stopped. (No crate resolves a crate's module graph as a library without a whole
//! compiler front end, so the walk is written here over `syn`'s syntax tree.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use quote::ToTokens;
use syn::visit::Visit;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A module path from the crate root (`[]` is the root).
type ModPath = Vec<String>;

/// The imports between the children of one module: from -> to -> an example (file, path as
/// written).
type Edges = BTreeMap<String, BTreeMap<String, (String, String)>>;

/// One module as written: its children, what it defines and imports, and what it names.
#[derive(Default)]
struct Module {
    file: PathBuf,
    children: BTreeSet<String>,
    items: BTreeSet<String>,
    /// A name brought in by `use` -> the absolute path it stands for (in-crate imports only).
    uses: BTreeMap<String, ModPath>,
    globs: Vec<ModPath>,
    /// Absolute in-crate paths this module names, with the text as written.
    refs: Vec<(ModPath, String)>,
}

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg") && {
            let t = a.meta.to_token_stream().to_string().replace(' ', "");
            t == "cfg(test)" || t.starts_with("cfg(all(test,")
        }
    })
}

fn item_attrs(item: &syn::Item) -> &[syn::Attribute] {
    use syn::Item::*;
    match item {
        Const(i) => &i.attrs,
        Enum(i) => &i.attrs,
        ExternCrate(i) => &i.attrs,
        Fn(i) => &i.attrs,
        ForeignMod(i) => &i.attrs,
        Impl(i) => &i.attrs,
        Macro(i) => &i.attrs,
        Mod(i) => &i.attrs,
        Static(i) => &i.attrs,
        Struct(i) => &i.attrs,
        Trait(i) => &i.attrs,
        TraitAlias(i) => &i.attrs,
        Type(i) => &i.attrs,
        Union(i) => &i.attrs,
        Use(i) => &i.attrs,
        _ => &[],
    }
}

fn item_name(item: &syn::Item) -> Option<String> {
    use syn::Item::*;
    Some(
        match item {
            Const(i) => &i.ident,
            Enum(i) => &i.ident,
            Fn(i) => &i.sig.ident,
            Static(i) => &i.ident,
            Struct(i) => &i.ident,
            Trait(i) => &i.ident,
            TraitAlias(i) => &i.ident,
            Type(i) => &i.ident,
            Union(i) => &i.ident,
            Macro(i) => i.ident.as_ref()?,
            _ => return None,
        }
        .to_string(),
    )
}

/// Turns a path as written in module `at` into an absolute in-crate path, or `None` when it
/// leads outside the crate.
fn absolute(at: &[String], m: &Module, segs: &[String]) -> Option<ModPath> {
    let first = segs.first()?;
    match first.as_str() {
        "crate" => Some(segs[1..].to_vec()),
        "self" => Some(at.iter().chain(&segs[1..]).cloned().collect()),
        "super" => {
            let ups = segs.iter().take_while(|s| *s == "super").count();
            let base = at.len().checked_sub(ups)?;
            Some(at[..base].iter().chain(&segs[ups..]).cloned().collect())
        }
        _ if m.children.contains(first) => Some(at.iter().chain(segs).cloned().collect()),
        _ => m.uses.get(first).map(|p| p.iter().chain(&segs[1..]).cloned().collect()),
    }
}

/// Every leaf of a `use` tree: (name it binds or `*`, the path).
fn use_leaves(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<(String, Vec<String>)>) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_leaves(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => {
            let name = n.ident.to_string();
            if name == "self" {
                if let Some(last) = prefix.last() {
                    out.push((last.clone(), prefix.clone()));
                }
            } else {
                let mut p = prefix.clone();
                p.push(name.clone());
                out.push((name, p));
            }
        }
        syn::UseTree::Rename(r) => {
            let mut p = prefix.clone();
            if r.ident != "self" {
                p.push(r.ident.to_string());
            }
            out.push((r.rename.to_string(), p));
        }
        syn::UseTree::Glob(_) => out.push(("*".into(), prefix.clone())),
        syn::UseTree::Group(g) => {
            for t in &g.items {
                use_leaves(t, prefix, out);
            }
        }
    }
}

struct Crate {
    name: String,
    src: PathBuf,
    modules: BTreeMap<ModPath, Module>,
}

impl Crate {
    fn load(name: &str, src: &Path) -> Crate {
        let mut c = Crate { name: name.into(), src: src.into(), modules: BTreeMap::new() };
        let root = src.join("lib.rs");
        let file =
            syn::parse_file(&std::fs::read_to_string(&root).unwrap()).unwrap_or_else(|e| panic!("{}: {e}", root.display()));
        c.add(vec![], &root, src, &file.items);
        c
    }

    /// Reads module `at` (written in `file`, its out-of-line children under `dir`) and its
    /// children, recursively.
    fn add(&mut self, at: ModPath, file: &Path, dir: &Path, items: &[syn::Item]) {
        let items: Vec<&syn::Item> = items.iter().filter(|i| !is_cfg_test(item_attrs(i))).collect();
        let mut m = Module { file: file.into(), ..Default::default() };
        let mut nested = Vec::new();
        for item in &items {
            if let syn::Item::Mod(md) = item {
                let name = md.ident.to_string();
                m.children.insert(name.clone());
                nested.push((name, md));
            } else if let Some(n) = item_name(item) {
                m.items.insert(n);
            }
        }
        for item in &items {
            if let syn::Item::Use(u) = item {
                let mut leaves = Vec::new();
                use_leaves(&u.tree, &mut Vec::new(), &mut leaves);
                for (name, path) in leaves {
                    let Some(abs) = absolute(&at, &m, &path) else { continue };
                    m.refs.push((abs.clone(), path.join("::")));
                    if name == "*" {
                        m.globs.push(abs);
                    } else {
                        m.uses.insert(name, abs);
                    }
                }
            }
        }
        let mut v = Refs { at: &at, m: &m, found: Vec::new() };
        for item in &items {
            match item {
                syn::Item::Mod(_) | syn::Item::Use(_) => {}
                _ => v.visit_item(item),
            }
        }
        let found = std::mem::take(&mut v.found);
        m.refs.extend(found);
        self.modules.insert(at.clone(), m);
        for (name, md) in nested {
            let mut child = at.clone();
            child.push(name.clone());
            match &md.content {
                Some((_, inner)) => self.add(child, file, &dir.join(&name), inner),
                None => {
                    let explicit = md.attrs.iter().find(|a| a.path().is_ident("path")).map(|a| {
                        let syn::Meta::NameValue(nv) = &a.meta else { panic!("#[path] without a value") };
                        let syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Str(s), .. }) = &nv.value else {
                            panic!("#[path] not a string")
                        };
                        file.parent().unwrap().join(s.value())
                    });
                    let (path, child_dir) = match explicit {
                        Some(p) => {
                            let d = p.with_extension("");
                            (p, d)
                        }
                        None if dir.join(format!("{name}.rs")).exists() => (dir.join(format!("{name}.rs")), dir.join(&name)),
                        None => (dir.join(&name).join("mod.rs"), dir.join(&name)),
                    };
                    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                    let parsed = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                    self.add(child, &path, &child_dir, &parsed.items);
                }
            }
        }
    }

    /// The module that defines what `path` names (following re-exports), or `None` outside
    /// the crate.
    fn resolve(&self, path: &[String], depth: usize) -> Option<ModPath> {
        if depth > 32 {
            return None;
        }
        let mut at: ModPath = Vec::new();
        for (i, seg) in path.iter().enumerate() {
            let m = self.modules.get(&at)?;
            if m.children.contains(seg) {
                at.push(seg.clone());
                continue;
            }
            if m.items.contains(seg) {
                return Some(at);
            }
            if let Some(target) = m.uses.get(seg) {
                let p: ModPath = target.iter().chain(&path[i + 1..]).cloned().collect();
                if p != path {
                    return self.resolve(&p, depth + 1);
                }
            }
            for g in &m.globs {
                let names_it = self
                    .modules
                    .get(g)
                    .is_some_and(|gm| gm.children.contains(seg) || gm.items.contains(seg) || gm.uses.contains_key(seg));
                if names_it && g.as_slice() != &at[..] {
                    let p: ModPath = g.iter().chain(&path[i..]).cloned().collect();
                    return self.resolve(&p, depth + 1);
                }
            }
            return Some(at);
        }
        Some(at)
    }

    fn rel(&self, file: &Path) -> String {
        file.strip_prefix(self.src.parent().unwrap()).unwrap_or(file).display().to_string()
    }

    /// For every module, the import graph between its children: parent -> (from -> to ->
    /// an example (file, path as written)).
    fn sibling_edges(&self) -> BTreeMap<ModPath, Edges> {
        let mut out: BTreeMap<ModPath, Edges> = BTreeMap::new();
        for (at, m) in &self.modules {
            for (path, text) in &m.refs {
                let Some(target) = self.resolve(path, 0) else { continue };
                let k = at.iter().zip(&target).take_while(|(a, b)| a == b).count();
                if k < at.len() && k < target.len() {
                    out.entry(at[..k].to_vec())
                        .or_default()
                        .entry(at[k].clone())
                        .or_default()
                        .entry(target[k].clone())
                        .or_insert_with(|| (self.rel(&m.file), text.clone()));
                }
            }
        }
        out
    }
}

/// Collects paths that start with `crate`, `super` or `self`, or with a name the module
/// imported, from code and from macro tokens.
struct Refs<'a> {
    at: &'a [String],
    m: &'a Module,
    found: Vec<(ModPath, String)>,
}

impl Refs<'_> {
    fn note(&mut self, segs: Vec<String>) {
        if segs.len() < 2 && !segs.first().is_some_and(|s| self.m.uses.contains_key(s)) {
            return;
        }
        if let Some(abs) = absolute(self.at, self.m, &segs) {
            self.found.push((abs, segs.join("::")));
        }
    }

    fn scan_tokens(&mut self, tokens: proc_macro2::TokenStream) {
        use proc_macro2::TokenTree;
        let trees: Vec<TokenTree> = tokens.into_iter().collect();
        let mut i = 0;
        while i < trees.len() {
            match &trees[i] {
                TokenTree::Group(g) => self.scan_tokens(g.stream()),
                TokenTree::Ident(id) if ["crate", "super", "self"].contains(&id.to_string().as_str()) => {
                    let mut segs = vec![id.to_string()];
                    let mut j = i + 1;
                    loop {
                        let colons = matches!((trees.get(j), trees.get(j + 1)),
                            (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b))) if a.as_char() == ':' && b.as_char() == ':');
                        match (colons, trees.get(j + 2)) {
                            (true, Some(TokenTree::Ident(next))) => {
                                segs.push(next.to_string());
                                j += 3;
                            }
                            _ => break,
                        }
                    }
                    self.note(segs);
                    i = j;
                    continue;
                }
                _ => {}
            }
            i += 1;
        }
    }
}

impl<'ast> Visit<'ast> for Refs<'_> {
    fn visit_path(&mut self, p: &'ast syn::Path) {
        if p.leading_colon.is_none() {
            self.note(p.segments.iter().map(|s| s.ident.to_string()).collect());
        }
        syn::visit::visit_path(self, p);
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        let mut leaves = Vec::new();
        use_leaves(&u.tree, &mut Vec::new(), &mut leaves);
        for (_, path) in leaves {
            self.note(path);
        }
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        self.visit_path(&m.path);
        self.scan_tokens(m.tokens.clone());
    }

    fn visit_item_mod(&mut self, _: &'ast syn::ItemMod) {}

    fn visit_attribute(&mut self, _: &'ast syn::Attribute) {}
}

/// Strongly connected components of more than one node (Tarjan).
fn cycles(edges: &Edges) -> Vec<Vec<String>> {
    struct T<'a> {
        edges: &'a Edges,
        index: BTreeMap<String, usize>,
        low: BTreeMap<String, usize>,
        stack: Vec<String>,
        on: BTreeSet<String>,
        out: Vec<Vec<String>>,
    }
    impl T<'_> {
        fn go(&mut self, v: &str) {
            let n = self.index.len();
            self.index.insert(v.into(), n);
            self.low.insert(v.into(), n);
            self.stack.push(v.into());
            self.on.insert(v.into());
            let next: Vec<String> = self.edges.get(v).map(|e| e.keys().cloned().collect()).unwrap_or_default();
            for w in next {
                if w == v {
                    continue;
                }
                if !self.index.contains_key(&w) {
                    self.go(&w);
                    let l = self.low[&w].min(self.low[v]);
                    self.low.insert(v.into(), l);
                } else if self.on.contains(&w) {
                    let l = self.index[&w].min(self.low[v]);
                    self.low.insert(v.into(), l);
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                loop {
                    let w = self.stack.pop().unwrap();
                    self.on.remove(&w);
                    let done = w == v;
                    comp.push(w);
                    if done {
                        break;
                    }
                }
                if comp.len() > 1 {
                    comp.sort();
                    self.out.push(comp);
                }
            }
        }
    }
    let mut t =
        T { edges, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), on: BTreeSet::new(), out: Vec::new() };
    let nodes: Vec<String> = edges.keys().cloned().collect();
    for v in nodes {
        if !t.index.contains_key(&v) {
            t.go(&v);
        }
    }
    t.out
}

/// Every library crate of the workspace: (package name, its `src`).
fn crates() -> Vec<(String, PathBuf)> {
    let mut out = vec![("allgrad".to_string(), repo().join("src"))];
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(repo().join("crates")).unwrap().flatten().map(|e| e.path()).collect();
    dirs.sort();
    for d in dirs {
        if d.join("src/lib.rs").exists() {
            out.push((d.file_name().unwrap().to_string_lossy().into_owned(), d.join("src")));
        }
    }
    out
}

fn describe(c: &Crate, parent: &ModPath, comp: &[String], edges: &Edges) -> String {
    let set: BTreeSet<&String> = comp.iter().collect();
    let mut s = format!(
        "{}: in `{}`, these modules import each other: {}\n",
        c.name,
        if parent.is_empty() { "crate".to_string() } else { parent.join("::") },
        comp.join(", ")
    );
    for a in comp {
        for (b, (file, text)) in &edges[a] {
            if set.contains(b) {
                s += &format!("    {a} -> {b}: {file} names `{text}`\n");
            }
        }
    }
    s
}

#[test]
fn no_module_imports_another_that_imports_it_back() {
    let mut problems = String::new();
    for (name, src) in crates() {
        let c = Crate::load(&name, &src);
        for (parent, edges) in c.sibling_edges() {
            for comp in cycles(&edges) {
                problems += &describe(&c, &parent, &comp, &edges);
            }
        }
    }
    assert!(problems.is_empty(), "import cycles inside crates:\n{problems}");
}

/// The floors ARCHITECTURE.md draws for each crate: crate -> floor number -> modules, read
/// from the fenced block under "Floors inside the crates" (lines `crate-name:` then
/// `  N  module module ...`).
fn drawn_floors() -> BTreeMap<String, BTreeMap<String, usize>> {
    let text = std::fs::read_to_string(repo().join("ARCHITECTURE.md")).unwrap();
    let section =
        text.split("## Floors inside the crates").nth(1).expect("ARCHITECTURE.md: no section \"Floors inside the crates\"");
    let block = section.split("```").nth(1).expect("the floors section has no fenced block");
    let mut out: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    let mut current = None;
    for line in block.lines().skip(1) {
        let t = line.trim();
        if t.is_empty() {
            continue;
        }
        if let Some(name) = t.strip_suffix(':') {
            current = Some(name.to_string());
            out.entry(name.to_string()).or_default();
            continue;
        }
        let krate = current.clone().unwrap_or_else(|| panic!("ARCHITECTURE.md floors: `{t}` before any crate name"));
        let mut words = t.split_whitespace();
        let floor: usize = words
            .next()
            .unwrap()
            .parse()
            .unwrap_or_else(|_| panic!("ARCHITECTURE.md floors: `{t}` does not start with a floor number"));
        for w in words {
            let prev = out.get_mut(&krate).unwrap().insert(w.to_string(), floor);
            assert!(prev.is_none(), "ARCHITECTURE.md floors: {krate}: `{w}` drawn twice");
        }
    }
    out
}

#[test]
fn architecture_draws_every_module_on_a_floor_above_what_it_imports() {
    let drawn = drawn_floors();
    let mut problems = String::new();
    for (name, src) in crates() {
        let c = Crate::load(&name, &src);
        let top = &c.modules[&Vec::new()].children;
        if top.len() < 2 {
            continue;
        }
        let Some(floors) = drawn.get(&name) else {
            problems += &format!("{name}: not drawn\n");
            continue;
        };
        for m in top {
            if !floors.contains_key(m) {
                problems += &format!("{name}: module `{m}` is on no floor\n");
            }
        }
        for m in floors.keys() {
            if !top.contains(m) {
                problems += &format!("{name}: `{m}` is drawn but is no module of the crate\n");
            }
        }
        let edges = c.sibling_edges();
        for (a, targets) in edges.get(&Vec::new()).into_iter().flatten() {
            for (b, (file, text)) in targets {
                if let (Some(fa), Some(fb)) = (floors.get(a), floors.get(b)) {
                    if fa <= fb {
                        problems += &format!("{name}: `{a}` (floor {fa}) imports `{b}` (floor {fb}): {file} names `{text}`\n");
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "ARCHITECTURE.md's floors do not match the code:\n{problems}");
}

// ------------------------------------------------------------ positive controls

/// Writes a small crate under a fresh temporary folder: `files` are (path under `src/`, text).
fn fixture_crate(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (path, text) in files {
        let p = dir.path().join("src").join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
    }
    dir
}

/// The walk finds a cycle planted through each way a module can name another: a `use`, a path
/// in code, a path in a macro's tokens, a `pub use` re-export followed to its definition, a
/// glob import, `super::`; one at the crate's top and one between the files of a folder. A
/// module that imports into the cycle without being imported back is left out of it.
#[test]
fn a_planted_cycle_in_a_fixture_crate_is_found_with_its_files_and_paths() {
    let dir = fixture_crate(&[
        ("lib.rs", "mod a;\nmod b;\nmod c;\nmod d;\nmod nest;\npub use c::Gamma;\n"),
        // a -> b by a `use`.
        ("a.rs", "use crate::b::Beta;\npub struct Alpha;\npub fn f(_: Beta) {}\n"),
        // b -> c through the crate root's re-export of `c::Gamma`.
        ("b.rs", "pub struct Beta;\npub fn g() -> crate::Gamma { todo!() }\n"),
        // c -> a inside a macro's tokens, by `super::`.
        ("c.rs", "pub struct Gamma;\npub fn h() { let _ = format!(\"{}\", std::mem::size_of::<super::a::Alpha>()); }\n"),
        // d -> a only: outside the cycle.
        ("d.rs", "use crate::a::Alpha;\npub fn k(_: Alpha) {}\n"),
        // Inside `nest`: p -> q by a path in code, q -> p through a glob import.
        ("nest/mod.rs", "mod p;\nmod q;\n"),
        ("nest/p.rs", "pub struct P;\npub fn m() { let _ = super::q::Q; }\n"),
        ("nest/q.rs", "use super::p::*;\npub struct Q;\npub fn n() { let _ = P; }\n"),
    ]);
    let c = Crate::load("fixture", &dir.path().join("src"));
    let edges = c.sibling_edges();
    let root = &edges[&Vec::new()];
    let found: Vec<Vec<String>> = cycles(root);
    assert_eq!(found, vec![vec!["a".to_string(), "b".into(), "c".into()]], "top-level edges: {root:?}");
    let text = describe(&c, &Vec::new(), &found[0], root);
    for line in [
        "fixture: in `crate`, these modules import each other: a, b, c",
        "    a -> b: src/a.rs names `crate::b::Beta`",
        "    b -> c: src/b.rs names `crate::Gamma`",
        "    c -> a: src/c.rs names `super::a::Alpha`",
    ] {
        assert!(text.lines().any(|l| l == line), "missing `{line}` in:\n{text}");
    }
    assert_eq!(root["d"].keys().collect::<Vec<_>>(), ["a"], "d's edges");

    let nest = &edges[&vec!["nest".to_string()]];
    assert_eq!(cycles(nest), vec![vec!["p".to_string(), "q".into()]], "edges inside nest: {nest:?}");
    assert_eq!(nest["p"]["q"], ("src/nest/p.rs".to_string(), "super::q::Q".to_string()));
    assert_eq!(nest["q"]["p"].0, "src/nest/q.rs");

    // The same crate with the back edges taken out has no cycle: the walk does not find
    // cycles everywhere.
    std::fs::write(dir.path().join("src/c.rs"), "pub struct Gamma;\n").unwrap();
    std::fs::write(dir.path().join("src/nest/q.rs"), "pub struct Q;\n").unwrap();
    let c = Crate::load("fixture", &dir.path().join("src"));
    let edges = c.sibling_edges();
    assert!(edges.values().all(|e| cycles(e).is_empty()), "{:?}", edges);
    assert!(edges[&Vec::new()]["b"].contains_key("c"), "b -> c through the re-export");
}

/// Imports that can be read in allgrad-dist's source are found, so a walk that resolved none
/// (and would pass both checks above) fails here: `group` names `crate::rendezvous::env::WorldInfo`
/// (a top-level edge, floor 5 onto floor 3), and inside `rendezvous` `agent` imports `store`
/// and `env` imports `elastic`.
#[test]
fn known_imports_of_the_real_crates_are_found() {
    let c = Crate::load("allgrad-dist", &repo().join("crates/allgrad-dist/src"));
    let edges = c.sibling_edges();
    let edge = |parent: &[&str], from: &str, to: &str| {
        let parent: ModPath = parent.iter().map(|s| s.to_string()).collect();
        edges.get(&parent).and_then(|e| e.get(from)).and_then(|t| t.get(to)).cloned().unwrap_or_else(|| {
            panic!("allgrad-dist: no edge {from} -> {to} under {parent:?}; edges there: {:?}", edges.get(&parent))
        })
    };
    let (file, _) = edge(&[], "group", "rendezvous");
    assert!(file.starts_with("src/group/"), "{file}");
    assert_eq!(
        edge(&["rendezvous"], "agent", "store"),
        ("src/rendezvous/agent.rs".into(), "crate::rendezvous::store::StoreServer".into())
    );
    assert_eq!(
        edge(&["rendezvous"], "env", "elastic"),
        ("src/rendezvous/env.rs".into(), "crate::rendezvous::elastic::Elastic".into())
    );
    // And across the workspace the walk sees many edges, not a handful.
    let total: usize = crates()
        .iter()
        .map(|(name, src)| {
            Crate::load(name, src).sibling_edges().values().flat_map(|e| e.values()).map(|t| t.len()).sum::<usize>()
        })
        .sum();
    assert!(total > 200, "only {total} edges between sibling modules in the whole workspace");
}
