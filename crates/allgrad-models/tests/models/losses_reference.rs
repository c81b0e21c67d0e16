//! The distributed losses against an independent reference: values and input gradients that
//! PyTorch computes (float64) with its own textbook formulations (`scripts/reference/ref_losses.py`:
//! NT-Xent as a masked cross-entropy over the 2N x 2N similarity matrix; cross-correlation
//! with `F.batch_norm` standardisation), pasted below. Each loss is checked on one rank with
//! the whole batch and on 2 and 3 thread-ranks with the rows split: the mean of the per-rank
//! losses is the reference loss, and each rank's gradient, scaled by 1/W as the trainer
//! does, is the reference gradient of its rows (f64, relative 1e-10). A wrong mask, positive
//! index, normalisation, statistic or weighting changes these numbers, which comparing world
//! sizes with each other cannot see. The tiled NT-Xent (`loss.tile`) is held to the same
//! values, and a learned temperature to PyTorch's gradient of it.

use allgrad_dist::{run_threads, ProcessGroup};
use allgrad_models::losses::{cross_correlation, nt_xent, nt_xent_tiled, LossConfig};
use candle_core::{Device, Result, Tensor, Var};

const N: usize = 6;
const D: usize = 5;

/// The two views, as `scripts/reference/ref_losses.py` builds them.
fn views() -> (Vec<f64>, Vec<f64>) {
    let z1 = (0..N * D).map(|k| ((k / D) as f64 * 0.9 + (k % D) as f64 * 0.4 + 0.3).sin() + 0.1 * (k % D) as f64);
    let z2 = (0..N * D).map(|k| ((k / D) as f64 * 0.5 - (k % D) as f64 * 0.7).cos() + 0.05 * ((k / D) * (k % D)) as f64);
    (z1.collect(), z2.collect())
}

/// Whether every rank computes the same (global) loss, or each its own anchors' share.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Local,
    Replicated,
}

/// Runs `loss` on `w` thread-ranks, rank r holding rows `r * N / w ..` of both views; returns
/// the per-rank losses and the gradients of both views (rank order, each scaled by 1/w).
fn run<F>(w: usize, loss: F) -> (Vec<f64>, Vec<f64>, Vec<f64>)
where
    F: Fn(&Tensor, &Tensor, &ProcessGroup) -> Result<Tensor> + Sync,
{
    let (z1, z2) = views();
    let rows = N / w;
    let per_rank = run_threads(w, |pg| {
        let part =
            |v: &[f64]| Var::from_vec(v[pg.rank() * rows * D..(pg.rank() + 1) * rows * D].to_vec(), (rows, D), &Device::Cpu);
        let (a, b) = (part(&z1)?, part(&z2)?);
        let l = loss(a.as_tensor(), b.as_tensor(), &pg)?;
        let grads = l.backward()?;
        let grad = |v: &Var| -> Result<Vec<f64>> {
            let g = grads.get(v).ok_or_else(|| candle_core::Error::Msg("an input got no gradient".into()))?;
            (g / w as f64)?.flatten_all()?.to_vec1::<f64>()
        };
        Ok((l.to_scalar::<f64>()?, grad(&a)?, grad(&b)?))
    })
    .unwrap();
    let mut out = (Vec::new(), Vec::new(), Vec::new());
    for (l, g1, g2) in per_rank {
        out.0.push(l);
        out.1.extend(g1);
        out.2.extend(g2);
    }
    out
}

/// `got` equals `want` within relative 1e-10, norm-wise (`allgrad_testkit::close`).
fn assert_close(got: &[f64], want: &[[f64; D]; N], what: &str) {
    let want: Vec<f64> = want.iter().flatten().copied().collect();
    assert!(want.iter().any(|v| *v != 0.0), "{what}: the reference gradient is zero");
    allgrad_testkit::close::assert_rel(got, &want, 1e-10, &format!("{what} vs PyTorch"));
}

/// The loss and both gradients match the reference on 1, 2 and 3 ranks.
fn check<F>(kind: Kind, loss: F, want_loss: f64, want_g1: &[[f64; D]; N], want_g2: &[[f64; D]; N])
where
    F: Fn(&Tensor, &Tensor, &ProcessGroup) -> Result<Tensor> + Sync,
{
    for w in [1, 2, 3] {
        let (losses, g1, g2) = run(w, &loss);
        let mean = losses.iter().sum::<f64>() / w as f64;
        assert!((mean - want_loss).abs() <= 1e-10 * want_loss.abs(), "W={w}: mean loss {mean}, PyTorch {want_loss}");
        if kind == Kind::Replicated {
            for (r, l) in losses.iter().enumerate() {
                assert!((l - want_loss).abs() <= 1e-10 * want_loss.abs(), "W={w}: rank {r}'s loss {l}, PyTorch {want_loss}");
            }
        }
        assert_close(&g1, want_g1, &format!("W={w}: dL/dz1"));
        assert_close(&g2, want_g2, &format!("W={w}: dL/dz2"));
    }
}

#[test]
fn nt_xent_matches_pytorch_on_one_two_and_three_ranks() {
    check(Kind::Local, |a, b, pg| nt_xent(a, b, 0.5, pg), NT_XENT_T05_LOSS, &NT_XENT_T05_GRAD_Z1, &NT_XENT_T05_GRAD_Z2);
}

#[test]
fn default_loss_config_is_nt_xent_at_temperature_0_2_and_matches_pytorch() {
    let cfg = LossConfig::default();
    check(Kind::Local, |a, b, pg| cfg.compute(a, b, pg), NT_XENT_T02_LOSS, &NT_XENT_T02_GRAD_Z1, &NT_XENT_T02_GRAD_Z2);
}

#[test]
fn cross_correlation_matches_pytorch_on_one_two_and_three_ranks() {
    check(Kind::Replicated, |a, b, pg| cross_correlation(a, b, 0.005, pg), CC_L0005_LOSS, &CC_L0005_GRAD_Z1, &CC_L0005_GRAD_Z2);
}

#[test]
fn cross_correlation_config_with_lambda_and_scale_matches_pytorch() {
    let cfg = LossConfig::CrossCorrelation { lambda: 0.3, scale: 0.125, tile: None };
    check(Kind::Replicated, |a, b, pg| cfg.compute(a, b, pg), CC_L03_S0125_LOSS, &CC_L03_S0125_GRAD_Z1, &CC_L03_S0125_GRAD_Z2);
}

#[test]
fn tiled_nt_xent_matches_pytorch_on_one_two_and_three_ranks_for_tiles_1_5_12_and_30() {
    for tile in [1, 5, 2 * N, 30] {
        let loss = |a: &Tensor, b: &Tensor, pg: &ProcessGroup| nt_xent_tiled(a, b, 0.5, tile, pg);
        check(Kind::Local, loss, NT_XENT_T05_LOSS, &NT_XENT_T05_GRAD_Z1, &NT_XENT_T05_GRAD_Z2);
    }
    let cfg = LossConfig::NtXent { temperature: 0.2, tile: Some(7), queue: None };
    check(Kind::Local, |a, b, pg| cfg.compute(a, b, pg), NT_XENT_T02_LOSS, &NT_XENT_T02_GRAD_Z1, &NT_XENT_T02_GRAD_Z2);
}

/// The gradient of a learned temperature (a scalar tensor), untiled and tiled, on 1, 2 and 3
/// ranks (each rank's scaled by 1/W and summed, as the trainer sums replicated gradients).
#[test]
fn a_learned_temperature_gets_pytorchs_gradient_untiled_and_tiled() {
    for (t, want_loss, want_grad) in [(0.5, NT_XENT_T05_LOSS, NT_XENT_T05_GRAD_T), (0.2, NT_XENT_T02_LOSS, NT_XENT_T02_GRAD_T)] {
        for tile in [None, Some(1), Some(5), Some(2 * N)] {
            for w in [1, 2, 3] {
                let (z1, z2) = views();
                let rows = N / w;
                let per_rank = run_threads(w, |pg| {
                    let part = |v: &[f64]| {
                        Tensor::from_vec(v[pg.rank() * rows * D..(pg.rank() + 1) * rows * D].to_vec(), (rows, D), &Device::Cpu)
                    };
                    let temperature = Var::from_vec(vec![t], (), &Device::Cpu)?;
                    let (a, b) = (part(&z1)?, part(&z2)?);
                    let l = match tile {
                        None => nt_xent(&a, &b, temperature.as_tensor(), &pg)?,
                        Some(tile) => nt_xent_tiled(&a, &b, temperature.as_tensor(), tile, &pg)?,
                    };
                    let g = (&l / w as f64)?.backward()?.get(&temperature).expect("a temperature gradient").to_scalar::<f64>()?;
                    Ok((l.to_scalar::<f64>()?, g))
                })
                .unwrap();
                let loss = per_rank.iter().map(|r| r.0).sum::<f64>() / w as f64;
                let grad: f64 = per_rank.iter().map(|r| r.1).sum();
                let what = format!("t={t} tile={tile:?} W={w}");
                assert!((loss - want_loss).abs() <= 1e-10 * want_loss.abs(), "{what}: loss {loss}, PyTorch {want_loss}");
                assert!((grad - want_grad).abs() <= 1e-10 * want_grad.abs(), "{what}: dL/dt {grad}, PyTorch {want_grad}");
            }
        }
    }
}

/// The reference tells pairings apart: pairing sample i's first view with sample i+1's
/// second view (a wrong positive index) moves the loss far beyond the tolerance.
#[test]
fn nt_xent_with_shifted_positives_does_not_match_pytorch() {
    let (losses, _, _) =
        run(1, |a, b, pg| nt_xent(a, &Tensor::cat(&[&b.narrow(0, 1, N - 1)?, &b.narrow(0, 0, 1)?], 0)?, 0.5, pg));
    assert!((losses[0] - NT_XENT_T05_LOSS).abs() > 1e-3, "shifted pairs gave {}, the reference {NT_XENT_T05_LOSS}", losses[0]);
}

// Printed by `python3 scripts/reference/ref_losses.py` (torch 2.15.0+cu132, float64).
// nt_xent(z1, z2, 0.5, pg)
const NT_XENT_T05_LOSS: f64 = 3.124052149780027;
const NT_XENT_T05_GRAD_Z1: [[f64; 5]; 6] = [
    [-0.09050272125492184, -0.06565609799000262, -0.017614249262478815, 0.026725828735838633, 0.0446794756069195],
    [-0.05318330139288948, -0.039453401330633645, -0.002113836649871445, 0.042268464269692795, 0.0735581617523391],
    [0.042040889551462374, -0.014152947096953108, -0.05208791034730009, -0.058904841861903826, -0.03738864000450694],
    [-0.07804841813586473, -0.08470191271156242, -0.06769185636303679, -0.013831020125520121, 0.06391428609411862],
    [0.10175277458913208, 0.03807373317001651, -0.029441817008695206, -0.0774351661290968, -0.09506221788313926],
    [0.007912433021473148, -0.048653617274516954, -0.10619460785469446, -0.14249116302341316, -0.14151778461163295],
];
const NT_XENT_T05_GRAD_Z2: [[f64; 5]; 6] = [
    [-0.04158684476279043, -0.06659965080384003, -0.07325989257545518, -0.07215791989648868, -0.0727516152522923],
    [-2.3941759384471517e-06, -0.007478723361970639, -0.029426232528083032, -0.05749539398548466, -0.07696174842635056],
    [-0.0759008431216622, -0.02407901340198232, 0.019110937362615304, 0.04633238460867379, 0.05833653035184153],
    [-0.00781481989886191, -0.023637727014047566, -0.020452590887595462, 0.006439602620743778, 0.04477303609889366],
    [0.09491957243923255, 0.07238672541548827, 0.03670197505712962, 0.0007830455035677808, -0.027100451480723958],
    [0.08820249219611156, 0.08698147566395871, 0.06575330071404767, 0.027281292649332507, -0.020257857771188773],
];
// The gradient of the temperature (printed by the same script, below its case's gradients).
const NT_XENT_T05_GRAD_T: f64 = -2.3499185686931487;
// LossConfig::default() (NT-Xent, temperature 0.2)
const NT_XENT_T02_LOSS: f64 = 5.247847322747105;
const NT_XENT_T02_GRAD_Z1: [[f64; 5]; 6] = [
    [-0.2515505068612321, -0.17982686146605784, -0.04603915412318357, 0.07466002051216947, 0.119985025411592],
    [-0.13938498345297384, -0.09842602599803957, -0.001350860410310177, 0.10867599044271128, 0.18180972207076668],
    [0.1080898906025233, -0.029456196901433994, -0.15127166281179322, -0.20663550053948168, -0.17800046235817563],
    [-0.2987268745069312, -0.30111602114239855, -0.2221662397082178, -0.03894175425612123, 0.19949546194304868],
    [0.23760967786418002, 0.08270682444293531, -0.07377813619993578, -0.17591964730860798, -0.20230535206615446],
    [0.030756709323269567, -0.16742779904246757, -0.35701339879297134, -0.473026114680304, -0.4738450902828773],
];
const NT_XENT_T02_GRAD_Z2: [[f64; 5]; 6] = [
    [-0.10499669420259078, -0.17595587187510014, -0.19364147962754674, -0.18805769681909723, -0.18843499438489245],
    [0.034647570589819064, -0.03105393312072973, -0.11510350826223865, -0.19173252221414575, -0.23119939511279006],
    [-0.17532982043818468, -0.058921446835281346, 0.04264252659451389, 0.11148959971038526, 0.14519884307107067],
    [-0.03255407420141758, -0.07544649157802158, -0.060087778218034626, 0.022285678326100566, 0.13322904275722358],
    [0.22618482385236666, 0.16582852949403407, 0.08106891860070525, 0.0018168497196719424, -0.05721432257187781],
    [0.21656897307911827, 0.2131739773202813, 0.16203080778601317, 0.06804562649064388, -0.05092597243080325],
];
const NT_XENT_T02_GRAD_T: f64 = -19.294452616225733;
// cross_correlation(z1, z2, 0.005, pg)
const CC_L0005_LOSS: f64 = 9.437382320429137;
const CC_L0005_GRAD_Z1: [[f64; 5]; 6] = [
    [-0.04067540660446919, 0.04188684598204954, 0.7793116431035455, 0.25317821474316843, 0.3712706529469193],
    [0.0012752079058412304, 0.008439421949356802, -0.36801134622389314, -0.08458199673649236, 0.42642260993179487],
    [0.019723040263659997, -0.031184739213771157, -0.6433412095629331, 0.14578258741425068, 0.5335433441984465],
    [0.011917979306989132, -0.05510312324983098, -0.3097377505162172, 0.3655742187466157, 0.32033793215922896],
    [-0.00048289319988974514, -0.028371790293380973, 0.14495125578629744, 0.06762307384349793, -0.36414399760357125],
    [0.00824207232786859, 0.06433338482557677, 0.3968274074132007, -0.7475760980110405, -1.2874305416328187],
];
const CC_L0005_GRAD_Z2: [[f64; 5]; 6] = [
    [0.04410975265473109, -0.09682298162096126, 0.4689228169136989, 0.010059164597870965, -0.40913273699619984],
    [-0.011702337652122089, -0.0753358347565125, -1.3282501900644197, -0.21472765732113194, -0.08151777161697665],
    [-0.03493562234147347, 0.011755009047060755, -1.2205692392496068, 0.1291949538324082, 0.3977347610588101],
    [-0.018886442558756007, 0.10720789484716481, -0.02159056949724409, 0.4455140345018526, 0.5551789368919595],
    [0.009153884413125384, 0.10623473362005631, 0.9983508197719443, 0.21177662578276513, 0.15252138472431595],
    [0.012260765484495116, -0.05303882113680829, 1.1031363621256256, -0.5818171213937652, -0.614784574061909],
];
// LossConfig::CrossCorrelation { lambda: 0.3, scale: 0.125 }
const CC_L03_S0125_LOSS: f64 = 1.6205128275844292;
const CC_L03_S0125_GRAD_Z1: [[f64; 5]; 6] = [
    [0.03577049463433799, 0.04882182047364124, 0.10478967053363773, 0.04136668044471054, 0.0629373863371935],
    [-0.0013862432443203813, -0.011219703410566818, -0.05424202285943654, -0.01151486985336461, 0.05989330728336922],
    [-0.017190732994684564, -0.02964142340579282, -0.07424967139044551, 0.029711221291642182, 0.07999730521818774],
    [-0.01028275029167015, -0.014959257811295359, -0.01472577357763822, 0.06567088138481394, 0.05246258003059676],
    [0.0004209167260088406, 0.0040980567179686135, 0.02995994577486151, 0.010120511929047985, -0.054322319688282994],
    [-0.007331684829671746, 0.0029005074360451354, 0.008467851519021097, -0.13535442519684998, -0.20096825918106423],
];
const CC_L03_S0125_GRAD_Z2: [[f64; 5]; 6] = [
    [0.019693487500733135, 0.02793888078007524, 0.08157637602526113, 0.020606848708127783, -0.038894153993597906],
    [0.01585242079983165, 0.021051042624116386, -0.21706020526834197, -0.046353272064702994, -0.024931270700529227],
    [-0.015070481867723355, -0.003838984966138005, -0.19133176868866825, -0.000752591059912785, 0.039996662056657535],
    [-0.038567224055745614, -0.030194239946961052, 0.0062332068717812095, 0.06182108592721873, 0.07931892793510412],
    [-0.021393827189293113, -0.02943385622839087, 0.16014896540149154, 0.042562934974376035, 0.033765556565629094],
    [0.0394856248121973, 0.014477157737298338, 0.16043342565847613, -0.07788500648510677, -0.08925572186326361],
];
