//! The optimizer's lazy update of row-sparse gradients against the dense update: 120 steps
//! with a few random rows in each gradient and a learning rate that changes every step
//! (warmup, cosine, a jump), SGD (momentum, nesterov, weight decay, each alone) and AdamW,
//! f32 and f64. The lazy result equals the dense update of the gradient scattered into zeros
//! bit for bit, whenever the pending rows are brought up to date (flushes at odd steps or
//! only at the end); both equal the formulas written out in f64 loops over every row
//! (f64: 1e-12); `keep_others` equals the dense row mask; LARS takes the dense update; bad
//! row lists are refused with the parameter's name. A bf16 parameter (bf16 state, f32
//! gradient) takes the lazy update in f32 arithmetic, equal bit for bit to the dense update
//! that loads, updates and stores bf16 every step, written out here.
//!
//! Each comparison also checks the path the optimizer took (`allgrad_train::optim_paths`): the
//! row-sparse runs took the lazy update, deferred rows and replayed them, the dense runs and
//! LARS did not, so a lazy path that fell back to the dense update (which would still be
//! bit for bit equal) fails the tests.

use allgrad_dist::ProcessGroup;
use allgrad_rng::{below, normals, stream};
use allgrad_testkit::close::assert_rel;
use allgrad_train::optim::{OptimConfig, Optimizer, RowUpdate};
use allgrad_train::{optim_paths, OptimPaths};
use candle_core::{DType, Device, Tensor, Var};

const ROWS: usize = 23;
const WIDTH: usize = 5;
const STEPS: u64 = 120;

fn configs() -> Vec<OptimConfig> {
    vec![
        OptimConfig::Sgd { lr: 0.1, momentum: 0.9, nesterov: false, weight_decay: 5e-3 },
        OptimConfig::Sgd { lr: 0.1, momentum: 0.9, nesterov: true, weight_decay: 5e-3 },
        OptimConfig::Sgd { lr: 0.1, momentum: 0.0, nesterov: false, weight_decay: 1e-2 },
        OptimConfig::Sgd { lr: 0.1, momentum: 0.8, nesterov: false, weight_decay: 0.0 },
        OptimConfig::Adamw { lr: 0.01, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.05 },
    ]
}

/// The learning rate of update `t` (from 1): a warmup, a cosine, then a jump up.
fn lr(base: f64, t: u64) -> f64 {
    match t {
        0..=10 => base * t as f64 / 10.0,
        11..=90 => base * 0.5 * (1.0 + (std::f64::consts::PI * (t - 10) as f64 / 80.0).cos()) + 1e-4,
        _ => base * 0.3,
    }
}

/// The rows in the gradient of update `t`: a few random ones (some steps none, some all).
fn rows_at(t: u64) -> Vec<u32> {
    let mut rng = stream(&[7, t]);
    match t % 29 {
        0 => Vec::new(),
        13 => (0..ROWS as u32).collect(),
        _ => {
            let mut r: Vec<u32> = (0..1 + below(&mut rng, 4)).map(|_| below(&mut rng, ROWS) as u32).collect();
            r.sort_unstable();
            r.dedup();
            r
        }
    }
}

/// The gradient values of those rows, `[rows, WIDTH]` f64.
fn values_at(t: u64, rows: &[u32]) -> Vec<f64> {
    normals(&mut stream(&[8, t]), rows.len() * WIDTH)
}

fn initial() -> Vec<f64> {
    normals(&mut stream(&[9]), ROWS * WIDTH)
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap().into_iter().map(f64::to_bits).collect()
}

/// The parameter and every state slot after the run, as f64 bits, and the optimizer's paths.
struct Outcome {
    param: Vec<u64>,
    state: Vec<(String, Vec<u64>)>,
    paths: OptimPaths,
}

/// The run took the lazy update at every step, left rows behind and replayed them.
fn assert_lazy(o: &Outcome, what: &str) {
    let p = o.paths;
    assert_eq!(p.lazy_updates, STEPS, "{what}: not every update took the lazy path: {p:?}");
    assert_eq!(p.sparse_as_dense + p.fused_cpu + p.composed, 0, "{what}: a dense update ran: {p:?}");
    assert!(p.deferred_rows > 0 && p.replayed_rows > 0, "{what}: no row was deferred and replayed: {p:?}");
}

/// Runs `cfg` for STEPS updates in `dtype`: `sparse` gives the optimizer the row-sparse
/// gradient, otherwise the same gradient scattered into zeros (dense, or with the row mask
/// when `keep_others`); the pending rows are flushed after the updates in `flush_at`.
fn run(cfg: &OptimConfig, dtype: DType, sparse: bool, keep_others: bool, flush_at: &[u64]) -> Outcome {
    let pg = ProcessGroup::single();
    let dev = Device::Cpu;
    let w = Var::from_tensor(&Tensor::from_vec(initial(), (ROWS, WIDTH), &dev).unwrap().to_dtype(dtype).unwrap()).unwrap();
    let params = [("head.centres".to_string(), w.clone())];
    let mut opt = Optimizer::new(cfg.clone());
    let before = optim_paths();
    for t in 1..=STEPS {
        let rows = rows_at(t);
        let g = Tensor::from_vec(values_at(t, &rows), (rows.len(), WIDTH), &dev).unwrap().to_dtype(dtype).unwrap();
        let (g, update) = if sparse {
            (g, RowUpdate::Sparse { rows: rows.clone(), keep_others })
        } else {
            let mut dense = Tensor::zeros((ROWS, WIDTH), dtype, &dev).unwrap();
            if !rows.is_empty() {
                dense = dense.index_add(&Tensor::new(rows.as_slice(), &dev).unwrap(), &g, 0).unwrap();
            }
            let mask = (0..ROWS as u32).map(|r| rows.contains(&r)).collect();
            (dense, if keep_others { RowUpdate::Only(mask) } else { RowUpdate::All })
        };
        opt.step_grads(&params, &[g], &[true], &[update], lr(cfg.lr(), t), &pg).unwrap();
        if flush_at.contains(&t) {
            opt.flush(&params).unwrap();
            assert!(!opt.pending(), "rows pending after a flush");
        }
    }
    opt.flush(&params).unwrap();
    let paths = optim_paths().since(before);
    Outcome { param: bits(w.as_tensor()), state: opt.state().iter().map(|(k, v)| (k.clone(), bits(v))).collect(), paths }
}

/// The dense updates written out in f64 over every row (zero gradient outside the rows).
fn reference(cfg: &OptimConfig) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut w = initial();
    let (mut m, mut v) = (vec![0f64; w.len()], vec![0f64; w.len()]);
    for t in 1..=STEPS {
        let rows = rows_at(t);
        let vals = values_at(t, &rows);
        let mut g = vec![0f64; w.len()];
        for (i, r) in rows.iter().enumerate() {
            g[*r as usize * WIDTH..(*r as usize + 1) * WIDTH].copy_from_slice(&vals[i * WIDTH..(i + 1) * WIDTH]);
        }
        let lr = lr(cfg.lr(), t);
        for k in 0..w.len() {
            match *cfg {
                OptimConfig::Sgd { momentum, nesterov, weight_decay, .. } => {
                    let mut d = g[k] + weight_decay * w[k];
                    if momentum > 0.0 {
                        m[k] = momentum * m[k] + d;
                        d = if nesterov { d + momentum * m[k] } else { m[k] };
                    }
                    w[k] -= lr * d;
                }
                OptimConfig::Adamw { beta1, beta2, eps, weight_decay, .. } => {
                    m[k] = beta1 * m[k] + (1.0 - beta1) * g[k];
                    v[k] = beta2 * v[k] + (1.0 - beta2) * g[k] * g[k];
                    let ti = t as i32;
                    let step = (m[k] / (1.0 - beta1.powi(ti))) / ((v[k] / (1.0 - beta2.powi(ti))).sqrt() + eps);
                    w[k] -= lr * (step + weight_decay * w[k]);
                }
                OptimConfig::Lars { .. } => unreachable!(),
            }
        }
    }
    (w, m, v)
}

fn assert_same(a: &Outcome, b: &Outcome, what: &str) {
    assert_eq!(a.param, b.param, "{what}: the parameter differs");
    assert_eq!(a.state.len(), b.state.len(), "{what}: state slots");
    for ((ka, va), (kb, vb)) in a.state.iter().zip(&b.state) {
        assert_eq!(ka, kb, "{what}");
        assert_eq!(va, vb, "{what}: state slot {ka} differs");
    }
}

#[test]
fn the_lazy_update_equals_the_dense_update_bitwise_over_120_steps_of_a_changing_schedule() {
    // Rows are left out for many steps in a row, some steps touch none or all.
    let gaps: usize = (1..=STEPS).map(|t| ROWS - rows_at(t).len()).sum();
    assert!(gaps > 100 * ROWS / 2, "the rows were not left out enough to test the deferral");
    for cfg in configs() {
        for dtype in [DType::F64, DType::F32] {
            let what = format!("{cfg:?} {dtype:?}");
            let dense = run(&cfg, dtype, false, false, &[]);
            assert_eq!(dense.paths.fused_cpu, STEPS, "{what}: the dense run's path: {:?}", dense.paths);
            assert_eq!(dense.paths.lazy_updates, 0, "{what}: the dense run's path: {:?}", dense.paths);
            let lazy = run(&cfg, dtype, true, false, &[]);
            assert_lazy(&lazy, &what);
            assert_same(&lazy, &dense, &what);
            // Bringing rows up to date at other times (checkpoints, evaluations) changes nothing.
            let flushed = run(&cfg, dtype, true, false, &[1, 2, 37, 38, 91]);
            assert_lazy(&flushed, &format!("{what} with flushes"));
            assert_same(&flushed, &dense, &format!("{what} with flushes"));
        }
    }
}

#[test]
fn the_dense_and_lazy_updates_equal_the_formulas_in_f64_loops() {
    for cfg in configs() {
        let (w, m, v) = reference(&cfg);
        let lazy = run(&cfg, DType::F64, true, false, &[]);
        assert_lazy(&lazy, &format!("{cfg:?}"));
        let got: Vec<f64> = lazy.param.iter().map(|b| f64::from_bits(*b)).collect();
        // The same f64 operations in the same order except for the kernel's fused forms
        // (`lr * (step + wd * w)` against `w - lr * step - ...`): rounding only, 120 steps.
        assert_rel(&got, &w, FORMULA_TOL, &format!("{cfg:?} parameter"));
        for (key, slot) in &lazy.state {
            let want = if key.ends_with("exp_avg_sq") { &v } else { &m };
            let slot: Vec<f64> = slot.iter().map(|x| f64::from_bits(*x)).collect();
            assert_rel(&slot, want, FORMULA_TOL, &format!("{cfg:?} {key}"));
        }
        // The rows left out moved: weight decay or momentum acts on them (else the test of
        // the deferral is empty).
        let init = initial();
        let never = (0..ROWS).find(|r| (1..=10).all(|t| !rows_at(t).contains(&(*r as u32))));
        if let Some(r) = never {
            let moved = (0..WIDTH).any(|c| w[r * WIDTH + c] != init[r * WIDTH + c]);
            assert!(moved, "{cfg:?}: row {r} did not move though weight decay or momentum acts on it");
        }
    }
}

#[test]
fn keep_others_equals_the_dense_row_mask_and_defers_nothing() {
    for cfg in configs() {
        for dtype in [DType::F64, DType::F32] {
            let masked = run(&cfg, dtype, false, true, &[]);
            let sparse = run(&cfg, dtype, true, true, &[]);
            let p = sparse.paths;
            assert!(p.lazy_updates == STEPS && p.deferred_rows == 0, "{cfg:?} {dtype:?} keep_others: {p:?}");
            assert_same(&sparse, &masked, &format!("{cfg:?} {dtype:?} keep_others"));
        }
    }
}

#[test]
fn lars_takes_the_dense_update_of_a_row_sparse_gradient() {
    let cfg = OptimConfig::Lars { lr: 0.1, momentum: 0.9, weight_decay: 1e-3, trust_coefficient: 0.01, exclude_1d: true };
    let sparse = run(&cfg, DType::F64, true, false, &[]);
    let p = sparse.paths;
    assert!(p.sparse_as_dense == STEPS && p.composed == STEPS && p.lazy_updates == 0, "LARS: {p:?}");
    assert_same(&sparse, &run(&cfg, DType::F64, false, false, &[]), "LARS");
}

#[test]
fn bad_row_lists_are_refused_with_the_parameter_name() {
    let pg = ProcessGroup::single();
    let w = Var::zeros((4, 2), DType::F64, &Device::Cpu).unwrap();
    let params = [("head.centres".to_string(), w)];
    let g = |n: usize| Tensor::ones((n, 2), DType::F64, &Device::Cpu).unwrap();
    let cases = [
        (vec![2, 1], g(2), "rows must be increasing, got 2 then 1"),
        (vec![1, 1], g(2), "rows must be increasing, got 1 then 1"),
        (vec![0, 4], g(2), "row 4 of a parameter of 4 rows"),
        (vec![0, 1], g(3), "but a gradient of shape [3, 2]"),
    ];
    for (rows, grad, want) in cases {
        let mut opt = Optimizer::new(OptimConfig::default());
        let err = opt.step_grads(&params, &[grad], &[true], &[RowUpdate::Sparse { rows, keep_others: false }], 0.1, &pg);
        let msg = err.unwrap_err().to_string();
        assert!(msg.contains("head.centres") && msg.contains(want), "{msg}");
    }
}

/// The dense update of a bf16 parameter with bf16 state in f32 arithmetic, written out: every
/// row each step (zero gradient outside the step's rows), values loaded from bf16, updated in
/// f32 with the f32 kernel's operations, stored back to bf16.
fn reference_bf16(cfg: &OptimConfig) -> (Vec<u16>, Vec<u16>, Vec<u16>) {
    let round = |x: f32| half::bf16::from_f32(x).to_f32();
    let mut w: Vec<f32> = initial().iter().map(|v| round(*v as f32)).collect();
    let (mut m, mut v) = (vec![0f32; w.len()], vec![0f32; w.len()]);
    for t in 1..=STEPS {
        let rows = rows_at(t);
        let vals = values_at(t, &rows);
        let mut g = vec![0f32; w.len()];
        for (i, r) in rows.iter().enumerate() {
            for c in 0..WIDTH {
                g[*r as usize * WIDTH + c] = vals[i * WIDTH + c] as f32;
            }
        }
        let lr = lr(cfg.lr(), t) as f32;
        for k in 0..w.len() {
            match *cfg {
                OptimConfig::Sgd { momentum, nesterov, weight_decay, .. } => {
                    let (mo, wd) = (momentum as f32, weight_decay as f32);
                    if momentum > 0.0 {
                        let d = if weight_decay > 0.0 { g[k] + w[k] * wd } else { g[k] };
                        m[k] = m[k] * mo + d;
                    }
                    let d = if weight_decay > 0.0 { g[k] + w[k] * wd } else { g[k] };
                    let d = match (momentum > 0.0, nesterov) {
                        (false, _) => d,
                        (true, false) => m[k],
                        (true, true) => d + m[k] * mo,
                    };
                    w[k] -= d * lr;
                }
                OptimConfig::Adamw { beta1, beta2, eps, weight_decay, .. } => {
                    let ti = t as i32;
                    let (bc1, bc2) = ((1.0 - beta1.powi(ti)) as f32, (1.0 - beta2.powi(ti)) as f32);
                    m[k] = m[k] * beta1 as f32 + g[k] * (1.0 - beta1) as f32;
                    v[k] = v[k] * beta2 as f32 + g[k] * g[k] * (1.0 - beta2) as f32;
                    let step = (m[k] / bc1) / ((f64::from(v[k] / bc2)).sqrt() as f32 + eps as f32);
                    w[k] -= (step + w[k] * weight_decay as f32) * lr;
                }
                OptimConfig::Lars { .. } => unreachable!(),
            }
            w[k] = round(w[k]);
            m[k] = round(m[k]);
            v[k] = round(v[k]);
        }
    }
    let bits = |x: &[f32]| x.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
    (bits(&w), bits(&m), bits(&v))
}

#[test]
fn a_bf16_parameter_takes_the_lazy_update_in_f32_arithmetic_equal_to_the_dense_bf16_update_bitwise() {
    let pg = ProcessGroup::single();
    let dev = Device::Cpu;
    let bf16_bits =
        |t: &Tensor| t.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<u16>>();
    for cfg in configs() {
        let (want_w, want_m, want_v) = reference_bf16(&cfg);
        for flush_at in [vec![], vec![3, 50, 51]] {
            let w = Var::from_tensor(&Tensor::from_vec(initial(), (ROWS, WIDTH), &dev).unwrap().to_dtype(DType::BF16).unwrap())
                .unwrap();
            let params = [("head.centres".to_string(), w.clone())];
            let mut opt = Optimizer::new(cfg.clone());
            let before = optim_paths();
            for t in 1..=STEPS {
                let rows = rows_at(t);
                let g = Tensor::from_vec(values_at(t, &rows), (rows.len(), WIDTH), &dev).unwrap().to_dtype(DType::F32).unwrap();
                let update = RowUpdate::Sparse { rows, keep_others: false };
                opt.step_grads(&params, &[g], &[true], &[update], lr(cfg.lr(), t), &pg).unwrap();
                if flush_at.contains(&t) {
                    opt.flush(&params).unwrap();
                }
            }
            opt.flush(&params).unwrap();
            let what = format!("{cfg:?} flushes {flush_at:?}");
            assert_lazy(&Outcome { param: vec![], state: vec![], paths: optim_paths().since(before) }, &what);
            assert_eq!(w.dtype(), DType::BF16, "{what}");
            assert_eq!(bf16_bits(w.as_tensor()), want_w, "{what}: the parameter differs");
            for (key, slot) in opt.state() {
                assert_eq!(slot.dtype(), DType::BF16, "{what}: {key} is not stored in bf16");
                let want = if key.ends_with("exp_avg_sq") { &want_v } else { &want_m };
                assert_eq!(&bf16_bits(slot), want, "{what}: state slot {key} differs");
            }
        }
    }
}

/// The lazy and dense updates against the f64 loops (norm-wise relative error; measured on
/// one machine, an AMD EPYC with AVX-512: at most 1.0e-16, AdamW's second moment; 0 for SGD).
const FORMULA_TOL: f64 = 1e-15;
