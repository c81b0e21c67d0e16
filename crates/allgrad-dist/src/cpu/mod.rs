//! The CPU backend, in floors: a group's shared-memory segment ([`segment`]) below the
//! authenticated TCP mesh between its ranks ([`mesh`]), which carries it; a collective call as
//! the algorithms see it ([`call`]); the algorithm families over the mesh: the binomial tree
//! of large groups ([`tree`]) and their all_to_all in Bruck's rounds ([`bruck`]), the
//! same-host path through the segment ([`shm`]), and on top the collectives themselves ([`collectives`]: direct and ring paths, and the choice among
//! the three). Everything here works on a [`Mesh`](mesh::Mesh); the process group that owns
//! one is above, in `group/`.

pub(crate) mod bruck;
pub(crate) mod call;
pub(crate) mod collectives;
pub(crate) mod mesh;
pub(crate) mod segment;
pub(crate) mod shm;
pub(crate) mod tree;

#[cfg(test)]
mod fuzz_tests;
#[cfg(test)]
mod hostile_tests;
