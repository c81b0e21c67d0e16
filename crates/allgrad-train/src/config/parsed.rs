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
/// The sections can change only through `RunConfig::sections_mut`, which drops the value; a
/// config made another way (deserialised directly, or cloned: a clone starts without it) has
/// none, and the registry deserialises its sections then. Equal to every other one, so that
/// configs compare by what they say. (A mutex because validating takes the config by shared
/// reference and puts the value back.)
#[derive(Default)]
pub(crate) struct ParsedSections(Mutex<Option<Box<dyn Any + Send>>>);

impl ParsedSections {
    /// Keeps `value`, the typed value of the config's sections as they are now.
    pub(crate) fn keep(&self, value: Box<dyn Any + Send>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(value);
    }

    /// Takes the value out (`None` when none is kept, or another call has it).
    pub(crate) fn take(&self) -> Option<Box<dyn Any + Send>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Drops the value: the sections are about to change.
    pub(crate) fn clear(&mut self) {
        *self.0.get_mut().unwrap_or_else(|p| p.into_inner()) = None;
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
