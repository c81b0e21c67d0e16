//! CLIP's zero-shot classification and retrieval split over the ranks: on an image folder
//! (one sub-folder per class, named by the folder) and on an IDX test split, W = 2, 3 and 4
//! ranks (threads) give exactly the 1-rank figures, each rank embedding its own share of the
//! images, prompts and captions (the rows each rank embedded add up to the whole, none more
//! than its ceiling share). The model is `data/clip-tiny` as it is (untrained).

use std::path::{Path, PathBuf};

use allgrad_data::{Normalize, Preprocess, Resample};
use allgrad_dist::{run_threads, ProcessGroup};
use allgrad_models::clip::{open_test_set, ClipData, ClipEval, ClipEvaluation, ClipFolder, EvalShare};
use candle_core::{DType, Device};

fn tiny() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/clip-tiny"))
}

const CLASSES: [&str; 4] = ["ankle_boot", "bag", "coat", "sneaker"];

/// `root/<class>/<i>.png`: 7 images a class, 28 x 28 gray with a class-dependent stripe
/// pattern, one of them RGB and 32 x 30 (converted, resized and cropped on the way in).
fn image_folder(root: &Path) {
    for (c, class) in CLASSES.iter().enumerate() {
        let dir = root.join(class);
        std::fs::create_dir_all(&dir).unwrap();
        for i in 0..7u32 {
            let px = |x: u32, y: u32| (((x * (c as u32 + 1) + y * i) * 37 + 11 * c as u32) % 256) as u8;
            if c == 2 && i == 3 {
                image::RgbImage::from_fn(32, 30, |x, y| image::Rgb([px(x, y), px(y, x), 128]))
                    .save(dir.join(format!("{i}.png")))
                    .unwrap();
            } else {
                image::GrayImage::from_fn(28, 28, |x, y| image::Luma([px(x, y)])).save(dir.join(format!("{i}.png"))).unwrap();
            }
        }
    }
}

fn eval_cfg(images: Option<PathBuf>) -> ClipEval {
    ClipEval {
        templates: vec!["a photo of a {}.".into(), "{} for sale".into(), "a black and white photo of the {}".into()],
        zero_shot: 23,
        retrieval: 17,
        batch: 4,
        images,
        classes: Vec::new(),
    }
}

/// Every rank's figures and share.
fn evaluate(w: usize, data: &ClipData, cfg: &ClipEval) -> Vec<(Vec<(String, f64)>, EvalShare)> {
    run_threads(w, |pg: ProcessGroup| {
        let folder = ClipFolder::open(&tiny())?;
        let model = folder.model(DType::F32, &Device::Cpu)?;
        let tok = folder.tokenizer(16)?;
        let (images, classes) = open_test_set(data, cfg)?;
        let ev = ClipEvaluation::new(images, classes, cfg, &tok, folder.config.projection_dim)?;
        // The evaluation view: the shorter side to 28 (bicubic), the centre 28 x 28.
        let view = Preprocess {
            channels: 1,
            shortest_edge: Some(28),
            crop: Some([28, 28]),
            resample: Resample::Bicubic,
            normalize: Normalize { mean: vec![0.5], std: vec![0.5] },
            random_crop: None,
        };
        ev.run_counted(&model, &view, tok.pad_id(), &pg, &Device::Cpu)
    })
    .unwrap()
}

/// W = 1-4 give the 1-rank figures on every rank; the shares add up to `total` (images,
/// texts) and none exceeds `ceiling` (the largest contiguous share of each list).
fn check_split(data: &ClipData, cfg: &ClipEval, lists: (&[usize], &[usize])) {
    let one = evaluate(1, data, cfg);
    let figures = &one[0].0;
    assert_eq!(figures.len(), 5, "{figures:?}");
    println!("1 rank: {figures:?}");
    let total = |l: &[usize]| l.iter().sum::<usize>();
    assert_eq!(one[0].1, EvalShare { images: total(lists.0), texts: total(lists.1) });
    for w in 2..=4 {
        let ranks = evaluate(w, data, cfg);
        for (r, (f, _)) in ranks.iter().enumerate() {
            assert_eq!(f, figures, "W = {w}, rank {r}: other figures than 1 rank's");
        }
        let ceiling = |l: &[usize]| l.iter().map(|n| n.div_ceil(w)).sum::<usize>();
        let images: Vec<usize> = ranks.iter().map(|(_, s)| s.images).collect();
        let texts: Vec<usize> = ranks.iter().map(|(_, s)| s.texts).collect();
        assert_eq!(images.iter().sum::<usize>(), total(lists.0), "W = {w}: images embedded {images:?}");
        assert_eq!(texts.iter().sum::<usize>(), total(lists.1), "W = {w}: texts embedded {texts:?}");
        assert!(images.iter().all(|n| *n <= ceiling(lists.0)), "W = {w}: images {images:?}");
        assert!(texts.iter().all(|n| *n <= ceiling(lists.1)), "W = {w}: texts {texts:?}");
    }
}

#[test]
fn evaluation_on_an_image_folder_split_over_ranks_equals_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    image_folder(dir.path());
    let cfg = eval_cfg(Some(dir.path().to_path_buf()));
    let data = ClipData::default();
    // Class names from the folders, `_` read as a space.
    let (images, names) = open_test_set(&data, &cfg).unwrap();
    assert_eq!(names, vec![vec!["ankle boot".to_string()], vec!["bag".into()], vec!["coat".into()], vec!["sneaker".into()]]);
    assert_eq!(images.len(), 28);
    // Zero-shot: 23 images and 4 x 3 prompts; retrieval: 17 images and 17 captions.
    check_split(&data, &cfg, (&[23, 17], &[12, 17]));

    // eval.classes names the folders' classes instead (and must have one list per folder).
    let named = ClipEval {
        classes: vec![vec!["boot".into()], vec!["purse".into()], vec!["jacket".into()], vec!["trainer".into()]],
        ..cfg.clone()
    };
    assert_eq!(open_test_set(&data, &named).unwrap().1[1], vec!["purse".to_string()]);
    let short = ClipEval { classes: vec![vec!["boot".into()]], ..cfg };
    let e = open_test_set(&data, &short).err().expect("one list for four folders").to_string();
    assert!(e.contains("eval.classes has 1 lists") && e.contains("4 class sub-folders"), "{e}");
}

#[test]
fn evaluation_on_an_idx_test_split_over_ranks_equals_one_rank() {
    let data = ClipData {
        images: Some(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/fashion-mnist"))),
        classes: (0..10).map(|c| vec![format!("class {c}")]).collect(),
        ..Default::default()
    };
    // Zero-shot: 23 images and 10 x 3 prompts; retrieval: 17 images and 17 captions.
    check_split(&data, &eval_cfg(None), (&[23, 17], &[30, 17]));
}
