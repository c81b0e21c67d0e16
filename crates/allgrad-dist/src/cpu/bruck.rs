//! Bruck's all_to_all for large groups (ALLGRAD_TREE_FROM ranks or more, default 32):
//! ceil(log2(W)) rounds in which every rank sends one frame, to rank r + 2^k, and receives one,
//! from rank r - 2^k, where the direct path has every rank send every other a frame (W - 1
//! out and W - 1 in per rank, W(W - 1) in the job: 1,047,552 per call at W = 1,024).
//!
//! Rank r keeps W slots; slot i starts with the block bound for rank r + i (mod W). In round
//! k every slot whose index has bit k set goes to rank r + 2^k, and the same slots of rank
//! r - 2^k take its place. After round k, slot i of rank r holds the block that rank
//! r - (i mod 2^(k+1)) sends to rank r - (i mod 2^(k+1)) + i; after the last round, slot i
//! holds what rank r - i sends here. Blocks are forwarded as they are, never combined: the
//! result is the direct path's, bit for bit.
//!
//! Blocks may differ in size (`all_to_all_sizes`), and a rank knows only the sizes of the
//! blocks it sends. So the sizes go first, through the same rounds (one frame of 8-byte counts
//! per round, the slots' sizes travelling with the slots), and every size frame also carries
//! the largest block its sender has seen so far: after the size rounds every rank has seen
//! every rank's (the rounds reach every rank from every other, and the largest of a set does
//! not mind seeing one twice), knows the sizes of every frame it will receive, and has this
//! rank's received sizes, which the direct path had to exchange with every peer. Every rank
//! then takes the same path for the data: Bruck's rounds when the largest block is small
//! ([`BRUCK_BLOCK_BYTES`]), else the direct exchange, since Bruck moves each block up to
//! log2(W) times (about W log2(W) / 2 blocks sent per rank instead of W - 1).
//!
//! Before the size rounds each rank hears its children's header and sends its own to its
//! parent in the binomial tree (`Mesh::tree_up`, one frame per rank): a rank whose call is
//! not this all_to_all (a barrier, an all_reduce: tree calls, which start the same way)
//! meets it at a tree edge and every rank fails naming both calls, where Bruck's first round
//! alone could leave two such ranks each waiting for the other. Frames: step 0 for that
//! check, 1 ..= R for the R size rounds, R + 1 .. 2R + 1 for the data.

use crate::cpu::call::Call;
use crate::cpu::mesh::{Mesh, RecvOp, SendOp};
use crate::error::{DistError, DistResult};
use crate::reduce::Elem;

/// All_to_all calls whose largest block (over every pair of ranks) is at most this many
/// bytes move their data through Bruck's rounds; larger ones take the direct exchange. Near
/// where a rank's W - 1 extra frames on the direct path (a system call and a wake-up each)
/// cost about what Bruck's extra copies do (a block sent log2(W) / 2 times on average) on one
/// host: a few KiB at W = 1,024, more in smaller groups.
pub(crate) const BRUCK_BLOCK_BYTES: u64 = 1 << 10;

/// The distances of Bruck's rounds in a group of `w` ranks: 1, 2, 4, ... below `w`.
fn distances(w: usize) -> impl Iterator<Item = usize> {
    (0..usize::BITS).map(|k| 1usize << k).take_while(move |d| *d < w)
}

/// The slots that move in the round of distance `d`: those whose index has bit `d` set.
fn moving(w: usize, d: usize) -> impl Iterator<Item = usize> {
    (0..w).filter(move |i| i & d != 0)
}

/// What the size rounds of a Bruck all_to_all tell every rank.
pub(crate) struct BruckSizes {
    /// Elements this rank receives from each rank, in rank order.
    pub recv_counts: Vec<usize>,
    /// The largest block any rank sends another, in bytes (the same on every rank).
    pub largest: u64,
    /// Per round, the sizes (elements) of the blocks this rank receives in it, in slot order.
    received: Vec<Vec<u64>>,
    /// The step of the first data frame (after the check and the size rounds).
    pub data_step: u32,
}

impl Mesh {
    /// The check up the tree and the size rounds of a Bruck all_to_all (steps 0 ..= rounds):
    /// this rank sends `send_counts[j]` elements of `T` to rank j.
    pub(crate) fn bruck_sizes<T: Elem>(&mut self, c: &Call, send_counts: &[usize]) -> DistResult<BruckSizes> {
        let (w, r) = (self.size(), self.rank);
        self.tree_up(c.header::<T>(0, 0), c.what)?;
        let esz = T::DTYPE.size_in_bytes() as u64;
        let mut sizes: Vec<u64> = (0..w).map(|i| send_counts[(r + i) % w] as u64).collect();
        // Slot 0, this rank's own block, never moves.
        let mut largest = sizes[1..].iter().map(|s| s.saturating_mul(esz)).max().unwrap_or(0);
        let mut received = Vec::new();
        for (k, d) in distances(w).enumerate() {
            let mut out = vec![largest];
            out.extend(moving(w, d).map(|i| sizes[i]));
            let mut got = vec![0u64; out.len()];
            let (to, from) = ((r + d) % w, (r + w - d) % w);
            let h = c.header::<T>(1 + k as u32, out.len() * 8);
            let mut sends = [SendOp { peer: to, header: h, data: bytemuck::cast_slice(&out) }];
            let mut recvs = [RecvOp { peer: from, expect: h, data: bytemuck::cast_slice_mut(&mut got), acc: None }];
            self.exchange(&mut sends, &mut recvs, c.what)?;
            // Every block a rank forwards was counted in the largest it announces.
            if let Some(bad) = got[1..].iter().find(|s| s.checked_mul(esz).is_none_or(|b| b > got[0])) {
                return Err(self.fail(DistError::Protocol {
                    peer: self.members[from],
                    group: self.group.clone(),
                    detail: format!(
                        "all_to_all: a block of {bad} elements of {esz} bytes in a round whose largest block is {} bytes",
                        got[0]
                    ),
                }));
            }
            largest = largest.max(got[0]);
            for (i, s) in moving(w, d).zip(&got[1..]) {
                sizes[i] = *s;
            }
            received.push(got[1..].to_vec());
        }
        // Slot i now holds the size of what rank r - i sends here.
        let recv_counts = (0..w).map(|q| sizes[(r + w - q) % w] as usize).collect();
        let rounds = received.len() as u32;
        Ok(BruckSizes { recv_counts, largest, data_step: 1 + rounds, received })
    }

    /// The data rounds of a Bruck all_to_all (steps from `sizes.data_step` on), after
    /// [`Mesh::bruck_sizes`]: block j of `input` (`send_counts[j]` elements) goes to rank j;
    /// returns the blocks received, in rank order (`sizes.recv_counts`).
    pub(crate) fn bruck_data<T: Elem>(
        &mut self,
        c: &Call,
        input: &[T],
        send_counts: &[usize],
        sizes: &BruckSizes,
    ) -> DistResult<Vec<T>> {
        let (w, r) = (self.size(), self.rank);
        let esz = T::DTYPE.size_in_bytes();
        let starts: Vec<usize> = send_counts.iter().scan(0, |s, c| Some(std::mem::replace(s, *s + c))).collect();
        // The slots, one after the other in `held`, slot i `lens[i]` elements long.
        let mut lens: Vec<usize> = (0..w).map(|i| send_counts[(r + i) % w]).collect();
        let mut held: Vec<T> = Vec::with_capacity(input.len());
        for i in 0..w {
            let j = (r + i) % w;
            held.extend_from_slice(&input[starts[j]..starts[j] + send_counts[j]]);
        }
        let mut out: Vec<T> = Vec::new();
        let mut next: Vec<T> = Vec::new();
        for ((k, d), got) in distances(w).enumerate().zip(&sizes.received) {
            // This round's frame: the moving slots, in order.
            out.clear();
            let mut at = 0;
            for (i, len) in lens.iter().enumerate() {
                if i & d != 0 {
                    out.extend_from_slice(&held[at..at + len]);
                }
                at += len;
            }
            let mut incoming = vec![T::zeroed(); got.iter().sum::<u64>() as usize];
            let (to, from) = ((r + d) % w, (r + w - d) % w);
            let step = sizes.data_step + k as u32;
            let mut sends = [SendOp { peer: to, header: c.header::<T>(step, out.len() * esz), data: bytemuck::cast_slice(&out) }];
            let mut recvs = [RecvOp {
                peer: from,
                expect: c.header::<T>(step, incoming.len() * esz),
                data: bytemuck::cast_slice_mut(&mut incoming),
                acc: None,
            }];
            self.exchange(&mut sends, &mut recvs, c.what)?;
            // The slots again, the moving ones from `incoming`.
            next.clear();
            let (mut at, mut at_in) = (0, 0);
            let mut got = got.iter();
            for (i, len) in lens.iter_mut().enumerate() {
                if i & d != 0 {
                    let n = *got.next().expect("one size per moving slot") as usize;
                    next.extend_from_slice(&incoming[at_in..at_in + n]);
                    at_in += n;
                    at += *len;
                    *len = n;
                } else {
                    next.extend_from_slice(&held[at..at + *len]);
                    at += *len;
                }
            }
            std::mem::swap(&mut held, &mut next);
        }
        // Slot i holds what rank r - i sent: rank q's block is slot r - q.
        let mut at = vec![0usize; w];
        for i in 1..w {
            at[i] = at[i - 1] + lens[i - 1];
        }
        let mut result = Vec::with_capacity(held.len());
        for q in 0..w {
            let i = (r + w - q) % w;
            result.extend_from_slice(&held[at[i]..at[i] + lens[i]]);
        }
        Ok(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The invariant the module's doc states, played out on labels: after every round, slot i
    /// of rank r holds the block from rank r - (i mod 2^(k+1)) to that rank + i, and at the
    /// end every rank holds one block from every rank, all addressed to it.
    #[test]
    fn bruck_rounds_deliver_every_block_to_its_rank() {
        for w in 1..=70usize {
            // slots[r][i] = (from, to)
            let mut slots: Vec<Vec<(usize, usize)>> = (0..w).map(|r| (0..w).map(|i| (r, (r + i) % w)).collect()).collect();
            let mut span = 1;
            for d in distances(w) {
                let before = slots.clone();
                for (r, mine) in slots.iter_mut().enumerate() {
                    for i in moving(w, d) {
                        mine[i] = before[(r + w - d) % w][i];
                    }
                }
                span *= 2;
                for (r, mine) in slots.iter().enumerate() {
                    for (i, &(from, to)) in mine.iter().enumerate() {
                        let want_from = (r + w - i % span) % w;
                        assert_eq!((from, to), (want_from, (want_from + i) % w), "w {w} d {d} r {r} slot {i}");
                    }
                }
            }
            for (r, mine) in slots.iter().enumerate() {
                for (i, &(from, to)) in mine.iter().enumerate() {
                    assert_eq!((from, to), ((r + w - i) % w, r), "w {w}: rank {r} slot {i} at the end");
                }
            }
            assert_eq!(distances(w).count(), if w <= 1 { 0 } else { (usize::BITS - (w - 1).leading_zeros()) as usize });
        }
    }
}
