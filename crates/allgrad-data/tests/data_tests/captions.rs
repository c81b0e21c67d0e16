//! Image-caption pairs through the loaders: each sample's caption reaches the batch as token
//! ids encoded on the loader's threads, from webdataset shards (a `txt` member, or a field of
//! the `json` member, as img2dataset writes them) and from an indexed data set's text; a
//! sample without its caption is an error naming the shard and the key, or is left out and
//! counted under `on_corrupt: skip`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use allgrad_data::webdataset::{CaptionField, OnCorrupt, ShardStream, ShardWriter, StreamLoader, WebDatasetOptions};
use allgrad_data::{
    Chw, ColorMode, DataError, DataResult, Dataset, FloatImage, Image, Loader, LoaderConfig, Normalize, Pipeline, ViewKey,
};
use candle_core::Device;

/// The plain image as one view; a caption's bytes as its "token ids".
struct Bytes;

impl Pipeline for Bytes {
    fn num_views(&self) -> usize {
        1
    }
    fn view(&self, img: &Image, _key: ViewKey) -> DataResult<Chw> {
        Normalize::identity().apply(&FloatImage::from_image(img))
    }
    fn takes_text(&self) -> bool {
        true
    }
    fn encode_text(&self, text: &str) -> DataResult<Vec<u32>> {
        Ok(text.bytes().map(u32::from).collect())
    }
}

fn png(i: usize) -> Vec<u8> {
    Image::new(6, 4, 3, (0..72).map(|p| (p * 3 + i * 17) as u8).collect()).unwrap().to_png().unwrap()
}

/// 16 pairs in 4 shards of 4, the caption of sample i `caption i` in a `txt` member and in the
/// `caption` field of a `json` member; sample `missing` has neither.
fn shards(dir: &Path, missing: Option<usize>) -> Vec<PathBuf> {
    let mut w = ShardWriter::new(dir, "pairs", 4).unwrap();
    for i in 0..16 {
        let (img, txt) = (png(i), format!("caption {i}"));
        let json = format!(r#"{{"caption": "caption {i}", "width": 6}}"#);
        if missing == Some(i) {
            w.write(&format!("s{i:03}"), &[("png", &img), ("json", br#"{"width": 6}"#)]).unwrap();
        } else {
            w.write(&format!("s{i:03}"), &[("png", &img), ("txt", txt.as_bytes()), ("json", json.as_bytes())]).unwrap();
        }
    }
    w.finish().unwrap()
}

fn options(on_corrupt: OnCorrupt) -> WebDatasetOptions {
    WebDatasetOptions {
        train: vec!["unused".into()],
        epoch_samples: 16,
        streams: 2,
        shuffle_buffer: 0,
        resampled: false,
        on_corrupt,
        ..Default::default()
    }
}

/// The captions of the batches of `plan`, decoded back from their token ids.
fn captions(stream: ShardStream, plan: Vec<Vec<usize>>, workers: usize) -> DataResult<Vec<Vec<String>>> {
    let cfg = LoaderConfig { workers, prefetch: 2, ..Default::default() };
    let loader = StreamLoader::new(Arc::new(stream), Arc::new(Bytes), 3, 0, plan, &cfg, &Device::Cpu)?;
    loader
        .map(|b| {
            let b = b?;
            assert_eq!(b.tokens.len(), b.indices.len(), "one caption per sample");
            Ok(b.tokens.iter().map(|t| t.iter().map(|&c| c as u8 as char).collect()).collect())
        })
        .collect()
}

#[test]
fn captions_from_a_txt_member_or_a_json_field_reach_the_batch_as_token_ids() {
    let dir = tempfile::tempdir().unwrap();
    let shards = shards(dir.path(), None);
    let plan = vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]];
    let stream = |field: CaptionField| {
        ShardStream::new(shards.clone(), options(OnCorrupt::Error), 4, ColorMode::Rgb).unwrap().with_caption(field)
    };
    let from_txt = captions(stream(CaptionField::default()), plan.clone(), 2).unwrap();
    let from_json = captions(stream(CaptionField::Json("caption".into())), plan.clone(), 0).unwrap();
    assert_eq!(from_txt, from_json, "the txt member and the json field hold the same captions");
    let all: Vec<&String> = from_txt.iter().flatten().collect();
    assert_eq!(all.len(), 8);
    assert!(all.iter().all(|c| c.starts_with("caption ")), "{all:?}");
    // Without captions the batch carries none; a pipeline that takes them is refused.
    let plain = ShardStream::new(shards.clone(), options(OnCorrupt::Error), 4, ColorMode::Rgb).unwrap();
    let e = captions(plain, plan, 1).unwrap_err().to_string();
    assert!(e.contains("takes captions but the stream reads none"), "{e}");
    // The field's spelling in a config.
    assert_eq!(CaptionField::try_from("json:caption".to_string()), Ok(CaptionField::Json("caption".into())));
    assert!(CaptionField::try_from("json:".to_string()).is_err());
}

#[test]
fn a_sample_without_its_caption_is_named_with_shard_and_key_or_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let shards = shards(dir.path(), Some(5));
    // The whole epoch: every sample is read (in order, no shuffle buffer), the bad one too.
    let plan: Vec<Vec<usize>> = vec![(0..8).collect(), (8..16).collect()];
    for field in [CaptionField::default(), CaptionField::Json("caption".into())] {
        let stream = ShardStream::new(shards.clone(), options(OnCorrupt::Error), 8, ColorMode::Rgb).unwrap();
        let e = captions(stream.with_caption(field.clone()), plan.clone(), 2).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, DataError::CorruptSample { ref key, .. } if key == "s005"), "{text}");
        assert!(text.contains("pairs-000001.tar") && text.contains("no caption"), "{text}");
        // Skipped: the epoch's samples all have captions, and the skip is counted.
        let stream =
            Arc::new(ShardStream::new(shards.clone(), options(OnCorrupt::Skip), 8, ColorMode::Rgb).unwrap().with_caption(field));
        let cfg = LoaderConfig { workers: 1, prefetch: 1, ..Default::default() };
        let batches: Vec<_> =
            StreamLoader::new(stream.clone(), Arc::new(Bytes), 3, 0, plan.clone(), &cfg, &Device::Cpu).unwrap().collect();
        let texts: Vec<String> =
            batches.into_iter().flat_map(|b| b.unwrap().tokens).map(|t| t.iter().map(|&c| c as u8 as char).collect()).collect();
        assert_eq!(texts.len(), 16);
        assert!(!texts.contains(&"caption 5".to_string()) && texts.iter().all(|t| t.starts_with("caption ")));
        assert_eq!(stream.skipped(), 1);
    }
}

/// Images with a text per sample, the last without.
struct Texts(Vec<Image>);

impl Dataset for Texts {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn get(&self, i: usize) -> DataResult<Image> {
        Ok(self.0[i].clone())
    }
    fn label(&self, _: usize) -> DataResult<usize> {
        Ok(0)
    }
    fn num_classes(&self) -> usize {
        1
    }
    fn text(&self, i: usize) -> DataResult<Option<String>> {
        Ok((i + 1 < self.0.len()).then(|| format!("text {i}")))
    }
}

#[test]
fn an_indexed_data_sets_text_is_encoded_on_the_loaders_threads() {
    let data = Arc::new(Texts((0..5).map(|i| Image::new(3, 3, 1, vec![i as u8; 9]).unwrap()).collect()));
    let cfg = LoaderConfig { workers: 2, prefetch: 2, ..Default::default() };
    let out: Vec<_> =
        Loader::new(data, Arc::new(Bytes), 0, 0, vec![vec![3, 1], vec![0, 4]], &cfg, &Device::Cpu).unwrap().collect();
    let first = out[0].as_ref().unwrap();
    assert_eq!(first.tokens, vec![b"text 3".map(u32::from).to_vec(), b"text 1".map(u32::from).to_vec()]);
    let e = out[1].as_ref().unwrap_err().to_string();
    assert!(e.contains("sample 4 has no text"), "{e}");
}

#[test]
fn a_captioned_stream_resumed_from_its_saved_position_gives_the_uninterrupted_captions() {
    // Captions read after a resume come from the samples the saved position names (the shard
    // reopened at its offset, the shuffle buffer's samples read again), not from the epoch's start.
    let dir = tempfile::tempdir().unwrap();
    let shards = shards(dir.path(), None);
    let opts = WebDatasetOptions { shuffle_buffer: 3, ..options(OnCorrupt::Error) };
    let stream = || {
        Arc::new(ShardStream::new(shards.clone(), opts.clone(), 4, ColorMode::Rgb).unwrap().with_caption(CaptionField::default()))
    };
    let plan: Vec<Vec<usize>> = (0..4).map(|b| (b * 4..b * 4 + 4).collect()).collect();
    let cfg = LoaderConfig { workers: 2, prefetch: 2, ..Default::default() };
    let read = |s: Arc<ShardStream>, plan: Vec<Vec<usize>>| -> Vec<Vec<Vec<u32>>> {
        StreamLoader::new(s, Arc::new(Bytes), 3, 0, plan, &cfg, &Device::Cpu).unwrap().map(|b| b.unwrap().tokens).collect()
    };
    let whole = read(stream(), plan.clone());
    let first = stream();
    assert_eq!(read(first.clone(), plan[..2].to_vec()), whole[..2]);
    let state = first.state().unwrap();
    assert!(!state.is_empty(), "the stream saved its position");
    let resumed = stream();
    resumed.resume_from(state).unwrap();
    let rest = read(resumed.clone(), plan[2..].to_vec());
    assert_eq!(rest, whole[2..], "the resumed captions are the uninterrupted run's");
    // What the resume read: the buffers' samples again and the 8 new ones, not the epoch from its start.
    assert!(resumed.samples_read() < 16, "read {} samples", resumed.samples_read());
}
