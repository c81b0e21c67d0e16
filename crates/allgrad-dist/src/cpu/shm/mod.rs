//! The same-host path of the CPU backend: how a group whose members all run on this host sets
//! up one shared-memory segment ([`setup`]), the collectives that move their data through it
//! ([`ops`]), and the names of a job's segments with their removal when the job ends
//! ([`job`]). The segment itself (the mapping and its unsafe code) is `cpu::segment`.

pub(crate) mod job;
pub(crate) mod ops;
pub(crate) mod setup;

#[cfg(test)]
mod path_tests;
