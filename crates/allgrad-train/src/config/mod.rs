//! The run configuration: YAML into serde types, one section per component.
//!
//! ```yaml
//! seed: 0
//! method: vectors
//! data: { kind: vectors, samples: 1024 }
//! model: { kind: mlp, hidden: 64, out: 16 }
//! loss: { kind: nt_xent, temperature: 0.2 }
//! optim: { kind: lars, lr: 0.3, weight_decay: 1.0e-6 }
//! schedule: { warmup_steps: 10, scale_by_batch: true }
//! train: { global_batch: 128, epochs: 2 }
//! checkpoint: { every: 50, keep_last: 3 }
//! log: { every: 10 }
//! ```
//!
//! The trainer owns `seed`, `device`, `dtype`, `precision`, `dist`, `method`, `optim`,
//! `param_groups`, `schedule`, `train`, `checkpoint` and `log`; every other top-level section (`data`,
//! `model`, `loss`, ...) belongs to the method that `method:` names, which reads it (see
//! [`crate::method`]).
//! [`RunConfig::load`], [`RunConfig::parse`] and [`RunConfig::validate`] know the built-in
//! methods (they are defined beside the [`crate::method::Registry`]); with your own, call the
//! registry's methods of the same names.
//!
//! Unknown keys, wrong types and values that do not fit the world size fail at start, with
//! the file, the key path and what was expected.
//!
//! # Layout
//!
//! This folder is the bottom of the crate: it imports nothing from the rest of it, and the
//! components import their sections from here. The top-level keys `seed`, `device`, `dtype`,
//! `dist` and `method` are here; each section has its file: `train` ([`train`]), `optim`
//! ([`optim`]), `param_groups` ([`groups`]), `schedule` ([`schedule`]), `precision` ([`precision`]), `checkpoint`
//! ([`checkpoint`]) and `log` ([`log`]). [`ConfigError`] is in [`error`], the `--set`
//! arguments in `overrides.rs`, the method's sections once deserialised (kept with the config
//! from parsing to building) in `parsed.rs`.

pub mod checkpoint;
pub mod error;
pub mod groups;
pub mod log;
pub mod optim;
mod overrides;
mod parsed;
pub mod precision;
pub mod schedule;
pub mod train;

use std::path::Path;

use allgrad_dist::CudaCollectives;
use candle_core::DType;
use serde::{Deserialize, Serialize};

pub use checkpoint::CheckpointConfig;
pub use error::ConfigError;
pub use groups::{GroupConfig, ParamGroupsConfig};
pub use log::{LogConfig, Progress};
pub use optim::OptimConfig;
use overrides::Override;
pub(crate) use parsed::ParsedSections;
pub use precision::ComputePrecision;
pub use schedule::{Decay, ScheduleConfig};
pub use train::{NonFinite, TrainSection};

/// The top-level keys the trainer owns; every other one belongs to the method.
pub const TRAINER_KEYS: [&str; 12] =
    ["seed", "device", "dtype", "precision", "dist", "method", "optim", "param_groups", "schedule", "train", "checkpoint", "log"];

/// A whole run: the trainer's sections, typed, and the method's, raw.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RunConfig {
    /// Seed of every random stream (initialisation, data order, views).
    #[serde(default)]
    pub seed: u64,
    /// Where tensors live.
    #[serde(default)]
    pub device: DeviceKind,
    /// The parameters' dtype (and the compute dtype with `precision: full`).
    #[serde(default)]
    pub dtype: ParamDtype,
    /// Compute precision of the training step: `full` (in `dtype`), `tf32` (f32 with TF32
    /// tensor-core products on CUDA) or `bf16` (autocast beside f32 parameters; see
    /// [`precision`]).
    #[serde(default)]
    pub precision: ComputePrecision,
    /// Which GPU each rank uses and how collectives of CUDA tensors move their data.
    #[serde(default, skip_serializing_if = "DistSection::is_default")]
    pub dist: DistSection,
    /// The method: a name in the [`crate::method::Registry`] (built in: `simclr`, `barlowtwins`, `vectors`).
    pub method: String,
    /// The optimizer.
    #[serde(default)]
    pub optim: OptimConfig,
    /// Which parameters take weight decay, with which learning-rate scale, and which are
    /// frozen ([`groups`]).
    #[serde(default)]
    pub param_groups: ParamGroupsConfig,
    /// The learning-rate schedule.
    #[serde(default)]
    pub schedule: ScheduleConfig,
    /// Batch, length and step policy.
    pub train: TrainSection,
    /// Checkpointing.
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// Metrics, progress and plots.
    #[serde(default)]
    pub log: LogConfig,
    /// The method's own sections (every top-level key not listed above), as YAML: the method
    /// deserialises them into its typed sections ([`crate::method::Method::Sections`]). Read
    /// with [`RunConfig::sections`], changed with [`RunConfig::sections_mut`].
    #[serde(flatten)]
    sections: serde_yaml::Mapping,
    /// The sections as the method's typed value, kept by the registry that deserialised them
    /// ([`parsed`]); dropped whenever the sections can change.
    #[serde(skip)]
    pub(crate) parsed: ParsedSections,
}

/// The device to train on.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// The CPU.
    #[default]
    Cpu,
    /// A GPU: the rank of local rank r uses CUDA device `r % (devices on its host)`, or
    /// `dist.device_ids[r]`; several ranks may share a GPU. Collectives of CUDA tensors go
    /// through NCCL where every rank has a GPU of its own (and the binary has the `nccl`
    /// feature), through host memory otherwise (`dist.cuda_collectives`). Needs a binary
    /// built with the `cuda` feature; otherwise [`RunConfig::validate`] rejects it (see
    /// [`NO_GPU`]).
    Cuda,
}

/// The `dist` section: how ranks use GPUs (with `device: cuda`).
///
/// ```yaml
/// device: cuda
/// dist: { cuda_collectives: auto, device_ids: [0, 0, 1, 1] }
/// ```
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DistSection {
    /// How collectives of CUDA tensors move their data: `auto` (NCCL when every rank of a
    /// group has a GPU of its own and the binary has the `nccl` feature, else through host
    /// memory), `nccl` (always; ranks that share a GPU are an error at start) or `host`
    /// (always through pinned host memory and the CPU backend). Absent:
    /// ALLGRAD_CUDA_COLLECTIVES, else `auto`; set in both places, the two must agree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_collectives: Option<CudaCollectives>,
    /// The CUDA device of each local rank: local rank r uses `device_ids[r]` (one entry per
    /// rank of the host, repeats allowed). Absent: LOCAL_RANK modulo the number of visible
    /// devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_ids: Option<Vec<usize>>,
}

impl DistSection {
    fn is_default(&self) -> bool {
        *self == DistSection::default()
    }

    /// The mode of this run's CUDA collectives: `dist.cuda_collectives` (`config`) and
    /// ALLGRAD_CUDA_COLLECTIVES (`env`) where set (they must agree), else `auto`.
    pub fn cuda_collectives(&self, env: Option<CudaCollectives>) -> Result<CudaCollectives, String> {
        match (self.cuda_collectives, env) {
            (Some(c), Some(e)) if c != e => Err(format!(
                "dist.cuda_collectives = {c} in the config, but ALLGRAD_CUDA_COLLECTIVES={e} in the environment: \
                 remove one, or make them agree"
            )),
            (c, e) => Ok(c.or(e).unwrap_or_default()),
        }
    }
}

/// The GPU features a binary was built with, against which `device` and `dist` are checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Build {
    /// The `cuda` feature.
    pub cuda: bool,
    /// The `nccl` feature.
    pub nccl: bool,
}

impl Build {
    /// This binary's features.
    pub const THIS: Build = Build { cuda: cfg!(feature = "cuda"), nccl: cfg!(feature = "nccl") };
}

/// Why `device: cuda` is refused.
pub const NO_GPU: &str = "device: cuda, but this binary was built without GPU support (the `cuda` feature): \
     build it with `--features cuda,nccl` (needs nvcc and CUDA), or use device: cpu";

/// The dtype of the parameters (the `dtype` key); the compute precision is
/// [`ComputePrecision`] (the `precision` key).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ParamDtype {
    /// 32-bit.
    #[default]
    F32,
    /// 64-bit (for exactness checks).
    F64,
}

impl RunConfig {
    /// The method's own sections (every top-level key the trainer does not own), as YAML.
    pub fn sections(&self) -> &serde_yaml::Mapping {
        &self.sections
    }

    /// The method's sections, to change: the typed value a registry kept from parsing them is
    /// dropped, so validating and building read the sections as they are after the change.
    pub fn sections_mut(&mut self) -> &mut serde_yaml::Mapping {
        self.parsed.clear();
        &mut self.sections
    }

    /// The trainer's sections typed, the method's kept raw (not checked against a method).
    /// `path_keys` gives, for a method name, the keys of its sections that hold paths: the
    /// relative ones are resolved against `path`'s folder (a value from the file) or the
    /// current directory (a `--set` value).
    pub(crate) fn parse_sections(
        text: &str,
        path: &Path,
        overrides: &[String],
        path_keys: &dyn Fn(&str) -> &'static [&'static str],
    ) -> Result<RunConfig, ConfigError> {
        let mut value: serde_yaml::Value =
            serde_yaml::from_str(text).map_err(|e| ConfigError::Yaml { path: path.into(), msg: e.to_string() })?;
        let sets = overrides.iter().map(|arg| Override::parse(arg)).collect::<Result<Vec<_>, _>>()?;
        // The method (a --set may change it) says which of its keys are paths.
        let method = sets
            .iter()
            .rev()
            .find(|o| o.key == ["method"])
            .map(|o| &o.value)
            .or_else(|| value.get("method"))
            .and_then(|m| m.as_str())
            .unwrap_or_default();
        let keys = path_keys(method);
        let folder = path.parent().unwrap_or(Path::new(""));
        for key in keys {
            let parts: Vec<&str> = key.split('.').collect();
            if let Some(v) = lookup_mut(&mut value, &parts) {
                resolve_path(v, folder);
            }
        }
        for mut o in sets {
            if keys.contains(&o.key.join(".").as_str()) {
                resolve_path(&mut o.value, Path::new(""));
            }
            o.apply(&mut value)?;
        }
        serde_path_to_error::deserialize(value).map_err(|e| {
            let key = e.path().to_string();
            ConfigError::Field { path: path.into(), key, msg: e.into_inner().to_string() }.blamed_on(overrides)
        })
    }

    /// The Candle dtype of `dtype`.
    pub fn candle_dtype(&self) -> DType {
        match self.dtype {
            ParamDtype::F32 => DType::F32,
            ParamDtype::F64 => DType::F64,
        }
    }

    /// Checks the trainer's values against each other and the world size.
    pub(crate) fn validate_trainer(&self, world_size: usize, path: &Path) -> Result<(), ConfigError> {
        let bad = |msg: String| ConfigError::Invalid { path: path.into(), msg };
        let t = &self.train;
        t.micro_batch(world_size).map_err(bad)?;
        t.check_cache_chunk(world_size).map_err(bad)?;
        if t.epochs == 0 && t.max_steps.is_none() {
            return Err(bad("train.epochs is 0 and train.max_steps is not set: nothing to train".into()));
        }
        if let Some(c) = t.clip_grad_norm {
            if !(c > 0.0 && c.is_finite()) {
                return Err(bad(format!("train.clip_grad_norm must be positive, got {c}")));
            }
        }
        if !(0.0..=1.0).contains(&self.schedule.final_fraction) {
            return Err(bad(format!("schedule.final_fraction must be in [0, 1], got {}", self.schedule.final_fraction)));
        }
        if self.checkpoint.keep_last == 0 {
            return Err(bad("checkpoint.keep_last must be at least 1 (the newest checkpoint is always kept)".into()));
        }
        if self.log.every == 0 {
            return Err(bad("log.every must be at least 1".into()));
        }
        self.optim.validate().map_err(bad)?;
        self.param_groups.validate(&self.optim).map_err(bad)?;
        self.precision.check_dtype(self.candle_dtype()).map_err(bad)?;
        self.validate_device(Build::THIS).map_err(bad)
    }

    /// Checks `device` and the `dist` section against each other and against `build` (the
    /// features this binary was built with: [`Build::THIS`]; tests pass the others).
    pub(crate) fn validate_device(&self, build: Build) -> Result<(), String> {
        if self.device == DeviceKind::Cuda && !build.cuda {
            return Err(NO_GPU.into());
        }
        let d = &self.dist;
        // Every `dist` key is about CUDA devices: on the CPU each is refused alike, rather than
        // one refused and another silently ignored.
        if self.device != DeviceKind::Cuda {
            let set = match (&d.device_ids, d.cuda_collectives) {
                (Some(ids), _) => Some(format!("dist.device_ids = {ids:?} names CUDA devices")),
                (None, Some(c)) => Some(format!("dist.cuda_collectives = {c} sets how CUDA tensors are reduced")),
                (None, None) => None,
            };
            if let Some(what) = set {
                return Err(format!("{what}, but device is cpu: set device: cuda, or remove it"));
            }
        }
        if let Some(ids) = &d.device_ids {
            if ids.is_empty() {
                return Err("dist.device_ids is empty: give one CUDA device per local rank, or remove it".into());
            }
        }
        if self.device == DeviceKind::Cuda && d.cuda_collectives == Some(CudaCollectives::Nccl) && !build.nccl {
            return Err("dist.cuda_collectives = nccl, but this binary was built without the `nccl` feature: \
                        build it with `--features cuda,nccl`, or use auto or host"
                .into());
        }
        Ok(())
    }

    /// The resolved configuration as YAML (written to the run directory).
    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).expect("configs serialise")
    }
}

/// The value at a dotted key path, if every section on the way exists.
fn lookup_mut<'v>(mut node: &'v mut serde_yaml::Value, parts: &[&str]) -> Option<&'v mut serde_yaml::Value> {
    for part in parts {
        node = node.as_mapping_mut()?.get_mut(*part)?;
    }
    Some(node)
}

/// A relative path (a YAML string) made absolute against `base` (relative to the current
/// directory itself when empty); the folders are resolved (symbolic links, `..`) when the
/// path exists. Anything else (an absolute path, `null`, a number) is left alone.
fn resolve_path(v: &mut serde_yaml::Value, base: &Path) {
    // A list of paths (e.g. `eval.verification`): each one.
    if let Some(list) = v.as_sequence_mut() {
        list.iter_mut().for_each(|item| resolve_path(item, base));
        return;
    }
    let Some(s) = v.as_str() else { return };
    if s.is_empty() || Path::new(s).is_absolute() {
        return;
    }
    let joined = base.join(s);
    let resolved = joined.canonicalize().or_else(|_| std::path::absolute(&joined)).unwrap_or(joined);
    *v = serde_yaml::Value::String(resolved.to_string_lossy().into_owned());
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "method: vectors\ndata: {kind: vectors}\nmodel: {kind: mlp}\ntrain: {global_batch: 12}\n";

    fn parse(text: &str, sets: &[&str]) -> Result<RunConfig, ConfigError> {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        RunConfig::parse(text, Path::new("run.yaml"), &sets)
    }

    #[test]
    fn defaults_fill_the_sections() {
        let c = parse(BASE, &[]).unwrap();
        assert_eq!(c.train.global_batch, 12);
        assert_eq!(c.optim, OptimConfig::default());
        c.validate(3, Path::new("run.yaml")).unwrap();
    }

    #[test]
    fn unknown_key_names_file_path_and_expected_keys() {
        let e = parse(&format!("{BASE}optim: {{kind: sgd, lr: 0.1, momentun: 0.9}}\n"), &[]).unwrap_err().to_string();
        assert!(e.starts_with("run.yaml: at `optim"), "{e}");
        assert!(e.contains("unknown field `momentun`") && e.contains("momentum"), "{e}");
        let e = parse(&format!("{BASE}trian: {{}}\n"), &[]).unwrap_err().to_string();
        assert!(e.contains("unknown field `trian`"), "{e}");
    }

    #[test]
    fn wrong_type_names_the_key() {
        let e = parse("method: vectors\ndata: {kind: vectors}\nmodel: {kind: mlp}\ntrain: {global_batch: many}\n", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("at `train.global_batch`") && e.contains("invalid type"), "{e}");
    }

    #[test]
    fn values_that_would_be_silently_changed_are_refused_with_their_key() {
        let e = parse(BASE, &["checkpoint.keep_last=0"]).unwrap().validate(1, Path::new("run.yaml")).unwrap_err().to_string();
        assert!(e.contains("checkpoint.keep_last must be at least 1"), "{e}");
        let image =
            "method: simclr\ndata: {kind: images, dir: /x, format: idx}\nmodel: {kind: resnet}\ntrain: {global_batch: 8}\n";
        for (set, want) in [
            ("data.knn.k=0", "at `data.knn.k`: must be at least 1"),
            ("data.knn.temperature=0", "at `data.knn.temperature`: must be positive, got 0"),
        ] {
            let e = parse(image, &[set]).unwrap().validate(1, Path::new("run.yaml")).unwrap_err().to_string();
            assert!(e.contains(want), "{set}: {e}");
        }
    }

    #[test]
    fn indivisible_batch_names_the_numbers() {
        let c = parse(BASE, &["train.global_batch=30"]).unwrap();
        let e = c.validate(4, Path::new("run.yaml")).unwrap_err().to_string();
        assert!(e.contains("train.global_batch = 30 is not divisible by world size 4"), "{e}");
    }

    #[test]
    #[cfg(not(feature = "cuda"))]
    fn device_cuda_is_rejected_saying_the_build_lacks_the_cuda_feature() {
        let c = parse(BASE, &["device=cuda"]).unwrap();
        assert_eq!(c.device, DeviceKind::Cuda);
        let e = c.validate(1, Path::new("run.yaml")).unwrap_err().to_string();
        assert!(
            e.starts_with("run.yaml: device: cuda")
                && e.contains("without GPU support")
                && e.contains("--features cuda,nccl")
                && e.contains("device: cpu"),
            "{e}"
        );
    }

    /// The builds `validate_device` is checked against, whatever this test binary's features:
    /// the checks of a CUDA build run in CPU CI too (they need no device).
    const CPU_BUILD: Build = Build { cuda: false, nccl: false };
    const CUDA_BUILD: Build = Build { cuda: true, nccl: false };
    const NCCL_BUILD: Build = Build { cuda: true, nccl: true };

    #[test]
    fn device_cuda_is_accepted_by_a_cuda_build() {
        let c = parse(BASE, &["device=cuda"]).unwrap();
        assert_eq!(c.device, DeviceKind::Cuda);
        c.validate_device(CUDA_BUILD).unwrap();
        c.validate_device(NCCL_BUILD).unwrap();
        assert_eq!(c.validate_device(CPU_BUILD).unwrap_err(), NO_GPU);
        // `validate` checks against this binary's own features.
        assert_eq!(Build::THIS, Build { cuda: cfg!(feature = "cuda"), nccl: cfg!(feature = "nccl") });
        assert_eq!(c.validate(2, Path::new("run.yaml")).is_ok(), cfg!(feature = "cuda"));
    }

    #[test]
    fn precision_bf16_with_f64_parameters_is_an_error_naming_both_keys() {
        let c = parse(BASE, &["precision=bf16"]).unwrap();
        assert_eq!(c.precision, ComputePrecision::Bf16);
        c.validate(1, Path::new("run.yaml")).unwrap();
        let c = parse(BASE, &["precision=bf16", "dtype=f64"]).unwrap();
        let e = c.validate(1, Path::new("run.yaml")).unwrap_err().to_string();
        assert!(e.starts_with("run.yaml: precision: bf16") && e.contains("dtype: f32") && e.contains("not dtype: f64"), "{e}");
        let e = parse(BASE, &["precision=fp16"]).unwrap_err().to_string();
        assert!(
            e.contains("at `precision`") && e.contains("fp16") && e.contains("full") && e.contains("tf32") && e.contains("bf16"),
            "{e}"
        );
        assert_eq!(parse(BASE, &["precision=tf32"]).unwrap().precision, ComputePrecision::Tf32);
        let e =
            parse(BASE, &["precision=tf32", "dtype=f64"]).unwrap().validate(1, Path::new("run.yaml")).unwrap_err().to_string();
        assert!(e.starts_with("run.yaml: precision: tf32") && e.contains("not dtype: f64"), "{e}");
        assert_eq!(parse(BASE, &[]).unwrap().precision, ComputePrecision::Full);
    }

    #[test]
    fn an_unknown_device_is_an_error_naming_the_key_and_the_choices() {
        let e = parse(BASE, &["device=gpu"]).unwrap_err().to_string();
        assert!(e.contains("device") && e.contains("gpu") && e.contains("cpu") && e.contains("cuda"), "{e}");
    }

    #[test]
    fn the_dist_section_parses_and_its_unknown_keys_and_bad_modes_name_the_key() {
        let c = parse(BASE, &["dist.cuda_collectives=host", "dist.device_ids=[1, 0]", "device=cuda"]).unwrap();
        assert_eq!(c.dist, DistSection { cuda_collectives: Some(CudaCollectives::Host), device_ids: Some(vec![1, 0]) });
        assert_eq!(parse(BASE, &[]).unwrap().dist, DistSection::default());
        let e = parse(BASE, &["dist.cuda_collectives=gloo"]).unwrap_err().to_string();
        assert!(e.contains("at `dist.cuda_collectives`") && e.contains("gloo") && e.contains("`auto`, `nccl`, `host`"), "{e}");
        let e = parse(BASE, &["dist.devices=[0]"]).unwrap_err().to_string();
        assert!(e.contains("at `dist") && e.contains("unknown field `devices`") && e.contains("device_ids"), "{e}");
        let e = parse(BASE, &["dist.device_ids=[-1]"]).unwrap_err().to_string();
        assert!(e.contains("at `dist.device_ids"), "{e}");
        // Written back only when set.
        assert!(!parse(BASE, &[]).unwrap().to_yaml().contains("dist"));
        assert!(c.to_yaml().contains("cuda_collectives: host"), "{}", c.to_yaml());
    }

    #[test]
    fn every_dist_key_on_the_cpu_is_refused_at_load_naming_it() {
        let e = parse(BASE, &["dist.device_ids=[0]"]).unwrap().validate(1, Path::new("run.yaml")).unwrap_err().to_string();
        assert!(e.starts_with("run.yaml: dist.device_ids = [0] names CUDA devices, but device is cpu"), "{e}");
        for mode in ["auto", "nccl", "host"] {
            let c = parse(BASE, &[&format!("dist.cuda_collectives={mode}")]).unwrap();
            let e = c.validate(1, Path::new("run.yaml")).unwrap_err().to_string();
            assert!(e.starts_with(&format!("run.yaml: dist.cuda_collectives = {mode} sets how CUDA tensors are reduced")), "{e}");
            assert!(e.contains("but device is cpu: set device: cuda, or remove it"), "{e}");
        }
        parse(BASE, &[]).unwrap().validate(1, Path::new("run.yaml")).unwrap();
    }

    #[test]
    fn an_empty_device_list_is_refused_at_load() {
        let c = parse(BASE, &["dist.device_ids=[]", "device=cuda"]).unwrap();
        let e = c.validate_device(CUDA_BUILD).unwrap_err();
        assert!(e.contains("dist.device_ids is empty"), "{e}");
    }

    #[test]
    fn nccl_in_a_build_without_it_is_refused_at_load() {
        let c = parse(BASE, &["dist.cuda_collectives=nccl", "device=cuda"]).unwrap();
        let e = c.validate_device(CUDA_BUILD).unwrap_err();
        assert!(e.contains("dist.cuda_collectives = nccl") && e.contains("--features cuda,nccl"), "{e}");
        c.validate_device(NCCL_BUILD).unwrap();
        parse(BASE, &["dist.cuda_collectives=host", "device=cuda"]).unwrap().validate_device(CUDA_BUILD).unwrap();
    }

    #[test]
    fn the_mode_comes_from_the_config_or_the_environment_and_they_must_agree() {
        use CudaCollectives::*;
        let d = |c| DistSection { cuda_collectives: c, device_ids: None };
        assert_eq!(d(None).cuda_collectives(None).unwrap(), Auto);
        assert_eq!(d(Some(Host)).cuda_collectives(None).unwrap(), Host);
        assert_eq!(d(None).cuda_collectives(Some(Nccl)).unwrap(), Nccl);
        assert_eq!(d(Some(Host)).cuda_collectives(Some(Host)).unwrap(), Host);
        let e = d(Some(Nccl)).cuda_collectives(Some(Host)).unwrap_err();
        assert!(e.contains("dist.cuda_collectives = nccl") && e.contains("ALLGRAD_CUDA_COLLECTIVES=host"), "{e}");
    }

    #[test]
    fn overrides_set_nested_keys_with_yaml_types() {
        let c = parse(BASE, &["optim.kind=adamw", "optim.lr=0.001", "log.plot=false", "seed=7"]).unwrap();
        assert!(matches!(c.optim, OptimConfig::Adamw { lr, .. } if lr == 0.001));
        assert!(!c.log.plot);
        assert_eq!(c.seed, 7);
        assert!(parse(BASE, &["nokey"]).is_err());
        assert!(parse(BASE, &["train.global_batch.x=1"])
            .unwrap_err()
            .to_string()
            .contains("`train.global_batch` is not a section"));
    }
}
