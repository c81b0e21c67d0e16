//! RecordIO face data sets as MXNet writes them: files written by MXNet's own `recordio`
//! module (ALLGRAD_MXNET_PYTHON) and by the format writer of
//! `scripts/reference/recordio_write.py` (ALLGRAD_PYTHON) read back with the labels and the
//! pixels Pillow decodes; insightface's header record; the records through the sampler and
//! the loader, the same for any number of workers and split over ranks.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use allgrad_data::{
    AugmentConfig, ColorMode, Dataset, DistributedSampler, Loader, LoaderConfig, Normalize, RecordHeader, RecordIo,
    RecordIoOptions, RecordIoWriter, TwoViews,
};
use allgrad_testkit::Need;

/// The Python named by `var`, when set.
fn python(var: &str) -> Option<PathBuf> {
    std::env::var_os(var).filter(|p| !p.is_empty()).map(PathBuf::from)
}

/// Runs `recordio_write.py OUT --writer WRITER` with `python`; what it expects back.
fn write_reference(python: &Path, writer: &str, out: &Path) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/reference/recordio_write.py");
    let mut cmd = std::process::Command::new(python);
    cmd.arg(&script).arg(out).args(["--writer", writer]);
    let (o, _) = allgrad_testkit::process::run(&mut cmd, "recordio_write.py", std::time::Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{} {}: {}\n{stderr}", python.display(), script.display(), o.status);
    let text = std::fs::read_to_string(out.join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Both layouts read back: the same samples, classes and pixels (PNG exactly; JPEG within
/// the difference of two decoders' rounding, Pillow's libjpeg and zune-jpeg).
fn check_reads_back(out: &Path, expected: &serde_json::Value) {
    let samples = expected["samples"].as_array().unwrap();
    for layout in ["plain", "with_header"] {
        let ds = RecordIo::open(out.join(layout), &RecordIoOptions::default()).unwrap();
        assert_eq!((ds.len(), ds.num_classes()), (samples.len(), 4), "{layout}");
        for (i, s) in samples.iter().enumerate() {
            assert_eq!(ds.label(i).unwrap() as u64, s["label"].as_u64().unwrap(), "{layout} sample {i}");
            let img = ds.get(i).unwrap();
            let shape: Vec<usize> = s["shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
            assert_eq!(vec![img.height, img.width, img.channels], shape, "{layout} sample {i}");
            let want: Vec<i32> = s["pixels"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap() as i32).collect();
            let worst = img.pixels.iter().zip(&want).map(|(a, b)| (*a as i32 - b).abs()).max().unwrap();
            let tol = if s["format"] == "JPEG" { 2 } else { 0 };
            assert!(worst <= tol, "{layout} sample {i} ({}): a pixel differs by {worst}", s["format"]);
        }
    }
    // The record of the label vector whose bytes hold the magic number was written in parts.
    let idx = std::fs::read_to_string(out.join("plain/train.idx")).unwrap();
    let off: usize = idx.lines().nth(4).unwrap().split('\t').nth(1).unwrap().parse().unwrap();
    let rec = std::fs::read(out.join("plain/train.rec")).unwrap();
    assert_eq!(u32::from_le_bytes(rec[off + 4..off + 8].try_into().unwrap()) >> 29, 1, "record 4 is not split");
}

#[test]
fn recordio_written_by_mxnet_reads_back_with_its_labels_and_pixels() {
    let dir = tempfile::tempdir().unwrap();
    let Some(py) = python("ALLGRAD_MXNET_PYTHON") else {
        return allgrad_testkit::skip(Need::Mxnet, "ALLGRAD_MXNET_PYTHON is unset");
    };
    let expected = write_reference(&py, "mxnet", dir.path());
    assert_eq!(expected["writer"], "mxnet");
    check_reads_back(dir.path(), &expected);
}

#[test]
fn recordio_written_from_the_published_format_reads_back_with_its_labels_and_pixels() {
    let dir = tempfile::tempdir().unwrap();
    let Some(py) = python("ALLGRAD_PYTHON") else {
        return allgrad_testkit::skip(Need::Torch, "ALLGRAD_PYTHON (a Python with NumPy and Pillow) is unset");
    };
    let expected = write_reference(&py, "format", dir.path());
    check_reads_back(dir.path(), &expected);
}

/// 40 gray 6x6 PNG records, class i % 5, written here.
fn records(dir: &Path) -> RecordIo {
    let mut w = RecordIoWriter::create(dir.join("train.rec"), dir.join("train.idx")).unwrap();
    for i in 0..40u32 {
        let img = image::GrayImage::from_fn(6, 6, |x, y| image::Luma([((x * 37 + y * 11 + i * 53) % 256) as u8]));
        let mut png = std::io::Cursor::new(Vec::new());
        img.write_to(&mut png, image::ImageOutputFormat::Png).unwrap();
        w.write(i as u64, &RecordHeader::scalar((i % 5) as f32, i as u64).pack(&png.into_inner())).unwrap();
    }
    w.finish().unwrap();
    std::fs::write(dir.join("property"), "5,6,6").unwrap();
    RecordIo::open(dir, &RecordIoOptions { color: ColorMode::Gray, ..Default::default() }).unwrap()
}

#[test]
fn records_through_the_sampler_and_loader_are_split_over_ranks_and_equal_for_any_workers() {
    let dir = tempfile::tempdir().unwrap();
    let ds: Arc<dyn Dataset> = Arc::new(records(dir.path()));
    let views = Arc::new(TwoViews::new(AugmentConfig { normalize: Normalize::identity(), ..AugmentConfig::simclr(4) }).unwrap());
    let mut sampler = DistributedSampler::new(ds.len(), 8, 3, true);
    // Epoch 1, steps 0..5, for 2 ranks: each rank's slices, through 0 and 3 workers.
    let run = |rank: usize, workers: usize, sampler: &mut DistributedSampler| {
        let plan: Vec<Vec<usize>> = (0..5).map(|p| sampler.local(sampler.clone().global_batch(1, p), rank, 2).to_vec()).collect();
        let cfg = LoaderConfig { workers, prefetch: 2, ..Default::default() };
        Loader::new(ds.clone(), views.clone(), 3, 1, plan, &cfg, &candle_core::Device::Cpu)
            .unwrap()
            .map(|b| {
                let b = b.unwrap();
                (b.indices, b.views[0].flatten_all().unwrap().to_vec1::<f32>().unwrap(), b.labels.to_vec1::<u32>().unwrap())
            })
            .collect::<Vec<_>>()
    };
    let mut seen = Vec::new();
    for rank in 0..2 {
        let a = run(rank, 0, &mut sampler);
        assert_eq!(a, run(rank, 3, &mut sampler), "rank {rank}: 0 and 3 workers differ");
        for (idx, _, labels) in &a {
            assert_eq!(labels, &idx.iter().map(|i| (i % 5) as u32).collect::<Vec<_>>());
        }
        seen.extend(a.into_iter().flat_map(|b| b.0));
    }
    // The two ranks' slices together are each global batch, no sample twice in the epoch.
    let mut all: Vec<usize> = (0..5).flat_map(|p| sampler.global_batch(1, p).to_vec()).collect();
    let mut mine = seen.clone();
    all.sort();
    mine.sort();
    assert_eq!(mine, all);
    mine.dedup();
    assert_eq!(mine.len(), 40);
}
