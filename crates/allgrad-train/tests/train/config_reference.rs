//! `docs/configuration.md` cannot go stale: every key of a resolved run config (what
//! `train --print-config` prints, every default filled in) is documented there, in the part
//! for its owner (the trainer's parts, or a part whose heading names the method), and every
//! key path the reference quotes is one that a config has.
//!
//! The configs are the shipped ones in `configs/` and variants of them that reach the kinds
//! those do not use (optimizers, losses, data formats, face data, models and margins, gradient
//! caching, bf16 precision).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use allgrad_train::method::Registry;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Dotted paths the reference may quote although no config has them, each with its reason.
const NOT_KEYS: &[(&str, &str)] = &[
    ("loss.png", "the plot a run writes (`log.plot`), a file name"),
    ("model.safetensors", "the weights file of a `model.dir` folder, a file name"),
    ("train.rec", "the records of a RecordIO set in `data.dir`, a file name"),
    ("train.idx", "the index of a RecordIO set in `data.dir`, a file name"),
];

/// The shipped configs, each as it is, then the variants: (config file, `--set` arguments).
fn configs() -> Vec<(PathBuf, Vec<String>)> {
    let dir = repo().join("configs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 6, "expected the shipped configs in {}, found {files:?}", dir.display());
    let mut out: Vec<(PathBuf, Vec<String>)> = files.into_iter().map(|f| (f, Vec::new())).collect();
    let variants: &[(&str, &[&str])] = &[
        ("vectors.yaml", &["optim={kind: sgd, lr: 0.1}"]),
        ("vectors.yaml", &["optim={kind: adamw, lr: 0.001}"]),
        ("vectors.yaml", &["optim={kind: lars, lr: 0.3}"]),
        ("vectors.yaml", &["loss={kind: cross_correlation}", "schedule.decay=linear"]),
        ("vectors.yaml", &["train.cache_chunk=16", "train.accumulate=2", "train.max_steps=4"]),
        ("vectors.yaml", &["train.clip_grad_norm=1.0", "train.on_nonfinite=skip", "log.progress=quiet"]),
        ("vectors.yaml", &["dtype=f64", "device=cpu", "schedule.decay=constant"]),
        ("simclr.yaml", &["precision=bf16"]),
        ("vectors.yaml", &["dist={cuda_collectives: host, device_ids: [0, 0]}"]),
        ("simclr.yaml", &["data.format=cifar10", "data.augment.crop=null"]),
        ("simclr.yaml", &["data.format=folder", "data.folder={color: gray, skip_corrupt: true}"]),
        ("simclr.yaml", &["model.encoder.stem=imagenet", "model.encoder.depth=50"]),
        ("simclr.yaml", &["loss=null"]),
        ("simclr.yaml", &["loss={kind: nt_xent, temperature: 0.2, tile: 64, queue: 2}"]),
        ("barlowtwins.yaml", &["loss=null", "data.loader={workers: 0}"]),
        ("simcse.yaml", &["eval.sts=sts-b.tsv", "model.pooling=cls"]),
        ("simcse.yaml", &["loss={temperature: 0.05, tile: 16, queue: 1}"]),
        ("clip.yaml", &["eval.images=test-images", "eval.classes=[[boot, ankle boot], [bag]]"]),
        ("face.yaml", &["head.margin={kind: arcface}"]),
        ("face.yaml", &["head.update=dense", "head.unsampled=frozen"]),
        ("face.yaml", &["head.storage=bf16"]),
        ("face.yaml", &["head.margin={kind: combined, m2: 0.3, m3: 0.1}"]),
        ("face.yaml", &["data={kind: synthetic, samples: 512, dim: 16}", "model={kind: linear, embedding: 32}"]),
        ("face.yaml", &["model={kind: iresnet, depth: 50, in_channels: 1, input_size: 32}"]),
        ("face.yaml", &["model={kind: mobilefacenet, in_channels: 1, input_size: 32}"]),
    ];
    for (file, sets) in variants {
        out.push((dir.join(file), sets.iter().map(|s| s.to_string()).collect()));
    }
    out
}

/// Every dotted key path of `value` (mappings descended, sequences not), sections included.
fn key_paths(value: &serde_yaml::Value, prefix: &str, out: &mut BTreeSet<String>) {
    let Some(map) = value.as_mapping() else { return };
    for (k, v) in map {
        let k = k.as_str().unwrap_or_else(|| panic!("a non-string key {k:?} under `{prefix}`"));
        let path = if prefix.is_empty() { k.to_string() } else { format!("{prefix}.{k}") };
        key_paths(v, &path, out);
        out.insert(path);
    }
}

/// The keys the configs have: the trainer's, and each method's.
struct Keys {
    trainer: BTreeSet<String>,
    by_method: BTreeMap<String, BTreeSet<String>>,
}

impl Keys {
    fn all(&self) -> BTreeSet<&str> {
        self.trainer.iter().chain(self.by_method.values().flatten()).map(String::as_str).collect()
    }

    /// The top-level keys (the sections).
    fn sections(&self) -> BTreeSet<&str> {
        self.all().into_iter().filter(|k| !k.contains('.')).collect()
    }
}

fn resolved_keys() -> Keys {
    let registry = Registry::builtin();
    let mut keys = Keys { trainer: BTreeSet::new(), by_method: BTreeMap::new() };
    for (file, sets) in configs() {
        let what = format!("{} with {sets:?}", file.display());
        let yaml = registry.resolved_yaml(&file, &sets).unwrap_or_else(|e| panic!("{what}: {e}"));
        let value: serde_yaml::Value = serde_yaml::from_str(&yaml).unwrap_or_else(|e| panic!("{what}: {e}\n{yaml}"));
        // The trainer's top-level keys: the config without the method's sections.
        let mut cfg = registry.load(&file, &sets).unwrap();
        cfg.sections_mut().clear();
        let trainer_value: serde_yaml::Value = serde_yaml::from_str(&cfg.to_yaml()).unwrap();
        let trainer_sections: BTreeSet<String> =
            trainer_value.as_mapping().unwrap().keys().map(|k| k.as_str().unwrap().to_string()).collect();
        let mut paths = BTreeSet::new();
        key_paths(&value, "", &mut paths);
        for path in paths {
            let section = path.split('.').next().unwrap();
            if trainer_sections.contains(section) {
                keys.trainer.insert(path);
            } else {
                keys.by_method.entry(cfg.method.clone()).or_default().insert(path);
            }
        }
    }
    let names = registry.names();
    for m in &names {
        assert!(keys.by_method.contains_key(*m), "no config reaches method `{m}`: add a variant that uses it");
    }
    keys
}

/// The inline code spans of a Markdown text, outside fenced blocks.
fn code_spans(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut parts = line.split('`');
        parts.next();
        while let Some(span) = parts.next() {
            out.insert(span.to_string());
            parts.next();
        }
    }
    out
}

/// A `## ` part of the reference: the methods its heading names, and its code spans.
struct Part {
    heading: String,
    methods: BTreeSet<String>,
    spans: BTreeSet<String>,
}

const REFERENCE: &str = "docs/configuration.md";

fn reference() -> String {
    std::fs::read_to_string(repo().join(REFERENCE)).unwrap_or_else(|e| panic!("{REFERENCE}: {e}"))
}

/// The reference's `## ` parts (the text before the first one is not a part).
fn parts(text: &str, methods: &[&str]) -> Vec<Part> {
    let mut chunks: Vec<(String, String)> = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        if !fenced && line.starts_with("## ") {
            chunks.push((line[3..].trim().to_string(), String::new()));
        } else if let Some((_, body)) = chunks.last_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    chunks
        .into_iter()
        .map(|(heading, body)| {
            let named = code_spans(&heading);
            let methods = methods.iter().filter(|m| named.contains(**m)).map(|m| m.to_string()).collect();
            Part { spans: code_spans(&format!("{heading}\n{body}")), heading, methods }
        })
        .collect()
}

/// A span shaped like a dotted key path: `a.b`, `a.b_c.d`.
fn is_dotted_key(span: &str) -> bool {
    let segments: Vec<&str> = span.split('.').collect();
    segments.len() >= 2
        && segments.iter().all(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
}

#[test]
fn every_key_of_a_resolved_config_is_documented_in_the_part_of_its_owner() {
    let keys = resolved_keys();
    let registry = Registry::builtin();
    let names = registry.names();
    let parts = parts(&reference(), &names);
    assert!(!parts.is_empty(), "{REFERENCE} has no `## ` parts");
    let trainer_parts: Vec<&Part> = parts.iter().filter(|p| p.methods.is_empty()).collect();
    let mut missing = Vec::new();
    for key in &keys.trainer {
        if !trainer_parts.iter().any(|p| p.spans.contains(key)) {
            missing.push(format!("`{key}` (the trainer's: in a part whose heading names no method)"));
        }
    }
    for (method, method_keys) in &keys.by_method {
        let own: Vec<&Part> = parts.iter().filter(|p| p.methods.contains(method)).collect();
        for key in method_keys {
            if !own.iter().any(|p| p.spans.contains(key)) {
                let headings: Vec<&str> = own.iter().map(|p| p.heading.as_str()).collect();
                missing.push(format!("`{key}` of method `{method}` (in a part whose heading names `{method}`: {headings:?})"));
            }
        }
    }
    let documented = keys.trainer.len() + keys.by_method.values().map(BTreeSet::len).sum::<usize>() - missing.len();
    assert!(
        missing.is_empty(),
        "{} config key(s) are not documented in {REFERENCE}; document each as `key.path` (its type, default, \
         meaning and constraints) in the part named:\n{}\n({documented} are)",
        missing.len(),
        missing.join("\n")
    );
}

#[test]
fn every_key_path_the_reference_quotes_is_a_key_of_a_config() {
    let keys = resolved_keys();
    let all = keys.all();
    let sections = keys.sections();
    let registry = Registry::builtin();
    let names = registry.names();
    let text = reference();
    let not_keys: BTreeSet<&str> = NOT_KEYS.iter().map(|(k, _)| *k).collect();
    let spans = code_spans(&text);
    let mut stale = Vec::new();
    for span in &spans {
        let first = span.split('.').next().unwrap();
        if is_dotted_key(span) && sections.contains(first) && !all.contains(span.as_str()) && !not_keys.contains(span.as_str()) {
            stale.push(format!("`{span}`"));
        }
    }
    // Within a method's part, a key of a method section must be one of that method's keys.
    for part in parts(&text, &names).iter().filter(|p| !p.methods.is_empty()) {
        let own: BTreeSet<&str> = part.methods.iter().flat_map(|m| &keys.by_method[m]).map(String::as_str).collect();
        for span in &part.spans {
            let first = span.split('.').next().unwrap();
            let method_section = sections.contains(first) && !keys.trainer.contains(first);
            if is_dotted_key(span) && method_section && all.contains(span.as_str()) && !own.contains(span.as_str()) {
                stale.push(format!("`{span}` in part {:?}: not a key of {:?}", part.heading, part.methods));
            }
        }
    }
    for (k, _) in NOT_KEYS {
        assert!(!all.contains(k), "`{k}` is a config key now: remove it from NOT_KEYS");
        assert!(spans.contains(*k), "{REFERENCE} no longer quotes `{k}`: remove it from NOT_KEYS");
    }
    assert!(
        stale.is_empty(),
        "{REFERENCE} quotes key paths that no config has, or that the methods of the part do not have (removed, \
         renamed or misplaced keys: update, move or remove them, or add the span to NOT_KEYS with a reason):\n{}",
        stale.join("\n")
    );
}
