//! Shared by the face-method tests through the trainer (`face.rs`, `face_sparse.rs`,
//! `face_bf16.rs`, `face_recordio.rs`, `face_insightface.rs`): training a run on W thread-ranks
//! to a list of steps, with the sharded centres put back together in rank order, comparing two
//! runs, and a small RecordIO training set of identity images.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use allgrad_data::{RecordHeader, RecordIoWriter};
use allgrad_dist::run_threads;
use allgrad_testkit::close::{assert_elem_rel, assert_rel};
use allgrad_train::{optim_paths, run, OptimPaths, RunConfig};
use candle_core::DType;

/// The face head's centres, the one sharded parameter.
pub const CENTRES: &str = "head.centres";

/// What a run ends with.
pub struct Run {
    /// The loss of the last step before each stop (rank 0's; the loss is the same on every
    /// rank).
    pub losses: Vec<f64>,
    /// Every parameter as f64, the centres concatenated over ranks in rank order.
    pub params: BTreeMap<String, Vec<f64>>,
    /// Each rank's optimizer paths during the run.
    pub paths: Vec<OptimPaths>,
    /// The dtype the centres are held in (rank 0's).
    pub centres_dtype: DType,
}

impl Run {
    /// Every rank's centres took the lazy update (rows deferred, then replayed), never the
    /// dense update of a scattered gradient.
    pub fn assert_lazy(&self, what: &str) {
        for (r, p) in self.paths.iter().enumerate() {
            let ok = p.lazy_updates > 0 && p.deferred_rows > 0 && p.replayed_rows > 0 && p.sparse_as_dense == 0;
            assert!(ok, "{what}: rank {r} did not take the lazy update of the centres: {p:?}");
        }
    }

    /// No rank took the lazy update.
    pub fn assert_dense(&self, what: &str) {
        for (r, p) in self.paths.iter().enumerate() {
            assert_eq!(p.lazy_updates + p.deferred_rows, 0, "{what}: rank {r} took the lazy update: {p:?}");
        }
    }
}

/// Trains `cfg` on `w` thread-ranks up to each of `stops`, in `dir` (resuming when asked).
/// Every rank must end with bitwise the same replicated parameters.
pub fn train(cfg: &RunConfig, w: usize, dir: Option<&Path>, resume: bool, stops: &[usize]) -> Run {
    let per_rank = run_threads(w, |pg| {
        let before = optim_paths();
        let mut t = run::build(cfg, pg, dir.map(Path::to_path_buf), resume)?;
        let mut losses = Vec::new();
        for &s in stops {
            losses.push(t.train_until(s)?.last_loss);
        }
        let mut params = BTreeMap::new();
        let mut centres_dtype = DType::F32;
        for (n, v) in t.params() {
            if n == CENTRES {
                centres_dtype = v.dtype();
            }
            params.insert(n.clone(), v.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?);
        }
        Ok((losses, params, optim_paths().since(before), centres_dtype))
    })
    .unwrap();
    let mut params = per_rank[0].1.clone();
    params.insert(CENTRES.into(), per_rank.iter().flat_map(|(_, p, _, _)| p[CENTRES].clone()).collect());
    for (r, (_, p, _, _)) in per_rank.iter().enumerate().skip(1) {
        for (n, v) in p.iter().filter(|(n, _)| *n != CENTRES) {
            assert_eq!(v, &params[n], "rank {r}'s replicated {n} differs from rank 0's");
        }
    }
    let paths = per_rank.iter().map(|(_, _, p, _)| *p).collect();
    Run { losses: per_rank[0].0.clone(), params, paths, centres_dtype: per_rank[0].3 }
}

/// The bits of each value.
pub fn bits(x: &[f64]) -> Vec<u64> {
    x.iter().map(|f| f.to_bits()).collect()
}

/// Every parameter of `a` equals `b`'s bit for bit.
pub fn assert_params_bitwise(a: &Run, b: &Run, what: &str) {
    assert_eq!(a.params.keys().collect::<Vec<_>>(), b.params.keys().collect::<Vec<_>>(), "{what}");
    for (n, v) in &b.params {
        assert_eq!(bits(&a.params[n]), bits(v), "{what}: {n} differs");
    }
}

/// Every parameter and every loss of `a` equals `b`'s bit for bit.
pub fn assert_bitwise(a: &Run, b: &Run, what: &str) {
    assert_params_bitwise(a, b, what);
    assert_eq!(bits(&a.losses), bits(&b.losses), "{what}: losses differ");
}

/// Each parameter of `a` within `tol` of `b`'s, norm-wise (`allgrad_testkit::close`).
pub fn assert_params(a: &Run, b: &Run, tol: f64, what: &str) {
    assert_eq!(a.params.keys().collect::<Vec<_>>(), b.params.keys().collect::<Vec<_>>(), "{what}");
    for (n, y) in &b.params {
        assert_rel(&a.params[n], y, tol, &format!("{what}: {n}"));
    }
}

/// Each loss (element-wise) and each parameter (norm-wise) of `a` within `tol` of `b`'s.
pub fn assert_close(a: &Run, b: &Run, tol: f64, what: &str) {
    assert_elem_rel(&a.losses, &b.losses, tol, f64::MIN_POSITIVE, &format!("{what}: losses at the stops"));
    assert_params(a, b, tol, what);
}

/// A gray `side` x `side` PNG of identity `class`, variant `k`.
pub fn identity_png(side: u32, class: u32, k: u32) -> Vec<u8> {
    let img = image::GrayImage::from_fn(side, side, |x, y| {
        let v = (x * (class + 1) * 13 + y * (class * 7 + 3) + k * 5 * (x ^ y)) % 256;
        image::Luma([v as u8])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageOutputFormat::Png).unwrap();
    out.into_inner()
}

/// `dir/train.{rec,idx}` and `property`: 36 records of 6 identities, `side` x `side` PNGs.
pub fn write_recordio(dir: &Path, side: u32) {
    let mut w = RecordIoWriter::create(dir.join("train.rec"), dir.join("train.idx")).unwrap();
    for i in 0..36u32 {
        let png = identity_png(side, i % 6, i / 6);
        w.write(i as u64, &RecordHeader::scalar((i % 6) as f32, i as u64).pack(&png)).unwrap();
    }
    w.finish().unwrap();
    std::fs::write(dir.join("property"), format!("6,{side},{side}\n")).unwrap();
}
