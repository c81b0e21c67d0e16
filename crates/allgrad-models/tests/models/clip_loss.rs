//! CLIP's and SigLIP's losses over the global batch:
//! - W = 1..4 ranks (uneven shards, asymmetric data) against one process on the global batch:
//!   loss, the gradients of every rank's image and text embeddings (under the trainer's 1/W)
//!   and of the logit scale and bias (summed over ranks, / W), f64 1e-10;
//! - the tiled CLIP loss against the untiled one;
//! - the ring forms of both losses (one way and both ways, whole blocks and tiles) against the
//!   gather forms on one process, W = 1..8 with uneven shards; their tensor form (the one CUDA
//!   embeddings take through NCCL, here on the CPU with host exchanges) against both, and
//!   reading nothing back from the device (the CPU counted as one) in its forward and backward; what their passes exchanged
//!   (one check per pass, the documented number of exchanges, all overlapped, one frame per
//!   peer and step); ranks that run the ring with different settings;
//! - an independent reference: both losses written as plain f64 loops, values and, by central
//!   differences of those loops, gradients;
//! - the logit scale's clamp at 100.

// The plain references are formulas of (row, column): the loops index by both on purpose.
#![allow(clippy::needless_range_loop)]

use allgrad_dist::{run_threads, ProcessGroup, RingCounts, ThreadWorld};
use allgrad_models::clip::ring::{clip_loss_ring_tensors, siglip_loss_ring_tensors};
use allgrad_models::clip::{clip_loss, clip_loss_ring, clip_loss_tiled, siglip_loss, siglip_loss_ring, RingOptions};
use allgrad_models::tiled_paths;
use allgrad_testkit::close::assert_rel;
use candle_core::{DType, Device, Result, Tensor, Var};

const CPU: Device = Device::Cpu;
const D: usize = 5;

/// Row i of the global batch: image and text embeddings, neither normalised nor symmetric.
fn embeddings(n: usize, phase: f64) -> Vec<f64> {
    (0..n * D).map(|j| ((j as f64) * 0.37 + phase).sin() * (1.0 + (j % 7) as f64 * 0.3) + 0.05 * (j / D) as f64).collect()
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

#[derive(Clone, Copy, Debug)]
enum Form {
    Clip,
    ClipTiled(usize),
    SiglipGather,
    /// The ring forms: both ways or one way, the tile, and the rows per message.
    ClipRing(bool, Option<usize>, Option<usize>),
    SiglipRing(bool, Option<usize>, Option<usize>),
    /// The ring forms scored with Candle ops (what CUDA embeddings take through NCCL).
    ClipRingTensors(bool, Option<usize>, Option<usize>),
    SiglipRingTensors(bool, Option<usize>, Option<usize>),
}

const SIGLIP_RING: Form = Form::SiglipRing(true, None, None);

fn apply(form: Form, img: &Tensor, txt: &Tensor, s: &Tensor, b: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    match form {
        Form::Clip => clip_loss(img, txt, s, pg),
        Form::ClipTiled(t) => clip_loss_tiled(img, txt, s, t, pg),
        Form::SiglipGather => siglip_loss(img, txt, s, b, pg),
        Form::ClipRing(bidirectional, tile, chunk) => clip_loss_ring(img, txt, s, RingOptions { bidirectional, tile, chunk }, pg),
        Form::SiglipRing(bidirectional, tile, chunk) => {
            siglip_loss_ring(img, txt, s, b, RingOptions { bidirectional, tile, chunk }, pg)
        }
        Form::ClipRingTensors(bidirectional, tile, chunk) => {
            clip_loss_ring_tensors(img, txt, s, RingOptions { bidirectional, tile, chunk }, pg)
        }
        Form::SiglipRingTensors(bidirectional, tile, chunk) => {
            siglip_loss_ring_tensors(img, txt, s, b, RingOptions { bidirectional, tile, chunk }, pg)
        }
    }
}

/// Mean over ranks of the losses, image gradient rows, text gradient rows, d scale, d bias.
type Outcome = (f64, Vec<f64>, Vec<f64>, f64, f64);

/// The [`Outcome`] on W ranks, rank r holding rows `n r / W .. n (r + 1) / W`, each rank's
/// backward scaled by 1/W as the trainer does.
fn run(form: Form, w: usize, n: usize, scale: f64, bias: f64) -> Outcome {
    let shards: Vec<usize> = (0..w).map(|r| n * (r + 1) / w - n * r / w).collect();
    run_shards(form, &shards, scale, bias).0
}

/// What a rank's ring passes did in one forward and backward, and its tiled-path counts.
type Exchanged = (RingCounts, allgrad_models::TiledPaths);

/// [`run`] with rank r holding `shards[r]` rows (consecutive), and what each rank exchanged.
fn run_shards(form: Form, shards: &[usize], scale: f64, bias: f64) -> (Outcome, Vec<Exchanged>) {
    let (w, n) = (shards.len(), shards.iter().sum::<usize>());
    let (img, txt) = (embeddings(n, 0.0), embeddings(n, 1.3));
    let out = run_threads(w, |pg| {
        let r = pg.rank();
        let lo: usize = shards[..r].iter().sum();
        let hi = lo + shards[r];
        let (ring0, paths0) = (pg.ring_counts(), tiled_paths());
        let part = |v: &[f64]| Var::from_tensor(&Tensor::from_vec(v[lo * D..hi * D].to_vec(), (hi - lo, D), &CPU)?);
        let (i, t) = (part(&img)?, part(&txt)?);
        let s = Var::from_tensor(&Tensor::new(scale, &CPU)?)?;
        let b = Var::from_tensor(&Tensor::new(bias, &CPU)?)?;
        let loss = apply(form, i.as_tensor(), t.as_tensor(), s.as_tensor(), b.as_tensor(), &pg)?;
        let g = (&loss / w as f64)?.backward()?;
        let get = |v: &Var| g.get(v).map(flat).unwrap_or_else(|| vec![0.0; v.elem_count()]);
        let exchanged = (pg.ring_counts().since(ring0), tiled_paths().since(paths0));
        Ok(((loss.to_scalar::<f64>()?, get(&i), get(&t), get(&s)[0], get(&b)[0]), exchanged))
    })
    .unwrap();
    let mut total: Outcome = (0.0, Vec::new(), Vec::new(), 0.0, 0.0);
    let mut exchanged = Vec::new();
    for ((l, gi, gt, gs, gb), e) in out {
        exchanged.push(e);
        total.0 += l / w as f64;
        total.1.extend(gi);
        total.2.extend(gt);
        total.3 += gs;
        total.4 += gb;
    }
    (total, exchanged)
}

fn assert_same(got: &Outcome, want: &Outcome, tol: f64, what: &str) {
    assert_rel(&[got.0], &[want.0], tol, &format!("{what}: loss"));
    assert_rel(&got.1, &want.1, tol, &format!("{what}: image gradients"));
    assert_rel(&got.2, &want.2, tol, &format!("{what}: text gradients"));
    assert_rel(&[got.3], &[want.3], tol, &format!("{what}: logit scale gradient"));
    if want.4 != 0.0 || got.4 != 0.0 {
        assert_rel(&[got.4], &[want.4], tol, &format!("{what}: logit bias gradient"));
    }
}

const FORMS: [Form; 7] = [
    Form::Clip,
    Form::ClipTiled(1),
    Form::ClipTiled(3),
    Form::ClipTiled(64),
    Form::SiglipGather,
    SIGLIP_RING,
    Form::ClipRing(true, None, None),
];

#[test]
fn every_loss_on_w_ranks_equals_one_process_uneven_shards_included() {
    for form in FORMS {
        for n in [12, 10] {
            let one = run(form, 1, n, 1.7, -2.0);
            for w in 2..=4 {
                assert_same(&run(form, w, n, 1.7, -2.0), &one, 1e-10, &format!("{form:?} n={n} W={w}"));
            }
        }
    }
}

#[test]
fn the_tiled_clip_loss_equals_the_untiled_one_and_the_ring_the_gather() {
    for w in [1, 3] {
        let whole = run(Form::Clip, w, 10, 1.7, 0.0);
        for tile in [1, 3, 64] {
            assert_same(&run(Form::ClipTiled(tile), w, 10, 1.7, 0.0), &whole, 1e-10, &format!("tile {tile} W={w}"));
        }
        let gather = run(Form::SiglipGather, w, 10, 1.7, -2.0);
        assert_same(&run(SIGLIP_RING, w, 10, 1.7, -2.0), &gather, 1e-10, &format!("ring vs gather W={w}"));
    }
}

/// Uneven shards of W ranks, none alike: 1 to 4 rows.
fn uneven(w: usize) -> Vec<usize> {
    (0..w).map(|r| (r * 5 + 2) % 4 + 1).collect()
}

#[test]
fn the_ring_losses_equal_the_gather_forms_on_1_to_8_ranks_with_uneven_shards_both_ways_and_in_tiles() {
    for w in 1..=8 {
        let shards = uneven(w);
        let n: usize = shards.iter().sum();
        // The gather forms on one process over the same global batch.
        let clip = run_shards(Form::Clip, &[n], 1.7, -2.0).0;
        let siglip = run_shards(Form::SiglipGather, &[n], 1.7, -2.0).0;
        // Whole blocks per message, and chunks of 1 to 3 rows (blocks of 1 to 4 rows: several
        // chunks, the last partial or empty).
        for (form, want) in [
            (Form::ClipRing(true, None, None), &clip),
            (Form::ClipRing(false, Some(2), None), &clip),
            (Form::ClipRing(true, Some(1), Some(1)), &clip),
            (Form::ClipRing(true, None, Some(3)), &clip),
            (Form::ClipRing(false, Some(1), Some(2)), &clip),
            (Form::SiglipRing(true, None, None), &siglip),
            (Form::SiglipRing(false, None, Some(1)), &siglip),
            (Form::SiglipRing(true, Some(2), Some(3)), &siglip),
            (Form::SiglipRing(true, Some(1), Some(2)), &siglip),
        ] {
            let (got, _) = run_shards(form, &shards, 1.7, -2.0);
            assert_same(&got, want, 1e-10, &format!("{form:?} W={w} shards {shards:?} vs the gather form on one process"));
        }
    }
}

#[test]
fn the_tensor_ring_equals_the_host_ring_and_the_gather_forms_on_1_to_8_ranks_with_uneven_shards() {
    for w in 1..=8 {
        let shards = uneven(w);
        let n: usize = shards.iter().sum();
        let clip = run_shards(Form::Clip, &[n], 1.7, -2.0).0;
        let siglip = run_shards(Form::SiglipGather, &[n], 1.7, -2.0).0;
        // Both ways and one way, whole blocks and tiles, chunks of 1 to 3 rows (blocks of 1 to
        // 4 rows: several chunks, the last partial or empty).
        for (tensors, host, want) in [
            (Form::ClipRingTensors(true, None, None), Form::ClipRing(true, None, None), &clip),
            (Form::ClipRingTensors(false, Some(2), Some(1)), Form::ClipRing(false, Some(2), Some(1)), &clip),
            (Form::ClipRingTensors(true, Some(1), Some(3)), Form::ClipRing(true, Some(1), Some(3)), &clip),
            (Form::ClipRingTensors(true, Some(3), Some(2)), Form::ClipRing(true, Some(3), Some(2)), &clip),
            (Form::SiglipRingTensors(true, None, None), Form::SiglipRing(true, None, None), &siglip),
            (Form::SiglipRingTensors(false, None, Some(1)), Form::SiglipRing(false, None, Some(1)), &siglip),
            (Form::SiglipRingTensors(true, Some(2), Some(3)), Form::SiglipRing(true, Some(2), Some(3)), &siglip),
            (Form::SiglipRingTensors(true, Some(1), Some(2)), Form::SiglipRing(true, Some(1), Some(2)), &siglip),
        ] {
            let (got, _) = run_shards(tensors, &shards, 1.7, -2.0);
            let what = format!("{tensors:?} W={w} shards {shards:?}");
            assert_same(&got, want, 1e-10, &format!("{what} vs the gather form on one process"));
            assert_same(&got, &run_shards(host, &shards, 1.7, -2.0).0, 1e-10, &format!("{what} vs the host ring"));
            // W ranks against one rank of the same form.
            assert_same(&got, &run_shards(tensors, &[n], 1.7, -2.0).0, 1e-10, &format!("{what} vs W = 1"));
        }
    }
}

/// The reads back from the device (the CPU counted as one, `candle_core::host_traffic`) and
/// the synchronisations of each rank's forward and backward of `form` on W ranks.
fn traffic_of(form: Form, w: usize) -> Vec<candle_core::host_traffic::Traffic> {
    use candle_core::host_traffic::{set_cpu_as_device_for_thread, thread_traffic};
    let shards = uneven(w);
    let n: usize = shards.iter().sum();
    let (img, txt) = (embeddings(n, 0.0), embeddings(n, 1.3));
    run_threads(w, |pg| {
        let r = pg.rank();
        let lo: usize = shards[..r].iter().sum();
        let hi = lo + shards[r];
        let part = |v: &[f64]| Var::from_tensor(&Tensor::from_vec(v[lo * D..hi * D].to_vec(), (hi - lo, D), &CPU)?);
        let (i, t) = (part(&img)?, part(&txt)?);
        let s = Var::from_tensor(&Tensor::new(1.7f64, &CPU)?)?;
        let b = Var::from_tensor(&Tensor::new(-2.0f64, &CPU)?)?;
        let was = set_cpu_as_device_for_thread(true);
        let before = thread_traffic();
        let out = apply(form, i.as_tensor(), t.as_tensor(), s.as_tensor(), b.as_tensor(), &pg).and_then(|l| l.backward());
        let during = thread_traffic() - before;
        set_cpu_as_device_for_thread(was);
        let g = out?;
        assert!(g.get(&i).is_some() && g.get(&s).is_some(), "{form:?}: the gradients must be there");
        Ok(during)
    })
    .unwrap()
}

#[test]
fn the_tensor_ring_reads_nothing_back_from_the_device_in_its_forward_and_backward() {
    for w in [1, 2, 3] {
        for form in [
            Form::ClipRingTensors(true, None, None),
            Form::ClipRingTensors(false, Some(2), Some(1)),
            Form::SiglipRingTensors(true, Some(1), Some(2)),
            Form::SiglipRingTensors(false, None, Some(3)),
        ] {
            for (r, t) in traffic_of(form, w).iter().enumerate() {
                assert_eq!((t.reads, t.syncs), (0, 0), "{form:?} W={w} rank {r}: {t:?}");
            }
        }
        // The positive control: the host form reads its blocks (and the incoming gradient) back,
        // and the count sees it.
        for form in [Form::ClipRing(true, None, None), Form::SiglipRing(true, None, None)] {
            for (r, t) in traffic_of(form, w).iter().enumerate() {
                assert!(t.reads > 0, "{form:?} W={w} rank {r}: the host form's reads must be counted: {t:?}");
            }
        }
    }
}

#[test]
fn ranks_on_the_tensor_ring_and_the_host_ring_fail_naming_the_form_and_the_ranks() {
    let world =
        ThreadWorld::new(3).timeout(std::time::Duration::from_secs(20)).watchdog(Some(std::time::Duration::from_secs(60)));
    let errors = world
        .run(|pg| {
            let r = pg.rank();
            let img = Tensor::from_vec(embeddings(2, r as f64), (2, D), &CPU)?;
            let txt = Tensor::from_vec(embeddings(2, 0.5 + r as f64), (2, D), &CPU)?;
            let (s, b) = (Tensor::new(1.0f64, &CPU)?, Tensor::new(-1.0f64, &CPU)?);
            let opts = RingOptions::default();
            let out = if r == 1 {
                siglip_loss_ring_tensors(&img, &txt, &s, &b, opts, &pg)
            } else {
                siglip_loss_ring(&img, &txt, &s, &b, opts, &pg)
            };
            Ok(out.map(|_| ()).unwrap_err().to_string())
        })
        .unwrap();
    for (r, e) in errors.iter().enumerate() {
        assert!(
            e.contains("the ring's form")
                && e.contains("differs")
                && e.contains("rank(s) [0, 2]: 0")
                && e.contains("rank(s) [1]: 1"),
            "rank {r}: {e}"
        );
    }
}

/// What rank `r`'s two passes (forward and backward) should exchange under the documented
/// schedule: step s of `up` steps (the first `down` of them both ways) brings chunk k of the
/// blocks of ranks r − s (and r + s), each straight from its owner, one exchange per step and
/// chunk, moving this rank's own chunk k to ranks r + s (and r − s); in the backward each
/// chunk visited goes home two exchanges after it arrived. An exchange with nothing to move
/// (every chunk it would move empty) does not happen. Returns (exchanges, messages sent).
fn expected_exchanges(shards: &[usize], chunk: usize, bidirectional: bool, r: usize) -> (usize, usize) {
    let w = shards.len();
    let (up, down) = if bidirectional { (w / 2, (w - 1) / 2) } else { (w - 1, 0) };
    let chunks = shards.iter().max().unwrap().div_ceil(chunk).max(1);
    let has = |o: usize, k: usize| shards[o] > k * chunk;
    let origins = |s: usize| {
        let mut v = vec![(r + w - s % w) % w];
        if s <= down {
            v.push((r + s) % w);
        }
        v
    };
    let n = up * chunks;
    // Per block exchange: whether this rank sends its chunk, and the foreign chunks it receives.
    let slot = |e: usize| (e / chunks + 1, e % chunks);
    let moves = |e: usize| {
        let (s, k) = slot(e);
        (if has(r, k) { origins(s).len() } else { 0 }, origins(s).into_iter().filter(|&o| has(o, k)).count())
    };
    let forward = (0..n).filter(|&e| moves(e) != (0, 0)).count();
    let backward = (0..n + 2)
        .filter(|&e| {
            let blocks = if e < n { moves(e) } else { (0, 0) };
            let going_home = e >= 2 && moves(e - 2).1 > 0;
            let coming_home = e >= 2 && moves(e - 2).0 > 0;
            blocks != (0, 0) || going_home || coming_home
        })
        .count();
    let own_sent: usize = (0..n).map(|e| moves(e).0).sum();
    let received: usize = (0..n).map(|e| moves(e).1).sum();
    (forward + backward, 2 * own_sent + received)
}

#[test]
fn a_ring_pass_checks_once_and_exchanges_point_to_point_overlapped_with_the_scoring() {
    for w in [1, 2, 3, 4, 5, 8] {
        for bidirectional in [true, false] {
            for (form, chunk) in [
                (Form::ClipRing(bidirectional, Some(2), None), 4),
                (Form::SiglipRing(bidirectional, None, None), 4),
                (Form::ClipRing(bidirectional, None, Some(1)), 1),
                (Form::SiglipRing(bidirectional, Some(1), Some(3)), 3),
                (Form::ClipRingTensors(bidirectional, Some(1), Some(2)), 2),
                (Form::SiglipRingTensors(bidirectional, None, Some(3)), 3),
            ] {
                let shards = uneven(w);
                let (_, exchanged) = run_shards(form, &shards, 1.7, -2.0);
                for (r, (ring, paths)) in exchanged.iter().enumerate() {
                    let what = format!("{form:?} W={w} rank {r}");
                    let (exchanges, messages) = expected_exchanges(&shards, chunk, bidirectional, r);
                    assert_eq!((ring.passes, ring.checks), (2, 2), "{what}: one check per pass, forward and backward");
                    assert_eq!(ring.exchanges, exchanges as u64, "{what}: exchanges {ring:?}");
                    assert_eq!(ring.overlapped, ring.exchanges, "{what}: every exchange ran beside the scoring");
                    // Forward: one chunk per direction, step and chunk, nothing else (no count
                    // exchange); backward: the chunks again, and each visited chunk's gradient.
                    assert_eq!(ring.messages_sent, messages as u64, "{what}: messages {ring:?}");
                    // Messages to one peer in one exchange travel as one frame.
                    assert!(ring.frames_sent <= ring.messages_sent && (w == 1 || ring.frames_sent > 0), "{what}: {ring:?}");
                    assert_eq!((paths.ring_forward, paths.ring_backward, paths.ring_staged), (1, 1, 0), "{what}: {paths:?}");
                }
            }
        }
    }
}

#[test]
fn ranks_with_different_ring_settings_fail_on_every_rank_naming_the_setting_and_the_ranks() {
    let world =
        ThreadWorld::new(3).timeout(std::time::Duration::from_secs(20)).watchdog(Some(std::time::Duration::from_secs(60)));
    let errors = world
        .run(|pg| {
            let r = pg.rank();
            let img = Tensor::from_vec(embeddings(2, r as f64), (2, D), &CPU)?;
            let txt = Tensor::from_vec(embeddings(2, 0.5 + r as f64), (2, D), &CPU)?;
            let s = Tensor::new(1.0f64, &CPU)?;
            // Rank 2 runs the ring one way, the others both ways.
            let opts = RingOptions { bidirectional: r != 2, ..Default::default() };
            Ok(clip_loss_ring(&img, &txt, &s, opts, &pg).map(|_| ()).unwrap_err().to_string())
        })
        .unwrap();
    for (r, e) in errors.iter().enumerate() {
        assert!(
            e.contains("bidirectional differs") && e.contains("rank(s) [0, 1]: 1") && e.contains("rank(s) [2]: 0"),
            "rank {r}: {e}"
        );
    }
    // Another loss on rank 0 (named as such, though its blocks are narrower too), then, with
    // SigLIP's blocks of width 2D as wide as CLIP's of width D, the loss alone; then another
    // width on rank 1.
    let errors = world
        .run(|pg| {
            let r = pg.rank();
            let x = Tensor::from_vec(embeddings(2 * D, r as f64)[..2 * D].to_vec(), (2, D), &CPU)?;
            let (s, b) = (Tensor::new(1.0f64, &CPU)?, Tensor::new(-1.0f64, &CPU)?);
            let out = if r == 0 {
                siglip_loss_ring(&x, &x, &s, &b, RingOptions::default(), &pg)
            } else {
                clip_loss_ring(&x, &x, &s, RingOptions::default(), &pg)
            };
            Ok(out.map(|_| ()).unwrap_err().to_string())
        })
        .unwrap();
    for (r, e) in errors.iter().enumerate() {
        assert!(e.contains("the loss (clip_ring or siglip_ring) differs") && e.contains("rank(s) [0]: 1"), "rank {r}: {e}");
    }
    let errors = world
        .run(|pg| {
            let r = pg.rank();
            let rows = |d: usize| Tensor::from_vec(embeddings(2 * d, r as f64)[..2 * d].to_vec(), (2, d), &CPU);
            let (s, b) = (Tensor::new(1.0f64, &CPU)?, Tensor::new(-1.0f64, &CPU)?);
            let out = if r == 0 {
                siglip_loss_ring(&rows(2 * D)?, &rows(2 * D)?, &s, &b, RingOptions::default(), &pg)
            } else {
                clip_loss_ring(&rows(D)?, &rows(D)?, &s, RingOptions::default(), &pg)
            };
            Ok(out.map(|_| ()).unwrap_err().to_string())
        })
        .unwrap();
    for (r, e) in errors.iter().enumerate() {
        assert!(
            e.contains("the loss (clip_ring or siglip_ring) differs")
                && e.contains("rank(s) [0]: 1")
                && e.contains("rank(s) [1, 2]: 0"),
            "rank {r}: {e}"
        );
    }
    let errors = world
        .run(|pg| {
            let r = pg.rank();
            let d = if r == 1 { D + 1 } else { D };
            let x = Tensor::from_vec(embeddings(2 * d, r as f64)[..2 * d].to_vec(), (2, d), &CPU)?;
            let s = Tensor::new(1.0f64, &CPU)?;
            Ok(clip_loss_ring(&x, &x, &s, RingOptions::default(), &pg).map(|_| ()).unwrap_err().to_string())
        })
        .unwrap();
    for (r, e) in errors.iter().enumerate() {
        assert!(e.contains("the embedding width d differs") && e.contains(&format!("rank(s) [1]: {}", D + 1)), "rank {r}: {e}");
    }
}

// ------------------------------------------------------------------ plain f64 reference

fn normalised(v: &[f64]) -> Vec<Vec<f64>> {
    v.chunks(D)
        .map(|r| {
            let n = r.iter().map(|x| x * x).sum::<f64>().sqrt();
            r.iter().map(|x| x / n).collect()
        })
        .collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// CLIP: mean over i of (CE of image i over texts + CE of text i over images) / 2, logits
/// exp(s) cos (uncapped: the cap is the trainer's clamp of the parameter).
fn clip_plain(img: &[f64], txt: &[f64], s: f64) -> f64 {
    let (a, b) = (normalised(img), normalised(txt));
    let n = a.len();
    let k = s.exp();
    let ce = |x: &Vec<Vec<f64>>, y: &Vec<Vec<f64>>| -> f64 {
        (0..n)
            .map(|i| {
                let l: Vec<f64> = (0..n).map(|j| k * dot(&x[i], &y[j])).collect();
                let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                m + l.iter().map(|v| (v - m).exp()).sum::<f64>().ln() - l[i]
            })
            .sum::<f64>()
    };
    (ce(&a, &b) + ce(&b, &a)) / (2.0 * n as f64)
}

/// SigLIP: −(1/n) Σ_ij log σ(y_ij (exp(s) cos_ij + bias)).
fn siglip_plain(img: &[f64], txt: &[f64], s: f64, bias: f64) -> f64 {
    let (a, b) = (normalised(img), normalised(txt));
    let n = a.len();
    let mut sum = 0.0;
    for i in 0..n {
        for j in 0..n {
            let z = s.exp() * dot(&a[i], &b[j]) + bias;
            let y = if i == j { 1.0 } else { -1.0 };
            sum += -(1.0 + (-y * z).exp()).ln();
        }
    }
    -sum / n as f64
}

fn plain(form: Form, img: &[f64], txt: &[f64], s: f64, bias: f64) -> f64 {
    match form {
        Form::Clip | Form::ClipTiled(_) => clip_plain(img, txt, s),
        Form::ClipRing(..) | Form::ClipRingTensors(..) => clip_plain(img, txt, s),
        Form::SiglipGather | Form::SiglipRing(..) | Form::SiglipRingTensors(..) => siglip_plain(img, txt, s, bias),
    }
}

#[test]
fn values_and_gradients_match_plain_f64_loops_and_their_central_differences() {
    let n = 6;
    for (form, s) in [
        (Form::Clip, 1.7),
        (Form::ClipTiled(4), 1.7),
        (Form::SiglipGather, 1.2),
        (SIGLIP_RING, 1.2),
        (Form::ClipRing(true, Some(2), Some(1)), 1.7),
        (Form::SiglipRing(false, Some(4), Some(2)), 1.2),
        (Form::ClipRingTensors(true, Some(2), Some(1)), 1.7),
        (Form::SiglipRingTensors(false, Some(4), Some(2)), 1.2),
    ] {
        let bias = -1.5;
        let (img, txt) = (embeddings(n, 0.0), embeddings(n, 1.3));
        let want = plain(form, &img, &txt, s, bias);
        for w in [1, 3] {
            let got = run(form, w, n, s, bias);
            assert_rel(&[got.0], &[want], 1e-12, &format!("{form:?} W={w}: loss vs plain loops"));
            // Central differences, h = 1e-5: truncation ~h² times the third derivative (below
            // 1e-9 here), rounding ~1e-16 / h; 1e-7 relative bounds both with margin.
            let h = 1e-5;
            let fd = |f: &dyn Fn(f64) -> f64| (f(h) - f(-h)) / (2.0 * h);
            let gi: Vec<f64> = (0..img.len())
                .map(|k| {
                    fd(&|e| {
                        let mut v = img.clone();
                        v[k] += e;
                        plain(form, &v, &txt, s, bias)
                    })
                })
                .collect();
            let gt: Vec<f64> = (0..txt.len())
                .map(|k| {
                    fd(&|e| {
                        let mut v = txt.clone();
                        v[k] += e;
                        plain(form, &img, &v, s, bias)
                    })
                })
                .collect();
            let gs = fd(&|e| plain(form, &img, &txt, s + e, bias));
            assert_rel(&got.1, &gi, 1e-7, &format!("{form:?} W={w}: image gradients vs central differences"));
            assert_rel(&got.2, &gt, 1e-7, &format!("{form:?} W={w}: text gradients vs central differences"));
            assert_rel(&[got.3], &[gs], 1e-7, &format!("{form:?} W={w}: logit scale gradient vs central difference"));
            if matches!(form, Form::SiglipGather | Form::SiglipRing(..)) {
                let gb = fd(&|e| plain(form, &img, &txt, s, bias + e));
                assert_rel(&[got.4], &[gb], 1e-7, &format!("{form:?} W={w}: bias gradient vs central difference"));
            }
        }
    }
}

/// The forward does not cap the scale (OpenCLIP and `transformers` do not: the cap is a clamp
/// of the parameter after each step, which the trainer applies): past ln 100 the logits are
/// `exp(s) · cos` and the scale keeps its gradient (a central difference of the plain loop).
#[test]
fn the_forward_does_not_cap_the_logit_scale_past_ln_100() {
    let s = 100f64.ln() + 0.5;
    let (img, txt) = (embeddings(6, 0.0), embeddings(6, 1.3));
    for form in [Form::Clip, Form::ClipTiled(2), Form::ClipRing(true, None, None)] {
        let got = run(form, 2, 6, s, 0.0);
        assert_rel(&[got.0], &[clip_plain(&img, &txt, s)], 1e-12, &format!("{form:?}: the loss at scale exp(ln 100 + 0.5)"));
        let h = 1e-5;
        let gs = (clip_plain(&img, &txt, s + h) - clip_plain(&img, &txt, s - h)) / (2.0 * h);
        assert!(gs.abs() > 1e-3, "the test needs a scale gradient well away from 0, got {gs}");
        assert_rel(&[got.3], &[gs], 1e-7, &format!("{form:?}: the scale's gradient past ln 100"));
    }
}
