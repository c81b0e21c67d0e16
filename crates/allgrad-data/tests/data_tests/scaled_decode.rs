//! Decoding at the size the crop needs: JPEGs decoded at 1/2, 1/4 or 1/8 in the DCT domain
//! (`LoaderConfig::scaled_decode`) give views within a measured error of the full decode's,
//! stay strict about files cut short, and the loaders give the same batches with it for any
//! number of workers; a rank's stream loader decodes on as many threads as workers asked for.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use allgrad_data::webdataset::{OnCorrupt, ShardStream, ShardWriter, StreamLoader, WebDatasetOptions};
use allgrad_data::{
    decode_image, decode_image_shrunk, resize_box, resize_box_shrunk, Augment, AugmentConfig, Chw, ColorJitter, ColorMode,
    CropBox, DataResult, FloatImage, GaussianBlur, Image, LoaderConfig, Normalize, Pipeline, RandomGrayscale,
    RandomHorizontalFlip, RandomResizedCrop, TwoViews, ViewKey,
};
use candle_core::Device;

/// The committed photographs (JPEG, 4:2:0 chroma, quality 90; one grayscale).
fn photos() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../allgrad-models/tests/data/clip-images");
    ["square.jpg", "wide.jpg", "tall.jpg", "gray.jpg"].iter().map(|n| dir.join(n)).collect()
}

/// The crop alone (no flip, jitter, grayscale or blur; values in [0, 1]): what a scaled decode
/// changes.
fn crop_only(size: usize) -> Augment {
    Augment::new(AugmentConfig {
        crop: Some(RandomResizedCrop { size, ..Default::default() }),
        flip: RandomHorizontalFlip { p: 0.0 },
        color_jitter: ColorJitter { p: 0.0, ..Default::default() },
        grayscale: RandomGrayscale { p: 0.0 },
        blur: GaussianBlur { p: 0.0, ..Default::default() },
        normalize: Normalize::identity(),
    })
    .unwrap()
}

/// Views of a scaled decode against full decode + crop + resize, per factor 2, 4, 8: the
/// largest mean absolute difference of one view's values (in [0, 1]). Measured over the four
/// photographs, crops of 6, 10 and 16 pixels, 300 samples each (3,600 views: 8 at full size,
/// 541 at 1/2, 1,650 at 1/4, 1,401 at 1/8): 0.0194, 0.0277, 0.0340 (5.0, 7.1, 8.7 levels of
/// 255); the bounds are 1.25 times these. The difference is the scaled decode's own low-pass
/// (a 1/s decode averages each s x s block, and the view's filter then comes on top of it), not
/// the box: on a smooth picture the views agree to a level
/// ([`on_a_ramp_a_scaled_view_is_the_full_view_so_the_box_maps_exactly`]).
const VIEW_MEAN: [f64; 3] = [0.025, 0.035, 0.043];
/// The largest absolute difference of a single value (of 1), per factor. Measured: 0.112,
/// 0.206, 0.239 (at sharp edges of the photographs); the bounds are 1.25 times these.
const VIEW_MAX: [f32; 3] = [0.15, 0.26, 0.3];

#[test]
fn scaled_decode_views_are_the_full_decode_views_within_the_measured_error() {
    // (count, largest mean, largest value difference) per factor 1, 2, 4, 8.
    let mut stats = [(0usize, 0f64, 0f32); 4];
    for path in photos() {
        let bytes = std::fs::read(&path).unwrap();
        let full = decode_image(&bytes, ColorMode::Rgb, &path).unwrap();
        for size in [6, 10, 16] {
            let aug = crop_only(size);
            for i in 0..300 {
                let key = ViewKey { seed: 5, epoch: 0, index: i, view: 0 };
                let want = aug.apply(&full, key).unwrap();
                let d = decode_image_shrunk(&bytes, ColorMode::Rgb, &path, &|w, h| aug.shrink(w, h, key)).unwrap();
                assert_eq!(d.full, (full.width, full.height));
                assert_eq!((d.image.width, d.image.height), (full.width.div_ceil(d.shrink), full.height.div_ceil(d.shrink)));
                let got = aug.apply_shrunk(&d.image, d.full, d.shrink, key).unwrap();
                assert_eq!(got.shape(), want.shape());
                let diffs: Vec<f32> = got.data.iter().zip(&want.data).map(|(a, b)| (a - b).abs()).collect();
                let mean = diffs.iter().map(|&x| x as f64).sum::<f64>() / diffs.len() as f64;
                let max = diffs.iter().cloned().fold(0f32, f32::max);
                let k = d.shrink.trailing_zeros() as usize;
                if d.shrink == 1 {
                    // No shrink: the full decode's view, bit for bit.
                    assert!(got.data.iter().zip(&want.data).all(|(a, b)| a.to_bits() == b.to_bits()), "{path:?} {i}");
                }
                let s = &mut stats[k];
                *s = (s.0 + 1, s.1.max(mean), s.2.max(max));
            }
        }
    }
    eprintln!("scaled decode against full decode, per factor 1/2/4/8 (views, largest mean, largest value): {stats:?}");
    // Every factor was exercised, and a scaled view is not the full one (the scaled path ran).
    assert!(stats[0].0 > 0 && stats[1..].iter().all(|s| s.0 > 100), "{stats:?}");
    assert!(stats[1..].iter().all(|s| s.1 > 0.0), "{stats:?}");
    for (k, (_, mean, max)) in stats[1..].iter().enumerate() {
        let s = 2 << k;
        assert!(*mean <= VIEW_MEAN[k], "factor {s}: mean difference {mean} > {}", VIEW_MEAN[k]);
        assert!(*max <= VIEW_MAX[k], "factor {s}: largest difference {max} > {}", VIEW_MAX[k]);
    }
}

/// The scaled decode itself, per factor 2, 4, 8: within this many levels (of 255, mean absolute
/// difference over a file's values) of the full decode averaged over each `s` x `s` block,
/// the quantity the DCT-domain decode approximates (it keeps the block's low frequencies, which
/// is not exactly a box average on textured photographs). Measured on the four photographs:
/// largest 4.08, 5.09, 6.36 (the tall photograph; 0.8-2.0 on the gray one); the bounds are 1.25
/// times these. A decode with a channel swapped, a wrong colour conversion or the blocks out of
/// place differs by tens of levels.
const BLOCK_MEAN: [f64; 3] = [5.1, 6.4, 8.0];

#[test]
fn a_scaled_decode_is_the_block_average_of_the_full_decode() {
    for path in photos() {
        let bytes = std::fs::read(&path).unwrap();
        for color in [ColorMode::Rgb, ColorMode::Auto] {
            let full = decode_image(&bytes, color, &path).unwrap();
            for s in [2, 4, 8] {
                let d = decode_image_shrunk(&bytes, color, &path, &|_, _| s).unwrap();
                assert_eq!(d.shrink, s);
                assert_eq!(d.image.channels, full.channels, "{path:?} {color:?}");
                let (w, h, c) = (d.image.width, d.image.height, full.channels);
                let mut total = 0f64;
                for y in 0..h {
                    for x in 0..w {
                        for k in 0..c {
                            let (mut sum, mut n) = (0f64, 0f64);
                            for yy in y * s..((y + 1) * s).min(full.height) {
                                for xx in x * s..((x + 1) * s).min(full.width) {
                                    sum += full.at(xx, yy, k) as f64;
                                    n += 1.0;
                                }
                            }
                            total += (sum / n - d.image.at(x, y, k) as f64).abs();
                        }
                    }
                }
                let mean = total / (w * h * c) as f64;
                eprintln!("{}: 1/{s}, {color:?}: mean difference from the block average {mean:.3}", path.display());
                let bound = BLOCK_MEAN[s.trailing_zeros() as usize - 1];
                assert!(mean <= bound, "{path:?} at 1/{s}: {mean} > {bound}");
            }
        }
    }
    // Another answer of the rule is taken as the next smaller factor; a PNG decodes whole.
    let path = &photos()[0];
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(decode_image_shrunk(&bytes, ColorMode::Rgb, path, &|_, _| 7).unwrap().shrink, 4);
    assert_eq!(decode_image_shrunk(&bytes, ColorMode::Rgb, path, &|_, _| 0).unwrap().shrink, 1);
    let png = path.with_file_name("photo.png");
    let d = decode_image_shrunk(&std::fs::read(&png).unwrap(), ColorMode::Rgb, &png, &|_, _| 8).unwrap();
    assert_eq!((d.shrink, d.full), (1, (d.image.width, d.image.height)));
}

/// Against Pillow's own scaled decode (`Image.draft`: libjpeg-turbo's scaled inverse DCT,
/// `scripts/reference/pillow_draft.py`), per factor 2, 4, 8: the largest mean absolute
/// difference over a file's values, in levels of 255, and the largest single difference.
/// Measured on the four photographs (Pillow 13.0.0): means 4.90, 5.68, 6.47 and largest 52,
/// 56, 52 (the colour photographs; the gray one 1.97, 1.49, 0.54); the bounds are 1.5 times
/// these. The two decoders reduce differently: jpeg-decoder puts the block's lowest 4 x 4 (2 x
/// 2) coefficients through a 4-point (2-point) inverse DCT, libjpeg-turbo weights the 8-point
/// coefficients for the smaller grid (on the gray photograph at 1/2 its result is 0.25 levels
/// from the block average, jpeg-decoder's 2.0); at 1/8 both keep each block's mean (gray: within
/// one level, [`PILLOW_GRAY_EIGHTH`]) and colour differs by how the chroma is upsampled.
const PILLOW_MEAN: [f64; 3] = [7.4, 8.6, 9.8];
const PILLOW_MAX: [i32; 3] = [78, 84, 78];
/// The gray photograph at 1/8, where both decoders give each block's mean: the largest
/// difference measured is 1 level (rounding).
const PILLOW_GRAY_EIGHTH: i32 = 1;

#[test]
fn a_scaled_decode_is_pillows_draft_within_the_measured_error() {
    let Some(py) = std::env::var_os("ALLGRAD_PYTHON").filter(|p| !p.is_empty()) else {
        return allgrad_testkit::skip(allgrad_testkit::Need::Torch, "ALLGRAD_PYTHON (a Python with Pillow) is unset");
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = tempfile::tempdir().unwrap();
    let script = root.join("scripts/reference/pillow_draft.py");
    let mut cmd = std::process::Command::new(py);
    cmd.arg(&script).arg(root.join("crates/allgrad-models/tests/data/clip-images")).arg(out.path());
    let (o, _) = allgrad_testkit::process::run(&mut cmd, "pillow_draft.py", Duration::from_secs(120));
    assert!(o.status.success(), "{}: {}\n{}", script.display(), o.status, String::from_utf8_lossy(&o.stderr));
    let mut worst = [(0f64, 0i32); 3];
    for path in photos() {
        let bytes = std::fs::read(&path).unwrap();
        for s in [2usize, 4, 8] {
            let name = format!("{}.{s}.rgb", path.file_name().unwrap().to_string_lossy());
            let theirs = std::fs::read(out.path().join(&name)).unwrap();
            let d = decode_image_shrunk(&bytes, ColorMode::Rgb, &path, &|_, _| s).unwrap();
            assert_eq!(d.image.pixels.len(), theirs.len(), "{name}: {}x{}", d.image.width, d.image.height);
            let diffs: Vec<i32> = d.image.pixels.iter().zip(&theirs).map(|(&a, &b)| (a as i32 - b as i32).abs()).collect();
            let mean = diffs.iter().map(|&x| x as f64).sum::<f64>() / diffs.len() as f64;
            let max = *diffs.iter().max().unwrap();
            eprintln!("{name}: against Pillow's draft, mean {mean:.3}, largest {max}");
            let k = s.trailing_zeros() as usize - 1;
            worst[k] = (worst[k].0.max(mean), worst[k].1.max(max));
            if s == 8 && name.starts_with("gray") {
                assert!(max <= PILLOW_GRAY_EIGHTH, "{name}: largest difference {max}");
            }
        }
    }
    for (k, (mean, max)) in worst.iter().enumerate() {
        assert!(*mean <= PILLOW_MEAN[k] && *max <= PILLOW_MAX[k], "1/{}: mean {mean}, largest {max}", 2 << k);
    }
}

/// A smooth picture (two linear ramps and a constant channel) as a JPEG of quality 100.
fn ramp_jpeg(w: u32, h: u32) -> Vec<u8> {
    let px: Vec<u8> =
        (0..h).flat_map(|y| (0..w).flat_map(move |x| [(x * 255 / (w - 1)) as u8, (y * 255 / (h - 1)) as u8, 90])).collect();
    let mut out = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 100).encode(&px, w, h, image::ColorType::Rgb8).unwrap();
    out
}

/// On a ramp every symmetric low-pass filter gives the value at its centre, so a scaled
/// decode's view equals the full decode's up to rounding when (and only when) the crop box is
/// mapped onto the scaled image exactly: a box off by half a scaled pixel is off by `s / 2`
/// source pixels, about `s / 2` levels on this ramp of one level per pixel. Measured: the
/// largest mean difference of a view, per factor 2, 4, 8, is 0.21, 0.34 and 0.96 levels of 255
/// (the 1/8 decode keeps one value per 8 x 8 block); the bounds are 1.5 times these, and the
/// test shows a box shifted by half a scaled pixel beyond them.
const RAMP_MEAN: [f64; 3] = [0.32 / 255.0, 0.51 / 255.0, 1.43 / 255.0];

#[test]
fn on_a_ramp_a_scaled_view_is_the_full_view_so_the_box_maps_exactly() {
    let bytes = ramp_jpeg(256, 256);
    let path = Path::new("ramp.jpg");
    let full = decode_image(&bytes, ColorMode::Rgb, path).unwrap();
    let mut worst = [0f64; 4];
    for size in [8, 12, 20] {
        let aug = crop_only(size);
        for i in 0..200 {
            let key = ViewKey { seed: 9, epoch: 0, index: i, view: 1 };
            let d = decode_image_shrunk(&bytes, ColorMode::Rgb, path, &|w, h| aug.shrink(w, h, key)).unwrap();
            let (got, want) = (aug.apply_shrunk(&d.image, d.full, d.shrink, key).unwrap(), aug.apply(&full, key).unwrap());
            // The ramps' channels only (the third is constant).
            let n = size * size;
            let mean = got.data[..2 * n].iter().zip(&want.data[..2 * n]).map(|(a, b)| (a - b).abs() as f64).sum::<f64>()
                / (2 * n) as f64;
            let k = d.shrink.trailing_zeros() as usize;
            worst[k] = worst[k].max(mean);
        }
    }
    eprintln!("ramp: largest mean difference per factor 1/2/4/8, in levels: {:?}", worst.map(|m| m * 255.0));
    assert_eq!(worst[0], 0.0);
    for (k, m) in worst[1..].iter().enumerate() {
        assert!(*m <= RAMP_MEAN[k], "factor {}: {} levels", 2 << k, m * 255.0);
    }
    // The control: the same box shifted by half a scaled pixel is beyond the bound.
    let ramp_mean = |a: &FloatImage, b: &FloatImage| {
        let n = a.width * a.height * 3;
        a.data.iter().zip(&b.data).enumerate().filter(|(i, _)| i % 3 != 2).map(|(_, (x, y))| (x - y).abs() as f64).sum::<f64>()
            / (n * 2 / 3) as f64
    };
    for s in [2, 4, 8] {
        let d = decode_image_shrunk(&bytes, ColorMode::Rgb, path, &|_, _| s).unwrap();
        let b = CropBox { x: 64, y: 40, width: 128, height: 160 };
        let want = resize_box(&full, b, 10, 10);
        let exact = ramp_mean(&resize_box_shrunk(&d.image, b, s, 10, 10), &want);
        let shifted = ramp_mean(&resize_box_shrunk(&d.image, CropBox { x: b.x + s / 2, ..b }, s, 10, 10), &want);
        let bound = RAMP_MEAN[s.trailing_zeros() as usize - 1];
        assert!(exact <= bound && shifted > bound, "1/{s}: exact {exact}, shifted {shifted}, bound {bound}");
    }
}

#[test]
fn a_jpeg_cut_short_or_corrupt_is_an_error_naming_it_at_every_scale() {
    let path = &photos()[1];
    let bytes = std::fs::read(path).unwrap();
    // Cut in the headers, in the scan, and just before the end marker.
    for cut in [300, bytes.len() / 2, bytes.len() - 2] {
        for s in [1, 2, 4, 8] {
            let err = decode_image_shrunk(&bytes[..cut], ColorMode::Rgb, path, &|_, _| s).unwrap_err().to_string();
            assert!(err.contains("wide.jpg"), "cut at {cut}, 1/{s}: {err}");
        }
    }
    // The start-of-frame marker's length field garbled: an error, not a picture.
    let sof = bytes.windows(2).position(|w| w == [0xFF, 0xC0]).unwrap();
    let mut bad = bytes.clone();
    bad[sof + 2..sof + 4].copy_from_slice(&[0x00, 0x03]);
    for s in [1, 2, 4, 8] {
        let err = decode_image_shrunk(&bad, ColorMode::Rgb, path, &|_, _| s).unwrap_err().to_string();
        assert!(err.contains("wide.jpg"), "1/{s}: {err}");
    }
}

/// A pipeline around [`TwoViews`] that counts how many views are being made at once: each
/// view waits (until a deadline shared by the whole test) for `target` views to be in flight
/// together, once; the most seen is what the test reads. No timing is asserted: a loader that
/// makes views on fewer threads just never reaches the target, and the deadline ends the wait.
struct Concurrency {
    inner: TwoViews,
    in_flight: AtomicUsize,
    most: AtomicUsize,
    reached: AtomicBool,
    target: usize,
    deadline: Instant,
}

impl Pipeline for Concurrency {
    fn num_views(&self) -> usize {
        2
    }

    fn view(&self, img: &Image, key: ViewKey) -> DataResult<Chw> {
        self.view_shrunk(img, (img.width, img.height), 1, key)
    }

    fn shrink(&self, width: usize, height: usize, key: ViewKey) -> usize {
        self.inner.shrink(width, height, key)
    }

    fn view_shrunk(&self, img: &Image, full: (usize, usize), shrink: usize, key: ViewKey) -> DataResult<Chw> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        while !self.reached.load(Ordering::SeqCst) && Instant::now() < self.deadline {
            if self.in_flight.load(Ordering::SeqCst) >= self.target {
                self.reached.store(true, Ordering::SeqCst);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let out = self.inner.view_shrunk(img, full, shrink, key);
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        out
    }
}

/// 48 JPEG samples (the three colour photographs in turn), 4 per shard, class `i % 4`.
fn jpeg_shards(dir: &Path) -> Vec<PathBuf> {
    let files: Vec<Vec<u8>> = photos()[..3].iter().map(|p| std::fs::read(p).unwrap()).collect();
    let mut w = ShardWriter::new(dir, "jpg", 4).unwrap();
    for i in 0..48 {
        let cls = (i % 4).to_string();
        w.write(&format!("p{i:04}"), &[("jpg", &files[i % 3]), ("cls", cls.as_bytes())]).unwrap();
    }
    w.finish().unwrap()
}

fn stream(shards: Vec<PathBuf>, streams: usize, on_corrupt: OnCorrupt) -> Arc<ShardStream> {
    let opts = WebDatasetOptions {
        train: vec!["unused".into()],
        epoch_samples: 48,
        streams,
        shuffle_buffer: 3,
        resampled: false,
        on_corrupt,
        ..Default::default()
    };
    Arc::new(ShardStream::new(shards, opts, 16, ColorMode::Rgb).unwrap())
}

type Flat = (Vec<usize>, Vec<Vec<f32>>, Vec<u32>);

fn batches(source: &Arc<ShardStream>, pipeline: Arc<dyn Pipeline>, workers: usize, scaled_decode: bool) -> Vec<Flat> {
    let plan: Vec<Vec<usize>> = (0..3).map(|b| (b * 16..(b + 1) * 16).collect()).collect();
    let cfg = LoaderConfig { workers, prefetch: 2, scaled_decode };
    StreamLoader::new(source.clone(), pipeline, 3, 0, plan, &cfg, &Device::Cpu)
        .unwrap()
        .map(|b| {
            let b = b.unwrap();
            let v = b.views.iter().map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
            (b.indices, v, b.labels.to_vec1::<u32>().unwrap())
        })
        .collect()
}

fn two_views() -> TwoViews {
    TwoViews::new(AugmentConfig { normalize: Normalize::identity(), ..AugmentConfig::simclr(10) }).unwrap()
}

#[test]
fn a_rank_decodes_on_the_workers_asked_for_and_keeps_the_order() {
    let dir = tempfile::tempdir().unwrap();
    let shards = jpeg_shards(dir.path());
    for on_corrupt in [OnCorrupt::Error, OnCorrupt::Skip] {
        // Two streams on this rank: two reading workers; four workers asked for.
        let source = stream(shards.clone(), 2, on_corrupt);
        let counting = Arc::new(Concurrency {
            inner: two_views(),
            in_flight: AtomicUsize::new(0),
            most: AtomicUsize::new(0),
            reached: AtomicBool::new(false),
            target: 4,
            deadline: Instant::now() + Duration::from_secs(20),
        });
        let four = batches(&source, counting.clone(), 4, false);
        let most = counting.most.load(Ordering::SeqCst);
        assert_eq!(most, 4, "{on_corrupt:?}: at most {most} views were made at once with 4 workers on 2 streams");
        // The same batches as one worker, and as the consumer's thread alone.
        let plain: Arc<dyn Pipeline> = Arc::new(two_views());
        assert_eq!(four, batches(&source, plain.clone(), 1, false), "{on_corrupt:?}");
        assert_eq!(four, batches(&source, plain.clone(), 0, false), "{on_corrupt:?}");
        assert_eq!(four, batches(&source, plain.clone(), 7, false), "{on_corrupt:?}");
        // Scaled decode: the same batches for any number of workers; close to the full decode's.
        let scaled = batches(&source, plain.clone(), 4, true);
        assert_eq!(scaled, batches(&source, plain.clone(), 1, true), "{on_corrupt:?}");
        assert_eq!(scaled, batches(&source, plain.clone(), 0, true), "{on_corrupt:?}");
        let (mut n, mut sum, mut differ) = (0usize, 0f64, 0usize);
        for (a, b) in scaled.iter().zip(&four) {
            assert_eq!((&a.0, &a.2), (&b.0, &b.2));
            for (va, vb) in a.1.iter().zip(&b.1) {
                for (x, y) in va.iter().zip(vb) {
                    n += 1;
                    sum += (x - y).abs() as f64;
                    differ += (x != y) as usize;
                }
            }
        }
        let mean = sum / n as f64;
        eprintln!("{on_corrupt:?}: scaled against full decode in the stream: mean {mean:.4}, {differ} of {n} values differ");
        match on_corrupt {
            // Under `error` the images decode at the size the crop needs ...
            OnCorrupt::Error => assert!(differ > 0 && mean <= VIEW_MEAN[2], "mean {mean}, {differ} differ"),
            // ... under `skip` at full size (a sample's decode decides what comes next).
            OnCorrupt::Skip => assert_eq!(differ, 0),
        }
    }
}

#[test]
fn an_image_folder_loader_decodes_scaled_the_same_for_any_number_of_workers() {
    // The photographs as a folder of two classes, 24 files.
    let dir = tempfile::tempdir().unwrap();
    for i in 0..24 {
        let class = dir.path().join(format!("c{}", i % 2));
        std::fs::create_dir_all(&class).unwrap();
        std::fs::copy(&photos()[i % 4], class.join(format!("{i:02}.jpg"))).unwrap();
    }
    let data: Arc<dyn allgrad_data::Dataset> =
        Arc::new(allgrad_data::ImageFolder::open(dir.path(), &allgrad_data::FolderOptions::default()).unwrap());
    let views: Arc<dyn Pipeline> = Arc::new(two_views());
    let plan: Vec<Vec<usize>> = vec![vec![3, 7, 1, 20], vec![10, 0, 5, 23], vec![2, 9, 4, 15]];
    let run = |workers, scaled_decode| -> Vec<Vec<Vec<f32>>> {
        let cfg = LoaderConfig { workers, prefetch: 2, scaled_decode };
        allgrad_data::Loader::new(data.clone(), views.clone(), 4, 1, plan.clone(), &cfg, &Device::Cpu)
            .unwrap()
            .map(|b| b.unwrap().views.iter().map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect())
            .collect()
    };
    let scaled = run(2, true);
    assert_eq!(scaled, run(0, true));
    assert_eq!(scaled, run(3, true));
    let full = run(2, false);
    let diffs: Vec<f64> =
        scaled.iter().flatten().flatten().zip(full.iter().flatten().flatten()).map(|(a, b)| (a - b).abs() as f64).collect();
    let mean = diffs.iter().sum::<f64>() / diffs.len() as f64;
    assert!(diffs.iter().any(|&d| d > 0.0) && mean <= VIEW_MEAN[2], "mean {mean}");
}
