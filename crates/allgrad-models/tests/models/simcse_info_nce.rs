//! SimCSE's InfoNCE over the global batch: world-size invariance (W = 2, 3, 4; uneven
//! splits too), values and gradients against PyTorch (scripts/reference/ref_info_nce.py, f64), also for
//! the tiled forms and a learned temperature, and the "put the local tensor back" gather of
//! public SimCSE code giving 1/W of the gradient.

use allgrad_dist::testing::check_world_size_invariance;
use allgrad_dist::{run_threads, ProcessGroup};
use allgrad_models::losses::{l2_normalize, logsumexp};
use allgrad_models::simcse::{info_nce, info_nce_hard_negatives, info_nce_hard_negatives_tiled, info_nce_tiled};
use candle_core::{Device, Result, Tensor, Var};

const T: f64 = 0.05;

/// Rows of different lengths and directions per rank (asymmetric data).
fn features(rows: usize, cols: usize) -> Tensor {
    let v: Vec<f64> =
        (0..rows * cols).map(|j| ((j as f64) * 0.37).sin() * (1.0 + (j % 7) as f64 * 0.3) + 0.05 * (j / cols) as f64).collect();
    Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
}

fn unsup(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    let d = x.dim(1)? / 2;
    info_nce(&x.narrow(1, 0, d)?, &x.narrow(1, d, d)?, T, pg)
}

fn sup(x: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    let d = x.dim(1)? / 3;
    info_nce_hard_negatives(&x.narrow(1, 0, d)?, &x.narrow(1, d, d)?, &x.narrow(1, 2 * d, d)?, T, 0.7, pg)
}

#[test]
fn unsupervised_info_nce_is_world_size_invariant() {
    for rows in [12, 10] {
        for r in check_world_size_invariance(&features(rows, 16), &[2, 3, 4], unsup).unwrap() {
            r.assert_close(1e-10).unwrap();
        }
    }
}

#[test]
fn supervised_info_nce_with_hard_negatives_is_world_size_invariant() {
    for rows in [12, 10] {
        for r in check_world_size_invariance(&features(rows, 24), &[2, 3, 4], sup).unwrap() {
            r.assert_close(1e-10).unwrap();
        }
    }
}

/// The reference script's inputs: x[i, k] = sin(0.7 (i d + k) + phase) + 0.1 k, 6 x 4.
fn script_input(phase: f64) -> Var {
    let v: Vec<f64> = (0..24).map(|j| (0.7 * j as f64 + phase).sin() + 0.1 * (j % 4) as f64).collect();
    Var::from_tensor(&Tensor::from_vec(v, (6, 4), &Device::Cpu).unwrap()).unwrap()
}

/// Within `tol` of PyTorch's gradient, norm-wise (`allgrad_testkit::close`).
fn assert_grad(name: &str, grads: &candle_core::backprop::GradStore, v: &Var, want: &[f64], tol: f64) {
    let g = grads.get(v).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    allgrad_testkit::close::assert_rel(&g, want, tol, &format!("{name} vs PyTorch"));
}

#[test]
fn info_nce_values_and_gradients_match_pytorch() {
    run_threads(1, |pg| {
        let (a, p, n) = (script_input(0.0), script_input(1.3), script_input(2.9));
        let l = info_nce(&a, &p, T, &pg)?;
        assert!((l.to_scalar::<f64>()? - UNSUP_LOSS).abs() < 1e-12 * UNSUP_LOSS);
        let g = l.backward()?;
        assert_grad("unsupervised anchors", &g, &a, &UNSUP_GRAD_A, 1e-12);
        assert_grad("unsupervised positives", &g, &p, &UNSUP_GRAD_P, 1e-12);
        let l = info_nce_hard_negatives(&a, &p, &n, T, 0.5, &pg)?;
        assert!((l.to_scalar::<f64>()? - SUP_LOSS).abs() < 1e-12 * SUP_LOSS);
        let g = l.backward()?;
        assert_grad("supervised anchors", &g, &a, &SUP_GRAD_A, 1e-12);
        assert_grad("supervised positives", &g, &p, &SUP_GRAD_P, 1e-12);
        assert_grad("supervised hard negatives", &g, &n, &SUP_GRAD_N, 1e-12);
        Ok(())
    })
    .unwrap();
}

#[test]
fn tiled_info_nce_and_a_learned_temperature_match_pytorch() {
    run_threads(1, |pg| {
        for tile in [None, Some(1), Some(4), Some(6), Some(12), Some(20)] {
            let (a, p, n) = (script_input(0.0), script_input(1.3), script_input(2.9));
            let t = Var::from_vec(vec![T], (), &Device::Cpu)?;
            let what = |x: &str| format!("{x}, tile {tile:?}");
            let l = match tile {
                None => info_nce(&a, &p, t.as_tensor(), &pg)?,
                Some(tile) => info_nce_tiled(&a, &p, t.as_tensor(), tile, &pg)?,
            };
            assert_close(l.to_scalar::<f64>()?, UNSUP_LOSS, &what("unsupervised loss"));
            let g = l.backward()?;
            assert_grad(&what("unsupervised anchors"), &g, &a, &UNSUP_GRAD_A, 1e-10);
            assert_grad(&what("unsupervised positives"), &g, &p, &UNSUP_GRAD_P, 1e-10);
            assert_close(g.get(&t).unwrap().to_scalar::<f64>()?, UNSUP_GRAD_T, &what("unsupervised temperature"));
            let l = match tile {
                None => info_nce_hard_negatives(&a, &p, &n, t.as_tensor(), 0.5, &pg)?,
                Some(tile) => info_nce_hard_negatives_tiled(&a, &p, &n, t.as_tensor(), 0.5, tile, &pg)?,
            };
            assert_close(l.to_scalar::<f64>()?, SUP_LOSS, &what("supervised loss"));
            let g = l.backward()?;
            assert_grad(&what("supervised anchors"), &g, &a, &SUP_GRAD_A, 1e-10);
            assert_grad(&what("supervised positives"), &g, &p, &SUP_GRAD_P, 1e-10);
            assert_grad(&what("supervised hard negatives"), &g, &n, &SUP_GRAD_N, 1e-10);
            assert_close(g.get(&t).unwrap().to_scalar::<f64>()?, SUP_GRAD_T, &what("supervised temperature"));
        }
        Ok(())
    })
    .unwrap();
}

fn assert_close(got: f64, want: f64, what: &str) {
    allgrad_testkit::close::assert_elem_rel(&[got], &[want], 1e-10, f64::MIN_POSITIVE, &format!("{what} vs PyTorch"));
}

/// The global-batch InfoNCE of public SimCSE code, computed on every rank from a gather
/// without backward in which the rank's own slot is replaced by its local tensor.
fn put_back_loss(a: &Tensor, p: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    let gather = |x: &Tensor| -> Result<Tensor> {
        let all = pg.all_gather(&x.detach())?; // no backward
        let b = x.dim(0)?;
        let r = pg.rank();
        let mut parts = Vec::new();
        for k in 0..pg.world_size() {
            parts.push(if k == r { x.clone() } else { all.narrow(0, k * b, b)? });
        }
        Tensor::cat(&parts, 0)
    };
    let (a, p) = (l2_normalize(&gather(a)?)?, l2_normalize(&gather(p)?)?);
    let logits = (a.matmul(&p.t()?)? / T)?;
    let n = logits.dim(0)?;
    let idx = Tensor::from_vec((0..n as u32).collect::<Vec<_>>(), (n, 1), logits.device())?;
    (logsumexp(&logits)? - logits.gather(&idx, 1)?.squeeze(1)?)?.mean_all()
}

/// Gradient of a shared projection θ (`[d, d]`) after a data-parallel step: each rank's
/// backward scaled by 1/W, then summed over ranks (DDP's average).
fn ddp_grad(w: usize, loss: fn(&Tensor, &Tensor, &ProcessGroup) -> Result<Tensor>) -> Vec<f64> {
    let data = features(12, 16);
    let per_rank = run_threads(w, |pg| {
        let theta = Var::from_tensor(&features(8, 8).affine(0.2, 0.0)?)?;
        let b = 12 / w;
        let x = data.narrow(0, pg.rank() * b, b)?;
        let a = x.narrow(1, 0, 8)?.matmul(theta.as_tensor())?;
        let p = x.narrow(1, 8, 8)?.matmul(theta.as_tensor())?;
        let g = (loss(&a, &p, &pg)? / w as f64)?.backward()?;
        g.get(&theta).unwrap().flatten_all()?.to_vec1::<f64>()
    })
    .unwrap();
    (0..64).map(|k| per_rank.iter().map(|g| g[k]).sum()).collect()
}

fn allgrad_form(a: &Tensor, p: &Tensor, pg: &ProcessGroup) -> Result<Tensor> {
    info_nce(a, p, T, pg)
}

#[test]
fn put_back_gather_gives_one_over_w_of_the_gradient_and_the_local_loss_form_all_of_it() {
    let truth = ddp_grad(1, allgrad_form);
    assert!(truth.iter().any(|g| g.abs() > 1e-3));
    for w in [2, 3] {
        let ours = ddp_grad(w, allgrad_form);
        let put_back = ddp_grad(w, put_back_loss);
        use allgrad_testkit::close::assert_rel;
        assert_rel(&ours[..64], &truth[..64], 1e-10, &format!("W={w}: local-loss form vs the true gradient"));
        let times_w: Vec<f64> = put_back[..64].iter().map(|g| g * w as f64).collect();
        assert_rel(&times_w, &truth[..64], 1e-10, &format!("W={w}: put-back x W vs the true gradient"));
    }
}

// (scripts/reference/ref_info_nce.py)
const UNSUP_LOSS: f64 = 12.629997280316955;
const UNSUP_GRAD_A: [f64; 24] = [
    -1.1391005375963463,
    -0.783071322033641,
    -0.08784014343160856,
    0.5905261960863617,
    2.2562912458078763,
    2.2455242038282712,
    1.0822891923518094,
    -0.7826890358285581,
    -0.4634175929706044,
    -0.47481400084163355,
    -0.2823985336950813,
    0.0038322389437568383,
    0.3834441349610036,
    1.558227372161468,
    1.8995554111737647,
    1.1462998247663843,
    -0.9016279494226986,
    -2.1429136350840263,
    -2.373961684409104,
    -1.4837147197679457,
    -1.0275679752662157,
    0.4067929554358516,
    1.5414684582062392,
    1.7344385696233064,
];
const UNSUP_GRAD_P: [f64; 24] = [
    1.2215619553535464,
    -0.16384491233455745,
    -1.4660944135339253,
    -2.066619715550331,
    -1.5487637139801333,
    0.7079186520132905,
    2.5465339854385456,
    3.017230936836408,
    0.9762508099705993,
    0.4489285092257052,
    -0.3144026430382137,
    -0.9796068374618893,
    -2.0514950744007456,
    -0.8165798064273713,
    0.6695530061481805,
    1.5751191823338277,
    0.5993658756785553,
    0.48686478972428493,
    0.11725443274753733,
    -0.36376082198733384,
    -1.5180902381212724,
    -1.391553723175699,
    -0.6977543499896304,
    0.14979659391751854,
];
const UNSUP_GRAD_T: f64 = -248.5089755310194;
const SUP_LOSS: f64 = 15.355979486054002;
const SUP_GRAD_A: [f64; 24] = [
    -1.1990513779710674,
    -0.8271841161810749,
    -0.09464307211001521,
    0.6256824222786905,
    2.0275646553409565,
    2.0330298478647144,
    0.9849584534181482,
    -0.7210960571751315,
    -0.9455891170944538,
    -0.9997755716387655,
    -0.6054893496845851,
    0.030093180923422058,
    0.32636197839365044,
    1.4853209889530767,
    1.816070781991467,
    1.033415014099071,
    -0.4953876581272507,
    -1.0824751647851156,
    -1.188700377577807,
    -0.7923466093884637,
    -0.9325912506149512,
    0.3701289778041299,
    1.3933879153960476,
    1.5505470458083126,
];
const SUP_GRAD_P: [f64; 24] = [
    0.8172538817543012,
    -0.10134179640101261,
    -0.9895958637787042,
    -1.4470695727174083,
    -0.9599535077480359,
    0.42920050219521805,
    1.5129408665550745,
    1.678013615104641,
    0.9763417302269597,
    0.44924264382922463,
    -0.31429463409279335,
    -0.9803189476547534,
    -2.0544151866935785,
    -0.8178238859693615,
    0.6704734928237703,
    1.5775781627981866,
    1.1813372096899033,
    0.9355831785499322,
    0.21257598713887782,
    -0.684876557632264,
    -2.3133604487366592,
    -2.157162903715755,
    -1.0944634962053212,
    0.26688807957804905,
];
const SUP_GRAD_N: [f64; 24] = [
    0.14439527766136112,
    0.12018800473844049,
    0.04095036159347776,
    -0.05455502368430143,
    -0.04211705384367237,
    -0.04535899270697216,
    -0.025957485131949065,
    0.008273040126363096,
    0.10302255948047234,
    0.23560048189013583,
    0.2547631068226803,
    0.1488892428629276,
    -0.0434337465794683,
    -0.08940723978247578,
    -0.09179672851844733,
    -0.04794401632739409,
    -0.025963537827612848,
    0.017291291443797374,
    0.051795891897852275,
    0.0607043465242952,
    -0.00864601409335556,
    0.01562779679833813,
    0.03283096629953716,
    0.035151930621713616,
];
const SUP_GRAD_T: f64 = -297.33901098918614;
