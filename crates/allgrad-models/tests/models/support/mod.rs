//! Shared by the tests: the committed tiny BERT (written by scripts/reference/ref_bert.py), here,
//! and the face head's set-up ([`face`]).

#![allow(dead_code)]

pub mod face;

use std::path::PathBuf;

/// The folder of the tiny test BERT (2 layers, hidden 32, 4 heads, word-level vocabulary).
pub fn tiny_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny-bert")
}

/// The all-MiniLM-L6-v2 folder, when scripts/data/get_minilm.sh has fetched it.
pub fn minilm_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/models/all-MiniLM-L6-v2");
    dir.join("model.safetensors").exists().then_some(dir)
}

/// Sentences of the tiny model's vocabulary (plus unknown words), one past max_len 16.
pub const TINY_SENTENCES: [&str; 5] = [
    "The cat sat on the mat.",
    "a dog ran",
    "Blue birds sing under the big tree and the sun is very quiet",
    "rain",
    "the small red house was over the park and the dog ran fast and slow and loud under the tree",
];
