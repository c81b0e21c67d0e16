//! Tests of the segment: creation and checks on open, copies, barriers, and the bounds,
//! overflow, rank and alignment checks.

use super::*;

fn temp_path(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("allgrad-shm-test-{tag}-{}-{:x}", std::process::id(), rand::random::<u64>()))
}

#[test]
fn create_open_copy_and_barrier() {
    let path = temp_path("basic");
    let mut a = Segment::create(&path, 2, 0, SLOT_ALIGN).unwrap();
    let mut b = Segment::open(&path, 2, 1, SLOT_ALIGN).unwrap();
    unlink(&path);
    assert!(!path.exists());
    a.write(Region { set: 1, slot: 0 }, 3, &[1.5f32, 2.5]).unwrap();
    b.write(Region { set: 1, slot: 2 }, 0, &[7u64]).unwrap();
    let ta = a.arrive();
    assert!(!a.passed(ta));
    assert_eq!(a.missing(ta), vec![1]);
    let tb = b.arrive();
    assert_eq!((ta, tb), (1, 1));
    assert!(a.passed(ta) && b.passed(tb));
    let mut y = [0f32; 2];
    b.read(Region { set: 1, slot: 0 }, 3, &mut y).unwrap();
    assert_eq!(y, [1.5, 2.5]);
    let mut x = [0u64];
    a.read(Region { set: 1, slot: 2 }, 0, &mut x).unwrap();
    assert_eq!(x, [7]);
    assert_eq!(a.aborted_by(), None);
    b.raise_abort(1);
    assert_eq!(a.aborted_by(), Some(1));
}

#[test]
fn open_refuses_wrong_size_mode_or_layout() {
    let path = temp_path("checks");
    let _a = Segment::create(&path, 2, 0, SLOT_ALIGN).unwrap();
    // Another layout: the size does not match.
    assert!(Segment::open(&path, 3, 1, SLOT_ALIGN).is_err());
    assert!(Segment::open(&path, 2, 1, 2 * SLOT_ALIGN).is_err());
    // Creating it again fails (O_EXCL).
    assert!(Segment::create(&path, 2, 0, SLOT_ALIGN).is_err());
    // Open to other users: refused.
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let err = Segment::open(&path, 2, 1, SLOT_ALIGN).err().expect("a world-readable segment was accepted");
    assert!(err.to_string().contains("open to other users"), "{err}");
    unlink(&path);
    // A symlink is not followed.
    let link = temp_path("link");
    std::os::unix::fs::symlink("/dev/null", &link).unwrap();
    assert!(Segment::open(&link, 2, 1, SLOT_ALIGN).is_err());
    std::fs::remove_file(&link).unwrap();
    // A file of the right size that is not a segment.
    let fake = temp_path("fake");
    std::fs::write(&fake, vec![0u8; segment_bytes(2, SLOT_ALIGN).unwrap()]).unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let err = Segment::open(&fake, 2, 1, SLOT_ALIGN).err().expect("a zero file was accepted");
    assert!(err.to_string().contains("header"), "{err}");
    std::fs::remove_file(&fake).unwrap();
}

#[test]
fn copies_are_bounds_checked() {
    let path = temp_path("bounds");
    let mut a = Segment::create(&path, 2, 0, SLOT_ALIGN).unwrap();
    unlink(&path);
    let err = a.write(Region { set: 0, slot: 1 }, SLOT_ALIGN / 4 - 1, &[0f32, 0.0]).unwrap_err();
    assert!(err.to_string().contains("overflow a slot"), "{err}");
}

#[test]
fn offsets_that_overflow_usize_are_errors_not_panics() {
    let path = temp_path("overflow");
    let mut a = Segment::create(&path, 2, 0, SLOT_ALIGN).unwrap();
    unlink(&path);
    let at = Region { set: 0, slot: 0 };
    for offset in [usize::MAX, usize::MAX / 4 + 1, usize::MAX / 8] {
        let err = a.write(at, offset, &[0f64]).unwrap_err().to_string();
        assert!(err.contains("overflow"), "{offset}: {err}");
        let err = a.read(at, offset, &mut [0f64]).unwrap_err().to_string();
        assert!(err.contains("overflow"), "{offset}: {err}");
        let err = a.combine_from(at, offset, &mut [0f64], ReduceOp::Sum).unwrap_err().to_string();
        assert!(err.contains("overflow"), "{offset}: {err}");
    }
    // An offset that fits alone but overflows a slot with the length.
    let err = a.read(at, 1, &mut vec![0u8; SLOT_ALIGN]).unwrap_err().to_string();
    assert!(err.contains("overflow a slot"), "{err}");
}

#[test]
fn regions_outside_the_layout_are_errors() {
    let path = temp_path("regions");
    let mut a = Segment::create(&path, 2, 0, SLOT_ALIGN).unwrap();
    unlink(&path);
    for at in [Region { set: 2, slot: 0 }, Region { set: 0, slot: 3 }, Region { set: usize::MAX, slot: usize::MAX }] {
        let err = a.write(at, 0, &[1u8]).unwrap_err().to_string();
        assert!(err.contains("no such region"), "{at:?}: {err}");
    }
    // The result area (slot w) is a region.
    a.write(Region { set: 1, slot: 2 }, 0, &[1u8]).unwrap();
}

#[test]
fn the_mapping_and_every_region_start_are_page_aligned() {
    let path = temp_path("align");
    let a = Segment::create(&path, 3, 0, SLOT_ALIGN).unwrap();
    unlink(&path);
    assert!((a.base as usize).is_multiple_of(SLOT_ALIGN));
    for set in 0..2 {
        for slot in 0..=3 {
            let start = a.range::<u64>(Region { set, slot }, 0, 1).unwrap();
            assert!(start.is_multiple_of(SLOT_ALIGN), "{set} {slot}: {start}");
        }
    }
}

#[test]
fn rank_not_below_the_group_size_is_refused() {
    let path = temp_path("rank");
    for rank in [2, 3, usize::MAX] {
        let err = Segment::create(&path, 2, rank, SLOT_ALIGN).err().expect("a segment for a rank outside the group");
        assert!(err.to_string().contains(&format!("rank {rank} is not below the group size 2")), "{err}");
    }
    assert!(!path.exists());
    let _a = Segment::create(&path, 2, 0, SLOT_ALIGN).unwrap();
    let err = Segment::open(&path, 2, 2, SLOT_ALIGN).err().expect("opened for rank 2 of 2");
    assert!(err.to_string().contains("not below"), "{err}");
    unlink(&path);
}

#[test]
fn combine_from_reduces_a_region_into_private_memory() {
    let path = temp_path("combine");
    let mut a = Segment::create(&path, 2, 0, SLOT_ALIGN).unwrap();
    unlink(&path);
    // More elements than one private piece, at an offset, to cover the chunking.
    let n = COMBINE_CHUNK + 37;
    let theirs: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    a.write(Region { set: 1, slot: 1 }, 5, &theirs).unwrap();
    let mut acc: Vec<f32> = (0..n).map(|i| 1000.0 - i as f32).collect();
    a.combine_from(Region { set: 1, slot: 1 }, 5, &mut acc, ReduceOp::Sum).unwrap();
    let want: Vec<f32> = (0..n).map(|i| 1000.0 - i as f32 + i as f32 * 0.5).collect();
    assert_eq!(acc, want);
    let mut m: Vec<f32> = vec![100.0; n];
    a.combine_from(Region { set: 1, slot: 1 }, 5, &mut m, ReduceOp::Max).unwrap();
    assert_eq!(m, (0..n).map(|i| (i as f32 * 0.5).max(100.0)).collect::<Vec<_>>());
}
