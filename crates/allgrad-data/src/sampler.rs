//! Which samples each rank sees: a global permutation per epoch from (seed, epoch), cut into
//! global batches; rank r takes the r-th contiguous slice of each. A run on W ranks therefore
//! sees exactly the batches of a run on one rank (ARCHITECTURE.md, "Why W ranks equal one").
//!
//! The sampler holds no position of its own: batch `pos` of `epoch` is a pure function of
//! (seed, epoch, pos), so a resumed run that knows its step sees exactly the batches of an
//! uninterrupted one.

use allgrad_rng::stream;

/// The distributed sampler.
#[derive(Clone, Debug)]
pub struct DistributedSampler {
    num_samples: usize,
    global_batch: usize,
    seed: u64,
    shuffle: bool,
    cached: Option<(usize, Vec<usize>)>,
}

impl DistributedSampler {
    /// A sampler over `num_samples` samples in global batches of `global_batch` (the last,
    /// incomplete batch of an epoch is dropped).
    pub fn new(num_samples: usize, global_batch: usize, seed: u64, shuffle: bool) -> Self {
        DistributedSampler { num_samples, global_batch, seed, shuffle, cached: None }
    }

    /// Full global batches per epoch (0 when `global_batch` is 0).
    pub fn steps_per_epoch(&self) -> usize {
        self.num_samples.checked_div(self.global_batch).unwrap_or(0)
    }

    /// The global sample indices of batch `pos` of `epoch`; `pos` must be below
    /// [`DistributedSampler::steps_per_epoch`] (panics otherwise: a caller's bug, not input).
    pub fn global_batch(&mut self, epoch: usize, pos: usize) -> &[usize] {
        if self.cached.as_ref().map(|(e, _)| *e) != Some(epoch) {
            let mut perm: Vec<usize> = (0..self.num_samples).collect();
            if self.shuffle {
                allgrad_rng::shuffle(&mut stream(&[self.seed, 0x5A3B, epoch as u64]), &mut perm);
            }
            self.cached = Some((epoch, perm));
        }
        let perm = &self.cached.as_ref().expect("filled above").1;
        &perm[pos * self.global_batch..(pos + 1) * self.global_batch]
    }

    /// Rank `rank`'s contiguous slice (of `world` equal slices) of a global batch.
    pub fn local<'a>(&self, global: &'a [usize], rank: usize, world: usize) -> &'a [usize] {
        let b = global.len() / world;
        &global[rank * b..(rank + 1) * b]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_partition_each_global_batch_and_epochs_differ() {
        let mut s = DistributedSampler::new(100, 12, 3, true);
        assert_eq!(s.steps_per_epoch(), 8);
        let g = s.global_batch(0, 1).to_vec();
        let parts: Vec<usize> = (0..3).flat_map(|r| s.local(&g, r, 3).to_vec()).collect();
        assert_eq!(parts, g);
        let e1 = s.global_batch(1, 1).to_vec();
        assert_ne!(g, e1);
        let mut all: Vec<usize> = (0..8).flat_map(|p| s.global_batch(0, p).to_vec()).collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 96, "no sample twice within an epoch");
    }

    #[test]
    fn a_fresh_sampler_gives_the_batches_of_one_that_ran_before() {
        // What resume relies on: no hidden position, only (seed, epoch, pos).
        let mut used = DistributedSampler::new(50, 8, 9, true);
        for p in 0..6 {
            used.global_batch(0, p);
        }
        let later = used.global_batch(1, 2).to_vec();
        assert_eq!(DistributedSampler::new(50, 8, 9, true).global_batch(1, 2), later.as_slice());
        assert_ne!(DistributedSampler::new(50, 8, 10, true).global_batch(1, 2), later.as_slice(), "the seed matters");
        assert_eq!(DistributedSampler::new(50, 8, 9, false).global_batch(1, 2), &[16, 17, 18, 19, 20, 21, 22, 23]);
    }
}
