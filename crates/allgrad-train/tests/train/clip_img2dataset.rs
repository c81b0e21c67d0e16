//! Captioned shards as users have them: shards in img2dataset's layout (`KEY.jpg` or
//! `KEY.webp`, `KEY.txt`, `KEY.json` per sample, keys such as `000010003`, `NNNNN_stats.json`
//! beside each shard), written by the Python `webdataset` package's own `TarWriter`
//! (`scripts/data/make_img2dataset_shards.py`, through ALLGRAD_PYTHON), read by CLIP's data
//! path (`PairData`: the stream of shards, the loader's threads, the tiny CLIP's tokenizer):
//! every sample arrives once per epoch, its image and its caption together, both those the
//! script wrote under its key (the caption from `txt` and from the `json` member's `caption`);
//! and `method: clip` trains steps from the shards on 2 ranks.

use std::path::{Path, PathBuf};

use allgrad_dist::run_threads;
use allgrad_models::clip::{ClipData, ClipFolder, ClipInputs, ImageProcessor, PairData};
use allgrad_models::Batch;
use allgrad_train::{run, RunConfig};
use candle_core::Device;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// What the script wrote, per sample: (key, caption, gray level).
fn write_shards(python: &Path, out: &Path, format: &str) -> Vec<(String, String, u8)> {
    let script = repo().join("scripts/data/make_img2dataset_shards.py");
    let mut cmd = std::process::Command::new(python);
    cmd.arg(&script).arg(out).args(["--samples", "48", "--per-shard", "12", "--format", format]);
    let (o, _) = allgrad_testkit::process::run(&mut cmd, "make_img2dataset_shards.py", std::time::Duration::from_secs(120));
    assert!(o.status.success(), "{}: {}", script.display(), String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "{00000..00003}.tar");
    let manifest: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    manifest
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["key"].as_str().unwrap().to_string(),
                s["caption"].as_str().unwrap().to_string(),
                s["level"].as_u64().unwrap() as u8,
            )
        })
        .collect()
}

const WEBDATASET: &str = "{train: [\"{00000..00003}.tar\"], epoch_samples: 48, streams: 4, shuffle_buffer: 6, resampled: false}";

#[test]
fn img2dataset_shards_written_by_pythons_webdataset_reach_clip_with_their_keys_and_train() {
    let Some(python) = std::env::var_os("ALLGRAD_PYTHON").filter(|p| !p.is_empty()).map(PathBuf::from) else {
        return allgrad_testkit::skip(
            allgrad_testkit::Need::Torch,
            "ALLGRAD_PYTHON (a Python with webdataset and Pillow) is unset",
        );
    };
    let dir = tempfile::tempdir().unwrap();
    let folder = ClipFolder::open(&repo().join("data/clip-tiny")).unwrap();
    let tokenizer = folder.tokenizer(folder.config.text_config.max_position_embeddings).unwrap();
    let channels = folder.config.vision_config.num_channels;
    let processor = ImageProcessor::of_folder(&folder.dir, &folder.config).unwrap();
    for (format, caption) in [("jpg", "txt"), ("webp", "json:caption")] {
        let shards = dir.path().join(format);
        let written = write_shards(&python, &shards, format);
        assert_eq!(written.len(), 48);
        assert!(written.iter().any(|w| w.0 == "000010003"), "img2dataset's keys: {:?}", &written[..3]);
        // Every caption tokenizes differently, so the tokens name the caption.
        let tokens: Vec<Vec<u32>> = written.iter().map(|w| tokenizer.encode(&w.1).unwrap()).collect();
        for (i, t) in tokens.iter().enumerate() {
            assert!(tokens[..i].iter().all(|u| u != t), "the captions of {} and another sample tokenize alike", written[i].0);
        }

        // CLIP's data path, the images kept as values / 255 (resized and centre-cropped to the
        // model's input as in evaluation: a flat image stays flat).
        let data: ClipData = serde_yaml::from_str(&format!(
            "{{shards: {}, webdataset: {WEBDATASET}, caption: '{caption}', loader: {{workers: 2, prefetch: 2}}, random_crop: null}}",
            shards.display()
        ))
        .unwrap();
        let mut image = processor.pipeline(channels, None).unwrap();
        image.normalize = allgrad_data::Normalize::identity();
        let inputs = ClipInputs { image, tokenizer: tokenizer.clone() };
        let mut pairs = PairData::open(&data, inputs, 5, 12, Device::Cpu).unwrap();
        assert_eq!(pairs.num_samples(), 48);
        let plan: Vec<Vec<usize>> = (0..4).map(|b| (b * 12..(b + 1) * 12).collect()).collect();
        pairs.plan(0, 5, &plan).unwrap();
        let mut seen = vec![0usize; written.len()];
        for (step, idx) in plan.iter().enumerate() {
            let (images, toks) = pairs.inputs(&Batch { indices: idx, epoch: 0, step, seed: 5 }).unwrap();
            assert_eq!(toks.len(), 12);
            let images = images.flatten_from(1).unwrap().to_vec2::<f32>().unwrap();
            for (img, tok) in images.iter().zip(&toks) {
                // The image's gray level names the sample the script wrote (levels 5 apart;
                // JPEG and lossy WebP of flat gray decode within 2 of it).
                let (lo, hi) = img.iter().fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
                assert!(hi - lo < 1e-3, "{format}: the flat image arrived with values {lo}..{hi}");
                let level = lo * 255.0;
                let n = written
                    .iter()
                    .position(|w| (w.2 as f32 - level).abs() <= 2.0)
                    .unwrap_or_else(|| panic!("{format}: an image of level {level} that no sample has"));
                assert_eq!(
                    tok, &tokens[n],
                    "{format}: sample {} arrived with another caption than {:?}",
                    written[n].0, written[n].1
                );
                seen[n] += 1;
            }
        }
        assert_eq!(pairs.prefetched(), 4, "{format}: the batches were not built on the loader's threads");
        let missing: Vec<&str> = written.iter().zip(&seen).filter(|(_, &c)| c != 1).map(|(w, _)| w.0.as_str()).collect();
        assert!(missing.is_empty(), "{format}: samples not read exactly once in the epoch: {missing:?}");

        // `method: clip` from the same shards: 2 ranks, 3 steps.
        let text = format!(
            "seed: 3\nmethod: clip\n\
             data: {{shards: {}, webdataset: {WEBDATASET}, caption: '{caption}', loader: {{workers: 2, prefetch: 2}}}}\n\
             model: {{dir: {}}}\n\
             train: {{global_batch: 12, epochs: 1, max_steps: 3, eval: false}}\n\
             optim: {{kind: adamw, lr: 1.0e-3}}\n\
             log: {{progress: quiet, plot: false}}\n",
            shards.display(),
            repo().join("data/clip-tiny").display()
        );
        let cfg = RunConfig::parse(&text, &dir.path().join("clip.yaml"), &[]).unwrap();
        let ends = run_threads(2, |pg| {
            let s = run::build(&cfg, pg, None, false)?.train()?;
            Ok((s.steps, s.last_loss))
        })
        .unwrap();
        for (steps, loss) in ends {
            assert_eq!(steps, 3, "{format}");
            assert!(loss.is_finite(), "{format}: loss {loss}");
        }
    }
}
