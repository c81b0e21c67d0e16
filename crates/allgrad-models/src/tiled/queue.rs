//! Extra negatives from the past: the keys of the last K global batches (a "memory bank" or
//! cross-batch queue, as in MoCo), used by the tiled losses as more columns of every row's
//! softmax.

use std::collections::HashMap;
use std::collections::VecDeque;

use candle_core::{Result, Tensor};

use crate::error::fail;
use crate::ModelError;

/// The keys of the last `batches` global batches, oldest first, detached.
///
/// A tiled loss with a queue scores every anchor against the current global batch's keys and
/// then the queued ones (negatives only: no gradient reaches them, no row's positive is among
/// them), then pushes the current keys, dropping the oldest batch beyond `batches`. The keys
/// pushed are the gathered ones, the same on every rank, so the queue is identical on every
/// rank and the loss stays W-invariant. With `accumulate > 1` each micro-batch is one batch of
/// the queue. The queue is state of the run: [`KeyQueue::buffer`] and [`KeyQueue::load`]
/// carry it through checkpoints (the objectives save it as the buffer [`KeyQueue::BUFFER`]).
#[derive(Clone, Debug)]
pub struct KeyQueue {
    batches: usize,
    queued: VecDeque<Tensor>,
    /// The rows of every batch this run will push ([`KeyQueue::expect_rows`]), when known.
    rows: Option<usize>,
}

impl KeyQueue {
    /// The name the objectives give the queue among their buffers.
    pub const BUFFER: &'static str = "loss.queue";

    /// An empty queue of up to `batches` batches (at least 1).
    pub fn new(batches: usize) -> Result<Self> {
        // A run's `loss.queue` was checked with its loss config ([`super::Tiling`]); this
        // guards the argument for callers of the library.
        if batches == 0 {
            return fail(ModelError::LossKey {
                key: "queue",
                msg: "loss.queue = 0: it is a number of past batches, at least 1".into(),
            });
        }
        Ok(KeyQueue { batches, queued: VecDeque::new(), rows: None })
    }

    /// Says how many keys each batch of this run will have (the objective knows it from the
    /// global micro-batch): a saved queue whose batches have another number is refused when
    /// loaded ([`KeyQueue::load`]), or now when it is already loaded, naming both numbers,
    /// rather than at the first push of the resumed run.
    pub fn expect_rows(&mut self, rows: usize) -> Result<()> {
        self.rows = Some(rows);
        match self.queued.front() {
            Some(first) => self.check_rows(first.dim(0)?),
            None => Ok(()),
        }
    }

    fn check_rows(&self, saved: usize) -> Result<()> {
        match self.rows {
            Some(rows) if rows != saved => fail(ModelError::TiledInput(format!(
                "the saved queue of past keys (loss.queue) holds batches of {saved} keys, but this run's batches have \
                 {rows}: train.global_batch or train.accumulate changed since the checkpoint was written"
            ))),
            _ => Ok(()),
        }
    }

    /// How many batches it keeps.
    pub fn capacity(&self) -> usize {
        self.batches
    }

    /// Batches queued now.
    pub fn len(&self) -> usize {
        self.queued.len()
    }

    /// Whether nothing is queued yet.
    pub fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }

    /// The queued keys, oldest batch first, `[rows, d]`; `None` while empty.
    pub fn keys(&self) -> Result<Option<Tensor>> {
        if self.queued.is_empty() {
            return Ok(None);
        }
        let parts: Vec<&Tensor> = self.queued.iter().collect();
        Ok(Some(Tensor::cat(&parts, 0)?))
    }

    /// Adds `keys` (`[rows, d]`, detached and copied) as the newest batch, dropping the oldest
    /// beyond the capacity. Every batch must have the shape of the first.
    pub fn push(&mut self, keys: &Tensor) -> Result<()> {
        if let Some(first) = self.queued.front() {
            if first.dims() != keys.dims() {
                return fail(ModelError::TiledInput(format!(
                    "the queue holds batches of keys {:?}, got {:?} (the global batch must not change during a run)",
                    first.dims(),
                    keys.dims()
                )));
            }
        }
        self.queued.push_back(keys.detach().copy()?);
        while self.queued.len() > self.batches {
            self.queued.pop_front();
        }
        Ok(())
    }

    /// The queue as one tensor `[batches queued, rows, d]`, to checkpoint; `None` while empty.
    pub fn buffer(&self) -> Result<Option<Tensor>> {
        if self.queued.is_empty() {
            return Ok(None);
        }
        let parts: Vec<&Tensor> = self.queued.iter().collect();
        Ok(Some(Tensor::stack(&parts, 0)?))
    }

    /// Restores what [`KeyQueue::buffer`] returned (empty when `buffer` is `None`).
    pub fn load(&mut self, buffer: Option<&Tensor>) -> Result<()> {
        self.queued.clear();
        let Some(b) = buffer else { return Ok(()) };
        if b.rank() != 3 || b.dim(0)? > self.batches {
            return fail(ModelError::TiledInput(format!(
                "a saved queue must be [batches, rows, d] with at most loss.queue = {} batches, got {:?}",
                self.batches,
                b.dims()
            )));
        }
        self.check_rows(b.dim(1)?)?;
        for i in 0..b.dim(0)? {
            self.queued.push_back(b.get(i)?.contiguous()?);
        }
        Ok(())
    }

    /// Adds the queue (when it holds anything) to an objective's `buffers`.
    pub fn save_into(&self, buffers: &mut Vec<(String, Tensor)>) -> Result<()> {
        if let Some(b) = self.buffer()? {
            buffers.push((Self::BUFFER.to_string(), b));
        }
        Ok(())
    }

    /// Restores the queue from an objective's `buffers` (empty when absent) and returns the
    /// other buffers.
    pub fn load_from(&mut self, buffers: &HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
        self.load(buffers.get(Self::BUFFER))?;
        Ok(buffers.iter().filter(|(k, _)| k.as_str() != Self::BUFFER).map(|(k, v)| (k.clone(), v.clone())).collect())
    }
}

/// `Objective::buffers` of an objective whose only buffer is its queue (`None`: no queue).
pub fn queue_buffers(queue: Option<&KeyQueue>) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    if let Some(q) = queue {
        q.save_into(&mut out)?;
    }
    Ok(out)
}

/// `Objective::load_buffers` of an objective whose only buffer is its queue: any other
/// buffer is an error naming it and `objective`.
pub fn load_queue_buffers(queue: Option<&mut KeyQueue>, buffers: &HashMap<String, Tensor>, objective: &str) -> Result<()> {
    let rest = match queue {
        Some(q) => q.load_from(buffers)?,
        None => buffers.clone(),
    };
    if let Some(name) = rest.keys().next() {
        candle_core::bail!(
            "the {objective} objective has no buffer {name} (the checkpoint's loss.queue and the config's differ?)"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn batch(v: f64) -> Tensor {
        Tensor::full(v, (2, 3), &Device::Cpu).unwrap()
    }

    #[test]
    fn the_queue_keeps_the_last_batches_oldest_first_and_round_trips_through_its_buffer() {
        let mut q = KeyQueue::new(2).unwrap();
        assert!(q.keys().unwrap().is_none() && q.buffer().unwrap().is_none());
        for v in [1.0, 2.0, 3.0] {
            q.push(&batch(v)).unwrap();
        }
        assert_eq!(q.len(), 2);
        let keys = q.keys().unwrap().unwrap();
        assert_eq!(keys.dims(), &[4, 3]);
        assert_eq!(keys.get(0).unwrap().to_vec1::<f64>().unwrap(), vec![2.0; 3]);
        assert_eq!(keys.get(3).unwrap().to_vec1::<f64>().unwrap(), vec![3.0; 3]);
        let mut r = KeyQueue::new(2).unwrap();
        r.load(q.buffer().unwrap().as_ref()).unwrap();
        assert_eq!(
            r.keys().unwrap().unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap(),
            keys.flatten_all().unwrap().to_vec1::<f64>().unwrap()
        );
        assert!(q.push(&Tensor::zeros((3, 3), candle_core::DType::F64, &Device::Cpu).unwrap()).is_err());
        assert!(KeyQueue::new(1).unwrap().load(q.buffer().unwrap().as_ref()).is_err(), "2 batches into a queue of 1");
        assert!(KeyQueue::new(0).unwrap_err().to_string().contains("loss.queue = 0"));
    }

    #[test]
    fn a_saved_queue_of_another_batch_size_is_refused_when_loaded_naming_both_numbers() {
        let mut q = KeyQueue::new(2).unwrap();
        q.push(&batch(1.0)).unwrap();
        let saved = q.buffer().unwrap();
        let want = "holds batches of 2 keys, but this run's batches have 4";
        // Told first, then loaded.
        let mut r = KeyQueue::new(2).unwrap();
        r.expect_rows(4).unwrap();
        let e = r.load(saved.as_ref()).unwrap_err().to_string();
        assert!(e.contains(want) && e.contains("train.global_batch"), "{e}");
        // Loaded first, then told.
        let mut r = KeyQueue::new(2).unwrap();
        r.load(saved.as_ref()).unwrap();
        let e = r.expect_rows(4).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
        // The same number loads.
        let mut r = KeyQueue::new(2).unwrap();
        r.expect_rows(2).unwrap();
        r.load(saved.as_ref()).unwrap();
        assert_eq!(r.len(), 1);
    }
}
