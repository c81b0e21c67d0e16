//! The whole training state of an image method (SimCLR, ResNet with SyncBatchNorm) survives a
//! checkpoint: batch-norm running statistics (buffers) are identical on every rank and saved,
//! and a run stopped at step k and resumed ends bitwise where an uninterrupted run does — in
//! parameters, buffers and evaluation metrics — having seen, after the resume, the same
//! sample indices and the same augmented views at every step.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};

use allgrad_dist::{run_threads, ProcessGroup};
use allgrad_models::{Batch, Objective};
use allgrad_train::{run, RunConfig, Settings, Trainer};
use candle_core::{Device, Result, Tensor};
use candle_nn::VarBuilder;

use crate::common::image_config;

/// (step, epoch, this rank's sample indices, bits of this rank's loss) of every loss call.
type Calls = Arc<Mutex<Vec<(usize, usize, Vec<usize>, u64)>>>;

/// The image objective, recording what each step saw. The loss of a step is a function of
/// the step's augmented views (and the parameters): equal loss bits at equal parameters mean
/// equal views.
struct Recording {
    inner: Box<dyn Objective>,
    calls: Calls,
}

impl Objective for Recording {
    fn build(&mut self, vb: VarBuilder) -> Result<()> {
        self.inner.build(vb)
    }
    fn num_samples(&self) -> usize {
        self.inner.num_samples()
    }
    fn plan(&mut self, epoch: usize, seed: u64, batches: &[Vec<usize>]) -> Result<()> {
        self.inner.plan(epoch, seed, batches)
    }
    fn loss(&mut self, batch: &Batch, pg: &ProcessGroup) -> Result<Tensor> {
        let loss = self.inner.loss(batch, pg)?;
        let bits = loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?.to_bits();
        self.calls.lock().unwrap().push((batch.step, batch.epoch, batch.indices.to_vec(), bits));
        Ok(loss)
    }
    fn evaluate(&mut self, pg: &ProcessGroup) -> Result<Vec<(String, f64)>> {
        self.inner.evaluate(pg)
    }
    fn buffers(&self) -> Result<Vec<(String, Tensor)>> {
        self.inner.buffers()
    }
    fn load_buffers(&mut self, buffers: &HashMap<String, Tensor>) -> Result<()> {
        self.inner.load_buffers(buffers)
    }
}

fn config() -> RunConfig {
    let sets = [
        "train.max_steps=4",
        "train.eval=true",
        "checkpoint.every=2",
        "data.knn={k: 10, temperature: 0.1, bank: 160, queries: 80, linear_probe_steps: 10}",
    ];
    image_config("simclr", "{kind: nt_xent, temperature: 0.5}", true, 32, &sets)
}

type Named = BTreeMap<String, Vec<u64>>;

fn bits(named: impl IntoIterator<Item = (String, Tensor)>) -> Result<Named> {
    let mut out = Named::new();
    for (n, t) in named {
        let v = t.to_dtype(candle_core::DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        out.insert(n, v.iter().map(|x| x.to_bits()).collect());
    }
    Ok(out)
}

/// What one rank ends with: parameters, buffers, the final evaluation, the loss calls.
struct End {
    params: Named,
    buffers: Named,
    eval: Vec<(String, u64)>,
    calls: Vec<(usize, usize, Vec<usize>, u64)>,
}

/// Runs `cfg` on `w` thread-ranks into `dir` up to `stop` steps (resuming when asked).
fn run_part(cfg: &RunConfig, w: usize, dir: &Path, stop: usize, resume: bool) -> Vec<End> {
    run_threads(w, |pg| {
        let calls = Calls::default();
        let inner = run::objective(cfg, &Device::Cpu)?;
        let objective = Box::new(Recording { inner, calls: calls.clone() });
        let tc = run::trainer_config(cfg, Device::Cpu, Settings::default());
        let mut t = Trainer::new(tc, objective, pg, Some(dir.to_path_buf()), resume)?;
        let summary = t.train_until(stop)?;
        let calls = calls.lock().unwrap().clone();
        Ok(End {
            params: bits(t.params().iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())))?,
            buffers: bits(t.buffers()?)?,
            eval: summary.eval.iter().map(|(k, v)| (k.clone(), v.to_bits())).collect(),
            calls,
        })
    })
    .unwrap()
}

#[test]
fn sync_batch_norm_buffers_are_identical_on_every_rank_moved_and_checkpointed() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config();
    let ends = run_part(&cfg, 2, dir.path(), 2, false);
    let b = &ends[0].buffers;
    assert!(
        b.contains_key("encoder.layer1.0.bn1.running_mean") && b.contains_key("projector.0.bn.running_var"),
        "{:?}",
        b.keys()
    );
    // 20 batch norms in a ResNet-18 (stem, 16 in blocks, 3 downsample), 2 in the projector.
    assert_eq!(b.len(), 2 * 22, "{:?}", b.keys());
    assert!(ends[1].buffers == *b, "rank 1's running statistics differ from rank 0's");
    let fresh = run_part(&cfg, 1, &dir.path().join("fresh"), 0, false);
    let changed = b.iter().filter(|(k, v)| fresh[0].buffers[*k] != **v).count();
    assert_eq!(changed, b.len(), "some running statistics never moved from their initial values");
    let ck = allgrad_train::checkpoint::load_latest(dir.path(), &Device::Cpu).unwrap().expect("a checkpoint at step 2");
    assert!(ck.path.ends_with("step_2"), "{}", ck.path.display());
    let saved = bits(ck.buffers).unwrap();
    assert!(saved == *b, "buffers.safetensors does not hold rank 0's running statistics");
}

#[test]
fn image_run_stopped_and_resumed_equals_an_uninterrupted_one_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config();
    let straight = run_part(&cfg, 2, &dir.path().join("straight"), usize::MAX, false);
    let part = dir.path().join("parts");
    let first = run_part(&cfg, 2, &part, 2, false);
    assert!(first[0].params != straight[0].params, "the first part already ended the run");
    let resumed = run_part(&cfg, 2, &part, usize::MAX, true);
    for (r, (a, b)) in resumed.iter().zip(&straight).enumerate() {
        // After the resume: steps 2 and 3, with the uninterrupted run's sample indices and
        // losses (so views) on every rank.
        let later: Vec<_> = b.calls.iter().filter(|c| c.0 >= 2).cloned().collect();
        assert_eq!(a.calls.first().map(|c| c.0), Some(2), "rank {r}: the resumed run did not start at step 2");
        assert_eq!(a.calls, later, "rank {r}: the resumed run saw other batches or views");
        assert!(a.params == b.params, "rank {r}: parameters differ after the resume");
        assert!(a.buffers == b.buffers, "rank {r}: running statistics differ after the resume");
        assert_eq!(a.eval, b.eval, "rank {r}: evaluation metrics differ after the resume");
    }
    assert!(!straight[0].eval.is_empty(), "rank 0 evaluated nothing");
}
