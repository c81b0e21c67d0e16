//! The `checkpoint` section: how often the trainer saves and how many checkpoints it keeps
//! (what a checkpoint holds and how it is written: `crate::checkpoint`).

use serde::{Deserialize, Serialize};

/// The `checkpoint` section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Save every this many steps (0: only at the end of the run).
    pub every: usize,
    /// How many checkpoints to keep.
    pub keep_last: usize,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig { every: 0, keep_last: 3 }
    }
}
