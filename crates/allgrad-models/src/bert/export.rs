//! Writing a trained encoder as a Hugging Face folder that `transformers.AutoModel` and
//! `sentence-transformers` load unchanged: `config.json`, `model.safetensors` (Hugging Face
//! names, f32), the tokenizer files, and sentence-transformers' `modules.json`,
//! `sentence_bert_config.json` and `1_Pooling/config.json` naming the pooling.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Result, Tensor};

use super::checkpoint::{BertFolder, Checkpoint};
use super::model::Pooling;

/// Tokenizer files copied from the source folder when present (`tokenizer.json` must be).
const TOKENIZER_FILES: [&str; 4] = ["tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"];

fn io<'a>(action: &str, path: &'a Path) -> impl FnOnce(std::io::Error) -> candle_core::Error + 'a {
    let action = action.to_string();
    move |e| candle_core::Error::Msg(format!("{action} {}: {e}", path.display()))
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(io("reading", path))?;
    serde_json::from_str(&text).map_err(|e| candle_core::Error::Msg(format!("parsing {}: {e}", path.display())))
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(io("writing", path))
}

/// The `max_seq_length` an export declares: the one of `source`'s own
/// `sentence_bert_config.json` when it has one (all-MiniLM-L6-v2: 256), capped by the model's
/// position limit `max_position_embeddings`; without that file, the position limit.
///
/// # Errors
/// When `source`'s `sentence_bert_config.json` exists but cannot be read or has no
/// positive integer `max_seq_length`.
fn serving_max_len(source: &Path, max_position_embeddings: usize) -> Result<usize> {
    let path = source.join("sentence_bert_config.json");
    if !path.is_file() {
        return Ok(max_position_embeddings);
    }
    match read_json(&path)?.get("max_seq_length").and_then(serde_json::Value::as_u64) {
        Some(n) if n > 0 => Ok((n as usize).min(max_position_embeddings)),
        _ => candle_core::bail!("{}: no positive integer `max_seq_length`", path.display()),
    }
}

/// Writes the encoder whose parameters are `params` (names `{prefix}embeddings.*`,
/// `{prefix}encoder.layer.*`, `{prefix}pooler.*`; other names, e.g. a training head, are
/// left out) as a Hugging Face folder `out`, with the architecture and the tokenizer of
/// `source` (the folder the run started from). When `params` has no pooler and `source`'s
/// weights do, the source's pooler is written (so `pooler_output` stays defined; it was not
/// trained). sentence-transformers reads `pooling` (`cls` and `cls_before_pooler` both as
/// its CLS-token pooling, which is `cls_before_pooler`) and the sequence limit: `source`'s own
/// (its `sentence_bert_config.json`, capped by the position limit; without one, the position
/// limit), not the run's training `max_len` (a crop for speed: kept in the export it would
/// silently truncate every longer input). A `sentence_bert_config.json` without a positive
/// `max_seq_length` is an error naming it.
///
/// The folder is read back before returning: every encoder tensor is present with its shape.
pub fn export_hf_folder(
    params: &HashMap<String, Tensor>,
    prefix: &str,
    source: &Path,
    out: &Path,
    pooling: Pooling,
) -> Result<()> {
    let config_path = source.join("config.json");
    let mut config = read_json(&config_path)?;
    let arch = super::BertConfig::from_file(&config_path)?;
    let hidden = arch.hidden_size;
    let max_len = serving_max_len(source, arch.max_position_embeddings)?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (name, t) in params {
        if let Some(hf) = name.strip_prefix(prefix) {
            tensors.insert(hf.to_string(), t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.contiguous()?);
        }
    }
    if tensors.is_empty() {
        candle_core::bail!("export: no parameter starts with {prefix:?}: not a BERT encoder's parameters");
    }
    let weights = source.join("model.safetensors");
    if !tensors.contains_key("pooler.dense.weight") && weights.is_file() {
        let ck = Checkpoint::read(&weights)?;
        if ck.has_pooler() {
            let shapes: [(&str, candle_core::Shape); 2] =
                [("pooler.dense.weight", (hidden, hidden).into()), ("pooler.dense.bias", hidden.into())];
            for (n, shape) in shapes {
                tensors.insert(n.to_string(), ck.tensor(n, &shape)?.to_dtype(DType::F32)?);
            }
        }
    }
    std::fs::create_dir_all(out.join("1_Pooling")).map_err(io("creating", out))?;
    if let Some(obj) = config.as_object_mut() {
        obj.insert("architectures".into(), serde_json::json!(["BertModel"]));
        obj.insert("model_type".into(), serde_json::json!("bert"));
    }
    write(&out.join("config.json"), &serde_json::to_string_pretty(&config).expect("JSON values serialise"))?;
    crate::save_safetensors(&tensors, &out.join("model.safetensors"))?;
    for f in TOKENIZER_FILES {
        let from = source.join(f);
        if from.is_file() {
            std::fs::copy(&from, out.join(f)).map_err(io("copying", &from))?;
        } else if f == "tokenizer.json" {
            candle_core::bail!("export: {} is missing", from.display());
        }
    }
    let modules = serde_json::json!([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    ]);
    write(&out.join("modules.json"), &modules.to_string())?;
    write(
        &out.join("sentence_bert_config.json"),
        &serde_json::json!({"max_seq_length": max_len, "do_lower_case": false}).to_string(),
    )?;
    let mean = pooling == Pooling::Mean;
    let pool = serde_json::json!({
        "word_embedding_dimension": hidden,
        "pooling_mode_cls_token": !mean,
        "pooling_mode_mean_tokens": mean,
        "pooling_mode_max_tokens": false,
        "pooling_mode_mean_sqrt_len_tokens": false
    });
    write(&out.join("1_Pooling/config.json"), &pool.to_string())?;
    // Read back: every tensor the encoder needs, with its shape.
    BertFolder::open(out)?.model(DType::F32, &Device::Cpu)?;
    Ok(())
}
