//! Times one SimCLR training step on the CPU: ResNet-18 (CIFAR stem, width 64) on 2B random
//! 3x32x32 views, projector 512-2048-128, NT-Xent, SGD update — the same step as
//! `scripts/bench_simclr_step.py` runs in PyTorch (`scripts/bench_simclr_step.sh` prints both).
//!
//! ```text
//! cargo run --release --example bench_simclr_step -- 64 256
//! ```

use std::time::Instant;

use allgrad::dist::ProcessGroup;
use allgrad::models::batch_norm::Mode;
use allgrad::models::losses::nt_xent;
use allgrad::models::resnet::{ResNet, ResNetConfig, Stem};
use allgrad::train::params::ParamStore;
use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, Optimizer, SGD};

fn main() -> anyhow::Result<()> {
    // As the train binary does (ALLGRAD_MALLOC_TUNE=0 measures without it).
    allgrad::tune_allocator();
    let batches: Vec<usize> = std::env::args().skip(1).map(|a| a.parse()).collect::<Result<_, _>>()?;
    let batches = if batches.is_empty() { vec![64, 256] } else { batches };
    let pg = ProcessGroup::single();
    let dev = Device::Cpu;
    for b in batches {
        let store = ParamStore::new(0);
        let vb = store.var_builder(DType::F32, &dev);
        let cfg = ResNetConfig { depth: 18, width: 64, in_channels: 3, stem: Stem::Cifar, sync_bn: false };
        let enc = ResNet::new(&cfg, vb.pp("encoder"))?;
        let p1 = candle_nn::linear(512, 2048, vb.pp("proj.0"))?;
        let p2 = candle_nn::linear(2048, 128, vb.pp("proj.1"))?;
        let vars: Vec<_> = store.vars().into_iter().map(|(_, v)| v).collect();
        let mut sgd = SGD::new(vars, 0.1)?;
        let x = Tensor::randn(0f32, 1.0, (2 * b, 3, 32, 32), &dev)?;
        let mut times = Vec::new();
        for step in 0..4 {
            let t = Instant::now();
            let h = enc.forward(&x, Mode { train: true, pg: &pg })?;
            let z = p2.forward(&p1.forward(&h)?.relu()?)?;
            let loss = nt_xent(&z.narrow(0, 0, b)?, &z.narrow(0, b, b)?, 0.5, &pg)?;
            sgd.backward_step(&loss)?;
            let s = t.elapsed().as_secs_f64();
            if step > 0 {
                times.push(s); // the first step warms up allocations
            }
        }
        times.sort_by(f64::total_cmp);
        println!("allgrad batch {b} ({} views): {:.3} s per step (median of {})", 2 * b, times[times.len() / 2], times.len());
    }
    Ok(())
}
