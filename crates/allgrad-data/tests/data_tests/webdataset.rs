//! webdataset shards: reading what the Python package writes, writing shards, the training
//! stream (identical for any number of workers and ranks, resumable at any batch), corrupt
//! samples and broken shards.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use allgrad_data::webdataset::{
    OnCorrupt, Sample, ShardReader, ShardStream, ShardWriter, StreamLoader, TarDataset, WebDatasetOptions,
};
use allgrad_data::{AugmentConfig, ColorMode, DataError, Dataset, LoaderConfig, Normalize, TwoViews};
use allgrad_testkit::Need;
use candle_core::Device;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/webdataset")
}

fn crc(bytes: &[u8]) -> u32 {
    let mut c = flate2::Crc::new();
    c.update(bytes);
    c.sum()
}

fn all_samples(shards: &[PathBuf]) -> Vec<Sample> {
    let mut out = Vec::new();
    for s in shards {
        let mut r = ShardReader::open(s).unwrap();
        while let Some(sample) = r.next_sample().unwrap() {
            out.push(sample);
        }
    }
    out
}

fn python_shards() -> Vec<PathBuf> {
    allgrad_data::webdataset::shard_paths(&["py-{000000..000001}.tar".into()], &fixture()).unwrap()
}

#[test]
fn shards_written_by_the_python_package_read_as_its_manifest_says() {
    let manifest: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(fixture().join("manifest.json")).unwrap()).unwrap();
    let manifest = manifest.as_sequence().unwrap();
    let samples = all_samples(&python_shards());
    assert_eq!(samples.len(), manifest.len());
    for (s, m) in samples.iter().zip(manifest) {
        assert_eq!(s.key, m["key"].as_str().unwrap());
        let members = m["members"].as_mapping().unwrap();
        assert_eq!(s.members.len(), members.len(), "{}", s.key);
        for (ext, info) in members {
            let bytes = s.member(ext.as_str().unwrap()).unwrap_or_else(|| panic!("{} lacks {ext:?}", s.key));
            assert_eq!(bytes.len() as u64, info["len"].as_u64().unwrap());
            assert_eq!(crc(bytes) as u64, info["crc32"].as_u64().unwrap(), "{} {ext:?}", s.key);
        }
        assert_eq!(s.class().unwrap().unwrap() as u64, m["cls"].as_u64().unwrap());
        assert_eq!(s.text().unwrap(), m["txt"].as_str().unwrap());
    }
    assert_eq!(samples[7].key, "sub/dir/sample007");
    assert_eq!(samples[6].image().unwrap().0, "png");
    // Random access: every image decodes, classes as written.
    let ds = TarDataset::open(&python_shards(), ColorMode::Rgb, 0).unwrap();
    assert_eq!((ds.len(), ds.num_classes()), (10, 3));
    for i in 0..10 {
        let img = ds.get(i).unwrap();
        assert_eq!((img.width, img.height, img.channels), (40, 30, 3));
        assert_eq!(ds.label(i).unwrap(), i % 3);
    }
    assert_eq!(TarDataset::open(&python_shards(), ColorMode::Rgb, 4).unwrap().len(), 4);
}

/// The Python-written samples again, through allgrad's writer, 3 per shard.
fn rewritten(dir: &Path) -> Vec<PathBuf> {
    let mut w = ShardWriter::new(dir, "rs", 3).unwrap();
    for s in all_samples(&python_shards()) {
        let members: Vec<(&str, &[u8])> = s.members.iter().map(|(e, b)| (e.as_str(), b.as_slice())).collect();
        w.write(&s.key, &members).unwrap();
    }
    assert_eq!(w.pattern(), "rs-{000000..000003}.tar");
    w.finish().unwrap()
}

#[test]
fn shards_written_here_hold_the_same_samples() {
    let dir = tempfile::tempdir().unwrap();
    let ours = rewritten(dir.path());
    assert_eq!(ours.len(), 4);
    let (a, b) = (all_samples(&python_shards()), all_samples(&ours));
    assert_eq!(
        a.iter().map(|s| (&s.key, &s.members)).collect::<Vec<_>>(),
        b.iter().map(|s| (&s.key, &s.members)).collect::<Vec<_>>()
    );
    // GNU tar reads them too.
    if gnu_tar() {
        let out = tar(&["--quoting-style=literal", "-tf"], &ours[0]);
        assert_eq!(out.lines().next(), Some("sample000.cls"), "{out}");
    }
    let mut w = ShardWriter::new(dir.path(), "bad", 3).unwrap();
    assert!(w.write("a.b", &[("jpg", b"x")]).is_err());
}

/// Whether GNU tar is here; if not, the test says so ([`Need::Tar`]) and should return.
fn gnu_tar() -> bool {
    let version = std::process::Command::new("tar").arg("--version").output();
    let gnu = version.as_ref().is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("GNU tar"));
    if !gnu {
        let why = match version {
            Err(e) => format!("`tar --version` does not run ({e})"),
            Ok(o) => {
                format!("`tar --version` says `{}`, not GNU tar", String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or(""))
            }
        };
        allgrad_testkit::skip(Need::Tar, &why);
    }
    gnu
}

/// GNU tar's output for `args` and `shard`; it must succeed.
fn tar(args: &[&str], shard: &Path) -> String {
    let mut cmd = std::process::Command::new("tar");
    cmd.args(args).arg(shard).env("LC_ALL", "C.UTF-8");
    let (out, _) = allgrad_testkit::process::run(&mut cmd, "tar", std::time::Duration::from_secs(60));
    let text = String::from_utf8(out.stdout).expect("tar's listing is UTF-8");
    assert!(out.status.success(), "tar {args:?} {}: {}\n{text}", shard.display(), String::from_utf8_lossy(&out.stderr));
    text
}

/// Keys as users' shards have them: over 100 bytes, non-ASCII, in folders, member names of
/// exactly 100 bytes and just over (the keys of `scripts/data/make_long_name_fixture.py`).
fn awkward_keys() -> Vec<String> {
    vec![
        "short000".into(),
        "a".repeat(120),
        "café/naïve-ñandú-日本語-002".into(),
        "長い名前".repeat(10) + "_003",
        format!("dir_{}/sub_{}/x004", "d".repeat(60), "e".repeat(60)),
        "b".repeat(96),
        "c".repeat(99),
        format!("über/{}/{}-007", "ß".repeat(60), "ø".repeat(40)),
    ]
}

/// Samples as written: key and `(extension, bytes)` of each member.
type Written = Vec<(String, Vec<(String, Vec<u8>)>)>;

/// One sample per awkward key, written here 3 per shard: members `png` (a different image
/// each), `cls`, `txt` (the key); the samples as written.
fn awkward_shards(dir: &Path) -> (Vec<PathBuf>, Written) {
    let mut w = ShardWriter::new(dir, "awk", 3).unwrap();
    let mut written = Vec::new();
    for (i, key) in awkward_keys().into_iter().enumerate() {
        let img = image::RgbImage::from_fn(6, 4, |x, y| image::Rgb([(x * 40 + i as u32) as u8, (y * 60) as u8, (i * 31) as u8]));
        let mut png = Vec::new();
        image::DynamicImage::ImageRgb8(img).write_to(&mut std::io::Cursor::new(&mut png), image::ImageOutputFormat::Png).unwrap();
        let members = vec![
            ("png".to_string(), png),
            ("cls".into(), (i % 3).to_string().into_bytes()),
            ("txt".into(), key.clone().into_bytes()),
        ];
        let refs: Vec<(&str, &[u8])> = members.iter().map(|(e, b)| (e.as_str(), b.as_slice())).collect();
        w.write(&key, &refs).unwrap();
        written.push((key, members));
    }
    (w.finish().unwrap(), written)
}

#[test]
fn shards_written_here_keep_long_and_non_ascii_names() {
    let dir = tempfile::tempdir().unwrap();
    let (shards, written) = awkward_shards(dir.path());
    assert!(written.iter().any(|(k, _)| k.len() > 100) && written.iter().any(|(k, _)| !k.is_ascii()));
    // Read back here, through and at each indexed offset.
    let samples = all_samples(&shards);
    assert_eq!(samples.iter().map(|s| (s.key.clone(), s.members.clone())).collect::<Vec<_>>(), written);
    let ds = TarDataset::open(&shards, ColorMode::Rgb, 0).unwrap();
    for (i, s) in samples.iter().enumerate() {
        let (at, offset) = ds.location(i).unwrap();
        assert_eq!(ShardReader::open_at(at, offset).unwrap().next_sample().unwrap().as_ref(), Some(s), "sample {i}");
        ds.get(i).unwrap();
    }
    // GNU tar lists every member under its full name and extracts the bytes written.
    if !gnu_tar() {
        return;
    }
    let out = dir.path().join("extracted");
    std::fs::create_dir(&out).unwrap();
    let mut listed = Vec::new();
    for shard in &shards {
        listed.extend(tar(&["--quoting-style=literal", "-tf"], shard).lines().map(str::to_string));
        tar(&["-C", out.to_str().unwrap(), "-xf"], shard);
    }
    let names: Vec<String> = written.iter().flat_map(|(k, m)| m.iter().map(move |(e, _)| format!("{k}.{e}"))).collect();
    assert_eq!(listed, names);
    for (key, members) in &written {
        for (ext, bytes) in members {
            let file = out.join(format!("{key}.{ext}"));
            assert_eq!(&std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display())), bytes, "{key}.{ext}");
        }
    }
}

/// The output of `scripts/reference/<script>` with `args`, run by the Python that CI provides
/// with webdataset (ALLGRAD_PYTHON, the PyTorch environment of `scripts/ci/get_torch.sh`); it
/// must succeed. Without that Python, or when it cannot import webdataset, the test says so
/// ([`Need::Torch`]) and gets `None`. (No separate probe: importing webdataset imports torch,
/// seconds each time.)
fn webdataset_python(script: &str, args: &[PathBuf]) -> Option<String> {
    let Some(python) = std::env::var_os("ALLGRAD_PYTHON").filter(|p| !p.is_empty()).map(PathBuf::from) else {
        allgrad_testkit::skip(Need::Torch, "ALLGRAD_PYTHON (a Python with webdataset 1.0.2) is unset");
        return None;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/reference").join(script);
    let mut cmd = std::process::Command::new(&python);
    cmd.arg(&script).args(args);
    let (out, _) = allgrad_testkit::process::run(&mut cmd, "a webdataset reference script", std::time::Duration::from_secs(120));
    let (stdout, stderr) = (String::from_utf8(out.stdout).unwrap(), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() && stderr.contains("No module named 'webdataset'") {
        let why = format!("ALLGRAD_PYTHON={} cannot import webdataset", python.display());
        allgrad_testkit::skip(Need::Torch, &why);
        return None;
    }
    assert!(out.status.success(), "{} {}: {}\n{stdout}\n{stderr}", python.display(), script.display(), out.status);
    Some(stdout)
}

#[test]
fn python_webdataset_reads_shards_written_here_as_written() {
    // webdataset's own reader (`webdataset.WebDataset`, no shuffling) over shards written here:
    // the same samples, in order, each member's length and CRC-32 as written; long and
    // non-ASCII keys included (what a sample's members are called is the key webdataset
    // groups them by, so a name it read wrong would split or rename a sample).
    let dir = tempfile::tempdir().unwrap();
    let (mut shards, mut written) = awkward_shards(dir.path());
    let images = image_shards(&dir.path().join("images"), 10, 4, None);
    for s in all_samples(&images) {
        written.push((s.key.clone(), s.members.clone()));
    }
    shards.extend(images);
    let Some(stdout) = webdataset_python("wds_read.py", &shards) else { return };
    let lines: Vec<serde_json::Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let (last, read) = lines.split_last().unwrap();
    assert_eq!(last["samples"].as_u64(), Some(written.len() as u64), "{stdout}");
    assert_eq!(read.len(), written.len());
    for ((key, members), got) in written.iter().zip(read) {
        assert_eq!(got["key"].as_str(), Some(key.as_str()));
        let got = got["members"].as_object().unwrap();
        assert_eq!(got.len(), members.len(), "{key}: {got:?}");
        for (ext, bytes) in members {
            let m = &got[ext.as_str()];
            assert_eq!((m[0].as_u64(), m[1].as_u64()), (Some(bytes.len() as u64), Some(crc(bytes) as u64)), "{key}.{ext}");
        }
    }
}

/// Image shards for the stream tests: `n` samples of 24x20 RGB PNG, `per` per shard, class
/// `i % 4`; sample `corrupt` (if any) has bytes that are no image.
pub(crate) fn image_shards(dir: &Path, n: usize, per: usize, corrupt: Option<usize>) -> Vec<PathBuf> {
    let mut w = ShardWriter::new(dir, "img", per).unwrap();
    for i in 0..n {
        let img = image::RgbImage::from_fn(24, 20, |x, y| {
            image::Rgb([(x as usize * 10 + i) as u8, (y * 12) as u8, (i * 37 % 256) as u8])
        });
        let mut png = Vec::new();
        image::DynamicImage::ImageRgb8(img).write_to(&mut std::io::Cursor::new(&mut png), image::ImageOutputFormat::Png).unwrap();
        if corrupt == Some(i) {
            png.truncate(40);
        }
        let cls = (i % 4).to_string();
        w.write(&format!("s{i:04}"), &[("png", &png), ("cls", cls.as_bytes())]).unwrap();
    }
    w.finish().unwrap()
}

pub(crate) fn options(streams: usize, resampled: bool, on_corrupt: OnCorrupt) -> WebDatasetOptions {
    WebDatasetOptions {
        train: vec!["unused".into()],
        epoch_samples: 48,
        streams,
        shuffle_buffer: 5,
        resampled,
        on_corrupt,
        ..Default::default()
    }
}

pub(crate) fn views() -> Arc<TwoViews> {
    let cfg = AugmentConfig { normalize: Normalize::identity(), ..AugmentConfig::simclr(8) };
    Arc::new(TwoViews::new(cfg).unwrap())
}

/// Flattened batches: (positions, views, labels).
pub(crate) type Flat = (Vec<usize>, Vec<Vec<f32>>, Vec<u32>);

pub(crate) fn run(source: &Arc<ShardStream>, plan: Vec<Vec<usize>>, workers: usize) -> Vec<Flat> {
    let cfg = LoaderConfig { workers, prefetch: 2, ..Default::default() };
    let loader = StreamLoader::new(source.clone(), views(), 7, 1, plan, &cfg, &Device::Cpu).unwrap();
    loader
        .map(|b| {
            let b = b.unwrap();
            let v = b.views.iter().map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
            (b.indices, v, b.labels.to_vec1::<u32>().unwrap())
        })
        .collect()
}

/// Rank `r` of `w`'s slices of global batches `steps` (global batch 12), in `acc`
/// micro-batches each, as the trainer plans them.
pub(crate) fn plan(steps: std::ops::Range<usize>, r: usize, w: usize, acc: usize) -> Vec<Vec<usize>> {
    let (b, local) = (12, 12 / w);
    let mut out = Vec::new();
    for s in steps {
        let mine: Vec<usize> = (s * b + r * local..s * b + (r + 1) * local).collect();
        out.extend(mine.chunks(local / acc).map(<[usize]>::to_vec));
    }
    out
}

/// The batches of every rank joined back into global batches.
fn join(ranks: Vec<Vec<Flat>>, per_step: usize) -> Vec<Flat> {
    let steps = ranks[0].len() / per_step;
    (0..steps)
        .map(|s| {
            let mut g: Flat = (Vec::new(), vec![Vec::new(), Vec::new()], Vec::new());
            for rank in &ranks {
                for part in &rank[s * per_step..(s + 1) * per_step] {
                    g.0.extend(&part.0);
                    g.1[0].extend(&part.1[0]);
                    g.1[1].extend(&part.1[1]);
                    g.2.extend(&part.2);
                }
            }
            g
        })
        .collect()
}

#[test]
fn stream_batches_do_not_depend_on_workers_ranks_or_micro_batches() {
    let dir = tempfile::tempdir().unwrap();
    let shards = image_shards(dir.path(), 30, 4, None);
    for resampled in [true, false] {
        let source =
            Arc::new(ShardStream::new(shards.clone(), options(4, resampled, OnCorrupt::Error), 12, ColorMode::Rgb).unwrap());
        let one = run(&source, plan(0..4, 0, 1, 1), 0);
        assert_eq!(one.len(), 4);
        assert_eq!(one[1].0, (12..24).collect::<Vec<_>>());
        for workers in [1, 3, 8] {
            assert!(run(&source, plan(0..4, 0, 1, 1), workers) == one, "{workers} workers");
        }
        for (w, acc) in [(2, 1), (4, 1), (2, 3), (4, 3)] {
            let ranks: Vec<Vec<Flat>> = (0..w).map(|r| run(&source, plan(0..4, r, w, acc), 2)).collect();
            assert!(join(ranks, acc) == one, "{w} ranks, {acc} micro-batches");
        }
        // The shuffle buffer and the shard draws mix the samples: the first batch is not the
        // shards' first samples in order, and every label is a class of the data.
        assert!(one[0].2.iter().all(|&l| l < 4));
        let labels: Vec<u32> = one.iter().flat_map(|b| b.2.clone()).collect();
        assert_ne!(labels, (0..48).map(|i| (i % 4) as u32).collect::<Vec<_>>());
    }
}

#[test]
fn a_plan_that_starts_mid_epoch_gives_the_uninterrupted_batches() {
    let dir = tempfile::tempdir().unwrap();
    for (corrupt, on_corrupt, resampled) in [
        (None, OnCorrupt::Error, true),
        (Some(5), OnCorrupt::Skip, true),
        (None, OnCorrupt::Error, false),
        (Some(5), OnCorrupt::Skip, false),
    ] {
        let shards = image_shards(dir.path(), 30, 4, corrupt);
        let source = Arc::new(ShardStream::new(shards, options(4, resampled, on_corrupt), 12, ColorMode::Rgb).unwrap());
        let whole = run(&source, plan(0..4, 0, 1, 1), 2);
        for start in 1..4 {
            // Rank 1 of 2 resuming at `start`: the tail of its uninterrupted batches.
            let resumed = run(&source, plan(start..4, 1, 2, 1), 1);
            let uninterrupted = run(&source, plan(0..4, 1, 2, 1), 1);
            assert!(resumed[..] == uninterrupted[start..], "resume at step {start}");
            assert!(join(vec![run(&source, plan(start..4, 0, 2, 1), 0), resumed], 1) == whole[start..], "both ranks at {start}");
        }
        if corrupt.is_some() {
            assert!(source.skipped() > 0, "the corrupt sample was never drawn");
        }
    }
}

/// A pipeline that hands the decoded image on as it is (one view: its bytes as floats), so a
/// batch says exactly which samples it holds.
pub(crate) struct Pixels;

impl allgrad_data::Pipeline for Pixels {
    fn num_views(&self) -> usize {
        1
    }

    fn view(&self, img: &allgrad_data::Image, _: allgrad_data::ViewKey) -> allgrad_data::DataResult<allgrad_data::Chw> {
        let data = img.pixels.iter().map(|&b| b as f32).collect::<Vec<_>>();
        Ok(allgrad_data::Chw { channels: 1, height: 1, width: data.len(), data })
    }
}

/// Every sample of `shards` by its decoded pixels: pixels -> key. The test images differ in
/// every sample, so the pixels name the sample.
pub(crate) fn keys_by_pixels(shards: &[PathBuf]) -> std::collections::HashMap<Vec<u8>, String> {
    let mut out = std::collections::HashMap::new();
    for s in all_samples(shards) {
        let img = allgrad_data::decode_image(s.image().unwrap().1, ColorMode::Rgb, Path::new(&s.key)).unwrap();
        assert!(out.insert(img.pixels, s.key.clone()).is_none(), "two samples with the same pixels");
    }
    out
}

/// The (position, key) of every sample of the batches `plan` gives, batch by batch, through
/// [`Pixels`]: which sample, by key, and that its bytes are that sample's, exactly.
pub(crate) fn keyed(
    source: &Arc<ShardStream>,
    keys: &std::collections::HashMap<Vec<u8>, String>,
    epoch: u64,
    plan: Vec<Vec<usize>>,
    workers: usize,
) -> Vec<Vec<(usize, String)>> {
    let cfg = LoaderConfig { workers, prefetch: 2, ..Default::default() };
    let loader = StreamLoader::new(source.clone(), Arc::new(Pixels), 7, epoch, plan, &cfg, &Device::Cpu).unwrap();
    loader
        .map(|b| {
            let b = b.unwrap();
            let v = b.views[0].flatten_from(1).unwrap().to_vec2::<f32>().unwrap();
            b.indices
                .iter()
                .zip(v)
                .map(|(&p, px)| {
                    let px: Vec<u8> = px.iter().map(|&f| f as u8).collect();
                    (p, keys.get(&px).unwrap_or_else(|| panic!("position {p}: pixels of no sample")).clone())
                })
                .collect()
        })
        .collect()
}

/// Shards of `shards` × `per` samples (keys `s0000`, ...), each image different.
fn even_shards(dir: &Path, shards: usize, per: usize) -> Vec<PathBuf> {
    image_shards(dir, shards * per, per, None)
}

#[test]
fn without_resampling_an_epoch_gives_every_sample_once() {
    // 12 shards of 4 samples, an epoch of all 48: each stream owns 12 / streams shards, which
    // hold its 48 / streams samples of the epoch; every sample must come exactly once, whatever
    // the shuffle buffer (larger than a stream's share included), the streams and W.
    let dir = tempfile::tempdir().unwrap();
    let shards = even_shards(dir.path(), 12, 4);
    let keys = keys_by_pixels(&shards);
    let mut all: Vec<String> = keys.values().cloned().collect();
    all.sort();
    for streams in [1, 3, 4] {
        for buffer in [0, 1, 5, 13, 100] {
            let opts = WebDatasetOptions { shuffle_buffer: buffer, ..options(streams, false, OnCorrupt::Error) };
            let source = Arc::new(ShardStream::new(shards.clone(), opts, 12, ColorMode::Rgb).unwrap());
            for w in [1, 2, 3, 4].into_iter().filter(|w| streams % w == 0) {
                for epoch in [1, 2] {
                    let mut seen: Vec<String> = (0..w)
                        .flat_map(|r| keyed(&source, &keys, epoch, plan(0..4, r, w, 1), 1))
                        .flatten()
                        .map(|(_, k)| k)
                        .collect();
                    seen.sort();
                    let twice: Vec<_> = seen.windows(2).filter(|p| p[0] == p[1]).map(|p| p[0].clone()).collect();
                    assert!(
                        seen == all,
                        "{streams} streams, buffer {buffer}, W = {w}, epoch {epoch}: {} samples, repeated {twice:?}",
                        seen.len()
                    );
                }
            }
        }
    }
    // The same on the shards webdataset's own writer wrote (2 shards of 5): global batches of 2,
    // an epoch of all 10.
    let py = python_shards();
    let keys = keys_by_pixels(&py);
    let mut all: Vec<String> = keys.values().cloned().collect();
    all.sort();
    for streams in [1, 2] {
        for buffer in [0, 3, 7] {
            let opts =
                WebDatasetOptions { shuffle_buffer: buffer, epoch_samples: 10, ..options(streams, false, OnCorrupt::Error) };
            let source = Arc::new(ShardStream::new(py.clone(), opts, 2, ColorMode::Rgb).unwrap());
            for w in [1, 2].into_iter().filter(|w| streams % w == 0) {
                let mut seen: Vec<String> = (0..w)
                    .flat_map(|r| {
                        let plan = (0..5).map(|b| (2 * b..2 * b + 2).skip(r * 2 / w).take(2 / w).collect()).collect();
                        keyed(&source, &keys, 1, plan, 1)
                    })
                    .flatten()
                    .map(|(_, k)| k)
                    .collect();
                seen.sort();
                assert_eq!(seen, all, "Python-written shards: {streams} streams, buffer {buffer}, W = {w}");
            }
        }
    }
}

#[test]
fn a_resumed_stream_gives_the_same_samples_by_key_and_bytes() {
    // Resampled and not (the latter cycling through its shards: 30 samples in shards of 4 feed an
    // epoch of 48), with a shuffle buffer, for several stream counts and W: rank r of W starting
    // at step `start` gives exactly the samples (key and bytes) of the uninterrupted run's steps
    // `start..`.
    let dir = tempfile::tempdir().unwrap();
    let shards = image_shards(dir.path(), 30, 4, None);
    let keys = keys_by_pixels(&shards);
    for resampled in [true, false] {
        for (streams, buffer) in [(1, 5), (2, 3), (4, 5), (4, 0)] {
            let opts = WebDatasetOptions { shuffle_buffer: buffer, ..options(streams, resampled, OnCorrupt::Error) };
            let source = Arc::new(ShardStream::new(shards.clone(), opts, 12, ColorMode::Rgb).unwrap());
            for w in [1, 2, 4].into_iter().filter(|w| streams % w == 0) {
                for r in 0..w {
                    let whole = keyed(&source, &keys, 1, plan(0..4, r, w, 1), 1);
                    for start in 1..4 {
                        let resumed = keyed(&source, &keys, 1, plan(start..4, r, w, 1), 2);
                        assert!(
                            resumed[..] == whole[start..],
                            "resampled {resampled}, {streams} streams, buffer {buffer}, rank {r} of {w}, resumed at step {start}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn corrupt_samples_are_errors_naming_them_or_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let shards = image_shards(dir.path(), 12, 12, Some(3));
    // No shuffling, one stream, one shard: sample 3 comes fourth.
    let opts = WebDatasetOptions { shuffle_buffer: 0, ..options(1, false, OnCorrupt::Error) };
    let source = Arc::new(ShardStream::new(shards.clone(), opts.clone(), 12, ColorMode::Rgb).unwrap());
    let mut loader =
        StreamLoader::new(source, views(), 0, 0, vec![(0..12).collect()], &LoaderConfig::default(), &Device::Cpu).unwrap();
    let err = loader.next().unwrap().unwrap_err();
    assert!(matches!(err, DataError::CorruptSample { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("img-000000.tar") && msg.contains("`s0003`") && msg.contains("byte"), "{msg}");
    assert!(loader.next().is_none(), "a failed stream stops");
    let skip = WebDatasetOptions { on_corrupt: OnCorrupt::Skip, ..opts };
    let source = Arc::new(ShardStream::new(shards, skip, 12, ColorMode::Rgb).unwrap());
    let batches = run(&source, vec![(0..12).collect()], 1);
    // Samples 0, 1, 2, 4, 5, ... : classes 0, 1, 2, 0, 1, 2, 3, ...
    assert_eq!(batches[0].2[..5], [0, 1, 2, 0, 1]);
    assert_eq!(source.skipped(), 1);
}

/// The first batch of `plan` over `shards`, or its error, within 20 s (a stream that never
/// gives a batch fails the test instead of hanging it).
pub(crate) fn first_batch_within(
    shards: Vec<PathBuf>,
    opts: WebDatasetOptions,
    plan: Vec<Vec<usize>>,
) -> Result<Vec<u32>, DataError> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let source = Arc::new(ShardStream::new(shards, opts, 4, ColorMode::Rgb).unwrap());
        let mut loader = StreamLoader::new(source, views(), 0, 0, plan, &LoaderConfig::default(), &Device::Cpu).unwrap();
        let _ = tx.send(loader.next().unwrap().map(|b| b.labels.to_vec1::<u32>().unwrap()));
    });
    allgrad_testkit::process::recv_within(&rx, "the stream's first batch", std::time::Duration::from_secs(20))
}

#[test]
fn a_stream_whose_every_sample_is_skipped_is_an_error_naming_a_shard() {
    // Shards of gif-only samples (a format the reader does not take): under on_corrupt: skip
    // each sample is left out; once every shard a stream reads has given nothing else, the
    // stream says so, naming a shard and why, instead of skipping forever.
    let dir = tempfile::tempdir().unwrap();
    let mut w = ShardWriter::new(dir.path(), "gif", 3).unwrap();
    for i in 0..6 {
        w.write(&format!("w{i}"), &[("gif", b"GIF89a\x01\0\x01\0"), ("cls", b"1")]).unwrap();
    }
    let gif = w.finish().unwrap();
    let plan = vec![(0..4).collect()];
    for (resampled, buffer) in [(true, 0), (true, 5), (false, 0), (false, 5)] {
        let opts = WebDatasetOptions { shuffle_buffer: buffer, epoch_samples: 4, ..options(1, resampled, OnCorrupt::Skip) };
        let err = first_batch_within(gif.clone(), opts.clone(), plan.clone()).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, DataError::Shard { .. }), "{msg}");
        assert!(msg.contains("gif-00000") && msg.contains("no jpg, jpeg, png or webp member (members: gif, cls)"), "{msg}");
        assert!(msg.contains("every sample of this shard was left out"), "{msg}");
        // With one good shard among them the stream goes on, leaving the others' samples out.
        let good = image_shards(&dir.path().join("good"), 4, 4, None);
        let mixed = [gif.clone(), good].concat();
        let labels = first_batch_within(mixed, opts, plan.clone()).unwrap();
        assert_eq!(labels.len(), 4);
    }
}

#[test]
fn broken_shards_are_errors_naming_the_shard_and_the_offset() {
    let dir = tempfile::tempdir().unwrap();
    let shard = &image_shards(dir.path(), 3, 3, None)[0];
    let full = std::fs::read(shard).unwrap();
    let cut = dir.path().join("cut.tar");
    // Every cut before the end-of-archive block (the last 1024 bytes, two zero blocks; a cut
    // in the second loses nothing): an error (never a panic, never fewer samples in silence).
    let end = full.len() - 1024;
    assert!(full[end..].iter().all(|&b| b == 0));
    for n in (0..end + 512).step_by(97).chain([512, 1024, end, end + 511]) {
        std::fs::write(&cut, &full[..n]).unwrap();
        let mut r = ShardReader::open(&cut).unwrap();
        let err = loop {
            match r.next_sample() {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("a shard cut at byte {n} of {} read to its end", full.len()),
                Err(e) => break e,
            }
        };
        assert!(matches!(err, DataError::Shard { .. }), "cut at {n}: {err}");
        assert!(err.to_string().contains("cut.tar") && err.to_string().contains("byte"), "{err}");
    }
    // Cut inside a member's data: the message says where the member starts and the file ends.
    std::fs::write(&cut, &full[..700]).unwrap();
    let err = ShardReader::open(&cut).unwrap().next_sample().unwrap_err().to_string();
    assert!(err.contains("byte 0") && err.contains("file ends at byte 700"), "{err}");
    // Garbage where a header should be.
    let mut junk = full.clone();
    junk[..512].fill(b'x');
    std::fs::write(&cut, &junk).unwrap();
    let err = ShardReader::open(&cut).unwrap().next_sample().unwrap_err().to_string();
    assert!(err.contains("not a tar header"), "{err}");
    // A missing shard, through the stream: its path in the message.
    let missing = dir.path().join("nope-000001.tar");
    let source = Arc::new(ShardStream::new(vec![missing], options(1, true, OnCorrupt::Skip), 12, ColorMode::Rgb).unwrap());
    let err = StreamLoader::new(source, views(), 0, 0, vec![(0..12).collect()], &LoaderConfig::default(), &Device::Cpu)
        .unwrap()
        .next()
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, DataError::ShardMissing { .. }) && err.to_string().contains("nope-000001.tar"), "{err}");
}

#[test]
fn options_are_checked_against_the_batch_and_the_world() {
    let o = options(4, true, OnCorrupt::Error);
    assert!(o.validate(12, 2).is_ok());
    let e = o.validate(12, 3).unwrap_err().to_string();
    assert!(e.contains("not a multiple of the world size 3"), "{e}");
    let e = o.validate(10, 1).unwrap_err().to_string();
    assert!(e.contains("train.global_batch = 10 is not divisible by webdataset.streams = 4"), "{e}");
    let e = WebDatasetOptions { epoch_samples: 0, ..o.clone() }.validate(12, 1).unwrap_err().to_string();
    assert!(e.contains("epoch_samples"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let two = image_shards(dir.path(), 4, 2, None);
    let e = ShardStream::new(two, options(4, false, OnCorrupt::Error), 12, ColorMode::Rgb).unwrap_err().to_string();
    assert!(e.contains("only 2 shards"), "{e}");
}

#[test]
fn python_written_shards_train_as_the_same_samples_written_here() {
    // The Python shards' samples rewritten here with the same shard boundaries (5 per shard):
    // the stream must give the same batches, bit for bit, from either set.
    let dir = tempfile::tempdir().unwrap();
    let mut w = ShardWriter::new(dir.path(), "rs", 5).unwrap();
    for s in all_samples(&python_shards()) {
        let members: Vec<(&str, &[u8])> = s.members.iter().map(|(e, b)| (e.as_str(), b.as_slice())).collect();
        w.write(&s.key, &members).unwrap();
    }
    let ours = w.finish().unwrap();
    let opts = WebDatasetOptions { shuffle_buffer: 3, epoch_samples: 12, ..options(2, true, OnCorrupt::Error) };
    let plan: Vec<Vec<usize>> = (0..3).map(|b| (b * 4..b * 4 + 4).collect()).collect();
    let py = Arc::new(ShardStream::new(python_shards(), opts.clone(), 4, ColorMode::Rgb).unwrap());
    let rs = Arc::new(ShardStream::new(ours, opts, 4, ColorMode::Rgb).unwrap());
    let (a, b) = (run(&py, plan.clone(), 1), run(&rs, plan, 2));
    assert_eq!(a.len(), 3);
    assert!(a == b, "batches differ between the Python-written and the rewritten shards");
}

/// The long-name shards (`scripts/data/make_long_name_fixture.py`): the same samples written by
/// webdataset's `TarWriter` (PAX) and by Python's tarfile as PAX, GNU and ustar.
const LONG_NAME_SHARDS: [&str; 4] = ["long-wds.tar", "long-pax.tar", "long-gnu.tar", "long-ustar.tar"];

#[test]
fn long_and_non_ascii_names_read_by_the_stream_and_by_random_access() {
    let manifest: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(fixture().join("long-manifest.json")).unwrap()).unwrap();
    for name in LONG_NAME_SHARDS {
        let path = fixture().join(name);
        let expected = manifest[name].as_sequence().unwrap();
        let keys: Vec<&str> = expected.iter().map(|m| m["key"].as_str().unwrap()).collect();
        // What the fixture holds: keys over 100 bytes and non-ASCII ones (but for ustar, which
        // has no room for the longest).
        assert!(keys.iter().any(|k| k.len() > 100) && keys.iter().any(|k| !k.is_ascii()), "{name}");
        // Read through: keys, members and bytes as written.
        let samples = all_samples(std::slice::from_ref(&path));
        assert_eq!(samples.iter().map(|s| s.key.as_str()).collect::<Vec<_>>(), keys, "{name}");
        for (s, m) in samples.iter().zip(expected) {
            let members = m["members"].as_mapping().unwrap();
            assert_eq!(s.members.len(), members.len(), "{name} {}", s.key);
            for (ext, info) in members {
                let bytes = s.member(ext.as_str().unwrap()).unwrap_or_else(|| panic!("{name}: {} lacks {ext:?}", s.key));
                assert_eq!(bytes.len() as u64, info["len"].as_u64().unwrap(), "{name} {} {ext:?}", s.key);
                assert_eq!(crc(bytes) as u64, info["crc32"].as_u64().unwrap(), "{name} {} {ext:?}", s.key);
            }
            assert_eq!(s.text().unwrap(), s.key, "{name}: the txt member holds the key");
        }
        // Random access: the sample at each indexed offset is the whole sample, long name
        // included, and decodes to the image the stream read.
        let ds = TarDataset::open(std::slice::from_ref(&path), ColorMode::Rgb, 0).unwrap();
        assert_eq!(ds.len(), samples.len(), "{name}");
        for (i, (s, m)) in samples.iter().zip(expected).enumerate() {
            let (at, offset) = ds.location(i).unwrap();
            let again = ShardReader::open_at(at, offset).unwrap().next_sample().unwrap();
            assert_eq!(again.as_ref(), Some(s), "{name}: sample {i} read again at byte {offset}");
            let img = ds.get(i).unwrap_or_else(|e| panic!("{name}: sample {i} (`{}`): {e}", s.key));
            let streamed = allgrad_data::decode_image(s.image().unwrap().1, ColorMode::Rgb, &path).unwrap();
            assert_eq!(img, streamed, "{name} {}", s.key);
            assert_eq!(ds.label(i).unwrap() as u64, m["cls"].as_u64().unwrap());
        }
        // The training stream (one stream, no shuffling): every sample, in order, by its pixels.
        let pixels = keys_by_pixels(std::slice::from_ref(&path));
        let n = samples.len();
        let opts = WebDatasetOptions { shuffle_buffer: 0, epoch_samples: n, ..options(1, false, OnCorrupt::Error) };
        let source = Arc::new(ShardStream::new(vec![path.clone()], opts, n, ColorMode::Rgb).unwrap());
        let got = keyed(&source, &pixels, 0, vec![(0..n).collect()], 1);
        assert_eq!(got[0].iter().map(|(_, k)| k.as_str()).collect::<Vec<_>>(), keys, "{name}");
    }
}

#[test]
fn shard_lists_joined_by_double_colons_gzip_shards_and_a_field_selection() {
    let dir = tempfile::tempdir().unwrap();
    let shards = image_shards(dir.path(), 12, 4, None);
    // `::` joins lists, each a brace pattern.
    let listed = allgrad_data::webdataset::shard_paths(&["img-000000.tar::img-{000001..000002}.tar".into()], dir.path()).unwrap();
    assert_eq!(listed, shards);
    let err = allgrad_data::webdataset::shard_paths(&["img-000000.tar::".into()], dir.path()).unwrap_err().to_string();
    assert!(err.contains("img-000000.tar::") && err.contains("empty entry"), "{err}");
    // The same shards gzip-compressed (`.tar.gz`): the same samples, stream, random access and
    // resume from a saved position.
    let gz: Vec<PathBuf> = shards
        .iter()
        .map(|s| {
            let to = s.with_extension("tar.gz");
            let mut enc = flate2::write::GzEncoder::new(std::fs::File::create(&to).unwrap(), flate2::Compression::default());
            std::io::Write::write_all(&mut enc, &std::fs::read(s).unwrap()).unwrap();
            enc.finish().unwrap();
            to
        })
        .collect();
    assert!(all_samples(&gz) == all_samples(&shards));
    let o = options(4, true, OnCorrupt::Error);
    let plain = Arc::new(ShardStream::new(shards.clone(), o.clone(), 12, ColorMode::Rgb).unwrap());
    let zipped = Arc::new(ShardStream::new(gz.clone(), o.clone(), 12, ColorMode::Rgb).unwrap());
    let whole = run(&plain, plan(0..4, 0, 1, 1), 1);
    assert!(run(&zipped, plan(0..4, 0, 1, 1), 2) == whole, "gzip shards stream otherwise");
    let (a, b) = (TarDataset::open(&shards, ColorMode::Rgb, 0).unwrap(), TarDataset::open(&gz, ColorMode::Rgb, 0).unwrap());
    for i in (0..12).rev() {
        assert_eq!(a.get(i).unwrap(), b.get(i).unwrap(), "sample {i} by random access");
    }
    let first = Arc::new(ShardStream::new(gz.clone(), o.clone(), 12, ColorMode::Rgb).unwrap());
    run(&first, plan(0..2, 0, 1, 1), 1);
    let resumed = Arc::new(ShardStream::new(gz.clone(), o.clone(), 12, ColorMode::Rgb).unwrap());
    resumed.resume_from(first.state().unwrap()).unwrap();
    assert!(run(&resumed, plan(2..4, 0, 1, 1), 1)[..] == whole[2..], "resumed on gzip shards");
    // A gzip shard cut short: an error naming it and the byte.
    let cut = dir.path().join("cut.tar.gz");
    let bytes = std::fs::read(&gz[0]).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let mut r = ShardReader::open(&cut).unwrap();
    let err = loop {
        match r.next_sample() {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("a cut gzip shard read to its end"),
            Err(e) => break e,
        }
    };
    assert!(matches!(err, DataError::Shard { .. }) && err.to_string().contains("cut.tar.gz"), "{err}");
    // A field selection keeps only the members listed: without `cls`, every label is 0; with
    // it, the batches are the unselected ones.
    let png_only = WebDatasetOptions { fields: vec!["png".into()], ..o.clone() };
    let source = Arc::new(ShardStream::new(shards.clone(), png_only, 12, ColorMode::Rgb).unwrap());
    let got = run(&source, plan(0..4, 0, 1, 1), 1);
    assert!(got.iter().all(|b| b.2.iter().all(|&l| l == 0)) && whole.iter().any(|b| b.2.iter().any(|&l| l != 0)));
    assert!(got.iter().zip(&whole).all(|(g, w)| g.1 == w.1), "the images are those of the unselected stream");
    let both = WebDatasetOptions { fields: vec!["png".into(), "cls".into()], ..o };
    let source = Arc::new(ShardStream::new(shards, both, 12, ColorMode::Rgb).unwrap());
    assert!(run(&source, plan(0..4, 0, 1, 1), 1) == whole);
}
