//! Ranks and GPUs: which backend carries a group's collectives of CUDA tensors, and which
//! CUDA device each rank of a host uses. Everything here is plain data and pure functions,
//! built and tested in every build; the CUDA side (reading a device's UUID, the exchange)
//! calls them.
//!
//! # The path of a group's CUDA collectives
//!
//! A collective on CUDA tensors moves its data one of two ways:
//!
//! - **`nccl`**: NCCL on the tensors' devices (feature `nccl`). NCCL needs every rank of a
//!   communicator on its own physical GPU: two ranks of one communicator on one GPU make
//!   `ncclCommInitRank` fail (ncclInvalidUsage).
//! - **`host`**: each rank copies its tensor into a pinned host buffer (reused from call to
//!   call), the CPU backend (TCP and shared memory) runs the collective, and the result is
//!   copied back to the tensor's device. PyTorch's gloo does the same for CUDA tensors. The
//!   results are those of the CPU backend on the same values, bit for bit.
//!
//! Each group chooses once, at its first collective on a CUDA tensor (or when
//! [`ProcessGroup::cuda_path`](crate::ProcessGroup::cuda_path) is called): its members
//! exchange the UUIDs of their devices over the group's TCP mesh and [`select_cuda_path`]
//! decides from the list, the mode ([`CudaCollectives`]: `dist.cuda_collectives` in a run
//! config, `ALLGRAD_CUDA_COLLECTIVES` in the environment) and whether the build has NCCL.
//!
//! # The device of a rank
//!
//! [`cuda_ordinal`]: rank r of a host uses CUDA device `LOCAL_RANK % device_count`, so that
//! `launch --nproc-per-node 2` on a machine with one GPU puts both ranks on it, unless a
//! `device_ids` list (`dist.device_ids` in a run config) names a device per local rank.
//!
//! # What the data path of a checked call gets
//!
//! A collective whose data moves outside the TCP mesh (through NCCL) is still checked against
//! the peers' calls over it (`group/checked.rs`); the data path then gets an `Elsewhere`: the
//! call's names, the group's rank, size, store, timeout and mesh (to notice failing peers),
//! and the slot of its NCCL communicator.
//!
//! The collectives of CUDA tensors themselves, which use all of this, are the group's
//! (`group/cuda/`); this module and its children hold what they run on: the pinned host
//! buffer and the device's UUID (`cuda`, feature `cuda`), the NCCL communicators (`nccl`,
//! feature `nccl`) with their watchdog (`watchdog`) and the exchange of their unique id
//! through the rendezvous store (`unique_id`).

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(feature = "nccl")]
pub(crate) mod nccl;
pub(crate) mod unique_id;
pub(crate) mod watchdog;

use std::fmt;
use std::time::Duration;

use crate::cpu::mesh::Mesh;
use crate::error::{DistError, DistResult};
use crate::rendezvous::store::StoreClient;
pub use crate::settings::CudaCollectives;

/// What the data path of one checked call may use.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) struct Elsewhere<'a> {
    /// This rank's call, for error messages.
    pub what: &'a str,
    /// The group's name.
    pub group: &'a str,
    /// This rank in the group.
    pub rank: usize,
    /// The group's size.
    pub world_size: usize,
    /// The job's rendezvous store (absent in a world of one rank).
    pub store: Option<&'a StoreClient>,
    /// The group's timeout.
    pub timeout: Duration,
    /// The group's TCP mesh, to notice peers that fail while the data moves elsewhere.
    pub mesh: &'a Mesh,
    /// The group's NCCL communicator, once made.
    #[cfg(feature = "nccl")]
    pub nccl: &'a mut Option<nccl::GroupComm>,
}

/// The names of a call, for error messages (copied out of an [`Elsewhere`]).
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) struct Names<'a> {
    /// The group's name.
    pub group: &'a str,
    /// This rank's call.
    pub what: &'a str,
}

impl<'a> Elsewhere<'a> {
    /// The call's names, independent of the borrow of `self`.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub(crate) fn names(&self) -> Names<'a> {
        Names { group: self.group, what: self.what }
    }
}

/// The path a group's collectives of CUDA tensors take (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudaPath {
    /// NCCL on the devices.
    Nccl,
    /// Pinned host buffers and the CPU backend.
    Host,
}

impl fmt::Display for CudaPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CudaPath::Nccl => "nccl",
            CudaPath::Host => "host",
        })
    }
}

/// The GPU one rank uses, as its peers see it: the device's UUID (which names the physical
/// GPU, whatever CUDA_VISIBLE_DEVICES numbers it) and its ordinal on the rank's host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GpuId {
    /// The 16 bytes of the device's UUID (`cuDeviceGetUuid`).
    pub uuid: [u8; 16],
    /// The CUDA ordinal the rank opened (`cuda:N`).
    pub ordinal: usize,
}

/// Bytes of a [`GpuId`] on the wire: the UUID, then the ordinal as a little-endian u64.
pub(crate) const GPU_ID_BYTES: usize = 24;

impl GpuId {
    /// The UUID as `nvidia-smi -L` prints it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub fn uuid_string(&self) -> String {
        let h: Vec<String> = self.uuid.iter().map(|b| format!("{b:02x}")).collect();
        format!("GPU-{}-{}-{}-{}-{}", h[0..4].concat(), h[4..6].concat(), h[6..8].concat(), h[8..10].concat(), h[10..16].concat())
    }

    pub(crate) fn to_bytes(self) -> [u8; GPU_ID_BYTES] {
        let mut b = [0u8; GPU_ID_BYTES];
        b[..16].copy_from_slice(&self.uuid);
        b[16..].copy_from_slice(&(self.ordinal as u64).to_le_bytes());
        b
    }

    pub(crate) fn from_bytes(b: &[u8]) -> GpuId {
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[..16]);
        let mut o = [0u8; 8];
        o.copy_from_slice(&b[16..GPU_ID_BYTES]);
        GpuId { uuid, ordinal: u64::from_le_bytes(o) as usize }
    }
}

impl fmt::Display for GpuId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (cuda:{})", self.uuid_string(), self.ordinal)
    }
}

/// A group's choice of path, with the reason in words (logged once, on the group's rank 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaChoice {
    /// The path.
    pub path: CudaPath,
    /// Why, for the log: the mode and what decided it.
    pub reason: String,
}

/// The ranks of `gpus` (group ranks, in order) that share a GPU with another rank, as
/// (the GPU, the ranks on it), GPUs in order of their first rank.
pub fn shared_gpus(gpus: &[GpuId]) -> Vec<(GpuId, Vec<usize>)> {
    let mut out: Vec<(GpuId, Vec<usize>)> = Vec::new();
    for (r, g) in gpus.iter().enumerate() {
        match out.iter_mut().find(|(h, _)| h.uuid == g.uuid) {
            Some((_, ranks)) => ranks.push(r),
            None => out.push((*g, vec![r])),
        }
    }
    out.retain(|(_, ranks)| ranks.len() > 1);
    out
}

/// The path of group `group`'s CUDA collectives, given the GPU of each of its ranks (in group
/// rank order), the mode and whether this build has the `nccl` feature. `nccl` on a shared
/// GPU or in a build without NCCL is an error naming the ranks and the GPU.
pub fn select_cuda_path(group: &str, gpus: &[GpuId], mode: CudaCollectives, nccl_built: bool) -> DistResult<CudaChoice> {
    let shared = shared_gpus(gpus);
    let describe_shared = || {
        shared
            .iter()
            .map(|(g, ranks)| {
                let ranks: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
                format!("ranks {} share GPU {}", ranks.join(", "), g.uuid_string())
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    let w = gpus.len();
    let choice = |path, reason: String| Ok(CudaChoice { path, reason });
    match mode {
        CudaCollectives::Host => choice(CudaPath::Host, "cuda_collectives = host".into()),
        CudaCollectives::Nccl if !nccl_built => Err(DistError::CudaCollectives {
            group: group.into(),
            detail: "cuda_collectives = nccl, but this binary was built without the `nccl` feature: \
                     build with `--features cuda,nccl`, or use cuda_collectives: host (or auto)"
                .into(),
        }),
        CudaCollectives::Nccl if !shared.is_empty() => Err(DistError::CudaCollectives {
            group: group.into(),
            detail: format!(
                "cuda_collectives = nccl, but {}: NCCL cannot run two ranks of one communicator on one GPU. \
                 Give each rank its own GPU (dist.device_ids, or fewer ranks per host), or use \
                 cuda_collectives: host (or auto, which chooses host here)",
                describe_shared()
            ),
        }),
        CudaCollectives::Nccl => {
            choice(CudaPath::Nccl, format!("cuda_collectives = nccl; each of the {w} rank(s) has its own GPU"))
        }
        CudaCollectives::Auto if !nccl_built => {
            choice(CudaPath::Host, "cuda_collectives = auto; this binary was built without the `nccl` feature".into())
        }
        CudaCollectives::Auto if !shared.is_empty() => {
            choice(CudaPath::Host, format!("cuda_collectives = auto; {}", describe_shared()))
        }
        CudaCollectives::Auto => {
            choice(CudaPath::Nccl, format!("cuda_collectives = auto; each of the {w} rank(s) has its own GPU"))
        }
    }
}

/// The CUDA device of local rank `local_rank` of a host that runs `local_world_size` ranks and
/// has `device_count` devices: `device_ids[local_rank]` when a list is given, else
/// `local_rank % device_count`. Errors name `dist.device_ids` and the numbers.
pub fn cuda_ordinal(
    local_rank: usize,
    local_world_size: usize,
    device_count: usize,
    device_ids: Option<&[usize]>,
) -> Result<usize, String> {
    if device_count == 0 {
        return Err(
            "device: cuda, but no CUDA device is visible to this process (check nvidia-smi and CUDA_VISIBLE_DEVICES)".into()
        );
    }
    let Some(ids) = device_ids else { return Ok(local_rank % device_count) };
    if ids.len() < local_world_size.max(local_rank + 1) {
        return Err(format!(
            "dist.device_ids has {} entr{} ({ids:?}), but this host runs {} rank(s) (LOCAL_WORLD_SIZE): \
             give one CUDA device per local rank",
            ids.len(),
            if ids.len() == 1 { "y" } else { "ies" },
            local_world_size.max(local_rank + 1)
        ));
    }
    let id = ids[local_rank];
    if id >= device_count {
        return Err(format!(
            "dist.device_ids[{local_rank}] = {id} (for LOCAL_RANK {local_rank}), but this host has {device_count} \
             visible CUDA device(s), numbered 0 to {}",
            device_count - 1
        ));
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(tag: u8, ordinal: usize) -> GpuId {
        let mut uuid = [0u8; 16];
        uuid[0] = 0xab;
        uuid[15] = tag;
        GpuId { uuid, ordinal }
    }

    #[test]
    fn the_uuid_is_written_as_nvidia_smi_writes_it_and_survives_the_wire() {
        let g = GpuId { uuid: std::array::from_fn(|i| (i * 17) as u8), ordinal: 3 };
        assert_eq!(g.uuid_string(), "GPU-00112233-4455-6677-8899-aabbccddeeff");
        assert_eq!(g.to_string(), "GPU-00112233-4455-6677-8899-aabbccddeeff (cuda:3)");
        assert_eq!(GpuId::from_bytes(&g.to_bytes()), g);
    }

    #[test]
    fn auto_chooses_nccl_only_when_every_rank_has_its_own_gpu_and_nccl_is_built() {
        let own = [gpu(1, 0), gpu(2, 1), gpu(3, 0)]; // rank 2 on another host's cuda:0
        let shared = [gpu(1, 0), gpu(1, 0), gpu(2, 1)];
        let pick = |g: &[GpuId], nccl| select_cuda_path("world", g, CudaCollectives::Auto, nccl).unwrap().path;
        assert_eq!(pick(&own, true), CudaPath::Nccl);
        assert_eq!(pick(&shared, true), CudaPath::Host);
        assert_eq!(pick(&own, false), CudaPath::Host);
        assert_eq!(pick(&shared, false), CudaPath::Host);
        // One rank: nothing to share.
        assert_eq!(pick(&[gpu(1, 0)], true), CudaPath::Nccl);
        assert_eq!(pick(&[gpu(1, 0)], false), CudaPath::Host);
        let why = select_cuda_path("world", &shared, CudaCollectives::Auto, true).unwrap().reason;
        assert!(why.contains("auto") && why.contains("ranks 0, 1 share GPU GPU-ab"), "{why}");
    }

    #[test]
    fn host_is_host_whatever_the_gpus() {
        for g in [&[gpu(1, 0), gpu(2, 1)][..], &[gpu(1, 0), gpu(1, 0)][..]] {
            for nccl in [true, false] {
                assert_eq!(select_cuda_path("world", g, CudaCollectives::Host, nccl).unwrap().path, CudaPath::Host);
            }
        }
    }

    #[test]
    fn nccl_on_a_shared_gpu_is_an_error_naming_the_group_the_ranks_and_the_gpu() {
        // Ranks 0 and 2 on one GPU, 1 and 3 on another, 4 alone.
        let g = [gpu(7, 0), gpu(8, 1), gpu(7, 0), gpu(8, 1), gpu(9, 2)];
        let e = select_cuda_path("world/1", &g, CudaCollectives::Nccl, true).unwrap_err().to_string();
        assert!(e.contains("group world/1"), "{e}");
        assert!(e.contains(&format!("ranks 0, 2 share GPU {}", g[0].uuid_string())), "{e}");
        assert!(e.contains(&format!("ranks 1, 3 share GPU {}", g[1].uuid_string())), "{e}");
        assert!(!e.contains(", 4"), "rank 4 has its own GPU: {e}");
        assert!(e.contains("cuda_collectives: host"), "{e}");
        assert_eq!(select_cuda_path("w", &[gpu(1, 0), gpu(2, 0)], CudaCollectives::Nccl, true).unwrap().path, CudaPath::Nccl);
    }

    #[test]
    fn nccl_without_the_nccl_feature_is_an_error_saying_how_to_build() {
        let e = select_cuda_path("world", &[gpu(1, 0), gpu(2, 1)], CudaCollectives::Nccl, false).unwrap_err().to_string();
        assert!(e.contains("without the `nccl` feature") && e.contains("--features cuda,nccl"), "{e}");
    }

    #[test]
    fn shared_gpus_groups_ranks_by_uuid_not_by_ordinal() {
        // The same ordinal on two hosts is two GPUs; one GPU seen under two ordinals (two
        // CUDA_VISIBLE_DEVICES orders) is one.
        let a = GpuId { ordinal: 1, ..gpu(5, 0) };
        assert!(shared_gpus(&[gpu(1, 0), gpu(2, 0)]).is_empty());
        assert_eq!(shared_gpus(&[gpu(5, 0), gpu(6, 0), a]), vec![(gpu(5, 0), vec![0, 2])]);
    }

    #[test]
    fn ranks_wrap_around_the_devices_of_their_host() {
        assert_eq!((0..4).map(|r| cuda_ordinal(r, 4, 1, None).unwrap()).collect::<Vec<_>>(), [0, 0, 0, 0]);
        assert_eq!((0..4).map(|r| cuda_ordinal(r, 4, 2, None).unwrap()).collect::<Vec<_>>(), [0, 1, 0, 1]);
        assert_eq!((0..3).map(|r| cuda_ordinal(r, 3, 8, None).unwrap()).collect::<Vec<_>>(), [0, 1, 2]);
        let e = cuda_ordinal(0, 1, 0, None).unwrap_err();
        assert!(e.contains("no CUDA device is visible"), "{e}");
    }

    #[test]
    fn device_ids_override_the_map_and_their_errors_name_the_key_and_the_numbers() {
        let ids = [3, 3, 1, 0];
        assert_eq!((0..4).map(|r| cuda_ordinal(r, 4, 4, Some(&ids)).unwrap()).collect::<Vec<_>>(), ids);
        let e = cuda_ordinal(1, 3, 4, Some(&[0, 1])).unwrap_err();
        assert!(e.contains("dist.device_ids has 2 entries ([0, 1])") && e.contains("runs 3 rank(s)"), "{e}");
        let e = cuda_ordinal(1, 2, 2, Some(&[0, 2])).unwrap_err();
        assert!(e.contains("dist.device_ids[1] = 2") && e.contains("2 visible CUDA device(s), numbered 0 to 1"), "{e}");
    }
}
