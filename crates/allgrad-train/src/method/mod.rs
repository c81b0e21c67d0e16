//! Methods by name: the `method:` key of a run config picks an entry of a [`Registry`], which
//! reads the method's own sections of the config, checks them and builds its
//! [`Objective`].
//!
//! # Design
//!
//! A run config has two kinds of top-level sections:
//!
//! - the trainer's, typed in [`RunConfig`]: `seed`, `device`, `dtype`, `method`, `optim`,
//!   `schedule`, `train`, `checkpoint`, `log`;
//! - the method's: every other top-level key (`data`, `model`, `loss` for the built-in
//!   methods; a face head may add `head`, a text method its tokenizer). The trainer keeps them
//!   as raw YAML ([`RunConfig::sections`]) and never interprets them.
//!
//! A method is a [`Method`]: its associated type [`Method::Sections`] is a serde type whose
//! fields ARE the top-level keys it owns (with `#[serde(deny_unknown_fields)]`, so a typo at
//! the top level or a section another method owns is an error that lists the valid keys).
//! The registry deserialises the raw sections into that type once, when it parses the config
//! (errors carry the file and the key path, e.g. `data.augment.crop.size`), and keeps the
//! typed value with the [`RunConfig`]; it then calls [`Method::validate`] with it, the whole
//! [`RunConfig`] and the world size (errors carry the key path), and [`Method::objective`] to
//! build, which takes it. Each method therefore owns its config vocabulary: SimCSE
//! brings `data: {kind: text, ...}` and `model: {kind: bert, ...}` as its own types, without
//! touching the trainer or the other methods; sections shared by several methods (the image
//! `data` section, [`allgrad_models::losses::LossConfig`]) are ordinary types they reuse.
//!
//! The built-in methods are in [`Registry::builtin`]: `simclr`, `barlowtwins` (one two-view
//! image method with different losses, [`image::ImageMethod`] on
//! [`allgrad_models::image_ssl::TwoViewMethod`]), `simcse` ([`simcse::SimCseMethod`]), `face`
//! ([`face::Face`]), `clip` ([`clip::ClipMethod`]: CLIP and SigLIP) and `vectors`
//! ([`vectors::Vectors`]); `vectors`, `simclr` and `barlowtwins` share their sections
//! ([`contrastive`]). A user's own method plugs in from their own binary:
//!
//! ```no_run
//! # use allgrad_train::method::{Method, Registry, SectionError};
//! # use allgrad_train::RunConfig;
//! # struct Mine;
//! # impl Method for Mine {
//! #     type Sections = serde_yaml::Value;
//! #     fn validate(&self, _: &Self::Sections, _: &RunConfig, _: usize) -> Result<(), SectionError> { Ok(()) }
//! #     fn objective(&self, _: Self::Sections, _: &RunConfig, _: &candle_core::Device)
//! #         -> candle_core::Result<Box<dyn allgrad_models::Objective>> { unimplemented!() }
//! # }
//! fn main() {
//!     let mut methods = Registry::builtin();
//!     methods.register("mine", Mine);
//!     std::process::exit(allgrad_train::cli::main_with(methods));
//! }
//! ```
//!
//! and `mine --config run.yaml` (with `method: mine`) trains it exactly as `train` trains the
//! built-in ones, under `launch` too (`examples/custom_loss.rs`).

pub mod clip;
pub mod clip_export;
pub mod contrastive;
pub mod face;
pub mod image;
pub mod resnet_export;
mod run_export;
pub mod simcse;
pub mod simcse_export;
pub mod vectors;

use std::collections::BTreeMap;
use std::path::Path;

use allgrad_models::{ModelError, Objective};
use candle_core::Device;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::config::{ConfigError, RunConfig, TRAINER_KEYS};

/// A training method: the typed sections it reads from a run config, their checks, and the
/// [`Objective`] it builds. See the module docs.
pub trait Method: Send + Sync + 'static {
    /// The method's own top-level sections of a run config, as one serde type whose fields
    /// are the keys (use `#[serde(deny_unknown_fields)]`). `train --print-config` shows them
    /// with their defaults through `Serialize`.
    /// The registry keeps the value with the config from parsing to building (hence `Send +
    /// 'static`): the sections are deserialised once per run.
    type Sections: DeserializeOwned + Serialize + Send + 'static;

    /// The dotted keys of the method's sections whose values are filesystem paths
    /// (`data.dir`, `model.dir`). [`Registry::load`] resolves the relative ones: a value
    /// written in the config file against the file's folder, a `--set` value against the
    /// current directory; the run's `config.yaml` then records them absolute, so the run
    /// (and `export-hf --run`) works from any folder.
    fn path_keys(&self) -> &'static [&'static str] {
        &[]
    }

    /// Checks the sections against each other, the trainer's sections and the world size.
    /// The error names the key path and the numbers.
    fn validate(&self, sections: &Self::Sections, run: &RunConfig, world_size: usize) -> Result<(), SectionError>;

    /// Builds the objective of a validated config on `device`, in `run`'s dtype.
    fn objective(&self, sections: Self::Sections, run: &RunConfig, device: &Device) -> candle_core::Result<Box<dyn Objective>>;
}

/// Why a method rejects its sections: the key path and what is wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("at `{key}`: {msg}")]
pub struct SectionError {
    /// Dotted key path (`loss.kind`, `data.samples`).
    pub key: String,
    /// What is wrong, with the numbers and what was expected.
    pub msg: String,
}

impl SectionError {
    /// An error at `key`.
    pub fn new(key: impl Into<String>, msg: impl Into<String>) -> Self {
        SectionError { key: key.into(), msg: msg.into() }
    }

    /// A check of the models crate as an error at the key it names: `loss.<key>` for a key of
    /// the `loss` section ([`ModelError::LossValue`], [`ModelError::LossKey`]), `head.<key>` for
    /// one of the face head's ([`ModelError::HeadValue`], [`ModelError::HeadKey`]), else at
    /// `section`, the section that was checked.
    pub(crate) fn from_model(e: ModelError, section: &str) -> Self {
        let key = match &e {
            ModelError::LossValue { key, .. } | ModelError::LossKey { key, .. } => format!("loss.{key}"),
            ModelError::HeadValue { key, .. } | ModelError::HeadKey { key, .. } => format!("head.{key}"),
            ModelError::ModelKey { key, .. } => format!("model.{key}"),
            _ => section.to_string(),
        };
        SectionError::new(key, e.to_string())
    }
}

/// The object-safe face of a [`Method`], as the registry stores it. [`AnyMethod::parse`]
/// deserialises the method's sections into its typed value and keeps it with the config
/// ([`RunConfig::parsed`]); `validate`, `resolved` and `objective` use that value, and
/// deserialise again only for a config whose sections changed since
/// ([`RunConfig::sections_mut`] drops it), or that was not parsed by a registry ([`typed`]).
trait AnyMethod: Send + Sync {
    fn parse(&self, name: &str, cfg: &RunConfig, path: &Path) -> Result<(), ConfigError>;
    fn validate(&self, name: &str, cfg: &RunConfig, world_size: usize, path: &Path) -> Result<(), ConfigError>;
    fn objective(&self, name: &str, cfg: &RunConfig, device: &Device) -> candle_core::Result<Box<dyn Objective>>;
    fn path_keys(&self) -> &'static [&'static str];
    fn resolved(&self, name: &str, cfg: &RunConfig, path: &Path) -> Result<serde_yaml::Mapping, ConfigError>;
}

impl<M: Method> AnyMethod for M {
    fn path_keys(&self) -> &'static [&'static str] {
        Method::path_keys(self)
    }

    fn parse(&self, name: &str, cfg: &RunConfig, path: &Path) -> Result<(), ConfigError> {
        let sections = deserialise::<M>(name, cfg, path)?;
        keep::<M>(cfg, sections);
        Ok(())
    }

    fn resolved(&self, name: &str, cfg: &RunConfig, path: &Path) -> Result<serde_yaml::Mapping, ConfigError> {
        let sections = typed::<M>(name, cfg, path)?;
        let value = serde_yaml::to_value(&sections);
        keep::<M>(cfg, sections);
        match value {
            Ok(serde_yaml::Value::Mapping(m)) => Ok(m),
            Ok(other) => Err(ConfigError::Invalid {
                path: path.into(),
                msg: format!("method `{name}`: its sections serialise to {other:?}, not a mapping of keys"),
            }),
            Err(e) => {
                Err(ConfigError::Invalid { path: path.into(), msg: format!("method `{name}`: serialising its sections: {e}") })
            }
        }
    }

    fn validate(&self, name: &str, cfg: &RunConfig, world_size: usize, path: &Path) -> Result<(), ConfigError> {
        let sections = typed::<M>(name, cfg, path)?;
        let checked = Method::validate(self, &sections, cfg, world_size);
        keep::<M>(cfg, sections);
        checked.map_err(|e| ConfigError::Method { path: path.into(), method: name.into(), key: e.key, msg: e.msg })
    }

    fn objective(&self, name: &str, cfg: &RunConfig, device: &Device) -> candle_core::Result<Box<dyn Objective>> {
        // The objective takes the sections: the value kept is used up here.
        let sections = typed::<M>(name, cfg, Path::new("config")).map_err(candle_core::Error::wrap)?;
        Method::objective(self, sections, cfg, device)
    }
}

/// The method's typed sections: the value [`AnyMethod::parse`] kept with `cfg` (taken out; put
/// it back with [`keep`]), else deserialised now.
fn typed<M: Method>(name: &str, cfg: &RunConfig, path: &Path) -> Result<M::Sections, ConfigError> {
    match cfg.parsed.take().map(|kept| kept.downcast::<M::Sections>()) {
        Some(Ok(sections)) => Ok(*sections),
        // Not kept, kept for other sections, or of another method's type.
        _ => deserialise::<M>(name, cfg, path),
    }
}

/// Keeps `sections`, the typed value of `cfg`'s sections, with `cfg`.
fn keep<M: Method>(cfg: &RunConfig, sections: M::Sections) {
    cfg.parsed.keep(Box::new(sections));
}

/// The method's typed sections, deserialised from `cfg`'s raw ones; an unknown top-level key
/// also lists the trainer's keys.
fn deserialise<M: Method>(name: &str, cfg: &RunConfig, path: &Path) -> Result<M::Sections, ConfigError> {
    let raw = serde_yaml::Value::Mapping(cfg.sections().clone());
    serde_path_to_error::deserialize(raw).map_err(|e| {
        let key = e.path().to_string();
        let mut msg = e.into_inner().to_string();
        // A top-level key that neither the method nor the trainer owns (a typo, or another
        // method's section): say whose keys the valid ones are.
        if !key.contains('.') && msg.starts_with("unknown field") {
            msg = format!("{msg} (method `{name}`), or one of the trainer's keys {}", TRAINER_KEYS.join(", "));
        }
        ConfigError::Field { path: path.into(), key, msg }
    })
}

/// Methods by name; see the module docs.
#[derive(Default)]
pub struct Registry {
    methods: BTreeMap<String, Box<dyn AnyMethod>>,
}

impl Registry {
    /// A registry without methods.
    pub fn empty() -> Registry {
        Registry::default()
    }

    /// The built-in methods: `simclr`, `barlowtwins`, `simcse`, `vectors`, `face` and `clip`.
    pub fn builtin() -> Registry {
        let mut r = Registry::empty();
        r.register("simcse", simcse::SimCseMethod);
        r.register("simclr", image::ImageMethod::SIMCLR);
        r.register("barlowtwins", image::ImageMethod::BARLOW_TWINS);
        r.register("vectors", vectors::Vectors);
        r.register("face", face::Face);
        r.register("clip", clip::ClipMethod);
        r
    }

    /// Adds `method` under `name` (replacing a method of that name).
    pub fn register<M: Method>(&mut self, name: impl Into<String>, method: M) -> &mut Registry {
        self.methods.insert(name.into(), Box::new(method));
        self
    }

    /// The names of the methods, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.methods.keys().map(String::as_str).collect()
    }

    fn get(&self, cfg: &RunConfig, path: &Path) -> Result<&dyn AnyMethod, ConfigError> {
        self.methods.get(&cfg.method).map(|m| m.as_ref()).ok_or_else(|| ConfigError::UnknownMethod {
            path: path.into(),
            name: cfg.method.clone(),
            known: self.names().join(", "),
        })
    }

    /// Reads `path`, applies `overrides` (`dotted.key=value`, the value parsed as YAML), and
    /// deserialises the trainer's sections and the method's (which must be registered).
    pub fn load(&self, path: &Path, overrides: &[String]) -> Result<RunConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
        self.parse(&text, path, overrides)
    }

    /// As [`Registry::load`], from text; `path` names the file in messages, and its folder is
    /// where relative paths in `text` are taken from.
    /// Relative paths are resolved against `path`'s folder (see [`Method::path_keys`]).
    pub fn parse(&self, text: &str, path: &Path, overrides: &[String]) -> Result<RunConfig, ConfigError> {
        let path_keys = |method: &str| self.methods.get(method).map_or(&[][..], |m| m.path_keys());
        let cfg = RunConfig::parse_sections(text, path, overrides, &path_keys)?;
        self.get(&cfg, path)?.parse(&cfg.method, &cfg, path).map_err(|e| e.blamed_on(overrides))?;
        Ok(cfg)
    }

    /// Checks the trainer's values against each other and the world size, then the method's
    /// sections ([`Method::validate`]).
    pub fn validate(&self, cfg: &RunConfig, world_size: usize, path: &Path) -> Result<(), ConfigError> {
        cfg.validate_trainer(world_size, path)?;
        self.get(cfg, path)?.validate(&cfg.method, cfg, world_size, path)
    }

    /// The config at `path` with `overrides`, as YAML with every default filled in, the
    /// trainer's sections and the method's (`train --print-config`).
    pub fn resolved_yaml(&self, path: &Path, overrides: &[String]) -> Result<String, ConfigError> {
        let mut cfg = self.load(path, overrides)?;
        *cfg.sections_mut() = self.get(&cfg, path)?.resolved(&cfg.method, &cfg, path)?;
        Ok(cfg.to_yaml())
    }

    /// The objective of a (validated) config, on `device`.
    pub fn objective(&self, cfg: &RunConfig, device: &Device) -> candle_core::Result<Box<dyn Objective>> {
        let method = self.get(cfg, Path::new("config")).map_err(candle_core::Error::wrap)?;
        method.objective(&cfg.method, cfg, device)
    }
}

/// The run config's constructors for the built-in methods: they are the [`Registry::builtin`]
/// registry's, so they live beside it (the config itself knows no methods).
impl RunConfig {
    /// Reads `path`, applies `overrides` (`dotted.key=value`, the value parsed as YAML), and
    /// deserialises, for a built-in method ([`Registry::load`] for others).
    pub fn load(path: &Path, overrides: &[String]) -> Result<RunConfig, ConfigError> {
        Registry::builtin().load(path, overrides)
    }

    /// As [`RunConfig::load`], from text; `path` is only used in messages.
    pub fn parse(text: &str, path: &Path, overrides: &[String]) -> Result<RunConfig, ConfigError> {
        Registry::builtin().parse(text, path, overrides)
    }

    /// Checks the values against each other and the world size, for a built-in method
    /// ([`Registry::validate`] for others).
    pub fn validate(&self, world_size: usize, path: &Path) -> Result<(), ConfigError> {
        Registry::builtin().validate(self, world_size, path)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use serde::{Deserialize, Deserializer};

    use super::*;

    /// Deserialisations of [`Counted`] (one test reads it).
    static PARSED: AtomicUsize = AtomicUsize::new(0);

    /// A method's sections, `points: N`, that count their deserialisations.
    #[derive(Serialize)]
    struct Counted {
        points: usize,
    }

    impl<'de> Deserialize<'de> for Counted {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            #[derive(Deserialize)]
            #[serde(deny_unknown_fields)]
            struct Raw {
                points: usize,
            }
            PARSED.fetch_add(1, Ordering::SeqCst);
            Raw::deserialize(d).map(|r| Counted { points: r.points })
        }
    }

    struct CountedMethod;

    impl Method for CountedMethod {
        type Sections = Counted;

        fn validate(&self, s: &Counted, _: &RunConfig, _: usize) -> Result<(), SectionError> {
            match s.points {
                0 => Err(SectionError::new("points", "must be at least 1")),
                _ => Ok(()),
            }
        }

        fn objective(&self, s: Counted, _: &RunConfig, _: &Device) -> candle_core::Result<Box<dyn Objective>> {
            candle_core::bail!("built with {} points", s.points)
        }
    }

    #[test]
    fn a_run_deserialises_the_methods_sections_once_and_again_only_after_they_change() {
        let mut methods = Registry::empty();
        methods.register("counted", CountedMethod);
        let text = "method: counted\npoints: 3\ntrain: {global_batch: 4, epochs: 1}\n";
        let path = Path::new("run.yaml");
        // Parse, validate, build: one deserialisation.
        let cfg = methods.parse(text, path, &[]).unwrap();
        methods.validate(&cfg, 1, path).unwrap();
        let built = methods.objective(&cfg, &Device::Cpu).err().unwrap().to_string();
        assert!(built.contains("built with 3 points"), "{built}");
        assert_eq!(PARSED.load(Ordering::SeqCst), 1, "parse, validate and objective deserialised more than once");
        // Building again (the value was used up), or from a clone, deserialises again.
        methods.objective(&cfg.clone(), &Device::Cpu).err().unwrap();
        assert_eq!(PARSED.load(Ordering::SeqCst), 2);
        // Sections edited after parsing are read as they are now, not as they were.
        let mut cfg = methods.parse(text, path, &[]).unwrap();
        cfg.sections_mut()["points"] = 0.into();
        let e = methods.validate(&cfg, 1, path).unwrap_err().to_string();
        assert!(e.contains("at `points`: must be at least 1"), "{e}");
        assert_eq!(PARSED.load(Ordering::SeqCst), 4);
        // A parse error is still an error at parse, naming the key.
        let e = methods.parse("method: counted\npoints: -1\ntrain: {global_batch: 4}\n", path, &[]).unwrap_err().to_string();
        assert!(e.contains("points"), "{e}");
    }
}
