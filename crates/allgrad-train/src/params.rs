//! Parameters with initialisation seeded by name.
//!
//! [`ParamStore`] is a Candle `VarBuilder` backend: a parameter's initial value is drawn from
//! a random stream keyed by `(seed, parameter name)`, so it does not depend on the world size,
//! the rank, or the order in which a model creates its layers. Candle's own `VarMap` draws
//! from its unseeded CPU RNG and iterates a HashMap; this store is seeded and ordered.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use allgrad_models::rng::{name_key, normals, stream, uniform};
use candle_core::{DType, Device, Result, Shape, Tensor, Var};
use candle_nn::init::NormalOrUniform;
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

/// Trainable parameters by name, in name order.
#[derive(Clone, Default)]
pub struct ParamStore {
    seed: u64,
    vars: Arc<Mutex<BTreeMap<String, Var>>>,
}

impl ParamStore {
    /// An empty store whose initialisation is keyed by `seed`.
    pub fn new(seed: u64) -> Self {
        ParamStore { seed, vars: Arc::default() }
    }

    /// A VarBuilder creating its variables in this store.
    pub fn var_builder(&self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self.clone()), dtype, device.clone())
    }

    /// Every parameter, sorted by name.
    pub fn vars(&self) -> Vec<(String, Var)> {
        self.vars.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }

    fn init(&self, name: &str, shape: &Shape, init: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let n = shape.elem_count();
        let mut rng = stream(&[self.seed, name_key(name)]);
        let values: Vec<f64> = match init {
            Init::Const(v) => vec![v; n],
            Init::Randn { mean, stdev } => normals(&mut rng, n).into_iter().map(|z| mean + stdev * z).collect(),
            Init::Uniform { lo, up } => (0..n).map(|_| uniform(&mut rng, lo, up)).collect(),
            Init::Kaiming { dist, fan, non_linearity } => {
                let std = non_linearity.gain() / (fan.for_shape(shape) as f64).sqrt();
                match dist {
                    NormalOrUniform::Normal => normals(&mut rng, n).into_iter().map(|z| std * z).collect(),
                    NormalOrUniform::Uniform => {
                        let bound = 3f64.sqrt() * std;
                        (0..n).map(|_| uniform(&mut rng, -bound, bound)).collect()
                    }
                }
            }
        };
        Tensor::from_vec(values, shape.clone(), dev)?.to_dtype(dtype)
    }
}

impl SimpleBackend for ParamStore {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let mut vars = self.vars.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = vars.get(name) {
            if v.shape() != &s {
                candle_core::bail!(
                    "parameter {name} exists with shape {:?}, requested again with shape {:?}",
                    v.dims(),
                    s.dims()
                );
            }
            return Ok(v.as_tensor().clone());
        }
        let var = match h {
            // Made in place: no f64 copy of a large parameter (a sharded head's centres).
            Init::Const(v) => {
                let var = Var::zeros(s, dtype, dev)?;
                if v != 0.0 {
                    var.set(&var.as_tensor().affine(0.0, v)?)?;
                }
                var
            }
            _ => Var::from_tensor(&self.init(name, &s, h, dtype, dev)?)?,
        };
        let t = var.as_tensor().clone();
        vars.insert(name.to_string(), var);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> Result<Tensor> {
        match self.vars.lock().unwrap_or_else(|p| p.into_inner()).get(name) {
            Some(v) => Ok(v.as_tensor().clone()),
            None => candle_core::bail!("no parameter named {name}"),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.vars.lock().unwrap_or_else(|p| p.into_inner()).contains_key(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initialisation_depends_on_seed_and_name_not_order() {
        let make = |seed, order: &[&str]| {
            let store = ParamStore::new(seed);
            let vb = store.var_builder(DType::F32, &Device::Cpu);
            for name in order {
                candle_nn::linear(3, 2, vb.pp(*name)).unwrap();
            }
            store.vars().into_iter().map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect::<Vec<_>>()
        };
        let a = make(7, &["a", "b"]);
        assert_eq!(a, make(7, &["b", "a"]));
        assert_ne!(a, make(8, &["a", "b"]));
        assert_ne!(a[0].1, a[2].1, "different names give different values");
    }
}
