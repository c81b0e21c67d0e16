//! The environment variables allgrad-nn reads, each once, on first use: the switches
//! `ALLGRAD_WINOGRAD` and `ALLGRAD_CUDA_FUSED` (`0` or `1`; unset or empty means `1`) and
//! `ALLGRAD_CPU_SIMD` (the level of [`crate::simd`]). A bad value is an [`NnError::Setting`]
//! naming the variable and the values it takes, never a silent default: [`check_settings`]
//! returns it (the trainer calls it before anything runs), and so does [`crate::conv2d`] for the
//! Winograd switch and every op with a vectorised loop for the SIMD level. docs/environment.md
//! lists every variable.

use std::sync::OnceLock;

use crate::error::NnError;

/// `0`: every CPU convolution takes im2col + GEMM (no Winograd).
pub const WINOGRAD_VAR: &str = "ALLGRAD_WINOGRAD";

/// `0`: CUDA tensors take Candle's composed ops instead of allgrad-nn's fused CUDA kernels (the
/// optimizer kernels included).
pub const CUDA_FUSED_VAR: &str = "ALLGRAD_CUDA_FUSED";

/// The value of a `0`/`1` switch: `default` when unset (`None`) or empty.
///
/// # Errors
/// [`NnError::Setting`] naming `var` for any other value.
pub fn parse_switch(var: &'static str, value: Option<&str>, default: bool) -> Result<bool, NnError> {
    match value.map(str::trim) {
        None | Some("") => Ok(default),
        Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(v) => Err(NnError::Setting { var, value: v.to_string(), why: "expected 0 or 1".into() }),
    }
}

fn read_switch(var: &'static str, default: bool) -> Result<bool, NnError> {
    match std::env::var(var) {
        Ok(v) => parse_switch(var, Some(&v), default),
        Err(std::env::VarError::NotPresent) => Ok(default),
        Err(std::env::VarError::NotUnicode(v)) => {
            Err(NnError::Setting { var, value: v.to_string_lossy().into_owned(), why: "not valid UTF-8; expected 0 or 1".into() })
        }
    }
}

/// `ALLGRAD_WINOGRAD`, read once.
pub(crate) fn winograd() -> &'static Result<bool, NnError> {
    static S: OnceLock<Result<bool, NnError>> = OnceLock::new();
    S.get_or_init(|| read_switch(WINOGRAD_VAR, true))
}

/// `ALLGRAD_CUDA_FUSED`, read once.
pub(crate) fn cuda_fused() -> &'static Result<bool, NnError> {
    static S: OnceLock<Result<bool, NnError>> = OnceLock::new();
    S.get_or_init(|| read_switch(CUDA_FUSED_VAR, true))
}

/// Checks every variable allgrad-nn reads.
///
/// # Errors
/// The first bad value's [`NnError::Setting`], in the order `ALLGRAD_WINOGRAD`,
/// `ALLGRAD_CUDA_FUSED`, `ALLGRAD_CPU_SIMD`.
pub fn check_settings() -> Result<(), NnError> {
    winograd().clone()?;
    cuda_fused().clone()?;
    crate::simd::simd_level()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_takes_0_and_1_and_defaults_when_unset_or_empty() {
        assert!(parse_switch(WINOGRAD_VAR, None, true).unwrap());
        assert!(!parse_switch(WINOGRAD_VAR, None, false).unwrap());
        assert!(parse_switch(WINOGRAD_VAR, Some(" "), true).unwrap());
        assert!(!parse_switch(WINOGRAD_VAR, Some("0"), true).unwrap());
        assert!(parse_switch(WINOGRAD_VAR, Some(" 1\n"), false).unwrap());
        for bad in ["on", "off", "yes", "2", "true"] {
            let e = parse_switch(CUDA_FUSED_VAR, Some(bad), true).unwrap_err().to_string();
            assert_eq!(e, format!("ALLGRAD_CUDA_FUSED={bad:?}: expected 0 or 1"));
        }
    }
}
