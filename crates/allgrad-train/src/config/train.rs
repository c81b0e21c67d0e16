//! The `train` section of a run config, and the one place where a global batch is split
//! into each rank's micro-batches: rank r takes the r-th of W equal contiguous slices of the
//! global batch, in `accumulate` equal consecutive micro-batches. The config check, the
//! trainer's step, its plan of the batches ahead and gradient caching's chunk check all ask
//! [`TrainSection::micro_batch`] / [`TrainSection::micro_batches`].

use serde::{Deserialize, Serialize};

/// The `train` section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    /// Samples per optimizer step, over all ranks (each rank takes global_batch / W).
    pub global_batch: usize,
    /// Passes over the data.
    #[serde(default = "one")]
    pub epochs: usize,
    /// Stop after this many steps (overrides `epochs` when smaller).
    #[serde(default)]
    pub max_steps: Option<usize>,
    /// Micro-batches per step on each rank (gradients are synchronised once per step).
    #[serde(default = "one")]
    pub accumulate: usize,
    /// Clip gradients to this global L2 norm.
    #[serde(default)]
    pub clip_grad_norm: Option<f64>,
    /// What to do when the loss or the gradients are not finite.
    #[serde(default)]
    pub on_nonfinite: NonFinite,
    /// Shuffle the data every epoch (from the seed and the epoch).
    #[serde(default = "yes")]
    pub shuffle: bool,
    /// Evaluate at the end of every epoch and of the run.
    #[serde(default = "yes")]
    pub eval: bool,
    /// Gradient caching: embed each rank's micro-batch in chunks of this many samples and
    /// backpropagate the cached gradient of the embeddings chunk by chunk, so activation
    /// memory is that of one chunk (see [`crate::grad_cache`]; the method must implement
    /// `allgrad_models::EmbeddingObjective`). Absent: the plain step.
    #[serde(default)]
    pub cache_chunk: Option<usize>,
}

fn one() -> usize {
    1
}
fn yes() -> bool {
    true
}

/// Policy for a non-finite loss or gradient.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum NonFinite {
    /// Stop the run with an error naming the step.
    #[default]
    Error,
    /// Skip the update and go on.
    Skip,
}

impl TrainSection {
    /// Samples each rank embeds per micro-batch: `global_batch / (world_size · accumulate)`, or
    /// the message (naming the keys and the numbers) when the global batch does not split so.
    pub fn micro_batch(&self, world_size: usize) -> Result<usize, String> {
        if self.global_batch == 0 || self.accumulate == 0 || world_size == 0 {
            return Err(format!(
                "train.global_batch ({}) and train.accumulate ({}) must be positive",
                self.global_batch, self.accumulate
            ));
        }
        let unit = world_size * self.accumulate;
        if !self.global_batch.is_multiple_of(unit) {
            return Err(format!(
                "train.global_batch = {} is not divisible by world size {world_size} x train.accumulate {} = {unit}: \
                 each rank takes global_batch / world_size samples per step, in `accumulate` equal micro-batches",
                self.global_batch, self.accumulate
            ));
        }
        Ok(self.global_batch / unit)
    }

    /// Checks `cache_chunk` (gradient caching) against the batch and the world size: at least 1
    /// and at most [`Self::micro_batch`]; `Err` holds the message, naming the keys and the numbers.
    pub fn check_cache_chunk(&self, world_size: usize) -> Result<(), String> {
        let Some(chunk) = self.cache_chunk else { return Ok(()) };
        if chunk == 0 {
            return Err("train.cache_chunk = 0: it is the number of samples per chunk on each rank and must be at least 1 \
                        (remove the key for the plain step)"
                .into());
        }
        let micro = self.micro_batch(world_size)?;
        if chunk > micro {
            return Err(format!(
                "train.cache_chunk = {chunk} exceeds the samples each rank embeds per micro-batch: train.global_batch {} / \
                 (world size {world_size} x train.accumulate {}) = {micro}; use a chunk of at most {micro} samples",
                self.global_batch, self.accumulate
            ));
        }
        Ok(())
    }

    /// Rank `rank`'s micro-batches of one global batch (of `global_batch` sample indices), in
    /// order. The split must have been checked ([`Self::micro_batch`]).
    pub fn micro_batches<'a>(&self, global: &'a [usize], rank: usize, world_size: usize) -> std::slice::Chunks<'a, usize> {
        let per_rank = global.len() / world_size;
        let local = &global[rank * per_rank..(rank + 1) * per_rank];
        local.chunks((per_rank / self.accumulate).max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(global_batch: usize, accumulate: usize) -> TrainSection {
        serde_yaml::from_str(&format!("{{global_batch: {global_batch}, accumulate: {accumulate}}}")).unwrap()
    }

    #[test]
    fn ranks_micro_batches_partition_the_global_batch_in_order() {
        let global: Vec<usize> = (100..124).collect();
        for (w, acc) in [(1, 1), (2, 1), (3, 2), (4, 3), (2, 4)] {
            let t = section(24, acc);
            let micro = t.micro_batch(w).unwrap();
            assert_eq!(micro, 24 / (w * acc));
            let mut seen = Vec::new();
            for r in 0..w {
                let parts: Vec<&[usize]> = t.micro_batches(&global, r, w).collect();
                assert_eq!(parts.len(), acc, "W={w} acc={acc} rank {r}");
                assert!(parts.iter().all(|p| p.len() == micro));
                seen.extend(parts.concat());
            }
            assert_eq!(seen, global, "W={w} acc={acc}: the ranks' micro-batches in order are the global batch");
        }
    }

    #[test]
    fn a_batch_that_does_not_split_is_an_error_naming_the_keys_and_numbers() {
        let e = section(30, 2).micro_batch(4).unwrap_err();
        assert!(e.contains("train.global_batch = 30") && e.contains("world size 4") && e.contains("= 8"), "{e}");
        let e = section(8, 0).micro_batch(2).unwrap_err();
        assert!(e.contains("train.accumulate (0)"), "{e}");
    }

    #[test]
    fn cache_chunk_zero_or_above_the_micro_batch_is_refused_naming_the_key_and_numbers() {
        assert!(section(24, 1).check_cache_chunk(3).is_ok());
        assert!(TrainSection { cache_chunk: Some(4), ..section(24, 2) }.check_cache_chunk(3).is_ok());
        let e = TrainSection { cache_chunk: Some(0), ..section(24, 1) }.check_cache_chunk(2).unwrap_err();
        assert!(e.starts_with("train.cache_chunk = 0") && e.contains("at least 1"), "{e}");
        let e = TrainSection { cache_chunk: Some(5), ..section(24, 2) }.check_cache_chunk(3).unwrap_err();
        assert!(e.contains("train.cache_chunk = 5") && e.contains("train.global_batch 24") && e.contains("= 4"), "{e}");
    }
}
