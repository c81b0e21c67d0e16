//! Setting up the same-host fast path of a group (the algorithms that use it are in
//! `ops`; the segment itself in `cpu::segment`).
//!
//! Once per group (init and `new_group`), over the group's TCP mesh (each round with every peer,
//! or gathered through the tree in groups that take it, `tree`):
//! 1. every rank sends every other its host id (boot id, host name and mount namespace,
//!    hashed), whether it wants shared memory (ALLGRAD_SHM is not `0`) and, from rank 0, a
//!    random nonce and the slot size. Shared memory is used only if every member agrees.
//! 2. rank 0 creates `/dev/shm/<job prefix><hash of job token, group and nonce>` (O_EXCL, mode
//!    0600, its memory reserved up front), maps it and says whether that worked;
//! 3. the others open it, check owner, mode, size and header, map it, and everyone tells
//!    everyone whether it succeeded. Rank 0 then removes the name, so nothing is left behind
//!    whatever happens to the processes afterwards (only rank 0 killed within these few
//!    milliseconds would leave the file). If any step fails locally the group simply keeps
//!    using TCP.
//!

use std::path::PathBuf;

use crate::cpu::call::{ranges, Call};
use crate::cpu::mesh::{Mesh, OpCode, RecvOp, SendOp};
use crate::cpu::segment::{segment_bytes, Segment, SLOT_ALIGN};
use crate::cpu::shm::job::{shm_rank_prefix, SHM_DIR};
use crate::error::DistResult;
use crate::settings::{Settings, DEFAULT_SHM_SLOT_BYTES, MIN_SHM_SLOT_BYTES};
use crate::wire::{Header, KIND_DATA};

// The smallest slot a user may ask for is one the segment can lay out.
const _: () = assert!(MIN_SHM_SLOT_BYTES.is_multiple_of(SLOT_ALIGN));

/// Largest segment a group maps (two sets of W + 1 slots); slots shrink to fit.
pub(crate) const MAX_SEGMENT_BYTES: usize = 256 << 20;

/// Whether and how a process's groups use shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ShmConfig {
    pub enabled: bool,
    pub slot_bytes: usize,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig { enabled: true, slot_bytes: DEFAULT_SHM_SLOT_BYTES }
    }
}

impl From<&Settings> for ShmConfig {
    /// ALLGRAD_SHM and ALLGRAD_SHM_SLOT_BYTES.
    fn from(s: &Settings) -> Self {
        ShmConfig { enabled: s.shm, slot_bytes: s.shm_slot_bytes }
    }
}

/// The slot size a group of `w` uses for a wish of `want` bytes: a multiple of the page size,
/// with the whole segment within [`MAX_SEGMENT_BYTES`].
fn slot_for(w: usize, want: usize) -> usize {
    let control = segment_bytes(w, 0).unwrap_or(usize::MAX);
    let cap = MAX_SEGMENT_BYTES.saturating_sub(control) / (2 * (w + 1));
    (want.min(cap) / SLOT_ALIGN * SLOT_ALIGN).max(SLOT_ALIGN)
}

// ------------------------------------------------------------------ setup

const OFFER_LEN: usize = 48;

/// What each rank says about itself in the first setup round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Offer {
    host: [u8; 16],
    nonce: u128,
    slot: u64,
    wants: bool,
    /// The process id of rank 0 (it names the segment it creates); 0 from the others.
    pid: u32,
}

impl Offer {
    fn encode(&self) -> [u8; OFFER_LEN] {
        let mut b = [0u8; OFFER_LEN];
        b[0..16].copy_from_slice(&self.host);
        b[16..32].copy_from_slice(&self.nonce.to_le_bytes());
        b[32..40].copy_from_slice(&self.slot.to_le_bytes());
        b[40] = self.wants as u8;
        b[44..48].copy_from_slice(&self.pid.to_le_bytes());
        b
    }
    fn decode(b: &[u8]) -> Offer {
        Offer {
            host: b[0..16].try_into().unwrap(),
            nonce: u128::from_le_bytes(b[16..32].try_into().unwrap()),
            slot: u64::from_le_bytes(b[32..40].try_into().unwrap()),
            wants: b[40] == 1,
            pid: u32::from_le_bytes(b[44..48].try_into().unwrap()),
        }
    }
}

/// This host, as seen by this process: the kernel's boot id, the host name and the mount
/// namespace (containers on one kernel with their own /dev/shm differ). `None` where there is
/// no boot id to read.
fn host_id() -> Option<[u8; 16]> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let mnt = std::fs::read_link("/proc/self/ns/mnt").map(|p| p.display().to_string()).unwrap_or_default();
    Some(allgrad_rng::hash128(&[boot.trim().as_bytes(), name.trim().as_bytes(), mnt.as_bytes()]))
}

/// The segment's file, created by the process `pid`. After the job's and the creator's
/// prefix ([`shm_rank_prefix`], so that the creator's launcher can remove a file left by a
/// rank that died during setup, and only its own ranks' files), its name hashes the job token
/// with the group and rank 0's 128-bit random nonce: unpredictable to other users, and (with
/// 128 unknown random bits hashed in) revealing nothing more of the token than the prefix does.
pub(crate) fn segment_path(token: &str, pid: u32, group: &str, nonce: u128) -> PathBuf {
    let h = allgrad_rng::hash128(&[&nonce.to_le_bytes(), token.as_bytes(), group.as_bytes(), &nonce.to_le_bytes()]);
    let hex: String = h.iter().map(|b| format!("{b:02x}")).collect();
    PathBuf::from(SHM_DIR).join(format!("{}{hex}", shm_rank_prefix(token, pid)))
}

/// Removes the segment's name when dropped (on success and on every error path alike).
struct Unlink(Option<PathBuf>);

impl Drop for Unlink {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            crate::cpu::segment::unlink(p);
        }
    }
}

impl Mesh {
    /// One setup round: sends `mine` to the peers in `to` and receives `len` bytes from each
    /// peer in `from`; returns what arrived, by group rank.
    fn setup_round(&mut self, step: u32, to: &[usize], mine: &[u8], from: &[usize], len: usize) -> DistResult<Vec<Vec<u8>>> {
        let header =
            |len: usize| Header { kind: KIND_DATA, op: OpCode::Setup as u8, step, len: len as u64, ..Default::default() };
        let mut got: Vec<Vec<u8>> =
            (0..self.size()).map(|p| if from.contains(&p) { vec![0u8; len] } else { Vec::new() }).collect();
        let mut sends: Vec<SendOp> = to.iter().map(|&p| SendOp { peer: p, header: header(mine.len()), data: mine }).collect();
        let mut recvs: Vec<RecvOp> = got
            .iter_mut()
            .enumerate()
            .filter(|(p, _)| from.contains(p))
            .map(|(p, b)| RecvOp { peer: p, expect: header(len), data: b, acc: None })
            .collect();
        self.exchange(&mut sends, &mut recvs, "setting up the group")?;
        Ok(got)
    }

    /// One setup round in a group that takes the tree (`tree`): every rank learns every rank's
    /// block (`len(p)` bytes from rank p, this rank's being `mine`), gathered up the tree and
    /// sent back down: 2 log2(W) frames per rank rather than 2(W - 1), once per group.
    fn setup_gather(&mut self, step: u32, mine: &[u8], len: impl Fn(usize) -> usize) -> DistResult<Vec<Vec<u8>>> {
        let (w, r) = (self.size(), self.rank);
        let counts: Vec<usize> = (0..w).map(len).collect();
        let blocks = ranges(&counts);
        let mut all = vec![0u8; blocks[w - 1].end];
        all[blocks[r].clone()].copy_from_slice(mine);
        let c = Call { op: OpCode::Setup, redop: None, seq: 0, meta: 0, what: "setting up the group" };
        self.tree_all_gather_v::<u8>(&c, &counts, step, &mut all)?;
        Ok(blocks.into_iter().map(|b| all[b].to_vec()).collect())
    }

    /// Decides with the other members whether this group uses shared memory, and maps the
    /// segment if so. Fails only when the mesh does (a peer died or misbehaved).
    pub(crate) fn setup_shm(&mut self, token: &str, cfg: ShmConfig) -> DistResult<()> {
        let (w, r) = (self.size(), self.rank);
        if w < 2 {
            return Ok(());
        }
        let host = host_id();
        let dir_ok = std::path::Path::new(SHM_DIR).is_dir();
        let mine = Offer {
            host: host.unwrap_or_default(),
            nonce: if r == 0 { rand::random() } else { 0 },
            slot: slot_for(w, cfg.slot_bytes) as u64,
            wants: cfg.enabled && host.is_some() && dir_ok,
            pid: if r == 0 { std::process::id() } else { 0 },
        };
        let peers: Vec<usize> = (0..w).filter(|p| *p != r).collect();
        let tree = self.uses_tree();
        let got = if tree {
            self.setup_gather(0, &mine.encode(), |_| OFFER_LEN)?
        } else {
            self.setup_round(0, &peers, &mine.encode(), &peers, OFFER_LEN)?
        };
        let offers: Vec<Offer> = (0..w).map(|p| if p == r { mine } else { Offer::decode(&got[p]) }).collect();
        if !offers.iter().all(|o| o.wants && o.host == mine.host) {
            tracing::debug!("{}: not every member is on this host or wants shared memory; TCP only", self.group);
            return Ok(());
        }
        let slot = usize::try_from(offers[0].slot).unwrap_or(0);
        if !slot.is_multiple_of(SLOT_ALIGN) || slot == 0 || segment_bytes(w, slot).is_none_or(|b| b > MAX_SEGMENT_BYTES) {
            // Every member sees the same offer from rank 0, so all of them stop here.
            tracing::debug!("{}: no shared-memory layout for {w} ranks of {slot} bytes; TCP only", self.group);
            return Ok(());
        }
        let path = segment_path(token, offers[0].pid, &self.group, offers[0].nonce);

        // Rank 0 creates the segment and says whether it could.
        let mut unlink = Unlink(None);
        let mut seg = None;
        let created = if r == 0 {
            match Segment::create(&path, w, r, slot) {
                Ok(s) => {
                    unlink.0 = Some(path.clone());
                    seg = Some(s);
                }
                Err(e) => tracing::debug!("{}: cannot create {}: {e}; TCP only", self.group, path.display()),
            }
            let status = [seg.is_some() as u8; 8];
            if tree {
                self.setup_gather(1, &status, |p| if p == 0 { 8 } else { 0 })?;
            } else {
                self.setup_round(1, &peers, &status, &[], 8)?;
            }
            seg.is_some()
        } else if tree {
            self.setup_gather(1, &[], |p| if p == 0 { 8 } else { 0 })?[0][0] == 1
        } else {
            self.setup_round(1, &[], &[], &[0], 8)?[0][0] == 1
        };
        if !created {
            return Ok(());
        }

        // The others map it; everyone learns whether all did, then the name goes.
        if r != 0 {
            match Segment::open(&path, w, r, slot) {
                Ok(s) => seg = Some(s),
                Err(e) => tracing::debug!("{}: cannot map {}: {e}; TCP only", self.group, path.display()),
            }
        }
        let status = [seg.is_some() as u8; 8];
        let got = if tree { self.setup_gather(2, &status, |_| 8)? } else { self.setup_round(2, &peers, &status, &peers, 8)? };
        drop(unlink);
        let all = seg.is_some() && peers.iter().all(|p| got[*p][0] == 1);
        if all {
            tracing::debug!("{}: large collectives go through shared memory ({slot}-byte slots)", self.group);
            self.shm = seg.map(|mut s| {
                s.busy_wait = std::thread::available_parallelism().is_ok_and(|cpus| w <= cpus.get());
                s
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offers_round_trip() {
        let o = Offer { host: [7; 16], nonce: u128::MAX - 5, slot: 1 << 20, wants: true, pid: u32::MAX - 3 };
        assert_eq!(Offer::decode(&o.encode()), o);
    }

    #[test]
    fn slots_are_pages_and_segments_bounded() {
        for w in [2, 3, 8, 64, 1000] {
            for want in [1, SLOT_ALIGN, 3 << 20, usize::MAX / 4] {
                let s = slot_for(w, want);
                assert!(s.is_multiple_of(SLOT_ALIGN) && s >= SLOT_ALIGN, "{w} {want}: {s}");
                assert!(segment_bytes(w, s).unwrap() <= MAX_SEGMENT_BYTES.max(segment_bytes(w, SLOT_ALIGN).unwrap()));
            }
        }
    }

    #[test]
    fn segment_names_depend_on_token_creator_group_and_nonce_and_do_not_show_the_token() {
        let a = segment_path("secret-token", 17, "world", 1);
        assert_ne!(a, segment_path("secret-token", 17, "world", 2));
        assert_ne!(a, segment_path("other", 17, "world", 1));
        assert_ne!(a, segment_path("secret-token", 17, "world/1", 1));
        assert!(!a.to_string_lossy().contains("secret"));
        assert!(a.starts_with(SHM_DIR));
        let name = a.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with(&shm_rank_prefix("secret-token", 17)), "{name}");
    }
}
