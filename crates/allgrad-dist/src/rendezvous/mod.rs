//! How the ranks of a job find each other: the world variables of torchrun, `launch` and
//! srun ([`env`], [`elastic`], [`slurm`]), the rendezvous store rank 0 serves ([`store`]),
//! PyTorch's TCPStore protocol for torchrun's agent store ([`torch_store`]) and the
//! rendezvous through that store ([`agent`]).

pub(crate) mod agent;
pub mod elastic;
pub mod env;
pub mod slurm;
pub mod store;
pub mod torch_store;
