//! The VarBuilder constructors: `Conv2d::from_vb` and `LayerNorm::from_vb` create their
//! parameters under the expected names and shapes with the documented initialisation, and
//! their forward equals an independent computation (Candle's own `conv2d` for the
//! convolution, a plain f64 loop for the layer norm).

use allgrad_nn::{Conv2d, ConvParams, LayerNorm, LayerNormConfig};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

use crate::common::{rand_tensor, rel_err, to_f64_vec};

fn param(map: &VarMap, name: &str) -> Tensor {
    let data = map.data().lock().unwrap();
    data.get(name)
        .unwrap_or_else(|| panic!("no parameter {name}; have {:?}", data.keys().collect::<Vec<_>>()))
        .as_tensor()
        .clone()
}

#[test]
fn conv2d_from_vb_names_shapes_init_and_forward() {
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let params = ConvParams { stride: 2, padding: 1, dilation: 1, groups: 2 };
    let conv = Conv2d::from_vb(4, 6, 3, params, true, vb.pp("conv")).unwrap();
    let (w, b) = (param(&map, "conv.weight"), param(&map, "conv.bias"));
    assert_eq!(w.dims(), &[6, 2, 3, 3]);
    assert_eq!(b.dims(), &[6]);
    assert_eq!(map.data().lock().unwrap().len(), 2, "exactly weight and bias");
    // Bias uniform in ±1/sqrt(in_channels) = ±0.5; the weight not constant.
    assert!(to_f64_vec(&b).iter().all(|v| v.abs() <= 0.5), "bias outside ±0.5: {b}");
    let wv = to_f64_vec(&w);
    assert!(wv.iter().any(|v| (v - wv[0]).abs() > 1e-6), "weight is constant");

    let x = rand_tensor(&[2, 4, 7, 7], 5, DType::F32);
    let ours = conv.forward(&x).unwrap();
    let reference = x.conv2d(&w, 1, 2, 1, 2).unwrap().broadcast_add(&b.reshape((1, 6, 1, 1)).unwrap()).unwrap();
    assert_eq!(ours.dims(), &[2, 6, 4, 4]);
    let e = rel_err(&ours, &reference);
    assert!(e < 1e-5, "Conv2d::from_vb forward differs from Candle's conv2d by {e:.2e}");

    let without = Conv2d::from_vb(4, 6, 3, ConvParams::default(), false, vb.pp("plain")).unwrap();
    assert!(without.bias().is_none());
    let err = Conv2d::from_vb(5, 6, 3, ConvParams { groups: 2, ..ConvParams::default() }, false, vb.pp("bad")).unwrap_err();
    assert!(err.to_string().contains("5 channels"), "{err}");
}

#[test]
fn layer_norm_from_vb_names_init_and_forward() {
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F64, &Device::Cpu);
    let ln = LayerNorm::from_vb(5, LayerNormConfig { eps: 1e-3 }, vb.pp("ln")).unwrap();
    assert_eq!(to_f64_vec(&param(&map, "ln.weight")), vec![1.0; 5]);
    assert_eq!(to_f64_vec(&param(&map, "ln.bias")), vec![0.0; 5]);

    let x = rand_tensor(&[3, 5], 9, DType::F64);
    let ours = to_f64_vec(&ln.forward(&x).unwrap());
    let xv = to_f64_vec(&x);
    for (r, row) in xv.chunks(5).enumerate() {
        let mean = row.iter().sum::<f64>() / 5.0;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 5.0;
        for (i, v) in row.iter().enumerate() {
            let want = (v - mean) / (var + 1e-3).sqrt();
            assert!((ours[r * 5 + i] - want).abs() < 1e-12, "row {r} col {i}: {} vs {want}", ours[r * 5 + i]);
        }
    }
    assert!(LayerNorm::from_vb(5, LayerNormConfig { eps: -1.0 }, vb.pp("bad")).is_err());
}
