//! How the members of a group agree on an NCCL unique id: rank 0 of the group creates it and
//! publishes it in the job's rendezvous store (whose connections are authenticated with the
//! job token); the other members wait for it there (the store's timeout). The id is opaque
//! bytes here, so this part runs, and is tested, in every build; the NCCL backend passes
//! `ncclGetUniqueId` as the creator.

// Used by the NCCL backend (feature `nccl`); tested in every build.
#![cfg_attr(not(feature = "nccl"), allow(dead_code))]

use crate::error::{DistError, DistResult};
use crate::rendezvous::store::StoreClient;

/// Size of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub(crate) const UNIQUE_ID_BYTES: usize = 128;

/// An NCCL unique id, as bytes.
pub(crate) type UniqueId = [u8; UNIQUE_ID_BYTES];

/// The store key of the unique id of group `group` (group names are unique within a job).
pub(crate) fn unique_id_key(group: &str) -> String {
    format!("{group}/nccl/unique_id")
}

/// Returns the unique id of group `group` on its member `rank` (a group rank): rank 0 calls
/// `create` and publishes the result; the others read it from `store`. A group of one rank
/// needs no store.
pub(crate) fn share_unique_id(
    store: Option<&StoreClient>,
    group: &str,
    rank: usize,
    create: impl FnOnce() -> DistResult<UniqueId>,
) -> DistResult<UniqueId> {
    let key = unique_id_key(group);
    if rank == 0 {
        let id = create()?;
        if let Some(store) = store {
            store.set(&key, &id)?;
        }
        return Ok(id);
    }
    let store = store.ok_or_else(|| {
        DistError::Invalid(format!("rank {rank} of group {group} has no rendezvous store to read the NCCL unique id from"))
    })?;
    let raw = store.get(&key)?;
    let n = raw.len();
    raw.try_into().map_err(|_| {
        DistError::Store(format!(
            "the NCCL unique id of group {group} (key {key}) has {n} bytes, not {UNIQUE_ID_BYTES}: \
             was the key written by something other than rank 0 of the group?"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::store::StoreServer;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    const TOKEN: &str = "unique-id-test-token";

    fn client(server: &StoreServer, rank: usize) -> StoreClient {
        StoreClient::connect(&server.addr().to_string(), TOKEN, rank, Duration::from_secs(20)).unwrap()
    }

    /// An id with every byte value a real one may hold, zeros and 0xff included.
    fn sample_id() -> UniqueId {
        std::array::from_fn(|i| (i * 77 + 255) as u8)
    }

    #[test]
    fn rank_0_creates_the_id_once_and_every_member_reads_the_same_bytes() {
        let server = StoreServer::start("127.0.0.1:0", TOKEN).unwrap();
        let created = AtomicUsize::new(0);
        let ids: Vec<UniqueId> = std::thread::scope(|s| {
            // The readers start first: they must wait for rank 0's id, not fail.
            let readers: Vec<_> = (1..4)
                .map(|r| {
                    let c = client(&server, r);
                    s.spawn(move || share_unique_id(Some(&c), "world/2", r, || panic!("rank {r} must not create")).unwrap())
                })
                .collect();
            std::thread::sleep(Duration::from_millis(100));
            let c0 = client(&server, 0);
            let own = share_unique_id(Some(&c0), "world/2", 0, || {
                created.fetch_add(1, Ordering::SeqCst);
                Ok(sample_id())
            })
            .unwrap();
            std::iter::once(own).chain(readers.into_iter().map(|h| h.join().unwrap())).collect()
        });
        assert_eq!(created.load(Ordering::SeqCst), 1);
        assert!(ids.iter().all(|id| *id == sample_id()), "every member must hold rank 0's bytes");
        // Stored under the group's own key: another group's members would not find it.
        assert_eq!(client(&server, 0).get(&unique_id_key("world/2")).unwrap(), sample_id().to_vec());
        assert!(!client(&server, 0).check(&unique_id_key("world")).unwrap());
    }

    #[test]
    fn a_value_of_the_wrong_length_is_an_error_naming_the_group_and_the_length() {
        let server = StoreServer::start("127.0.0.1:0", TOKEN).unwrap();
        client(&server, 0).set(&unique_id_key("world"), &[1, 2, 3, 4, 5]).unwrap();
        let e = share_unique_id(Some(&client(&server, 1)), "world", 1, || unreachable!()).unwrap_err().to_string();
        assert!(e.contains("group world") && e.contains("5 bytes") && e.contains("128"), "{e}");
    }

    #[test]
    fn a_single_rank_group_needs_no_store_but_other_ranks_do() {
        assert_eq!(share_unique_id(None, "world", 0, || Ok(sample_id())).unwrap(), sample_id());
        let e = share_unique_id(None, "world/1", 2, || unreachable!()).unwrap_err().to_string();
        assert!(e.contains("rank 2 of group world/1") && e.contains("no rendezvous store"), "{e}");
    }

    #[test]
    fn a_reader_whose_id_never_comes_times_out_naming_the_key() {
        let server = StoreServer::start("127.0.0.1:0", TOKEN).unwrap();
        let c = StoreClient::connect(&server.addr().to_string(), TOKEN, 1, Duration::from_millis(200)).unwrap();
        let e = share_unique_id(Some(&c), "world", 1, || unreachable!()).unwrap_err().to_string();
        assert!(e.contains(&unique_id_key("world")), "{e}");
    }
}
