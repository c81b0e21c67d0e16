//! `--set dotted.key=value` arguments: parsing one, applying it to the YAML before it is
//! deserialised, and blaming a key error on the argument that gave the value.

use super::error::ConfigError;

/// One `--set dotted.key=value`.
pub(super) struct Override<'a> {
    arg: &'a str,
    /// The dotted key, split.
    pub(super) key: Vec<&'a str>,
    /// The value, parsed as YAML (a string where it does not parse).
    pub(super) value: serde_yaml::Value,
}

impl<'a> Override<'a> {
    pub(super) fn parse(arg: &'a str) -> Result<Override<'a>, ConfigError> {
        let err = |msg: &str| ConfigError::Override { arg: arg.to_string(), msg: msg.to_string() };
        let (key, raw) = arg.split_once('=').ok_or_else(|| err("expected dotted.key=value"))?;
        let key: Vec<&str> = key.trim().split('.').collect();
        if key.iter().any(|p| p.is_empty()) {
            return Err(err("empty key segment"));
        }
        let value = serde_yaml::from_str(raw).unwrap_or_else(|_| serde_yaml::Value::String(raw.to_string()));
        Ok(Override { arg, key, value })
    }

    /// The most precise key path of a value that the `--set` argument `arg` gave, where a
    /// deserialisation error reports `key`: the error's key when it lies within what `arg`
    /// set, the argument's own key when the error names only a section holding it (an
    /// internally tagged section such as `optim` loses the inner path). `None` when `arg` did
    /// not set anything at `key`.
    fn blamed_key(arg: &str, key: &str) -> Option<String> {
        let (set, _) = arg.split_once('=')?;
        let (set, key) = (set.trim(), key.trim_start_matches('.'));
        let within = |outer: &str, inner: &str| inner == outer || inner.starts_with(&format!("{outer}."));
        if within(set, key) {
            Some(key.to_string())
        } else if within(key, set) {
            Some(set.to_string())
        } else {
            None
        }
    }

    /// Sets the value at the key in `root`, making the sections on the way.
    pub(super) fn apply(self, root: &mut serde_yaml::Value) -> Result<(), ConfigError> {
        let err = |msg: String| ConfigError::Override { arg: self.arg.to_string(), msg };
        let mut node = root;
        for (i, part) in self.key.iter().enumerate() {
            if node.is_null() {
                *node = serde_yaml::Value::Mapping(Default::default());
            }
            let map = node.as_mapping_mut().ok_or_else(|| err(format!("`{}` is not a section", self.key[..i].join("."))))?;
            let k = serde_yaml::Value::String(part.to_string());
            if i + 1 == self.key.len() {
                map.insert(k, self.value);
                return Ok(());
            }
            node = map.entry(k).or_insert(serde_yaml::Value::Null);
        }
        Ok(())
    }
}

impl ConfigError {
    /// A key error whose value came from a `--set` argument, as an error of that argument:
    /// the user is told to fix the command line, not the file.
    pub(crate) fn blamed_on(self, overrides: &[String]) -> ConfigError {
        match self {
            ConfigError::Field { path, key, msg } => {
                match overrides.iter().rev().find_map(|arg| Some((arg, Override::blamed_key(arg, &key)?))) {
                    Some((arg, key)) => ConfigError::OverrideValue { arg: arg.clone(), key, msg },
                    None => ConfigError::Field { path, key, msg },
                }
            }
            e => e,
        }
    }
}
