//! The `loss` keys `tile` and `queue`: what they mean and their one check ([`Tiling`]), for
//! every loss that has them (NT-Xent, SimCSE's InfoNCE, CLIP's; the last without a queue).

use candle_core::Result;

use super::queue::KeyQueue;
use crate::ModelError;

/// Which losses have a tiled form (`loss.tile`), in words for error messages.
pub const TILED_LOSSES: &str = "nt_xent (methods simclr and vectors), SimCSE's info_nce, unsupervised and with hard \
     negatives (method simcse), and CLIP's (method clip, loss.kind clip)";

/// Which losses keep a queue of past keys (`loss.queue`), in words for error messages.
pub const QUEUED_LOSSES: &str = "nt_xent (methods simclr and vectors) and SimCSE's info_nce (method simcse)";

/// How a loss with a tiled form computes its logits: the `loss` keys `tile` and `queue`,
/// checked. A value of this type has passed the check ([`Tiling::new`],
/// [`Tiling::without_queue`]); the loss configs give theirs with their `tiling()`
/// ([`crate::losses::LossConfig::tiling`], [`crate::simcse::SimCseLoss::tiling`],
/// [`crate::clip::ClipLoss::tiling`]), and the objectives build from it.
///
/// - `tile: T` computes the loss in blocks of `T x T` logits ([the module docs](super)): the
///   same loss and gradients, its memory linear in the batch instead of quadratic. Absent:
///   the whole logits matrix at once. At least 1.
/// - `queue: K` (with `tile`) also scores every anchor against the keys of the last `K`
///   global batches (negatives only, without gradient; a memory bank), kept in a
///   [`KeyQueue`] ([`Tiling::new_queue`]) identical on every rank and checkpointed with the
///   run. Absent: none. At least 1; a loss whose tiled form keeps no queue (CLIP's) refuses it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tiling {
    tile: Option<usize>,
    queue: Option<usize>,
}

impl Tiling {
    /// The untiled loss: neither key.
    pub const UNTILED: Tiling = Tiling { tile: None, queue: None };

    /// `loss.tile` and `loss.queue` of a loss whose tiled form can keep a queue (NT-Xent,
    /// SimCSE's InfoNCE), checked: each at least 1, and a queue only with a tile. The error
    /// names the key ([`ModelError::LossKey`]).
    pub fn new(tile: Option<usize>, queue: Option<usize>) -> std::result::Result<Tiling, ModelError> {
        Self::check(tile, queue, None)
    }

    /// As [`Tiling::new`], for a loss whose tiled form keeps no queue (`loss`, its name in the
    /// message: CLIP's): a `queue` is refused.
    pub fn without_queue(tile: Option<usize>, queue: Option<usize>, loss: &str) -> std::result::Result<Tiling, ModelError> {
        Self::check(tile, queue, Some(loss))
    }

    /// The one check of the two keys.
    fn check(tile: Option<usize>, queue: Option<usize>, no_queue: Option<&str>) -> std::result::Result<Tiling, ModelError> {
        let refuse = |key, msg: String| Err(ModelError::LossKey { key, msg });
        if tile == Some(0) {
            return refuse(
                "tile",
                "loss.tile = 0: it is the number of rows and columns of each block of logits and must be at least 1 \
                 (remove the key for the untiled loss)"
                    .into(),
            );
        }
        match (queue, tile, no_queue) {
            (Some(k), _, Some(loss)) => refuse(
                "queue",
                format!(
                    "loss.queue = {k}: the {loss} loss keeps no queue of past keys (remove loss.queue). Losses with one: \
                     {QUEUED_LOSSES}"
                ),
            ),
            (Some(0), _, None) => refuse(
                "queue",
                "loss.queue = 0: it is the number of past global batches whose keys are extra negatives, at least 1 \
                 (remove the key for none)"
                    .into(),
            ),
            (Some(k), None, None) => refuse(
                "queue",
                format!("loss.queue = {k} needs loss.tile: the queue's negatives are scored by the tiled loss (add loss.tile)"),
            ),
            _ => Ok(Tiling { tile, queue }),
        }
    }

    /// `loss.tile`: the rows and columns of each block of logits (`None`: untiled).
    pub fn tile(&self) -> Option<usize> {
        self.tile
    }

    /// `loss.queue`: the past global batches whose keys are extra negatives (`None`: none;
    /// `Some` only with a tile).
    pub fn queue(&self) -> Option<usize> {
        self.queue
    }

    /// The empty queue of past keys that `loss.queue` asks for (`None` without it).
    pub fn new_queue(&self) -> Result<Option<KeyQueue>> {
        self.queue.map(KeyQueue::new).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(t: std::result::Result<Tiling, ModelError>) -> (&'static str, String) {
        match t.unwrap_err() {
            ModelError::LossKey { key, msg } => (key, msg),
            e => panic!("not a LossKey: {e}"),
        }
    }

    #[test]
    fn each_key_is_at_least_1_and_a_queue_needs_a_tile() {
        assert_eq!(Tiling::new(None, None).unwrap(), Tiling::UNTILED);
        let t = Tiling::new(Some(8), Some(2)).unwrap();
        assert_eq!((t.tile(), t.queue()), (Some(8), Some(2)));
        assert_eq!(t.new_queue().unwrap().unwrap().capacity(), 2);
        assert!(Tiling::new(Some(8), None).unwrap().new_queue().unwrap().is_none());
        let (key, msg) = refusal(Tiling::new(Some(0), Some(2)));
        assert!(key == "tile" && msg.starts_with("loss.tile = 0") && msg.contains("at least 1"), "{msg}");
        let (key, msg) = refusal(Tiling::new(Some(4), Some(0)));
        assert!(key == "queue" && msg.starts_with("loss.queue = 0"), "{msg}");
        let (key, msg) = refusal(Tiling::new(None, Some(3)));
        assert!(key == "queue" && msg.starts_with("loss.queue = 3 needs loss.tile"), "{msg}");
    }

    #[test]
    fn a_loss_without_a_queue_refuses_one_with_the_same_check() {
        assert_eq!(Tiling::without_queue(Some(4), None, "clip").unwrap().tile(), Some(4));
        let (key, msg) = refusal(Tiling::without_queue(Some(4), Some(2), "clip"));
        assert!(key == "queue" && msg.starts_with("loss.queue = 2: the clip loss keeps no queue"), "{msg}");
        let (key, _) = refusal(Tiling::without_queue(Some(0), None, "clip"));
        assert_eq!(key, "tile");
    }
}
