//! Where a batch is assembled before it becomes tensors, how it gets to its device, and the
//! [`Batch`] of tensors it becomes.
//!
//! For a CPU device the views are plain vectors and become tensors as they are (the path
//! the loader always had). For a CUDA device (feature `cuda`) the workers write the views
//! into page-locked (pinned) host buffers from a pool, and each batch is copied to the
//! device by one asynchronous DMA per buffer on a copy stream of its own, which the step's
//! stream waits for through an event ([`crate::pinned`]): the copy never races the
//! compute, and neither the workers nor the training thread wait for it. The loaders hand
//! out batch b only after batch b + 1's copy has been started, so on a GPU the copy of the
//! next batch runs while the step computes on this one.

use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{Device, Tensor};

use crate::error::DataResult;

/// One batch: the global indices, one `[B, C, H, W]` f32 tensor per view, and the labels.
#[derive(Clone, Debug)]
pub struct Batch {
    /// Global sample indices, in batch order.
    pub indices: Vec<usize>,
    /// One `[B, C, H, W]` f32 tensor per view of the pipeline.
    pub views: Vec<Tensor>,
    /// `[B]` u32 class ids.
    pub labels: Tensor,
    /// Each sample's text as token ids, in batch order, when the pipeline takes text
    /// ([`crate::Pipeline::takes_text`]); empty otherwise.
    pub tokens: Vec<Vec<u32>>,
}

/// Views copied to a device through the pinned path, in this process.
static PINNED_UPLOADS: AtomicU64 = AtomicU64::new(0);

/// How many batch views this process has copied to a CUDA device through pinned buffers and
/// the copy stream (what a test of that path checks ran; always 0 in a build without `cuda`).
pub fn pinned_uploads() -> u64 {
    PINNED_UPLOADS.load(Ordering::Relaxed)
}

/// Host memory for one view of a batch (or a part of one).
pub(crate) enum HostBuf {
    /// Ordinary memory (a CPU device).
    Plain(Vec<f32>),
    /// Page-locked memory from the pool of a CUDA device.
    #[cfg(feature = "cuda")]
    Pinned(crate::pinned::PinnedBuf),
}

impl HostBuf {
    /// The buffer's values, to write into (for pinned memory: after any copy still reading
    /// it has finished).
    pub(crate) fn as_mut_slice(&mut self) -> DataResult<&mut [f32]> {
        match self {
            HostBuf::Plain(v) => Ok(v.as_mut_slice()),
            #[cfg(feature = "cuda")]
            HostBuf::Pinned(p) => p.as_mut_slice(),
        }
    }
}

/// Where the buffers of a loader's batches come from.
#[derive(Clone)]
pub(crate) enum Staging {
    /// Plain vectors.
    Plain,
    /// The pinned pool and copy stream of a CUDA device.
    #[cfg(feature = "cuda")]
    Pinned(std::sync::Arc<crate::pinned::Uploader>),
}

impl Staging {
    /// The staging for tensors on `device`.
    pub(crate) fn for_device(device: &Device) -> DataResult<Self> {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => Ok(Staging::Pinned(crate::pinned::Uploader::new(d)?)),
            _ => Ok(Staging::Plain),
        }
    }

    /// A buffer of `len` values.
    pub(crate) fn buffer(&self, len: usize) -> DataResult<HostBuf> {
        match self {
            Staging::Plain => Ok(HostBuf::Plain(vec![0f32; len])),
            #[cfg(feature = "cuda")]
            Staging::Pinned(u) => Ok(HostBuf::Pinned(u.take(len)?)),
        }
    }

    /// Whether batches go to a device by asynchronous copies (then the loaders start the
    /// next batch's copy before handing out the current one).
    pub(crate) fn copies_ahead(&self) -> bool {
        !matches!(self, Staging::Plain)
    }
}

/// One view of a batch: its parts in order (one for the indexed loader, one per stream for
/// the stream loader) and the shape of one sample.
pub(crate) struct HostView {
    pub(crate) parts: Vec<HostBuf>,
    pub(crate) sample: (usize, usize, usize),
}

/// A batch built on the host.
pub(crate) struct HostBatch {
    pub(crate) indices: Vec<usize>,
    pub(crate) views: Vec<HostView>,
    pub(crate) labels: Vec<u32>,
    pub(crate) tokens: Vec<Vec<u32>>,
}

/// The tensors of a host batch on `device`: for plain buffers the vectors become CPU
/// tensors (one part as it is, several joined); pinned buffers are copied to the device
/// asynchronously (see the module docs).
pub(crate) fn to_batch(host: HostBatch, device: &Device) -> DataResult<Batch> {
    let n = host.indices.len();
    let mut views = Vec::with_capacity(host.views.len());
    for view in host.views {
        let (c, h, w) = view.sample;
        let shape = (n, c, h, w);
        let mut parts = view.parts.into_iter();
        let tensor = match parts.next() {
            Some(HostBuf::Plain(mut first)) => {
                for part in parts {
                    match part {
                        HostBuf::Plain(v) => first.extend(v),
                        #[cfg(feature = "cuda")]
                        HostBuf::Pinned(_) => unreachable!("one staging per loader"),
                    }
                }
                Tensor::from_vec(first, shape, device)?
            }
            #[cfg(feature = "cuda")]
            Some(HostBuf::Pinned(first)) => {
                let rest = parts.map(|p| match p {
                    HostBuf::Pinned(p) => p,
                    HostBuf::Plain(_) => unreachable!("one staging per loader"),
                });
                let tensor = crate::pinned::upload(std::iter::once(first).chain(rest).collect(), shape)?;
                PINNED_UPLOADS.fetch_add(1, Ordering::Relaxed);
                tensor
            }
            None => Tensor::zeros(shape, candle_core::DType::F32, device)?,
        };
        views.push(tensor);
    }
    let labels = Tensor::from_vec(host.labels, n, device)?;
    Ok(Batch { indices: host.indices, views, labels, tokens: host.tokens })
}
