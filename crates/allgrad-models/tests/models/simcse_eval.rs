//! SimCSE evaluation and inference: the benchmark readers (on files the tests write), the
//! retrieval and Spearman scores against hand computations, batched embedding in input order,
//! the evaluator on 2 and 3 ranks against 1, the `embed` JSON lines, and the Hugging Face
//! export read back (on the committed tiny BERT).

use std::collections::HashMap;
use std::path::Path;

use allgrad_dist::run_threads;
use allgrad_models::bert::{embed_lines, embed_texts, export_hf_folder, BertFolder, Pooling};
use allgrad_models::simcse::{
    rated_spearman, read_lee, read_retrieval, read_sts_tsv, read_word_pairs, retrieval_scores, Evaluator, RatedPairs, SimCseEval,
};
use candle_core::{DType, Device, Tensor};

use crate::support::{tiny_dir, TINY_SENTENCES};

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn sts_tsv_reads_the_glue_and_the_original_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let glue = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n\
                0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off.\tAn air plane is taking off.\t5.000\n\
                1\tmain-captions\tMSRvid\t2012test\t0004\tnone\tnone\tA man is playing a flute.\tA man is playing a flute.\t3.800\n";
    let s = read_sts_tsv(&write(dir.path(), "glue.tsv", glue)).unwrap();
    assert_eq!(s.texts, ["A plane is taking off.", "An air plane is taking off.", "A man is playing a flute."]);
    assert_eq!(s.pairs, [(0, 1, 5.0), (2, 2, 3.8)]);
    let orig = "main-news\tMSRpar\t2012train\t0005\t2.5\tOne sentence.\tAnother one.\textra\n\
                main-news\tMSRpar\t2012train\t0006\t0.25\tAnother one.\tA third.\n";
    let s = read_sts_tsv(&write(dir.path(), "sts-dev.csv", orig)).unwrap();
    assert_eq!(s.texts, ["One sentence.", "Another one.", "A third."]);
    assert_eq!(s.pairs, [(0, 1, 2.5), (1, 2, 0.25)]);
    let bad = "main-news\tMSRpar\t2012train\t0005\tfive\tOne.\tTwo.\nmain\tx\ty\tz\t1\ta\tb\n";
    let e = read_sts_tsv(&write(dir.path(), "bad.tsv", bad)).unwrap_err().to_string();
    assert!(e.contains("bad.tsv line 1") && e.contains("\"five\""), "{e}");
    let short = "main-news\tMSRpar\t2012train\n";
    let e = read_sts_tsv(&write(dir.path(), "short.tsv", short)).unwrap_err().to_string();
    assert!(e.contains("short.tsv line 1") && e.contains("3 fields"), "{e}");
}

#[test]
fn lee_pairs_are_the_upper_triangle_and_word_lists_skip_comments() {
    let dir = tempfile::tempdir().unwrap();
    let cor = dir.path().join("lee.cor");
    std::fs::write(&cor, b"doc zero\ndoc \xe9t\xe9 one\ndoc two").unwrap(); // Latin-1, as gensim's
    let sim = write(dir.path(), "sim.txt", "1\t0.5\t0.25\n0\t1\t0.75\n0\t0\t1\n");
    let lee = read_lee(&cor, &sim).unwrap();
    assert_eq!(lee.texts, ["doc zero", "doc été one", "doc two"]);
    assert_eq!(lee.pairs, [(0, 1, 0.5), (0, 2, 0.25), (1, 2, 0.75)]);
    let short = write(dir.path(), "short.txt", "1\t0.5\t0.25\n0\t1\n0\t0\t1\n");
    let e = read_lee(&cor, &short).unwrap_err().to_string();
    assert!(e.contains("short.txt line 2") && e.contains("2 values, expected 3"), "{e}");
    let words =
        write(dir.path(), "w.txt", "# header\n# Word 1\tWord 2\tHuman\nold\tnew\t1.58\nsmart\tintelligent\t9.2\nnew\tsmart\t3\n");
    let w = read_word_pairs(&words).unwrap();
    assert_eq!(w.texts, ["old", "new", "smart", "intelligent"]);
    assert_eq!(w.pairs, [(0, 1, 1.58), (2, 3, 9.2), (1, 2, 3.0)]);
    let r = write(dir.path(), "r.tsv", "synset\tsentence\tgloss\nn1\ta cat sat\ta small feline\nv2\the ran\tmove fast\n");
    let r = read_retrieval(&r).unwrap();
    assert_eq!(
        (r.sentences, r.glosses),
        (vec!["a cat sat".to_string(), "he ran".into()], vec!["a small feline".to_string(), "move fast".into()])
    );
}

#[test]
fn retrieval_scores_count_ranks_with_ties_against_the_query() {
    // Query 0: correct first (rank 1). Query 1: one candidate above (rank 2). Query 2: one
    // candidate above and one tied with the correct one (rank 3).
    let sim = vec![vec![0.9, 0.1, 0.2], vec![0.8, 0.5, 0.1], vec![0.7, 0.4, 0.4]];
    let (top1, mrr) = retrieval_scores(&sim);
    assert_eq!(top1, 1.0 / 3.0);
    assert!((mrr - (1.0 + 0.5 + 1.0 / 3.0) / 3.0).abs() < 1e-15, "{mrr}");
    // Spearman of the pair similarities with the ratings: a monotone relation gives 1.
    let set = RatedPairs { texts: vec![], pairs: vec![(0, 1, 1.0), (0, 2, 2.0), (1, 2, 0.5)] };
    let s = vec![vec![1.0, 0.1, 0.2], vec![0.1, 1.0, 0.05], vec![0.2, 0.05, 1.0]];
    assert!((rated_spearman(&s, &set).unwrap() - 1.0).abs() < 1e-12);
}

#[test]
fn batched_embeddings_come_back_in_input_order() {
    let folder = BertFolder::open(&tiny_dir()).unwrap();
    let model = folder.model(DType::F64, &Device::Cpu).unwrap();
    let tok = folder.tokenizer(16).unwrap();
    // Batches of 2 over sentences of different lengths: the length sort must be undone.
    let (ids, all) = embed_texts(&model, &tok, Pooling::Mean, &TINY_SENTENCES, 2, false).unwrap();
    for (i, s) in TINY_SENTENCES.iter().enumerate() {
        let (one_ids, one) = embed_texts(&model, &tok, Pooling::Mean, &[s], 1, false).unwrap();
        assert_eq!(ids[i], one_ids[0]);
        let d =
            (all.get(i).unwrap() - one.get(0).unwrap()).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
        assert!(d < 1e-12, "sentence {i}: {d}");
    }
    let (_, unit) = embed_texts(&model, &tok, Pooling::Mean, &TINY_SENTENCES, 3, true).unwrap();
    let norms: Vec<f64> = unit.sqr().unwrap().sum(1).unwrap().to_vec1().unwrap();
    assert!(norms.iter().all(|n| (n - 1.0).abs() < 1e-12), "{norms:?}");
}

fn eval_files(dir: &Path) -> SimCseEval {
    let words = ["the", "cat", "dog", "sat", "ran", "mat", "tree", "bird", "sun", "rain"];
    let retrieval: String = std::iter::once("synset\tsentence\tgloss\n".to_string())
        .chain((0..7).map(|i| format!("s{i}\t{} {} sat\tthe {} and {}\n", words[i], words[i + 1], words[i + 2], words[i + 3])))
        .collect();
    write(dir, "retrieval.tsv", &retrieval);
    let gensim = dir.join("gensim");
    std::fs::create_dir_all(&gensim).unwrap();
    let pairs: String = (0..9).map(|i| format!("{}\t{}\t{}\n", words[i], words[(i * 3 + 1) % 10], (i * 7 % 10) as f64)).collect();
    write(&gensim, "wordsim353.tsv", &pairs);
    SimCseEval {
        retrieval: Some(dir.join("retrieval.tsv")),
        similarity_dir: Some(gensim),
        sts: Some(dir.join("absent.tsv")),
        max_len: 16,
        batch: 2,
    }
}

#[test]
fn evaluation_on_2_and_3_ranks_equals_1_rank_and_absent_files_are_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = eval_files(dir.path());
    let evaluator = Evaluator::load(&cfg).unwrap();
    let run = |w: usize| {
        run_threads(w, |pg| {
            let folder = BertFolder::open(&tiny_dir()).unwrap();
            let model = folder.model(DType::F64, &Device::Cpu)?;
            evaluator.evaluate(&model, &folder.tokenizer(16)?, Pooling::Cls, &pg)
        })
        .unwrap()
    };
    let one = run(1).remove(0);
    let names: Vec<&str> = one.iter().map(|(n, _)| n.as_str()).collect();
    // lee and simlex files are absent, and so is the STS file: skipped, not errors.
    assert_eq!(names, ["wordnet_top1", "wordnet_mrr", "wordsim_spearman"]);
    assert!(one.iter().all(|(_, v)| v.is_finite()));
    assert!(one[1].1 >= one[0].1 && one[1].1 > 0.0, "MRR {} below top-1 {}", one[1].1, one[0].1);
    for w in [2, 3] {
        for rank_figures in run(w) {
            for ((n, a), (_, b)) in rank_figures.iter().zip(&one) {
                allgrad_testkit::close::assert_elem_rel(&[*a], &[*b], 1e-12, f64::MIN_POSITIVE, &format!("W={w} {n}"));
            }
        }
    }
    let none = Evaluator::load(&SimCseEval { retrieval: Some(dir.path().join("nope.tsv")), ..SimCseEval::default() }).unwrap();
    assert!(none.is_empty());
}

#[test]
fn embed_lines_prints_text_ids_and_the_embedding_per_line() {
    let folder = BertFolder::open(&tiny_dir()).unwrap();
    let input = format!("{}\n\n{}\r\n", TINY_SENTENCES[0], TINY_SENTENCES[2]);
    let mut out = Vec::new();
    let n = embed_lines(&folder, Pooling::Cls, 16, true, input.as_bytes(), &mut out).unwrap();
    assert_eq!(n, 2);
    let lines: Vec<serde_json::Value> =
        String::from_utf8(out).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2);
    let model = folder.model(DType::F32, &Device::Cpu).unwrap();
    let tok = folder.tokenizer(16).unwrap();
    for (line, text) in lines.iter().zip([TINY_SENTENCES[0], TINY_SENTENCES[2]]) {
        assert_eq!(line["text"], text);
        let ids: Vec<u32> = serde_json::from_value(line["ids"].clone()).unwrap();
        assert_eq!(ids, tok.encode(text).unwrap());
        let emb: Vec<f32> = serde_json::from_value(line["embedding"].clone()).unwrap();
        let batch = tok.batch(&[text], &Device::Cpu).unwrap();
        let want = allgrad_models::losses::l2_normalize(&model.embed(&batch, Pooling::Cls, None).unwrap()).unwrap();
        let want: Vec<f32> = want.squeeze(0).unwrap().to_vec1().unwrap();
        assert_eq!(emb.len(), 32);
        let d = emb.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(d < 1e-6, "{text}: {d}");
    }
}

fn st_max_len(dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(dir.join("sentence_bert_config.json")).unwrap();
    serde_json::from_str::<serde_json::Value>(&text).unwrap()["max_seq_length"].as_u64()
}

#[test]
fn an_export_keeps_the_source_sequence_limit_and_refuses_a_broken_one() {
    let tiny = tiny_dir();
    let src = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(tiny.join(f), src.path().join(f)).unwrap();
    }
    let params: HashMap<String, Tensor> = candle_core::safetensors::load(tiny.join("model.safetensors"), &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, v)| (format!("bert.{k}"), v))
        .collect();
    // The source's own limit is kept, capped by its 40 positions.
    for (declared, want) in [(24, 24), (256, 40)] {
        write(src.path(), "sentence_bert_config.json", &format!(r#"{{"max_seq_length": {declared}, "do_lower_case": false}}"#));
        let out = tempfile::tempdir().unwrap();
        export_hf_folder(&params, "bert.", src.path(), out.path(), Pooling::Mean).unwrap();
        assert_eq!(st_max_len(out.path()), Some(want), "declared {declared}");
    }
    write(src.path(), "sentence_bert_config.json", r#"{"do_lower_case": false}"#);
    let out = tempfile::tempdir().unwrap();
    let e = export_hf_folder(&params, "bert.", src.path(), out.path(), Pooling::Mean).unwrap_err().to_string();
    assert!(e.contains("sentence_bert_config.json") && e.contains("max_seq_length"), "{e}");
}

#[test]
fn an_exported_folder_reads_back_with_the_trained_weights_and_the_source_pooler() {
    let src = tiny_dir();
    // The tiny model is stored in f16; the export writes f32.
    let weights: HashMap<String, Tensor> = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, v)| (k, v.to_dtype(DType::F32).unwrap()))
        .collect();
    // "Trained" parameters under the trainer's names: the encoder shifted by 0.01, no pooler,
    // plus a training head that must not be exported.
    let mut params: HashMap<String, Tensor> = weights
        .iter()
        .filter(|(k, _)| !k.starts_with("pooler."))
        .map(|(k, v)| (format!("bert.{k}"), (v + 0.01).unwrap()))
        .collect();
    params.insert("head.dense.weight".into(), Tensor::zeros((32, 32), DType::F32, &Device::Cpu).unwrap());
    let out = tempfile::tempdir().unwrap();
    export_hf_folder(&params, "bert.", &src, out.path(), Pooling::Mean).unwrap();
    let back = candle_core::safetensors::load(out.path().join("model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(back.len(), weights.len(), "{:?}", back.keys().collect::<Vec<_>>());
    for (k, v) in &weights {
        let want = if k.starts_with("pooler.") { v.clone() } else { (v + 0.01).unwrap() };
        let d = (back[k].clone() - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(d, 0.0, "{k}");
    }
    for f in ["config.json", "tokenizer.json", "modules.json", "sentence_bert_config.json", "1_Pooling/config.json"] {
        assert!(out.path().join(f).is_file(), "{f}");
    }
    let pool: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("1_Pooling/config.json")).unwrap()).unwrap();
    assert_eq!((pool["pooling_mode_mean_tokens"].as_bool(), pool["word_embedding_dimension"].as_u64()), (Some(true), Some(32)));
    // The tiny source has no sentence_bert_config.json: its position limit (40 in its
    // config.json), not a training crop, bounds what sentence-transformers encodes.
    assert_eq!(st_max_len(out.path()), Some(40));
    // Without the `bert.` prefix nothing is an encoder parameter: an error, not an empty folder.
    let e = export_hf_folder(&params, "encoder.", &src, out.path(), Pooling::Mean).unwrap_err().to_string();
    assert!(e.contains("no parameter starts with"), "{e}");
}
