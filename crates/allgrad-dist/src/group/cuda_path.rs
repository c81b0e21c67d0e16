//! Each group's path for collectives of CUDA tensors ([`crate::gpu`]): chosen once, from the
//! GPUs of its members exchanged over its TCP mesh, and kept.

// Choosing needs a CUDA device (feature `cuda`); the rest is tested in every build.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use candle_core::Device;

use super::ProcessGroup;
use crate::cpu::mesh::OpCode;
use crate::error::{DistError, DistResult};
use crate::gpu::{select_cuda_path, CudaPath, GpuId, GPU_ID_BYTES};
use crate::settings::CudaCollectives;

/// A group's decision: the mode it was made under, the path, and this rank's GPU then.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CudaDecision {
    pub mode: CudaCollectives,
    pub path: CudaPath,
    pub gpu: GpuId,
}

/// Tag in the exchange's call digest: no other all_gather of 24 bytes matches it.
const EXCHANGE_TAG: u64 = 0x6770_755f_7575_6964; // "gpu_uuid"

impl ProcessGroup {
    /// The mode ([`CudaCollectives`]) this group chooses its CUDA path with: the last
    /// [`ProcessGroup::set_cuda_collectives`] of this process, else ALLGRAD_CUDA_COLLECTIVES,
    /// else `auto`.
    pub fn cuda_collectives(&self) -> CudaCollectives {
        *self.inner.ctx.cuda_mode.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets the mode every group of this process chooses its CUDA path with from now on (a run
    /// config's `dist.cuda_collectives`). An error when this group has already chosen under
    /// another mode.
    pub fn set_cuda_collectives(&self, mode: CudaCollectives) -> DistResult<()> {
        if let Some(d) = self.lock().cuda {
            if d.mode != mode {
                return Err(DistError::CudaCollectives {
                    group: self.name().to_string(),
                    detail: format!(
                        "cuda_collectives = {mode} comes too late: the group already chose the {} path under \
                         cuda_collectives = {} at its first collective of a CUDA tensor",
                        d.path, d.mode
                    ),
                });
            }
        }
        *self.inner.ctx.cuda_mode.lock().unwrap_or_else(|p| p.into_inner()) = mode;
        Ok(())
    }

    /// The path this group's collectives of CUDA tensors on `device` take (see
    /// [`crate::gpu`]). The first call, or the group's first collective of a CUDA tensor,
    /// chooses it: that is a collective (every member calls it at the same point of its
    /// program) exchanging the members' GPU UUIDs over TCP; the path is logged on the group's
    /// rank 0 and kept. `nccl` forced where ranks share a GPU fails on every member, naming
    /// the ranks and the GPU. Later calls are answered from memory and fail if `device` is
    /// not the GPU the path was chosen for.
    pub fn cuda_path(&self, device: &Device) -> DistResult<CudaPath> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = device {
            return self.cuda_path_of(d);
        }
        Err(DistError::Invalid(format!(
            "cuda_path on group {}: {device:?} is not a CUDA device (collectives of other tensors use the CPU backend)",
            self.name()
        )))
    }

    /// [`ProcessGroup::cuda_path`] for a device known to be CUDA.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_path_of(&self, device: &candle_core::CudaDevice) -> DistResult<CudaPath> {
        if let Some(d) = self.lock().cuda {
            // The common case: no device query at all.
            if d.gpu.ordinal == device.cuda_stream().context().ordinal() {
                return Ok(d.path);
            }
        }
        self.choose_cuda_path(crate::gpu::cuda::gpu_id(device)?, cfg!(feature = "nccl"))
    }

    /// Chooses (once) this group's path for this rank's GPU `me`; `nccl_built` says whether
    /// the NCCL backend exists. The testable core of [`ProcessGroup::cuda_path`].
    pub(crate) fn choose_cuda_path(&self, me: GpuId, nccl_built: bool) -> DistResult<CudaPath> {
        if let Some(d) = self.lock().cuda {
            if d.gpu != me {
                return Err(DistError::Invalid(format!(
                    "group {} chose its CUDA path for this rank's GPU {}, but this tensor is on {}: keep every CUDA \
                     tensor of a rank on one device",
                    self.name(),
                    d.gpu,
                    me
                )));
            }
            return Ok(d.path);
        }
        let mode = self.cuda_collectives();
        let gpus = self.exchange_gpu_ids(me)?;
        let choice = select_cuda_path(self.name(), &gpus, mode, nccl_built)?;
        if self.rank() == 0 {
            tracing::info!(
                "group {}: collectives of CUDA tensors take the {} path ({})",
                self.name(),
                choice.path,
                choice.reason
            );
        }
        self.lock().cuda = Some(CudaDecision { mode, path: choice.path, gpu: me });
        Ok(choice.path)
    }

    /// Every member's GPU, in group-rank order (a checked all_gather over TCP).
    fn exchange_gpu_ids(&self, me: GpuId) -> DistResult<Vec<GpuId>> {
        let w = self.world_size();
        let own = me.to_bytes();
        let mut all = vec![0u8; GPU_ID_BYTES * w];
        let counts = vec![GPU_ID_BYTES; w];
        self.call(
            OpCode::AllGather,
            None,
            &[GPU_ID_BYTES as u64, EXCHANGE_TAG],
            || "the exchange of GPU UUIDs that chooses the path of CUDA collectives".into(),
            |m, c| m.all_gather_v(c, &own, &counts, 0, &mut all),
        )?;
        Ok(all.chunks(GPU_ID_BYTES).map(GpuId::from_bytes).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::threads::ThreadWorld;

    fn gpu(tag: u8, ordinal: usize) -> GpuId {
        GpuId { uuid: std::array::from_fn(|i| if i == 15 { tag } else { 0x5a }), ordinal }
    }

    /// Rank r of a host with `per_gpu` ranks per GPU.
    fn gpu_of(rank: usize, per_gpu: usize) -> GpuId {
        gpu((rank / per_gpu) as u8, rank / per_gpu)
    }

    #[test]
    fn every_rank_chooses_the_same_path_from_the_exchanged_uuids_and_keeps_it() {
        for w in 1..=4 {
            for (per_gpu, nccl_built, want) in [(1, true, CudaPath::Nccl), (2, true, CudaPath::Host), (1, false, CudaPath::Host)]
            {
                let paths = ThreadWorld::new(w)
                    .run(|pg| {
                        let me = gpu_of(pg.rank(), per_gpu);
                        let first = pg.choose_cuda_path(me, nccl_built)?;
                        // Kept: a second call exchanges nothing (a peer that made no second
                        // call would leave an exchange waiting until the timeout).
                        let again = pg.choose_cuda_path(me, nccl_built)?;
                        Ok((first, again))
                    })
                    .unwrap();
                // With one rank per group nothing is shared, whatever per_gpu says.
                let want = if w == 1 && nccl_built { CudaPath::Nccl } else { want };
                assert!(paths.iter().all(|p| *p == (want, want)), "W={w} per_gpu={per_gpu} nccl={nccl_built}: {paths:?}");
            }
        }
    }

    #[test]
    fn nccl_forced_on_a_shared_gpu_fails_on_every_rank_naming_the_ranks_and_the_gpu() {
        let errors = ThreadWorld::new(3)
            .run(|pg| {
                pg.set_cuda_collectives(CudaCollectives::Nccl)?;
                // Ranks 0 and 2 share GPU 7; rank 1 has GPU 8.
                let me = if pg.rank() == 1 { gpu(8, 1) } else { gpu(7, 0) };
                Ok(pg.choose_cuda_path(me, true).unwrap_err().to_string())
            })
            .unwrap();
        for e in &errors {
            assert!(e.contains("group world") && e.contains(&format!("ranks 0, 2 share GPU {}", gpu(7, 0).uuid_string())), "{e}");
        }
    }

    #[test]
    fn the_mode_comes_from_the_environment_setting_then_from_set_cuda_collectives() {
        let modes = ThreadWorld::new(2)
            .run(|pg| {
                let before = pg.cuda_collectives();
                pg.set_cuda_collectives(CudaCollectives::Host)?;
                let path = pg.choose_cuda_path(gpu(pg.rank() as u8, 0), true)?;
                // The same mode again is fine; another one is refused, naming both.
                pg.set_cuda_collectives(CudaCollectives::Host)?;
                let late = pg.set_cuda_collectives(CudaCollectives::Nccl).unwrap_err().to_string();
                Ok((before, path, late))
            })
            .unwrap();
        for (before, path, late) in modes {
            assert_eq!(before, CudaCollectives::Auto, "ALLGRAD_CUDA_COLLECTIVES is unset in the tests");
            assert_eq!(path, CudaPath::Host, "host was set, though every rank has its own GPU");
            assert!(
                late.contains("cuda_collectives = nccl comes too late") && late.contains("under cuda_collectives = host"),
                "{late}"
            );
        }
    }

    #[test]
    fn a_tensor_on_another_gpu_than_the_chosen_one_is_an_error() {
        let out = ThreadWorld::new(2)
            .run(|pg| {
                pg.choose_cuda_path(gpu(pg.rank() as u8, pg.rank()), false)?;
                Ok(pg.choose_cuda_path(gpu(9, 3), false).unwrap_err().to_string())
            })
            .unwrap();
        assert!(out[0].contains("keep every CUDA tensor of a rank on one device") && out[0].contains("(cuda:3)"), "{}", out[0]);
    }

    #[test]
    fn a_rank_that_runs_another_collective_instead_gets_a_mismatch_not_a_hang() {
        // Whichever rank sees the mismatch first names its own call and aborts the other, so
        // only "mismatch" is certain on both.
        let out = ThreadWorld::new(2)
            .run(|pg| {
                if pg.rank() == 0 {
                    Ok(pg.choose_cuda_path(gpu(0, 0), true).unwrap_err().to_string())
                } else {
                    Ok(pg.all_gather_slice(&[0u8; GPU_ID_BYTES]).unwrap_err().to_string())
                }
            })
            .unwrap();
        assert!(out.iter().all(|e| e.contains("collective mismatch on group world")), "{out:?}");
    }
}
