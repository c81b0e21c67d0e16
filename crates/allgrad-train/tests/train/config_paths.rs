//! How a config's paths and `--set` values are read: relative paths in a file are taken from
//! the file's folder, `--set` paths from the current directory; a bad `--set` value is blamed
//! on the command line with its own key; `--print-config` shows every default and reads back
//! as the same config.

use std::path::{Path, PathBuf};

use allgrad_train::method::Registry;
use allgrad_train::RunConfig;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

fn section_str(cfg: &RunConfig, section: &str, key: &str) -> Option<String> {
    cfg.sections().get(section)?.get(key)?.as_str().map(String::from)
}

const IMAGES: &str = "method: simclr\n\
                      data: {kind: images, dir: ../images, format: idx}\n\
                      model: {kind: resnet}\n\
                      train: {global_batch: 8, epochs: 1}\n";

#[test]
fn relative_paths_in_a_file_are_taken_from_its_folder_and_set_paths_from_the_current_directory() {
    let root = tempfile::tempdir().unwrap();
    let root = root.path().canonicalize().unwrap();
    std::fs::create_dir_all(root.join("configs")).unwrap();
    std::fs::create_dir_all(root.join("images")).unwrap();
    let file = root.join("configs/run.yaml");
    std::fs::write(&file, IMAGES).unwrap();

    // From the file: against configs/, whatever the current directory (the test's is the crate's).
    let cfg = RunConfig::load(&file, &[]).unwrap();
    assert_eq!(section_str(&cfg, "data", "dir").unwrap(), root.join("images").to_string_lossy());
    // An existing path is resolved through `..`; a missing one is made absolute all the same.
    let cfg = RunConfig::load(&file, &["data.dir=elsewhere/x".into()]).unwrap();
    let cwd = std::env::current_dir().unwrap();
    assert_eq!(section_str(&cfg, "data", "dir").unwrap(), cwd.join("elsewhere/x").to_string_lossy());
    // An absolute path is kept as written, also from the file.
    let cfg = RunConfig::load(&file, &["data.dir=/abs/images".into()]).unwrap();
    assert_eq!(section_str(&cfg, "data", "dir").unwrap(), "/abs/images");
    std::fs::write(&file, IMAGES.replace("../images", "/abs/from/file")).unwrap();
    assert_eq!(section_str(&RunConfig::load(&file, &[]).unwrap(), "data", "dir").unwrap(), "/abs/from/file");
    // The run's config.yaml holds the absolute path, so reading it from anywhere finds the data.
    std::fs::write(&file, IMAGES).unwrap();
    let yaml = RunConfig::load(&file, &[]).unwrap().to_yaml();
    let elsewhere = root.join("runs/x/config.yaml");
    let again = RunConfig::parse(&yaml, &elsewhere, &[]).unwrap();
    assert_eq!(section_str(&again, "data", "dir").unwrap(), root.join("images").to_string_lossy());
    // A method's other keys, and a method without path keys, are left alone.
    let vectors = "method: vectors\ndata: {kind: vectors}\nmodel: {kind: mlp}\ntrain: {global_batch: 8}\n";
    let cfg = RunConfig::parse(vectors, &file, &[]).unwrap();
    assert_eq!(cfg.sections().get("data").unwrap().get("kind").unwrap().as_str(), Some("vectors"));
}

#[test]
fn the_shipped_simcse_config_finds_the_repository_data_from_any_folder() {
    let cfg = RunConfig::load(&repo().join("configs/simcse.yaml"), &[]).unwrap();
    assert_eq!(section_str(&cfg, "data", "sentences").unwrap(), repo().join("data/wordnet/sentences.txt").to_string_lossy());
    assert_eq!(section_str(&cfg, "eval", "retrieval").unwrap(), repo().join("data/wordnet/retrieval.tsv").to_string_lossy());
    let model = section_str(&cfg, "model", "dir").unwrap();
    assert!(Path::new(&model).is_absolute() && model.ends_with("data/models/all-MiniLM-L6-v2"), "{model}");
    let cfg = RunConfig::load(&repo().join("configs/simclr.yaml"), &[]).unwrap();
    assert_eq!(section_str(&cfg, "data", "dir").unwrap(), repo().join("data/fashion-mnist").to_string_lossy());
}

#[test]
fn a_bad_set_value_is_blamed_on_the_command_line_with_its_own_key() {
    let file = repo().join("configs/vectors.yaml");
    // `optim` is a tagged section: the parser loses the inner key, the message does not.
    let e = RunConfig::load(&file, &["optim.lr=0.1.0".into()]).unwrap_err().to_string();
    assert!(e.starts_with("--set optim.lr=0.1.0: at `optim.lr`: "), "{e}");
    assert!(e.contains("the value comes from the command line") && !e.contains("vectors.yaml"), "{e}");
    // A trainer key and a method key, typed at their own paths.
    let e = RunConfig::load(&file, &["train.global_batch=many".into()]).unwrap_err().to_string();
    assert!(e.starts_with("--set train.global_batch=many: at `train.global_batch`: invalid type"), "{e}");
    let e = RunConfig::load(&file, &["data.samples=-3".into()]).unwrap_err().to_string();
    assert!(e.starts_with("--set data.samples=-3: at `data.samples`: "), "{e}");
    // A section set whole, whose inner key is wrong: the error's own, more precise key.
    let e = RunConfig::load(&file, &["train={global_batch: 8, epochs: x}".into()]).unwrap_err().to_string();
    assert!(e.starts_with("--set train={global_batch: 8, epochs: x}: at `train.epochs`"), "{e}");
    // An error in the file, with --set values elsewhere, is still the file's.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, std::fs::read_to_string(&file).unwrap().replace("global_batch: 256", "global_batch: lots")).unwrap();
    let e = RunConfig::load(&bad, &["optim.lr=0.1".into()]).unwrap_err().to_string();
    assert!(e.starts_with(&format!("{}: at `train.global_batch`", bad.display())), "{e}");
}

#[test]
fn print_config_shows_every_default_and_reads_back_as_the_same_config() {
    let registry = Registry::builtin();
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo().join("configs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "{files:?}");
    let dir = tempfile::tempdir().unwrap();
    for file in files {
        let yaml = registry.resolved_yaml(&file, &[]).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        // Defaults the file leaves out are there, the trainer's and the method's.
        for key in ["clip_grad_norm:", "on_nonfinite:", "keep_last:", "scale_by_batch:"] {
            assert!(yaml.contains(key), "{}: no {key} in\n{yaml}", file.display());
        }
        // Read back from another folder (its paths are absolute), it is the same run.
        let printed = dir.path().join("printed.yaml");
        std::fs::write(&printed, &yaml).unwrap();
        let original = registry.load(&file, &[]).unwrap();
        let back = registry.load(&printed, &[]).unwrap();
        assert_eq!(registry.resolved_yaml(&printed, &[]).unwrap(), yaml, "{}: printing is not idempotent", file.display());
        assert_eq!(
            (back.seed, &back.method, &back.optim, &back.train),
            (original.seed, &original.method, &original.optim, &original.train)
        );
    }
    let image = registry.resolved_yaml(&repo().join("configs/simclr.yaml"), &[]).unwrap();
    assert!(image.contains("augment:") && image.contains("projector:"), "{image}");
}
