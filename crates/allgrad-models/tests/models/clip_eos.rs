//! Where CLIP's text tower pools, as `transformers` 5.24's `CLIPTextTransformer` does
//! (`modeling_clip.py`): `eos_token_id` absent means 49407; the legacy 2 means the largest id
//! of each sequence; any other id its first occurrence. Where `transformers` would pool a
//! sequence without that token silently at position 0, allgrad stops with an error naming
//! it, and a tokenizer that does not end captions with the end-of-text token is refused.

use std::path::{Path, PathBuf};

use allgrad_models::clip::{ClipConfig, ClipFolder, TextPooling, LEGACY_EOS, OPENAI_EOT};
use candle_core::{DType, Device};

fn tiny() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/clip-tiny"))
}

/// `data/clip-tiny`'s config.json with `text_config` edited by `edit`.
fn config_with(edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> String {
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(tiny().join("config.json")).unwrap()).unwrap();
    edit(v["text_config"].as_object_mut().unwrap());
    v.to_string()
}

/// A copy of `data/clip-tiny` whose config.json is `config`.
fn folder_with(config: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json", "model.safetensors"] {
        std::fs::copy(tiny().join(f), dir.path().join(f)).unwrap();
    }
    std::fs::write(dir.path().join("config.json"), config).unwrap();
    dir
}

fn error_of<T>(r: candle_core::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn eos_token_id_defaults_to_49407_and_selects_transformers_pooling() {
    let absent = ClipConfig::from_json(&config_with(|t| {
        t.remove("eos_token_id");
    }))
    .unwrap();
    assert_eq!(absent.text_config.eos_token_id, OPENAI_EOT, "transformers' CLIPTextConfig default");
    assert_eq!(absent.text_pooling(), TextPooling::FirstOf(49407));
    let legacy = ClipConfig::from_json(&config_with(|t| {
        t.insert("eos_token_id".into(), LEGACY_EOS.into());
    }))
    .unwrap();
    assert_eq!(legacy.text_pooling(), TextPooling::LargestId);
    let listed = ClipConfig::from_json(&config_with(|t| {
        t.insert("eos_token_id".into(), serde_json::json!([706]));
    }))
    .unwrap();
    assert_eq!(listed.text_pooling(), TextPooling::FirstOf(706), "a one-id list, as transformers accepts");
    let null = ClipConfig::from_json(&config_with(|t| {
        t.insert("eos_token_id".into(), serde_json::Value::Null);
    }))
    .unwrap_err();
    assert!(null.contains("eos_token_id null"), "{null}");

    // The positions: first occurrence (padding with the same id after it), largest id (its
    // first position), and the error for a sequence without the token.
    let ids = vec![vec![49406, 7, 49407, 49407], vec![49406, 49407]];
    assert_eq!(TextPooling::FirstOf(49407).positions(&ids, 4).unwrap(), vec![2, 1]);
    let ids = vec![vec![5, 900, 3, 900], vec![1, 2, 3]];
    assert_eq!(TextPooling::LargestId.positions(&ids, 4).unwrap(), vec![1, 2]);
    let e = error_of(TextPooling::FirstOf(706).positions(&[vec![705, 706], vec![705, 320, 5]], 3));
    assert!(e.contains("sequence 1 (3 tokens) has no end-of-text token (eos_token_id 706)"), "{e}");
    assert_eq!(TextPooling::Last.positions(&[vec![1], vec![1, 2]], 16).unwrap(), vec![15, 15]);
}

#[test]
fn a_sequence_without_the_end_of_text_token_is_an_error_not_pooled_at_position_0() {
    let f = ClipFolder::open(&tiny()).unwrap();
    let model = f.model(DType::F32, &Device::Cpu).unwrap();
    // clip-tiny's eos_token_id is 706: the second caption lacks it.
    let e = error_of(model.text.forward(&[vec![705, 320, 706], vec![705, 320, 670]], 706, &Device::Cpu));
    assert!(e.contains("sequence 1 (3 tokens) has no end-of-text token (eos_token_id 706)"), "{e}");
    assert!(model.text.forward(&[vec![705, 320, 706]], 706, &Device::Cpu).is_ok());
}

fn tokenizer_error(dir: &Path) -> String {
    error_of(ClipFolder::open(dir).unwrap().tokenizer(16))
}

#[test]
fn a_tokenizer_without_the_end_of_text_token_is_refused_with_what_is_missing() {
    // An id outside the tokenizer's vocabulary.
    let dir = folder_with(&config_with(|t| {
        t.insert("eos_token_id".into(), 5000.into());
    }));
    let e = tokenizer_error(dir.path());
    assert!(e.contains("has no token of id 5000 (text_config.eos_token_id)"), "{e}");
    // A token of the vocabulary that the tokenizer does not append.
    let dir = folder_with(&config_with(|t| {
        t.insert("eos_token_id".into(), 320.into());
    }));
    let e = tokenizer_error(dir.path());
    assert!(e.contains("does not end a caption with the end-of-text token") && e.contains("(id 320)"), "{e}");
    // Neither eos_token_id nor a vocabulary of OpenAI's size: the default 49407 is not there.
    let dir = folder_with(&config_with(|t| {
        t.remove("eos_token_id");
    }));
    let e = tokenizer_error(dir.path());
    assert!(e.contains("has no token of id 49407"), "{e}");
    // The legacy 2 works on clip-tiny (<|endoftext|> is its largest id) and pools there.
    let dir = folder_with(&config_with(|t| {
        t.insert("eos_token_id".into(), 2.into());
    }));
    let f = ClipFolder::open(dir.path()).unwrap();
    let tok = f.tokenizer(16).unwrap();
    let ids = tok.encode("a photo of a sneaker.").unwrap();
    assert_eq!(*ids.last().unwrap(), 706);
    assert_eq!(tok.pad_id(), 706);
    // And a caption cut at max_len still ends with it.
    let cut = f.tokenizer(4).unwrap().encode("a black and white photo of the dress").unwrap();
    assert_eq!(cut, vec![705, 320, 587, 706]);
}
