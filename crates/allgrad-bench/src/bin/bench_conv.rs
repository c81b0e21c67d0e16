//! Conv2d forward / input-gradient / weight-gradient timings: Candle vs allgrad-nn.
//!
//! ```text
//! cargo run --release -p allgrad-bench --bin bench_conv -- [--runs N] [--all | --resnet18] [--only TEXT] [--skip-candle]
//! ```
//!
//! Prints a table and, for `scripts/bench/bench_conv.sh` (which adds PyTorch beside it), one
//! `RESULT layer op impl median_s min_s` line per measurement. Each figure is the median of
//! `--runs` timed runs after one warm-up; Candle's and allgrad's runs alternate so both see the
//! same background load. Default layer: input 128x64x32x32, 64 3x3 filters,
//! padding 1, f32. `--all` adds a stride-2 and a pointwise layer; `--resnet18` runs instead every
//! distinct convolution of the SimCLR step's ResNet-18 (3x3 stem, 32x32 images, 128 views).

use std::time::Instant;

use allgrad_nn::{conv2d, conv2d_backward, ConvParams};
use candle_core::{Device, Result, Tensor, Var};

/// Median and minimum seconds of one measurement.
type Timing = (f64, f64);

/// One benchmarked convolution.
struct Layer {
    name: &'static str,
    x: [usize; 4],
    out: usize,
    k: usize,
    p: ConvParams,
}

/// The SimCLR step's ResNet-18 convolutions at batch 64 (128 views); the same list is in
/// `scripts/bench/bench_conv.py`.
fn resnet18() -> Vec<Layer> {
    let conv = |name, x: [usize; 4], out, k, stride| {
        let p = ConvParams { stride, padding: if k == 3 { 1 } else { 0 }, ..Default::default() };
        Layer { name, x, out, k, p }
    };
    vec![
        conv("r18 stem 3->64 32x32", [128, 3, 32, 32], 64, 3, 1),
        conv("r18 3x3 64->64 32x32", [128, 64, 32, 32], 64, 3, 1),
        conv("r18 3x3/s2 64->128 32x32", [128, 64, 32, 32], 128, 3, 2),
        conv("r18 1x1/s2 64->128 32x32", [128, 64, 32, 32], 128, 1, 2),
        conv("r18 3x3 128->128 16x16", [128, 128, 16, 16], 128, 3, 1),
        conv("r18 3x3/s2 128->256 16x16", [128, 128, 16, 16], 256, 3, 2),
        conv("r18 1x1/s2 128->256 16x16", [128, 128, 16, 16], 256, 1, 2),
        conv("r18 3x3 256->256 8x8", [128, 256, 8, 8], 256, 3, 1),
        conv("r18 3x3/s2 256->512 8x8", [128, 256, 8, 8], 512, 3, 2),
        conv("r18 1x1/s2 256->512 8x8", [128, 256, 8, 8], 512, 1, 2),
        conv("r18 3x3 512->512 4x4", [128, 512, 4, 4], 512, 3, 1),
    ]
}

fn layers(all: bool) -> Vec<Layer> {
    let mut v = vec![Layer {
        name: "3x3 128x64x32x32->64",
        x: [128, 64, 32, 32],
        out: 64,
        k: 3,
        p: ConvParams { padding: 1, ..Default::default() },
    }];
    if all {
        v.push(Layer {
            name: "3x3/s2 128x64x32x32->128",
            x: [128, 64, 32, 32],
            out: 128,
            k: 3,
            p: ConvParams { padding: 1, stride: 2, ..Default::default() },
        });
        v.push(Layer { name: "1x1 128x256x16x16->64", x: [128, 256, 16, 16], out: 64, k: 1, p: ConvParams::default() });
    }
    v
}

type Job<'a> = &'a mut dyn FnMut() -> Result<()>;

/// Seconds of one call.
fn once(f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    let start = Instant::now();
    f()?;
    Ok(start.elapsed().as_secs_f64())
}

/// Median and minimum of a sample.
fn summary(mut t: Vec<f64>) -> Timing {
    t.sort_by(f64::total_cmp);
    (t[t.len() / 2], t[0])
}

/// Times Candle (unless skipped) and allgrad-nn: one warm-up each, then `runs` rounds that run
/// each once, alternating, so both see the same background load on a shared machine.
fn time_pair(runs: usize, mut candle: Option<Job>, ours: Job) -> Result<(Option<Timing>, Timing)> {
    if let Some(c) = candle.as_mut() {
        c()?;
    }
    ours()?;
    let (mut tc, mut ta) = (vec![], vec![]);
    for _ in 0..runs.max(1) {
        if let Some(c) = candle.as_mut() {
            tc.push(once(&mut **c)?);
        }
        ta.push(once(&mut *ours)?);
    }
    Ok(((!tc.is_empty()).then(|| summary(tc)), summary(ta)))
}

/// Candle's own backward formulas for conv2d (as in candle-core's backprop.rs).
fn candle_input_grad(x: &Tensor, w: &Tensor, gy: &Tensor, p: ConvParams) -> Result<Tensor> {
    let (gh, kh) = (gy.dim(2)?, w.dim(2)?);
    let out_size = (gh - 1) * p.stride + p.dilation * (kh - 1) + 1 - 2 * p.padding;
    let out_padding = x.dim(2)? - out_size;
    gy.conv_transpose2d(w, p.padding, out_padding, p.stride, p.dilation)
}

fn candle_weight_grad(x: &Tensor, w: &Tensor, gy: &Tensor, p: ConvParams) -> Result<Tensor> {
    let g = x.transpose(0, 1)?.conv2d(&gy.transpose(0, 1)?, p.padding, p.dilation, p.stride, 1)?.transpose(0, 1)?;
    let (_, _, k0, k1) = w.dims4()?;
    g.narrow(2, 0, k0)?.narrow(3, 0, k1)?.contiguous()
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runs = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.parse().expect("--runs takes a number"))
        .unwrap_or(5);
    let all = args.iter().any(|a| a == "--all");
    let skip_candle = args.iter().any(|a| a == "--skip-candle");
    let dev = Device::Cpu;
    println!("conv2d f32 on CPU, {} rayon threads, median of {runs} runs (seconds)", rayon::current_num_threads());
    println!("{:<26} {:<22} {:>10} {:>10} {:>8}", "layer", "op", "candle", "allgrad", "ratio");
    let list = if args.iter().any(|a| a == "--resnet18") { resnet18() } else { layers(all) };
    // `--only TEXT`: the layers whose name contains TEXT.
    let only = args.iter().position(|a| a == "--only").and_then(|i| args.get(i + 1)).cloned().unwrap_or_default();
    for l in list.into_iter().filter(|l| l.name.contains(&only)) {
        let x = Tensor::rand(-1f32, 1f32, &l.x[..], &dev)?;
        let w = (Tensor::rand(-1f32, 1f32, (l.out, l.x[1] / l.p.groups, l.k, l.k), &dev)? * 0.05)?;
        let y = conv2d(&x, &w, l.p)?;
        let gy = Tensor::rand(-1f32, 1f32, y.shape(), &dev)?;
        let p = l.p;
        let mut rows: Vec<(&str, Option<Timing>, Timing)> = vec![];

        let mut measure = |op: &'static str, candle: Job, ours: Job| -> Result<()> {
            let (c, a) = time_pair(runs, (!skip_candle).then_some(candle), ours)?;
            rows.push((op, c, a));
            Ok(())
        };
        measure("forward", &mut || x.conv2d(&w, p.padding, p.stride, p.dilation, p.groups).map(drop), &mut || {
            conv2d(&x, &w, p).map(drop)
        })?;
        measure("input-grad", &mut || candle_input_grad(&x, &w, &gy, p).map(drop), &mut || {
            conv2d_backward(&x, &w, &gy, p, true, false).map(drop)
        })?;
        measure("weight-grad", &mut || candle_weight_grad(&x, &w, &gy, p).map(drop), &mut || {
            conv2d_backward(&x, &w, &gy, p, false, true).map(drop)
        })?;
        let (xv, wv) = (Var::from_tensor(&x)?, Var::from_tensor(&w)?);
        measure(
            "fwd+bwd (autograd)",
            &mut || {
                let y = xv.as_tensor().conv2d(&wv, p.padding, p.stride, p.dilation, p.groups)?;
                (y * &gy)?.sum_all()?.backward().map(drop)
            },
            &mut || {
                let y = conv2d(&xv, &wv, p)?;
                (y * &gy)?.sum_all()?.backward().map(drop)
            },
        )?;
        for (op, c, a) in rows {
            let (cs, ratio) = match c {
                Some(c) => (format!("{:.3}", c.0), format!("{:.1}x", c.0 / a.0)),
                None => ("-".into(), "-".into()),
            };
            println!("{:<26} {:<22} {:>10} {:>10.3} {:>8}", l.name, op, cs, a.0, ratio);
            if let Some(c) = c {
                println!("RESULT\t{}\t{op}\tcandle\t{:.6}\t{:.6}", l.name, c.0, c.1);
            }
            println!("RESULT\t{}\t{op}\tallgrad\t{:.6}\t{:.6}", l.name, a.0, a.1);
        }
    }
    Ok(())
}
