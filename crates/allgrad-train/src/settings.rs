//! The environment variables the trainer reads, read once at start-up into [`Settings`]
//! (never at the point of use), so a run's behaviour is fixed when it starts and a typo is
//! an error before any work is done.
//!
//! | variable | meaning |
//! |---|---|
//! | `ALLGRAD_FONT` | TrueType font for the labels of `loss.png` (default: DejaVu Sans where Debian installs it) |
//! | `ALLGRAD_FAULT` | test hook: `checkpoint:<stage>` aborts the process at that stage of a checkpoint save (`model`, `optimizer`, `buffers`, `rename`) |
//! | `ALLGRAD_PROFILE` | `1`: time the regions of every step (with CUDA events on a GPU) and print the table at the end (`train --profile`) |
//! | `ALLGRAD_DEVICE_PATH` | `1`: a CPU run takes the code path CUDA tensors take (statistics and figures kept in tensors, one read per step; [`allgrad_nn::transfer`]), to count its host traffic on a machine without a GPU |
//!
//! | `ALLGRAD_LOG` | the log filter of the `train` binary (tracing's env-filter syntax; default `info`) |
//! | `ALLGRAD_MALLOC_TUNE` | `0`: `allgrad::tune_allocator` leaves glibc's malloc settings alone (default `1`) |
//!
//! The last two act before `Settings` exist (the logger and the allocator are set up first
//! thing in `main`, and fall back to their defaults on a bad value); `Settings` checks them, so a
//! bad value still stops `train` before it starts. The distributed layer reads its own
//! variables (`allgrad_dist::Settings`). The variables allgrad-nn reads (`ALLGRAD_WINOGRAD`, `ALLGRAD_CUDA_FUSED`,
//! `ALLGRAD_CPU_SIMD`) are checked here too, through [`allgrad_nn::check_settings`].

use std::path::PathBuf;

use crate::error::TrainError;

/// A stage of a checkpoint save at which `ALLGRAD_FAULT` can abort the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultStage {
    /// After `model.safetensors` is written.
    Model,
    /// After `optimizer.safetensors` is written.
    Optimizer,
    /// After `buffers.safetensors` is written.
    Buffers,
    /// After everything is written, before the directory is renamed into place.
    Rename,
}

impl FaultStage {
    const ALL: [(&'static str, FaultStage); 4] = [
        ("model", FaultStage::Model),
        ("optimizer", FaultStage::Optimizer),
        ("buffers", FaultStage::Buffers),
        ("rename", FaultStage::Rename),
    ];

    /// The stage's name in `ALLGRAD_FAULT`.
    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(_, s)| *s == self).map(|(n, _)| *n).unwrap_or("?")
    }
}

/// The trainer's settings from the environment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    /// `ALLGRAD_FONT`.
    pub font: Option<PathBuf>,
    /// `ALLGRAD_FAULT=checkpoint:<stage>`.
    pub fault: Option<FaultStage>,
    /// `ALLGRAD_PROFILE=1`.
    pub profile: bool,
    /// `ALLGRAD_DEVICE_PATH=1`.
    pub device_path: bool,
}

/// A `0`/`1` switch (unset or empty: `false`), or an error naming the variable.
fn switch(get: &impl Fn(&str) -> Option<String>, name: &str) -> Result<bool, TrainError> {
    match get(name).as_deref().map(str::trim) {
        None | Some("") | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(v) => Err(TrainError::Setup(format!("{name}={v:?} must be 0 or 1"))),
    }
}

impl Settings {
    /// Reads the variables of the module docs from this process's environment.
    ///
    /// # Errors
    /// [`TrainError::Setup`] naming the variable for a bad value of these, or of the variables
    /// allgrad-nn reads (`ALLGRAD_WINOGRAD`, `ALLGRAD_CUDA_FUSED`, `ALLGRAD_CPU_SIMD`:
    /// [`allgrad_nn::check_settings`]), so that a run with one fails before it starts.
    pub fn from_env() -> Result<Settings, TrainError> {
        allgrad_nn::check_settings().map_err(|e| TrainError::Setup(e.to_string()))?;
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As [`Settings::from_env`], from any lookup (for tests).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Settings, TrainError> {
        let font = get("ALLGRAD_FONT").filter(|s| !s.is_empty()).map(PathBuf::from);
        let fault = match get("ALLGRAD_FAULT").filter(|s| !s.is_empty()) {
            None => None,
            Some(v) => {
                let stage = v.strip_prefix("checkpoint:").and_then(|s| FaultStage::ALL.iter().find(|(n, _)| *n == s));
                let names: Vec<&str> = FaultStage::ALL.iter().map(|(n, _)| *n).collect();
                Some(
                    stage
                        .ok_or_else(|| {
                            TrainError::Setup(format!(
                                "ALLGRAD_FAULT={v:?} is not a known fault: use checkpoint:<stage> with stage one of {}, or unset it",
                                names.join(", ")
                            ))
                        })?
                        .1,
                )
            }
        };
        let (profile, device_path) = (switch(&get, "ALLGRAD_PROFILE")?, switch(&get, "ALLGRAD_DEVICE_PATH")?);
        // Checked only: the allocator and the logger read these before any settings exist.
        switch(&get, "ALLGRAD_MALLOC_TUNE")?;
        if let Some(v) = get("ALLGRAD_LOG").filter(|s| !s.trim().is_empty()) {
            tracing_subscriber::EnvFilter::try_new(&v).map_err(|e| {
                TrainError::Setup(format!(
                    "ALLGRAD_LOG={v:?} is not a log filter ({e}): use a level (error, warn, info, debug, trace) or tracing's env-filter syntax, e.g. allgrad_train=debug"
                ))
            })?;
        }
        Ok(Settings { font, fault, profile, device_path })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_are_parsed_and_a_bad_fault_is_an_error_listing_the_stages() {
        let none = Settings::from_vars(|_| None).unwrap();
        assert_eq!(none, Settings::default());
        let s = Settings::from_vars(|k| match k {
            "ALLGRAD_FONT" => Some("/f.ttf".into()),
            "ALLGRAD_FAULT" => Some("checkpoint:buffers".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(s.font, Some(PathBuf::from("/f.ttf")));
        assert_eq!(s.fault, Some(FaultStage::Buffers));
        assert_eq!(FaultStage::Buffers.name(), "buffers");
        let e = Settings::from_vars(|k| (k == "ALLGRAD_FAULT").then(|| "checkpoint:nope".into())).unwrap_err().to_string();
        assert!(e.contains("ALLGRAD_FAULT") && e.contains("model, optimizer, buffers, rename"), "{e}");
        let on = Settings::from_vars(|k| matches!(k, "ALLGRAD_PROFILE" | "ALLGRAD_DEVICE_PATH").then(|| "1".into())).unwrap();
        assert!(on.profile && on.device_path);
        let e = Settings::from_vars(|k| (k == "ALLGRAD_PROFILE").then(|| "yes".into())).unwrap_err().to_string();
        assert!(e.contains("ALLGRAD_PROFILE=\"yes\" must be 0 or 1"), "{e}");
        let e = Settings::from_vars(|k| (k == "ALLGRAD_MALLOC_TUNE").then(|| "off".into())).unwrap_err().to_string();
        assert!(e.contains("ALLGRAD_MALLOC_TUNE=\"off\" must be 0 or 1"), "{e}");
        let e = Settings::from_vars(|k| (k == "ALLGRAD_LOG").then(|| "debug,x=[".into())).unwrap_err().to_string();
        assert!(e.contains("ALLGRAD_LOG=\"debug,x=[\" is not a log filter"), "{e}");
        for ok in ["debug", "allgrad_train=trace,warn"] {
            Settings::from_vars(|k| (k == "ALLGRAD_LOG").then(|| ok.into())).unwrap();
        }
    }
}
