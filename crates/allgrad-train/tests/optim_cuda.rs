//! The optimizer on CUDA parameters (feature `cuda`): SGD (plain, momentum, Nesterov, weight
//! decay) and AdamW (with and without decoupled weight decay) take allgrad-nn's in-place
//! kernels there, one per pass; after five steps of the same gradients each parameter and
//! state slot equals the CPU optimizer's (f64 1e-10, f32 1e-5, norm-wise through
//! `allgrad_testkit::close`; the kernels evaluate the CPU's expressions in its order, so they
//! are meant to agree far closer). A parameter of each of three shapes (a matrix, a vector, a
//! scalar-like 1-element tensor); LARS, which keeps the composed path, is included as a check
//! of the fallback. Every update is checked to have taken the path it is meant to
//! (`allgrad_train::optim_paths`): the CUDA kernels for SGD and AdamW on CUDA (under
//! ALLGRAD_CUDA_FUSED=0, which turns them off, the test fails saying so), the composed path for
//! LARS.
//!
//! It needs the `cuda` feature and a GPU (`scripts/ci/gpu_ci.sh`). Without either it skips by
//! name, saying why, unless ALLGRAD_REQUIRE_GPU=1, which makes that a failure.

use allgrad_dist::ProcessGroup;
use allgrad_testkit::hashed_values as values;
use allgrad_train::optim::{OptimConfig, Optimizer};
use allgrad_train::{optim_paths, OptimPaths};
use candle_core::{DType, Device, Result, Tensor, Var};

fn gpu() -> Option<Device> {
    if !cfg!(feature = "cuda") {
        allgrad_testkit::skip(allgrad_testkit::Need::Gpu, "this test binary was built without the `cuda` feature");
        return None;
    }
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            allgrad_testkit::skip(allgrad_testkit::Need::Gpu, &format!("no CUDA device ({e})"));
            None
        }
    }
}

const SHAPES: [&[usize]; 3] = [&[17, 33], &[257], &[1]];

/// Five steps of `cfg` on `dev` in `dt` with gradients that differ per step; the parameters and
/// every state slot afterwards, as f64 host vectors in name order, and the optimizer's paths.
/// Tensors by name, as f64 host vectors.
type Named = Vec<(String, Vec<f64>)>;

fn run(cfg: &OptimConfig, dev: &Device, dt: DType) -> Result<(Named, OptimPaths)> {
    let to = |v: Vec<f64>, shape: &[usize]| Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dt)?.to_device(dev);
    let params: Vec<(String, Var)> = SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| Ok((format!("p{i}"), Var::from_tensor(&to(values(s.iter().product(), i as u64), s)?)?)))
        .collect::<Result<_>>()?;
    let mut opt = Optimizer::new(cfg.clone());
    let pg = ProcessGroup::single();
    let before = optim_paths();
    for step in 0..5u64 {
        let grads: Vec<Tensor> = SHAPES
            .iter()
            .enumerate()
            .map(|(i, s)| to(values(s.iter().product(), 100 + 10 * step + i as u64), s))
            .collect::<Result<_>>()?;
        opt.step(&params, &grads, &[false; 3], 0.05 * (step + 1) as f64, &pg)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    }
    let paths = optim_paths().since(before);
    let host = |t: &Tensor| -> Result<Vec<f64>> { t.flatten_all()?.to_dtype(DType::F64)?.to_device(&Device::Cpu)?.to_vec1() };
    let mut out = Vec::new();
    for (name, v) in &params {
        out.push((name.clone(), host(v.as_tensor())?));
    }
    for (key, t) in opt.state() {
        out.push((key.clone(), host(t)?));
    }
    Ok((out, paths))
}

/// Parameter updates in a run: 5 steps of 3 parameters.
const UPDATES: u64 = 15;

#[test]
fn sgd_and_adamw_on_cuda_equal_the_cpu_optimizer() {
    let Some(dev) = gpu() else { return };
    let sgd = |momentum, nesterov, weight_decay| OptimConfig::Sgd { lr: 0.1, momentum, nesterov, weight_decay };
    let adamw = |weight_decay| OptimConfig::Adamw { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay };
    let configs = [
        ("SGD", sgd(0.0, false, 0.0)),
        ("SGD + weight decay", sgd(0.0, false, 5e-4)),
        ("SGD + momentum + weight decay", sgd(0.9, false, 5e-4)),
        ("SGD + Nesterov", sgd(0.9, true, 0.0)),
        ("AdamW", adamw(0.0)),
        ("AdamW + weight decay", adamw(0.05)),
        (
            "LARS (composed path)",
            OptimConfig::Lars { lr: 0.1, momentum: 0.9, weight_decay: 1e-6, trust_coefficient: 0.001, exclude_1d: true },
        ),
    ];
    for (name, cfg) in configs {
        for (dt, rel) in [(DType::F64, 1e-10), (DType::F32, 1e-5)] {
            let (cpu, _) = run(&cfg, &Device::Cpu, dt).unwrap();
            let (cuda, paths) = run(&cfg, &dev, dt).unwrap();
            let lars = matches!(cfg, OptimConfig::Lars { .. });
            let want = if lars {
                OptimPaths { composed: UPDATES, ..Default::default() }
            } else {
                OptimPaths { fused_cuda: UPDATES, ..Default::default() }
            };
            assert_eq!(
                paths, want,
                "{name} {dt:?}: the optimizer's paths on CUDA (ALLGRAD_CUDA_FUSED=0 turns the kernels off: unset it)"
            );
            assert_eq!(
                cpu.iter().map(|(k, _)| k).collect::<Vec<_>>(),
                cuda.iter().map(|(k, _)| k).collect::<Vec<_>>(),
                "{name} {dt:?}: the same parameters and state slots"
            );
            for ((key, c), (_, g)) in cpu.iter().zip(&cuda) {
                allgrad_testkit::close::assert_rel(g, c, rel, &format!("{name} {dt:?} {key}: CUDA vs CPU"));
            }
            eprintln!("{name} {dt:?}: the CUDA optimizer equals the CPU's");
        }
    }
}

/// The guarded step on CUDA ([`Optimizer::step_guarded`]): with the device-side flag 1 each
/// optimizer equals its unguarded CUDA step bit for bit; with the flag 0 (a non-finite step)
/// the kernels, and LARS's composed path, leave every parameter and state slot as it was.
#[test]
fn a_guarded_step_on_cuda_skips_on_a_zero_flag_and_equals_the_plain_step_otherwise() {
    use allgrad_train::optim::RowUpdate;
    let Some(dev) = gpu() else { return };
    let configs = [
        OptimConfig::Sgd { lr: 0.1, momentum: 0.9, nesterov: true, weight_decay: 5e-4 },
        OptimConfig::Adamw { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.05 },
        OptimConfig::Lars { lr: 0.1, momentum: 0.9, weight_decay: 1e-6, trust_coefficient: 0.001, exclude_1d: true },
    ];
    for cfg in configs {
        for dt in [DType::F64, DType::F32] {
            let to = |v: Vec<f64>, s: &[usize]| Tensor::from_vec(v, s, &Device::Cpu)?.to_dtype(dt)?.to_device(&dev);
            let make = || -> Result<Vec<(String, Var)>> {
                SHAPES
                    .iter()
                    .enumerate()
                    .map(|(i, s)| Ok((format!("p{i}"), Var::from_tensor(&to(values(s.iter().product(), i as u64), s)?)?)))
                    .collect()
            };
            let (pa, pb) = (make().unwrap(), make().unwrap());
            let grads: Vec<Tensor> = SHAPES
                .iter()
                .enumerate()
                .map(|(i, s)| to(values(s.iter().product(), 50 + i as u64), s))
                .collect::<Result<_>>()
                .unwrap();
            let (mut oa, mut ob) = (Optimizer::new(cfg.clone()), Optimizer::new(cfg.clone()));
            let pg = ProcessGroup::single();
            let flag = |v: u8| Tensor::new(&[v], &Device::Cpu).unwrap().reshape(()).unwrap().to_device(&dev).unwrap();
            let all = [RowUpdate::All, RowUpdate::All, RowUpdate::All];
            oa.step(&pa, &grads, &[false; 3], 0.1, &pg).unwrap();
            assert!(ob.step_guarded(&pb, &grads, &[false; 3], &all, 0.1, &pg, &flag(1)).unwrap());
            let bits = |t: &Tensor| -> Vec<u64> {
                t.flatten_all()
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap()
                    .into_iter()
                    .map(f64::to_bits)
                    .collect()
            };
            for ((_, a), (_, b)) in pa.iter().zip(&pb) {
                assert_eq!(bits(a.as_tensor()), bits(b.as_tensor()), "{cfg:?} {dt:?}: the guarded step with flag 1 differs");
            }
            let before: Vec<Vec<u64>> = pb.iter().map(|(_, v)| bits(v.as_tensor())).collect();
            let state: Vec<Vec<u64>> = ob.state().values().map(bits).collect();
            assert!(ob.step_guarded(&pb, &grads, &[false; 3], &all, 0.1, &pg, &flag(0)).unwrap());
            assert_eq!(
                pb.iter().map(|(_, v)| bits(v.as_tensor())).collect::<Vec<_>>(),
                before,
                "{cfg:?} {dt:?}: a skipped step moved"
            );
            assert_eq!(
                ob.state().values().map(bits).collect::<Vec<_>>(),
                state,
                "{cfg:?} {dt:?}: a skipped step changed the state"
            );
        }
    }
}
