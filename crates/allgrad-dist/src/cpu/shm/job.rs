//! The names of a job's shared-memory segments, and their removal when the job ends.
//!
//! Every segment of a job is named `allgrad-<16 hex digits>-<pid>-<32 hex digits>` under
//! `/dev/shm`: the first part hashes the job token alone ([`shm_job_prefix`]), the pid is the
//! creating rank's process id ([`shm_rank_prefix`]), the last part hashes the token with the
//! group and rank 0's random nonce. A segment's name lives only for the few milliseconds of a
//! group's setup, but a rank that dies in between leaves the file behind; the launcher, which
//! knows the token and its ranks' pids, removes the files its own ranks created once they have
//! all exited ([`remove_job_segments`]).
//!
//! Only its own ranks' files: the launchers of a job's other nodes may share this `/dev/shm`
//! (several nodes on one host, or containers and network namespaces over one tmpfs) and may be
//! setting up their groups at that very moment. A launcher that removed every file of the job
//! took such a node's segment between its creation and its mapping, and that node's group fell
//! back to TCP.
//!
//! The prefix reveals 64 bits of a (non-cryptographic) hash of the token to other users of
//! the host while a name exists. The launcher's tokens are 128 random bits, and a token only
//! matching the hash does not pass the connection handshake, which checks the token itself.

use std::path::{Path, PathBuf};

/// Directory of the segment files.
pub(crate) const SHM_DIR: &str = "/dev/shm";

/// The start of the name of every shared-memory segment of the job whose token is `token`:
/// `allgrad-` and 16 hex digits of a hash of the token, then `-`.
pub fn shm_job_prefix(token: &str) -> String {
    let h = allgrad_rng::hash128(&[b"allgrad shared-memory job", token.as_bytes()]);
    let hex: String = h[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("allgrad-{hex}-")
}

/// The start of the name of every segment that the process `pid` creates for the job whose
/// token is `token`: [`shm_job_prefix`], the pid in decimal, then `-`.
pub fn shm_rank_prefix(token: &str, pid: u32) -> String {
    format!("{}{pid}-", shm_job_prefix(token))
}

/// Removes the files under `/dev/shm` that the processes `pids` created for the job whose
/// token is `token` (regular files of this user whose name starts with [`shm_rank_prefix`] of
/// one of them) and returns their paths. Call it only once those processes have exited: a
/// name removed during a setup makes that group fall back to TCP. Other processes' files of
/// the same job are left alone.
pub fn remove_job_segments(token: &str, pids: &[u32]) -> Vec<PathBuf> {
    remove_job_segments_in(Path::new(SHM_DIR), token, pids)
}

fn remove_job_segments_in(dir: &Path, token: &str, pids: &[u32]) -> Vec<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let prefixes: Vec<String> = pids.iter().map(|&p| shm_rank_prefix(token, p)).collect();
    if prefixes.is_empty() {
        return Vec::new();
    }
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !prefixes.iter().any(|p| name.starts_with(p.as_str())) {
            continue;
        }
        let path = entry.path();
        // symlink_metadata: a link planted under the job's name is not followed.
        let ours = std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_file() && m.uid() == me);
        if ours && std::fs::remove_file(&path).is_ok() {
            removed.push(path);
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_depends_on_the_token_only_and_does_not_show_it() {
        let p = shm_job_prefix("secret-token");
        assert_eq!(p.len(), "allgrad-".len() + 16 + 1, "{p}");
        assert!(p.starts_with("allgrad-") && p.ends_with('-') && !p.contains("secret"), "{p}");
        assert_eq!(p, shm_job_prefix("secret-token"));
        assert_ne!(p, shm_job_prefix("secret-tokeN"));
    }

    #[test]
    fn every_segment_name_of_a_job_starts_with_its_prefix() {
        let prefix = shm_job_prefix("tok");
        for (group, nonce) in [("world", 1u128), ("world/1", u128::MAX), ("g", 7)] {
            let path = crate::cpu::shm::setup::segment_path("tok", 1234, group, nonce);
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            assert!(path.starts_with(SHM_DIR) && name.starts_with(&prefix), "{name} vs {prefix}");
            assert!(!name.starts_with(&shm_job_prefix("other")), "{name}");
        }
    }

    #[test]
    fn removal_takes_the_given_ranks_files_of_this_job_only_and_follows_no_link() {
        let dir = tempfile_dir();
        let mine =
            [dir.join(format!("{}0123", shm_rank_prefix("job-a", 41))), dir.join(format!("{}4567", shm_rank_prefix("job-a", 7)))];
        let other_job = dir.join(format!("{}0123", shm_rank_prefix("job-b", 41)));
        // Another node's launcher's rank of the same job, on the same /dev/shm, and pids that
        // only start like one of ours.
        let other_node = dir.join(format!("{}0123", shm_rank_prefix("job-a", 42)));
        let longer_pid = dir.join(format!("{}0123", shm_rank_prefix("job-a", 410)));
        let target = dir.join("target");
        let link = dir.join(format!("{}link", shm_rank_prefix("job-a", 41)));
        for p in mine.iter().chain([&other_job, &other_node, &longer_pid, &target]) {
            std::fs::write(p, b"x").unwrap();
        }
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let mut removed = remove_job_segments_in(&dir, "job-a", &[41, 7]);
        removed.sort();
        let mut want = mine.to_vec();
        want.sort();
        assert_eq!(removed, want);
        assert!(mine.iter().all(|p| !p.exists()));
        assert!(other_job.exists() && other_node.exists() && longer_pid.exists() && target.exists());
        assert!(link.symlink_metadata().is_ok());
        assert!(remove_job_segments_in(&dir, "job-a", &[]).is_empty() && other_node.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("allgrad-shm-job-test-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
