//! Parameters with initialisation seeded by name.
//!
//! [`ParamStore`] is a Candle `VarBuilder` backend: a parameter's initial value is drawn from
//! a random stream keyed by `(seed, parameter name)`, so it does not depend on the world size,
//! the rank, or the order in which a model creates its layers. Candle's own `VarMap` draws
//! from its unseeded CPU RNG and iterates a HashMap; this store is seeded and ordered.
//!
//! A frozen parameter ([`ParamStore::with_frozen`], a frozen group of `param_groups`) is
//! handed to the model detached: the same storage, so loading pretrained values, a
//! checkpoint or a broadcast into the variable reaches the model, but it is not tracked: an
//! operation on frozen parameters and untracked inputs alone is not recorded (no backward
//! runs into a frozen tower), and the variable itself never gets a gradient (Candle may form
//! one for the detached tensor at an operation that also reads trained values; the trainer
//! never reads it).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use allgrad_models::rng::{name_key, normals, stream, uniform};
use candle_core::{DType, Device, Result, Shape, Tensor, Var};
use candle_nn::init::NormalOrUniform;
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

/// Whether a parameter name is frozen.
type Frozen = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// Parameters by name, in name order.
#[derive(Clone, Default)]
pub struct ParamStore {
    seed: u64,
    vars: Arc<Mutex<BTreeMap<String, Var>>>,
    frozen: Option<Frozen>,
}

impl ParamStore {
    /// An empty store whose initialisation is keyed by `seed`.
    pub fn new(seed: u64) -> Self {
        ParamStore { seed, vars: Arc::default(), frozen: None }
    }

    /// This store, handing the parameters whose name `frozen` accepts to the model detached
    /// (see the module docs).
    pub fn with_frozen(mut self, frozen: impl Fn(&str) -> bool + Send + Sync + 'static) -> Self {
        self.frozen = Some(Arc::new(frozen));
        self
    }

    /// What the model gets for variable `v` named `name`.
    fn handed(&self, name: &str, v: &Var) -> Tensor {
        match &self.frozen {
            Some(f) if f(name) => v.as_tensor().detach(),
            _ => v.as_tensor().clone(),
        }
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
            return Ok(self.handed(name, v));
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
        let t = self.handed(name, &var);
        vars.insert(name.to_string(), var);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> Result<Tensor> {
        match self.vars.lock().unwrap_or_else(|p| p.into_inner()).get(name) {
            Some(v) => Ok(self.handed(name, v)),
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

    /// A frozen parameter reaches the model untracked (its variable gets no gradient), and
    /// shares its variable's storage: a value set into the variable reaches the model.
    #[test]
    fn a_frozen_parameter_is_handed_out_detached_and_shares_its_storage() {
        let store = ParamStore::new(3).with_frozen(|n| n.starts_with("locked."));
        let vb = store.var_builder(DType::F64, &Device::Cpu);
        let locked = vb.get_with_hints(3, "locked.w", Init::Const(1.0)).unwrap();
        let free = vb.get_with_hints(3, "free.w", Init::Const(1.0)).unwrap();
        let loss = ((&locked * &free).unwrap().sum_all().unwrap() * 2.0).unwrap();
        let grads = loss.backward().unwrap();
        let vars: BTreeMap<String, Var> = store.vars().into_iter().collect();
        assert!(grads.get(vars["locked.w"].as_tensor()).is_none(), "a frozen parameter got a gradient");
        assert!(!locked.track_op(), "a frozen parameter reaches the model as a tracked tensor");
        let g = grads.get(vars["free.w"].as_tensor()).expect("the free parameter's gradient");
        assert_eq!(g.to_vec1::<f64>().unwrap(), [2.0; 3]);
        vars["locked.w"].set(&Tensor::new(&[4.0f64, 5.0, 6.0], &Device::Cpu).unwrap()).unwrap();
        assert_eq!(locked.to_vec1::<f64>().unwrap(), [4.0, 5.0, 6.0], "the model sees the variable's new value");
    }
}
