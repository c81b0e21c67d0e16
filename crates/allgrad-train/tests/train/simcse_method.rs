//! `method: simcse` through the registry: its sections are checked with errors naming the
//! key; a run on the committed tiny BERT evaluates before training and after its epoch (both
//! records in metrics.jsonl), and `export_run` writes the trained encoder of its checkpoint
//! as a Hugging Face folder.

use std::path::{Path, PathBuf};

use allgrad_dist::run_threads;
use allgrad_train::method::simcse_export::export_run;
use allgrad_train::{run, RunConfig};
use candle_core::Device;

fn tiny_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../allgrad-models/tests/data/tiny-bert")
}

const WORDS: [&str; 12] = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "fast", "big", "tree", "sun"];

/// A temporary folder with 24 sentences, 24 triplets and a retrieval split of 6.
fn data_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let sentence = |i: usize| (0..2 + i % 5).map(|k| WORDS[(i * 5 + k * 3) % 12]).collect::<Vec<_>>().join(" ");
    let sentences: String = (0..24).map(|i| sentence(i) + "\n").collect();
    std::fs::write(dir.path().join("sentences.txt"), sentences).unwrap();
    let triplets: String = std::iter::once("sent0,sent1,hard_neg\n".to_string())
        .chain((0..24).map(|i| format!("{},{},{}\n", sentence(i), sentence(i + 1), sentence(i + 7))))
        .collect();
    std::fs::write(dir.path().join("triplets.csv"), triplets).unwrap();
    let retrieval: String = std::iter::once("synset\tsentence\tgloss\n".to_string())
        .chain((0..6).map(|i| format!("s{i}\t{}\t{}\n", sentence(i + 30), sentence(i + 40))))
        .collect();
    std::fs::write(dir.path().join("retrieval.tsv"), retrieval).unwrap();
    dir
}

fn config(data: &Path, extra: &str) -> String {
    format!(
        "seed: 3\nmethod: simcse\n\
         data: {{sentences: {d}/sentences.txt}}\n\
         model: {{dir: {m}, pretrained: true, pooling: cls_before_pooler, max_len: 12}}\n\
         eval: {{retrieval: {d}/retrieval.tsv, similarity_dir: {d}/absent, max_len: 16}}\n\
         optim: {{kind: adamw, lr: 1.0e-3}}\nschedule: {{warmup_steps: 1, decay: linear}}\n\
         train: {{global_batch: 8, epochs: 1, max_steps: 3, clip_grad_norm: 1.0}}\n\
         log: {{progress: quiet, plot: false}}\n{extra}",
        d = data.display(),
        m = tiny_dir().display()
    )
}

fn check(text: &str, sets: &[&str]) -> Result<RunConfig, String> {
    let path = Path::new("simcse-test.yaml");
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let cfg = RunConfig::parse(text, path, &sets).map_err(|e| e.to_string())?;
    cfg.validate(2, path).map_err(|e| e.to_string())?;
    Ok(cfg)
}

#[test]
fn invalid_sections_are_errors_naming_the_key() {
    let data = data_dir();
    let text = config(data.path(), "");
    check(&text, &[]).unwrap();
    let t = format!("{}/triplets.csv", data.path().display());
    let cases: [(&[&str], &str); 9] = [
        (&["data.sentences=null"], "at `data`: needs `sentences`"),
        (&[&format!("data.triplets={t}")], "at `data`: give `sentences` or `triplets`, not both"),
        (&["data.sentences=/nonexistent/s.txt"], "at `data.sentences`: /nonexistent/s.txt does not exist"),
        (&["data.limit=4"], "at `data.limit`: data.limit = 4 is smaller than train.global_batch = 8"),
        (&["model.dir=/nonexistent"], "at `model.dir`: /nonexistent/config.json does not exist"),
        (&["loss.temperature=0"], "at `loss.temperature`: must be positive"),
        (&["loss.hard_negative_weight=0.5"], "at `loss.hard_negative_weight`: needs data.triplets"),
        (&["loss.tile=0"], "at `loss.tile`: loss.tile = 0: it is the number of rows and columns"),
        (&["eval.batch=0"], "at `eval.batch`: must be at least 1"),
    ];
    for (sets, want) in cases {
        let e = check(&text, sets).unwrap_err();
        assert!(e.contains(want), "{sets:?}: {e}");
    }
    let e = check(&text, &["model.pooling=max"]).unwrap_err();
    assert!(e.contains("model.pooling") && e.contains("unknown variant"), "{e}");
    let e = check(&text, &["data.lines=3"]).unwrap_err();
    assert!(e.contains("data") && e.contains("unknown field `lines`"), "{e}");
    // Supervised: triplets with a hard-negative weight are accepted.
    check(&text, &["data.sentences=null", &format!("data.triplets={t}"), "loss.hard_negative_weight=0.5"]).unwrap();
}

#[test]
fn a_run_evaluates_before_and_after_training_and_exports_its_encoder() {
    let data = data_dir();
    let run_dir = tempfile::tempdir().unwrap();
    let cfg = check(&config(data.path(), ""), &[]).unwrap();
    let dir = run_dir.path().to_path_buf();
    let summaries = run_threads(2, |pg| Ok(run::build(&cfg, pg, Some(dir.clone()), false)?.train()?)).unwrap();
    let s = &summaries[0];
    assert_eq!(s.steps, 3);
    let names: Vec<&str> = s.eval.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["wordnet_top1", "wordnet_mrr"]);
    assert_eq!(summaries[1].eval, s.eval, "ranks disagree on the evaluation");
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let eval_steps: Vec<u64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r.get("wordnet_mrr").is_some())
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(eval_steps, [0, 3], "{metrics}");

    let out = export_run(&dir, None).unwrap();
    assert_eq!(out, dir.join("hf"));
    let ck = allgrad_train::checkpoint::load_latest(&dir, &Device::Cpu).unwrap().unwrap();
    let exported = candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap();
    let source = candle_core::safetensors::load(tiny_dir().join("model.safetensors"), &Device::Cpu).unwrap();
    let diff = |a: &candle_core::Tensor, b: &candle_core::Tensor| {
        let b = b.to_dtype(candle_core::DType::F32).unwrap(); // the tiny model is stored in f16
        (a - &b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
    };
    let w = "encoder.layer.1.output.dense.weight";
    assert_eq!(diff(&exported[w], &ck.model[&format!("bert.{w}")]), 0.0, "the export is not the checkpoint");
    assert!(diff(&exported[w], &source[w]) > 1e-4, "training did not move {w}");
    // The pooler was not trained (cls_before_pooler): the source's is kept.
    assert_eq!(diff(&exported["pooler.dense.weight"], &source["pooler.dense.weight"]), 0.0);
    assert!(!exported.keys().any(|k| k.starts_with("head.")));
}
