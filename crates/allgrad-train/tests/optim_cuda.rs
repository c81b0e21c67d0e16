//! The optimizer on CUDA parameters (feature `cuda`): SGD (plain, momentum, Nesterov, weight
//! decay) and AdamW (with and without decoupled weight decay) take allgrad-nn's in-place
//! kernels there, one per pass; after five steps of the same gradients each parameter and
//! state slot equals the CPU optimizer's (f64 1e-10, f32 1e-5, relative to the largest
//! magnitude; the kernels evaluate the CPU's expressions in its order, so they are meant to
//! agree far closer). A parameter of each of three shapes (a matrix, a vector, a scalar-like 1-element
//! tensor); LARS, which keeps the composed path, is included as a check of the fallback.
//!
//! Built only with the `cuda` feature; it needs a GPU (`scripts/gpu_ci.sh`). Without one it
//! skips, saying why, unless ALLGRAD_REQUIRE_GPU=1, which makes that a failure.
#![cfg(feature = "cuda")]

use allgrad_dist::ProcessGroup;
use allgrad_testkit::hashed_values as values;
use allgrad_train::optim::{OptimConfig, Optimizer};
use candle_core::{DType, Device, Result, Tensor, Var};

fn gpu() -> Option<Device> {
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
/// every state slot afterwards, as f64 host vectors in name order.
fn run(cfg: &OptimConfig, dev: &Device, dt: DType) -> Result<Vec<(String, Vec<f64>)>> {
    let to = |v: Vec<f64>, shape: &[usize]| Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dt)?.to_device(dev);
    let params: Vec<(String, Var)> = SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| Ok((format!("p{i}"), Var::from_tensor(&to(values(s.iter().product(), i as u64), s)?)?)))
        .collect::<Result<_>>()?;
    let mut opt = Optimizer::new(cfg.clone());
    let pg = ProcessGroup::single();
    for step in 0..5u64 {
        let grads: Vec<Tensor> = SHAPES
            .iter()
            .enumerate()
            .map(|(i, s)| to(values(s.iter().product(), 100 + 10 * step + i as u64), s))
            .collect::<Result<_>>()?;
        opt.step(&params, &grads, &[false; 3], 0.05 * (step + 1) as f64, &pg)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    }
    let host = |t: &Tensor| -> Result<Vec<f64>> { t.flatten_all()?.to_dtype(DType::F64)?.to_device(&Device::Cpu)?.to_vec1() };
    let mut out = Vec::new();
    for (name, v) in &params {
        out.push((name.clone(), host(v.as_tensor())?));
    }
    for (key, t) in opt.state() {
        out.push((key.clone(), host(t)?));
    }
    Ok(out)
}

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
            let cpu = run(&cfg, &Device::Cpu, dt).unwrap();
            let cuda = run(&cfg, &dev, dt).unwrap();
            assert_eq!(
                cpu.iter().map(|(k, _)| k).collect::<Vec<_>>(),
                cuda.iter().map(|(k, _)| k).collect::<Vec<_>>(),
                "{name} {dt:?}: the same parameters and state slots"
            );
            for ((key, c), (_, g)) in cpu.iter().zip(&cuda) {
                let scale = c.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-300);
                let worst = c.iter().zip(g).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
                assert!(worst <= rel * scale, "{name} {dt:?} {key}: max |CUDA - CPU| = {worst:e} > {rel:e} x {scale:e}");
            }
            eprintln!("{name} {dt:?}: the CUDA optimizer equals the CPU's");
        }
    }
}
