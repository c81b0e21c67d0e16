//! The CPU backend: the authenticated TCP mesh between the ranks of a group ([`mesh`]), the
//! collective algorithms over it ([`collectives`]; for large groups, the binomial tree of
//! [`tree`]), shared memory between the ranks of one
//! host ([`shm`]), and one collective of a tensor's values on host memory ([`host_ops`]),
//! which the differentiable ops and the host-staged path of CUDA tensors both run.

pub(crate) mod collectives;
pub(crate) mod host_ops;
pub(crate) mod mesh;
pub(crate) mod shm;
pub(crate) mod tree;

#[cfg(test)]
mod fuzz_tests;
#[cfg(test)]
mod hostile_tests;
