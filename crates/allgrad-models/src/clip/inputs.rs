//! The training data of CLIP: image-caption pairs from a CSV, a captioned image data set or
//! webdataset shards, turned into the towers' inputs on the loader's worker threads (images
//! decoded and preprocessed, captions tokenized as they are read), prefetched, and kept for
//! the step that asked for them, so that gradient caching (which embeds each chunk twice)
//! decodes each sample once.

use std::sync::Arc;

use allgrad_data::webdataset::{ShardStream, StreamLoader, StreamState};
use allgrad_data::{ColorMode, DataError, DataResult, Dataset, IdxDataset, Image, Loader, Pipeline, Preprocess, Split, ViewKey};
use candle_core::{Device, Result, Tensor};

use super::data::{ClassCaptions, CsvPairs};
use super::folder::ClipTokenizer;
use super::settings::ClipData;
use crate::{Batch, ModelError};

/// What a pair becomes on the loader's threads: its image through the model's preprocessing
/// (one view), its caption through the tokenizer.
pub struct ClipInputs {
    /// The image preprocessing (training or evaluation views).
    pub image: Preprocess,
    /// The caption tokenizer.
    pub tokenizer: ClipTokenizer,
}

impl Pipeline for ClipInputs {
    fn num_views(&self) -> usize {
        1
    }

    fn view(&self, img: &Image, key: ViewKey) -> DataResult<allgrad_data::Chw> {
        self.image.apply(img, key)
    }

    fn takes_text(&self) -> bool {
        true
    }

    fn encode_text(&self, text: &str) -> DataResult<Vec<u32>> {
        self.tokenizer.encode(text).map_err(|e| DataError::Text { reason: e.to_string() })
    }
}

/// Where the pairs come from.
enum Source {
    /// By global index (CSV, captioned image data set).
    Indexed(Arc<dyn Dataset>),
    /// Webdataset shards, read as a stream.
    Stream(Arc<ShardStream>),
}

/// The loader building the coming batches.
enum Ahead {
    Indexed(Loader),
    Stream(StreamLoader),
}

impl Ahead {
    fn next(&mut self) -> Option<DataResult<allgrad_data::Batch>> {
        match self {
            Ahead::Indexed(l) => l.next(),
            Ahead::Stream(l) => l.next(),
        }
    }
}

/// The training pairs and their loader; see the module docs.
pub struct PairData {
    source: Source,
    inputs: Arc<ClipInputs>,
    loader_cfg: allgrad_data::LoaderConfig,
    loader: Option<Ahead>,
    /// The batch last asked for: its indices, images and token ids.
    current: Option<(Vec<usize>, Tensor, Vec<Vec<u32>>)>,
    prefetched: usize,
    device: Device,
}

fn data_err(e: DataError) -> candle_core::Error {
    ModelError::Data(e).into()
}

impl PairData {
    /// Opens the pairs of `data` (checked by the method's validation): a CSV, the training
    /// split of an IDX folder captioned from class names (`seed` picks each sample's caption),
    /// or webdataset shards laid out for global batches of `global_batch`.
    pub fn open(data: &ClipData, inputs: ClipInputs, seed: u64, global_batch: usize, device: Device) -> Result<Self> {
        let source = match (&data.csv, &data.images, &data.shards) {
            (Some(csv), None, None) => Source::Indexed(Arc::new(CsvPairs::open(csv)?)),
            (None, Some(dir), None) => {
                let images = Arc::new(IdxDataset::open_dir(dir, Split::Train).map_err(data_err)?);
                Source::Indexed(Arc::new(ClassCaptions::new(
                    images,
                    data.classes.clone(),
                    data.templates.clone(),
                    seed,
                    data.limit,
                )?))
            }
            (None, None, Some(dir)) => {
                let shards = data.webdataset.train_shards(dir).map_err(data_err)?;
                let color = if inputs.image.channels == 1 { ColorMode::Gray } else { ColorMode::Rgb };
                let stream = ShardStream::new(shards, data.webdataset.clone(), global_batch, color).map_err(data_err)?;
                Source::Stream(Arc::new(stream.with_caption(data.caption.clone())))
            }
            _ => candle_core::bail!("clip: data needs exactly one of `csv`, `images` and `shards`"),
        };
        Ok(PairData {
            source,
            inputs: Arc::new(inputs),
            loader_cfg: data.loader.clone(),
            loader: None,
            current: None,
            prefetched: 0,
            device,
        })
    }

    /// Pairs per epoch (`webdataset.epoch_samples` for shards).
    pub fn num_samples(&self) -> usize {
        match &self.source {
            Source::Indexed(d) => d.len(),
            Source::Stream(s) => s.epoch_samples(),
        }
    }

    /// Whether the pairs are a stream (batch indices are positions in the epoch).
    pub fn sequential(&self) -> bool {
        matches!(self.source, Source::Stream(_))
    }

    /// Starts building `batches` (this rank's coming micro-batches of `epoch`) on the
    /// loader's threads, replacing any earlier plan.
    pub fn plan(&mut self, epoch: usize, seed: u64, batches: &[Vec<usize>]) -> Result<()> {
        self.loader = None; // stops the old workers first
        if batches.is_empty() {
            return Ok(());
        }
        let pipeline: Arc<dyn Pipeline> = self.inputs.clone();
        let (plan, cfg, dev) = (batches.to_vec(), &self.loader_cfg, &self.device);
        self.loader = Some(match &self.source {
            Source::Stream(s) => {
                Ahead::Stream(StreamLoader::new(s.clone(), pipeline, seed, epoch as u64, plan, cfg, dev).map_err(data_err)?)
            }
            Source::Indexed(_) if cfg.workers == 0 => return Ok(()),
            Source::Indexed(d) => {
                Ahead::Indexed(Loader::new(d.clone(), pipeline, seed, epoch as u64, plan, cfg, dev).map_err(data_err)?)
            }
        });
        Ok(())
    }

    /// Where this rank's training streams stand after the last batch taken (shards; `None`
    /// for the indexed sources, whose position is the sampler's).
    pub fn stream_state(&self) -> Result<Option<StreamState>> {
        match &self.source {
            Source::Stream(s) => Ok(Some(s.state().map_err(data_err)?)),
            Source::Indexed(_) => Ok(None),
        }
    }

    /// Resumes the training stream from a saved position (see [`ShardStream::resume_from`]):
    /// the streams this rank reads start there, not at the epoch's start. An error for the
    /// indexed sources (a checkpoint's stream position is never dropped silently).
    pub fn resume_stream(&mut self, state: StreamState) -> Result<()> {
        match &self.source {
            Source::Stream(s) => s.resume_from(state).map_err(data_err),
            Source::Indexed(_) => {
                candle_core::bail!("clip: the checkpoint holds a stream position (stream.json), but the pairs are not shards")
            }
        }
    }

    /// How many batches came from the loader's plan (the rest were built when asked for).
    pub fn prefetched(&self) -> usize {
        self.prefetched
    }

    /// The images (`[n, c, h, w]` f32) and token ids of `batch`'s pairs: from the loader when
    /// it built this batch, else built here; kept until another batch is asked for.
    pub fn inputs(&mut self, batch: &Batch) -> Result<(Tensor, Vec<Vec<u32>>)> {
        if let Some((idx, img, tok)) = &self.current {
            if idx == batch.indices {
                return Ok((img.clone(), tok.clone()));
            }
        }
        let built = self.take(batch)?;
        let out = (built.views[0].clone(), built.tokens);
        self.current = Some((built.indices, out.0.clone(), out.1.clone()));
        Ok(out)
    }

    fn take(&mut self, batch: &Batch) -> Result<allgrad_data::Batch> {
        if let Some(loader) = &mut self.loader {
            match loader.next() {
                Some(Ok(b)) if b.indices == batch.indices => {
                    self.prefetched += 1;
                    return Ok(b);
                }
                Some(Err(e)) => return Err(data_err(e)),
                _ => {
                    tracing::debug!("the loader's plan does not match the batch asked for; building it here");
                    self.loader = None;
                }
            }
        }
        // Unplanned: built on this thread (a stream read from the epoch's start to it).
        let pipeline: Arc<dyn Pipeline> = self.inputs.clone();
        let cfg = allgrad_data::LoaderConfig { workers: 0, prefetch: 0, ..Default::default() };
        let plan = vec![batch.indices.to_vec()];
        let (seed, epoch) = (batch.seed, batch.epoch as u64);
        let mut once = match &self.source {
            Source::Stream(s) => {
                Ahead::Stream(StreamLoader::new(s.clone(), pipeline, seed, epoch, plan, &cfg, &self.device).map_err(data_err)?)
            }
            Source::Indexed(d) => {
                Ahead::Indexed(Loader::new(d.clone(), pipeline, seed, epoch, plan, &cfg, &self.device).map_err(data_err)?)
            }
        };
        once.next().ok_or_else(|| candle_core::Error::Msg("clip: the loader gave no batch".into()))?.map_err(data_err)
    }
}
