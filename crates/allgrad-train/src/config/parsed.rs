//! The method's sections once deserialised: [`ParsedSections`], which a [`super::RunConfig`]
//! carries from the registry's `parse` to its `validate` and `objective`.

use std::any::Any;
use std::sync::Mutex;

/// The method's sections as the method's own typed value, kept with the config by the
/// registry that deserialised them (`Registry::parse`), so that validating the run, building
/// its objective and printing the resolved config use them instead of deserialising
/// [`super::RunConfig::sections`] again. Opaque here: the config knows no methods, the
/// registry puts the value in and takes it out by its type.
///
/// It stands for the raw sections as they were when parsed: once those change (a test edits
/// `sections`), or in a config made another way (deserialised directly, or cloned: a clone
/// starts without it), the registry deserialises them again. Equal to every other one, so that
/// configs compare by what they say.
#[derive(Default)]
pub(crate) struct ParsedSections(Mutex<Option<Parsed>>);

/// The raw sections the value was deserialised from, and the value.
type Parsed = (serde_yaml::Mapping, Box<dyn Any + Send>);

impl ParsedSections {
    /// Keeps `value`, deserialised from `raw`.
    pub(crate) fn keep(&self, raw: serde_yaml::Mapping, value: Box<dyn Any + Send>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some((raw, value));
    }

    /// Takes the value out when it was deserialised from sections equal to `raw`, the config's
    /// sections now (`None` otherwise, or when another call has it).
    pub(crate) fn take(&self, raw: &serde_yaml::Mapping) -> Option<Box<dyn Any + Send>> {
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match kept.take() {
            Some((from, value)) if from == *raw => Some(value),
            _ => None,
        }
    }
}

impl Clone for ParsedSections {
    fn clone(&self) -> Self {
        ParsedSections::default()
    }
}

impl PartialEq for ParsedSections {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for ParsedSections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ParsedSections(..)")
    }
}
