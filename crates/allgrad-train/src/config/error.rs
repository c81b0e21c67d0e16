//! [`ConfigError`]: why a run configuration could not be used. Every variant names the file
//! (or the `--set` argument) and the key path; the config's own checks and the method
//! registry's raise them.

use std::path::PathBuf;

/// A configuration that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid YAML.
    #[error("{path}: not valid YAML: {msg}")]
    Yaml {
        /// The file.
        path: PathBuf,
        /// The parser's message (with line and column).
        msg: String,
    },
    /// A key is unknown or its value has the wrong type.
    #[error("{path}: at `{key}`: {msg}")]
    Field {
        /// The file.
        path: PathBuf,
        /// Dotted key path.
        key: String,
        /// What was wrong and what was expected.
        msg: String,
    },
    /// A `--set key=value` argument is malformed.
    #[error("--set {arg:?}: {msg}")]
    Override {
        /// The argument.
        arg: String,
        /// What is wrong.
        msg: String,
    },
    /// A `--set key=value` gives a value of the wrong type or an unknown key.
    #[error("--set {arg}: at `{key}`: {msg} (the value comes from the command line)")]
    OverrideValue {
        /// The argument.
        arg: String,
        /// Dotted key path where the value failed.
        key: String,
        /// What was wrong and what was expected.
        msg: String,
    },
    /// The `method:` is not in the registry.
    #[error("{path}: at `method`: unknown method `{name}`; the methods are: {known}")]
    UnknownMethod {
        /// The file.
        path: PathBuf,
        /// The name asked for.
        name: String,
        /// The registered names, comma-separated.
        known: String,
    },
    /// The method rejects its sections.
    #[error("{path}: at `{key}`: {msg}")]
    Method {
        /// The file.
        path: PathBuf,
        /// The method.
        method: String,
        /// Dotted key path.
        key: String,
        /// What is wrong, with the numbers.
        msg: String,
    },
    /// The values do not work together (or with the world size).
    #[error("{path}: {msg}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the numbers.
        msg: String,
    },
}
