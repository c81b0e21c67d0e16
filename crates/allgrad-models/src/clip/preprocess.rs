//! A CLIP folder's image preprocessing, `preprocessor_config.json` (what `transformers`'
//! `CLIPImageProcessor` saves): read on import, written on export, and turned into the
//! loader's [`Preprocess`] pipeline (one implementation of resize, crop and normalisation, in
//! allgrad-data).

use std::path::Path;

use allgrad_data::{Normalize, Preprocess, Resample};
use candle_core::Result;
use serde_json::{json, Value};

use super::config::ClipConfig;

/// OpenAI CLIP's per-channel mean and standard deviation of RGB inputs.
pub const OPENAI_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
/// See [`OPENAI_MEAN`].
pub const OPENAI_STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];

/// The file's name in a Hugging Face folder.
pub const PREPROCESSOR_CONFIG: &str = "preprocessor_config.json";

/// The image preprocessing of a CLIP folder: resize the shortest side, crop the centre,
/// normalise.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageProcessor {
    /// `size.shortest_edge` (`None` when `do_resize` is false).
    pub shortest_edge: Option<usize>,
    /// `crop_size` as `[height, width]` (`None` when `do_center_crop` is false).
    pub crop: Option<[usize; 2]>,
    /// `resample`: Pillow's filter.
    pub resample: Resample,
    /// `image_mean` (zeros when `do_normalize` is false).
    pub mean: Vec<f32>,
    /// `image_std` (ones when `do_normalize` is false).
    pub std: Vec<f32>,
}

fn bad(file: &Path, what: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{}: {what}", file.display()))
}

fn side(file: &Path, key: &str, v: &Value) -> Result<usize> {
    v.as_u64()
        .filter(|n| *n > 0)
        .map(|n| n as usize)
        .ok_or_else(|| bad(file, format!("{key} must be a positive integer, got {v}")))
}

fn floats(file: &Path, key: &str, v: &Value) -> Result<Vec<f32>> {
    let one = |x: &Value| x.as_f64().map(|f| f as f32).ok_or_else(|| bad(file, format!("{key} must be numbers, got {v}")));
    match v {
        Value::Array(a) => a.iter().map(one).collect(),
        x => Ok(vec![one(x)?]),
    }
}

impl ImageProcessor {
    /// What a folder without `preprocessor_config.json` gets: the tower's side for the resize
    /// and the crop, bicubic, OpenAI's mean and std for 3 channels and 0.5 for 1 (what
    /// `CLIPImageProcessor`'s defaults are at the tower's size).
    pub fn default_for(cfg: &ClipConfig) -> Self {
        let v = &cfg.vision_config;
        let (mean, std) = match v.num_channels {
            3 => (OPENAI_MEAN.to_vec(), OPENAI_STD.to_vec()),
            c => (vec![0.5; c], vec![0.5; c]),
        };
        ImageProcessor {
            shortest_edge: Some(v.image_size),
            crop: Some([v.image_size, v.image_size]),
            resample: Resample::Bicubic,
            mean,
            std,
        }
    }

    /// Reads `file` (a `preprocessor_config.json`). Unknown keys are ignored; a resample
    /// filter other than bilinear (2) and bicubic (3), a `size` without `shortest_edge`, or a
    /// rescale other than 1/255 is an error naming the file and the value.
    pub fn read(file: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(file).map_err(|e| bad(file, e))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| bad(file, format!("not JSON: {e}")))?;
        let flag = |key: &str| v.get(key).and_then(Value::as_bool).unwrap_or(true);
        let resample = match v.get("resample") {
            None => Resample::Bicubic,
            Some(r) => {
                let code = r.as_i64().ok_or_else(|| bad(file, format!("resample must be Pillow's filter number, got {r}")))?;
                Resample::from_pil(code).map_err(|name| {
                    bad(file, format!("resample {name} is not supported: allgrad resizes with bilinear (2) or bicubic (3)"))
                })?
            }
        };
        let shortest_edge = match (flag("do_resize"), v.get("size")) {
            (false, _) => None,
            (true, None) => candle_core::bail!("{}: do_resize without a size", file.display()),
            (true, Some(s)) if s.is_u64() => Some(side(file, "size", s)?),
            (true, Some(s)) => match s.get("shortest_edge") {
                Some(e) => Some(side(file, "size.shortest_edge", e)?),
                None => candle_core::bail!(
                    "{}: size {s} is not supported: allgrad resizes the shortest side (size.shortest_edge)",
                    file.display()
                ),
            },
        };
        let crop = match (flag("do_center_crop"), v.get("crop_size")) {
            (false, _) => None,
            (true, None) => candle_core::bail!("{}: do_center_crop without a crop_size", file.display()),
            (true, Some(c)) if c.is_u64() => {
                let s = side(file, "crop_size", c)?;
                Some([s, s])
            }
            (true, Some(c)) => match (c.get("height"), c.get("width")) {
                (Some(h), Some(w)) => Some([side(file, "crop_size.height", h)?, side(file, "crop_size.width", w)?]),
                _ => candle_core::bail!("{}: crop_size {c} needs height and width", file.display()),
            },
        };
        if flag("do_rescale") {
            let factor = v.get("rescale_factor").and_then(Value::as_f64).unwrap_or(1.0 / 255.0);
            if (factor * 255.0 - 1.0).abs() > 1e-9 {
                candle_core::bail!("{}: rescale_factor {factor} is not supported (only 1/255)", file.display());
            }
        } else {
            candle_core::bail!("{}: do_rescale false is not supported (pixels are scaled to [0, 1])", file.display());
        }
        let (mean, std) = if flag("do_normalize") {
            let m = v.get("image_mean").map(|m| floats(file, "image_mean", m)).transpose()?;
            let s = v.get("image_std").map(|s| floats(file, "image_std", s)).transpose()?;
            (m.unwrap_or_else(|| OPENAI_MEAN.to_vec()), s.unwrap_or_else(|| OPENAI_STD.to_vec()))
        } else {
            (vec![0.0], vec![1.0])
        };
        Ok(ImageProcessor { shortest_edge, crop, resample, mean, std })
    }

    /// The folder's `preprocessor_config.json`, or [`ImageProcessor::default_for`] its model
    /// when it has none.
    pub fn of_folder(dir: &Path, cfg: &ClipConfig) -> Result<Self> {
        let file = dir.join(PREPROCESSOR_CONFIG);
        if file.is_file() {
            Self::read(&file)
        } else {
            Ok(Self::default_for(cfg))
        }
    }

    /// The JSON `transformers`' `CLIPImageProcessor.from_pretrained` reads back to these
    /// settings.
    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "image_processor_type": "CLIPImageProcessor",
            "do_resize": self.shortest_edge.is_some(),
            "do_center_crop": self.crop.is_some(),
            "do_rescale": true,
            "rescale_factor": 1.0 / 255.0,
            "do_normalize": true,
            "do_convert_rgb": true,
            "resample": self.resample.pil_code(),
            "image_mean": self.mean,
            "image_std": self.std,
        });
        if let Some(s) = self.shortest_edge {
            v["size"] = json!({ "shortest_edge": s });
        }
        if let Some([h, w]) = self.crop {
            v["crop_size"] = json!({ "height": h, "width": w });
        }
        v
    }

    /// Writes [`ImageProcessor::to_json`] as `file`.
    pub fn write(&self, file: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(&self.to_json()).map_err(|e| bad(file, e))?;
        std::fs::write(file, text + "\n").map_err(|e| bad(file, e))
    }

    /// The loader's pipeline for a tower of `channels` channels: evaluation views, or with
    /// `random_crop` (OpenCLIP's training crop scale, `[0.9, 1.0]`) training views. The mean
    /// and std are repeated for a tower whose channels differ from theirs only when they
    /// hold a single value; otherwise they must match (checked).
    pub fn pipeline(&self, channels: usize, random_crop: Option<[f64; 2]>) -> Result<Preprocess> {
        let p = Preprocess {
            channels,
            shortest_edge: self.shortest_edge,
            crop: self.crop,
            resample: self.resample,
            normalize: Normalize { mean: self.mean.clone(), std: self.std.clone() },
            random_crop,
        };
        p.validate().map_err(|e| candle_core::Error::Msg(format!("image preprocessing: {e}")))?;
        Ok(p)
    }
}
