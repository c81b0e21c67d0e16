//! The BERT encoder beyond the forward values: loading errors and the `bert.` prefix,
//! gradients against finite differences (f64), and keyed dropout (independent of batch
//! position, padding and rank; off in evaluation).

use std::collections::HashMap;

use allgrad_models::bert::{BertFolder, BertModel, Checkpoint, DropoutKey, Pooling, TokenBatch};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

use crate::support::{tiny_dir, TINY_SENTENCES};

fn tiny_tensors() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(tiny_dir().join("model.safetensors"), &Device::Cpu).unwrap()
}

/// A copy of the tiny folder whose weights are `tensors`.
fn folder_with(tensors: &HashMap<String, Tensor>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(tiny_dir().join(f), dir.path().join(f)).unwrap();
    }
    candle_core::safetensors::save(tensors, dir.path().join("model.safetensors")).unwrap();
    dir
}

fn embed(folder: &BertFolder, dtype: DType) -> Vec<Vec<f64>> {
    let model = folder.model(dtype, &Device::Cpu).unwrap();
    let batch = folder.tokenizer(16).unwrap().batch(&TINY_SENTENCES, &Device::Cpu).unwrap();
    model.embed(&batch, Pooling::Cls, None).unwrap().to_dtype(DType::F64).unwrap().to_vec2().unwrap()
}

#[test]
fn bert_prefix_and_old_layer_norm_names_load_the_same_weights() {
    let plain = embed(&BertFolder::open(&tiny_dir()).unwrap(), DType::F32);
    let prefixed: HashMap<String, Tensor> = tiny_tensors()
        .into_iter()
        .map(|(k, v)| {
            (format!("bert.{}", k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")), v)
        })
        .collect();
    let dir = folder_with(&prefixed);
    assert_eq!(embed(&BertFolder::open(dir.path()).unwrap(), DType::F32), plain);
}

#[test]
fn a_missing_or_mis_shaped_tensor_is_an_error_naming_it() {
    let mut t = tiny_tensors();
    t.remove("encoder.layer.1.attention.self.key.weight");
    let dir = folder_with(&t);
    let err = BertFolder::open(dir.path()).unwrap().model(DType::F32, &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("encoder.layer.1.attention.self.key.weight") && err.contains("no tensor"), "{err}");

    let mut t = tiny_tensors();
    t.insert("encoder.layer.0.intermediate.dense.bias".into(), Tensor::zeros(36, DType::F16, &Device::Cpu).unwrap());
    let dir = folder_with(&t);
    let err = BertFolder::open(dir.path()).unwrap().model(DType::F32, &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("encoder.layer.0.intermediate.dense.bias") && err.contains("[36]") && err.contains("[37]"), "{err}");
}

#[test]
fn truncation_keeps_max_len_tokens_and_padding_goes_to_the_longest() {
    let folder = BertFolder::open(&tiny_dir()).unwrap();
    let batch = folder.tokenizer(6).unwrap().batch(&TINY_SENTENCES[..2], &Device::Cpu).unwrap();
    assert_eq!(batch.rows, vec![vec![2, 4, 6, 8, 9, 3], vec![2, 5, 7, 11, 3]]);
    assert_eq!(batch.ids.to_vec2::<u32>().unwrap(), vec![vec![2, 4, 6, 8, 9, 3], vec![2, 5, 7, 11, 3, 0]]);
    assert_eq!(batch.mask.to_vec2::<u32>().unwrap(), vec![vec![1; 6], vec![1, 1, 1, 1, 1, 0]]);
    assert!(folder.tokenizer(41).is_err(), "max_len above max_position_embeddings (40) must be refused");
}

/// The tiny model in f64 with trainable variables.
fn trainable() -> (BertModel, VarMap) {
    let folder = BertFolder::open(&tiny_dir()).unwrap();
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F64, &Device::Cpu);
    let model = folder.checkpoint.init_model(&folder.config, vb, true).unwrap();
    (model, vars)
}

fn tokens() -> TokenBatch {
    BertFolder::open(&tiny_dir()).unwrap().tokenizer(16).unwrap().batch(&TINY_SENTENCES, &Device::Cpu).unwrap()
}

/// A scalar of all three poolings with fixed weights, so that every parameter matters.
fn objective(model: &BertModel, batch: &TokenBatch) -> Tensor {
    let h = model.forward(batch, None).unwrap();
    let w = Tensor::arange(0f64, 32.0, &Device::Cpu).unwrap().affine(0.37, -5.0).unwrap().sin().unwrap();
    let mut total = Tensor::zeros((), DType::F64, &Device::Cpu).unwrap();
    for p in [Pooling::Cls, Pooling::ClsBeforePooler, Pooling::Mean] {
        let z = model.pool(&h, &batch.mask, p).unwrap();
        total = (total + z.broadcast_mul(&w).unwrap().sqr().unwrap().sum_all().unwrap()).unwrap();
    }
    total
}

#[test]
fn gradients_of_every_parameter_match_finite_differences() {
    let (model, vars) = trainable();
    let batch = tokens();
    let grads = objective(&model, &batch).backward().unwrap();
    let mut data = vars.data().lock().unwrap().iter().map(|(k, v)| (k.clone(), v.clone())).collect::<Vec<(String, Var)>>();
    data.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(data.len(), 5 + 16 * 2 + 2, "every parameter of the tiny BERT was created");
    for (name, var) in &data {
        let g = grads.get(var).unwrap_or_else(|| panic!("no gradient for {name}"));
        let g = g.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let n = g.len();
        // Three entries per parameter: first, middle, last. (Word embeddings: entries of a
        // token the batch uses.)
        let picks = if name.contains("word_embeddings") { vec![4 * 32, 4 * 32 + 17, 9 * 32 + 31] } else { vec![0, n / 2, n - 1] };
        let base = var.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        for k in picks {
            let eps = 1e-5;
            let at = |delta: f64| {
                let mut v = base.clone();
                v[k] += delta;
                var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap()).unwrap();
                objective(&model, &batch).to_scalar::<f64>().unwrap()
            };
            let fd = (at(eps) - at(-eps)) / (2.0 * eps);
            var.set(&Tensor::from_vec(base.clone(), var.shape(), &Device::Cpu).unwrap()).unwrap();
            // Central differences at h = 1e-5: the loss's rounding over 2h (~1e-11) and an h²
            // term; measured up to 3.9e-7 of the entry. Relative to the entry; entries below
            // 1e-2 are held to 1e-8 absolute.
            let err = (g[k] - fd).abs() / fd.abs().max(1e-2);
            allgrad_testkit::close::report(&format!("{name}[{k}] (|fd| = {:.1e})", fd.abs()), err, 1e-6);
            assert!(err < 1e-6, "{name}[{k}]: backward {} vs finite difference {fd} (rel. {err:.2e})", g[k]);
        }
    }
}

fn hidden_with_dropout(sentences: &[&str], samples: &[u64], view: u64) -> Vec<Tensor> {
    let folder = BertFolder::open(&tiny_dir()).unwrap();
    let model = folder.model(DType::F64, &Device::Cpu).unwrap();
    let batch = folder.tokenizer(16).unwrap().batch(sentences, &Device::Cpu).unwrap();
    let key = DropoutKey { seed: 5, step: 3, rows: samples.iter().map(|s| (*s, view)).collect() };
    let h = model.forward(&batch, Some(&key)).unwrap();
    (0..sentences.len()).map(|r| h.get(r).unwrap().narrow(0, 0, batch.rows[r].len()).unwrap()).collect()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap()
}

#[test]
fn dropout_masks_depend_on_the_global_sample_not_on_batch_position_or_padding() {
    let s = TINY_SENTENCES;
    // Sample 11 alone (no padding), and as the second row beside a longer sentence (padded).
    let alone = hidden_with_dropout(&[s[1]], &[11], 0);
    let batched = hidden_with_dropout(&[s[2], s[1]], &[10, 11], 0);
    let d = max_diff(&alone[0], &batched[1]);
    assert!(d < 1e-12, "the same sample's states differ by {d:.2e} with another batch position and padding");
    // Another view, or another sample index, gives other masks.
    let other_view = hidden_with_dropout(&[s[1]], &[11], 1);
    assert!(max_diff(&alone[0], &other_view[0]) > 1e-3, "views 0 and 1 drew the same masks");
    let other_sample = hidden_with_dropout(&[s[1]], &[12], 0);
    assert!(max_diff(&alone[0], &other_sample[0]) > 1e-3, "samples 11 and 12 drew the same masks");
}

#[test]
fn dropout_is_off_without_a_key() {
    let folder = BertFolder::open(&tiny_dir()).unwrap();
    let model = folder.model(DType::F64, &Device::Cpu).unwrap();
    let batch = tokens();
    let eval = model.forward(&batch, None).unwrap();
    assert_eq!(max_diff(&eval, &model.forward(&batch, None).unwrap()), 0.0);
    let key = DropoutKey { seed: 5, step: 0, rows: (0..5).map(|s| (s, 0)).collect() };
    let train = model.forward(&batch, Some(&key)).unwrap();
    assert!(max_diff(&eval, &train) > 1e-3, "a dropout key changed nothing");
}

#[test]
fn a_checkpoint_without_pooler_refuses_cls_pooling_by_name() {
    let mut t = tiny_tensors();
    t.retain(|k, _| !k.starts_with("pooler."));
    let dir = folder_with(&t);
    let ck = Checkpoint::read(&dir.path().join("model.safetensors")).unwrap();
    assert!(!ck.has_pooler());
    let folder = BertFolder::open(dir.path()).unwrap();
    let model = folder.model(DType::F32, &Device::Cpu).unwrap();
    let batch = folder.tokenizer(16).unwrap().batch(&TINY_SENTENCES, &Device::Cpu).unwrap();
    let err = model.embed(&batch, Pooling::Cls, None).unwrap_err().to_string();
    assert!(err.contains("pooler.dense.weight"), "{err}");
    assert!(model.embed(&batch, Pooling::Mean, None).is_ok());
}
