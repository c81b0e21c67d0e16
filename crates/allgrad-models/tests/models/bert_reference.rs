//! The BERT encoder against transformers' `BertModel` (values from scripts/reference/ref_bert.py, f32,
//! dropout off): token ids, last hidden states and the three poolings, on the committed tiny
//! model and on all-MiniLM-L6-v2 when scripts/data/get_minilm.sh has fetched it.

use std::path::Path;

use allgrad_models::bert::{BertFolder, Pooling};
use allgrad_testkit::close::report;
use candle_core::{DType, Device, Tensor};

use crate::support::{minilm_dir, tiny_dir, TINY_SENTENCES};

struct Ref {
    ids: &'static [u32],
    first: &'static [f64],
    last: &'static [f64],
    sum: f64,
    sum_sq: f64,
    pooler: &'static [f64],
    pooler_sum: f64,
    mean: &'static [f64],
    mean_sum: f64,
}

/// Both sides compute in f32, in different orders (other GEMM blocking, other reductions in
/// the softmax and the layer norms), through 2 (tiny) or 6 (MiniLM) layers: measured up to
/// 6.5e-7 (tiny) and 4.7e-6 (MiniLM, the pooler of the longest sentence), norm-wise.
const TOL: f64 = 2e-5;

/// `got` against PyTorch's `want`, relative to `scale`: the value itself for a sum of squares,
/// a bound of the summed terms' magnitudes for a sum whose terms cancel.
fn close(what: &str, got: f64, want: f64, scale: f64) {
    let err = (got - want).abs() / scale;
    report(what, err, TOL);
    assert!(err <= TOL, "{what}: got {got}, PyTorch {want} (error {err:.2e} of {scale:.3e})");
}

/// The leading entries of a vector against PyTorch's (the script prints the first few),
/// norm-wise (`allgrad_testkit::close::rel_err`).
fn close_all(what: &str, got: &[f64], want: &[f64]) {
    assert!(got.len() >= want.len(), "{what}: {} entries, PyTorch printed {}", got.len(), want.len());
    allgrad_testkit::close::assert_rel(&got[..want.len()], want, TOL, what);
}

/// √n · ‖v‖₂ ≥ Σ |v_i|: the scale of a sum of `n` terms whose squares sum to `sum_sq`.
fn l1_bound(n: usize, sum_sq: f64) -> f64 {
    (n as f64 * sum_sq).sqrt()
}

fn row(t: &Tensor, r: usize) -> Vec<f64> {
    t.get(r).unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap()
}

fn compare(dir: &Path, sentences: &[&str], max_len: usize, refs: &[Ref]) {
    let dev = Device::Cpu;
    let folder = BertFolder::open(dir).unwrap();
    let model = folder.model(DType::F32, &dev).unwrap();
    let batch = folder.tokenizer(max_len).unwrap().batch(sentences, &dev).unwrap();
    let hidden = model.forward(&batch, None).unwrap();
    let pooled = model.pool(&hidden, &batch.mask, Pooling::Cls).unwrap();
    let mean = model.pool(&hidden, &batch.mask, Pooling::Mean).unwrap();
    let before = model.pool(&hidden, &batch.mask, Pooling::ClsBeforePooler).unwrap();
    for (s, r) in refs.iter().enumerate() {
        assert_eq!(batch.rows[s], r.ids, "token ids of sentence {s}");
        let k = r.ids.len();
        let h = hidden.get(s).unwrap().narrow(0, 0, k).unwrap().to_dtype(DType::F64).unwrap();
        let first = row(&h, 0);
        close_all(&format!("sentence {s} hidden[0]"), &first, r.first);
        close_all(&format!("sentence {s} hidden[{}]", k - 1), &row(&h, k - 1), r.last);
        let n = h.elem_count();
        close(&format!("sentence {s} sum"), h.sum_all().unwrap().to_scalar().unwrap(), r.sum, l1_bound(n, r.sum_sq));
        let sum_sq: f64 = h.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
        close(&format!("sentence {s} sum of squares"), sum_sq, r.sum_sq, r.sum_sq);
        let p = row(&pooled, s);
        close_all(&format!("sentence {s} pooler"), &p, r.pooler);
        let sq = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>();
        close(&format!("sentence {s} pooler sum"), p.iter().sum(), r.pooler_sum, l1_bound(p.len(), sq(&p)));
        let m = row(&mean, s);
        close_all(&format!("sentence {s} mean pooling"), &m, r.mean);
        close(&format!("sentence {s} mean pooling sum"), m.iter().sum(), r.mean_sum, l1_bound(m.len(), sq(&m)));
        assert_eq!(row(&before, s), first.iter().map(|v| *v as f32 as f64).collect::<Vec<_>>(), "cls_before_pooler");
    }
}

#[test]
fn tiny_bert_matches_transformers() {
    compare(&tiny_dir(), &TINY_SENTENCES, 16, TINY);
}

#[test]
fn minilm_matches_transformers() {
    let Some(dir) = minilm_dir() else {
        return allgrad_testkit::skip(allgrad_testkit::Need::MiniLm, "data/models/all-MiniLM-L6-v2 is absent");
    };
    compare(&dir, &MINILM_SENTENCES, 32, MINILM);
}

const MINILM_SENTENCES: [&str; 5] = [
    "A man is playing a guitar.",
    "The quick brown fox jumps over the lazy dog!",
    "Contrastive learning of sentence embeddings",
    "hi",
    "Distributed training must give the same gradients as one process over the global batch, \
     whatever the number of ranks, including the dropout masks and the padding of every sequence.",
];

// TINY: scripts/reference/ref_bert.py, transformers 5.23.0, torch 2.15.0+cu132, f32, max_len 16
const TINY: &[Ref] = &[
    Ref {
        ids: &[2, 4, 6, 8, 9, 4, 10, 1, 3],
        first: &[-0.2579095661640167, -3.0219922065734863, 1.1606273651123047, -1.1304900646209717],
        last: &[-0.8151485323905945, -1.3251444101333618, 0.4824921488761902, -1.7163432836532593],
        sum: -2.211261136457324,
        sum_sq: 301.3155604869301,
        pooler: &[0.8376718163490295, -0.2623416781425476, -0.2886482775211334, 0.17251436412334442],
        pooler_sum: -9.047219544649124,
        mean: &[-0.6289216578006744, -2.2775582869847617, 0.7764455949266752, -1.2007898622088962],
        mean_sum: -0.2456956818285918,
    },
    Ref {
        ids: &[2, 5, 7, 11, 3],
        first: &[-0.46954166889190674, -3.182830333709717, 1.3606138229370117, -1.175279140472412],
        last: &[-0.6929771900177002, -2.6541969776153564, 1.423809289932251, -1.4374370574951172],
        sum: -3.3400759105570614,
        sum_sq: 174.04909048984095,
        pooler: &[0.76258385181427, -0.4800601601600647, -0.512611985206604, -0.10760892182588577],
        pooler_sum: -7.545976221561432,
        mean: &[-0.7958464384078979, -2.6650859832763674, 1.2044434070587158, -1.3247558355331421],
        mean_sum: -0.6680151821114129,
    },
    Ref {
        ids: &[2, 17, 1, 1, 20, 4, 14, 19, 22, 4, 30, 23, 25, 29, 3],
        first: &[-0.6856800317764282, -3.1268951892852783, 1.498134970664978, -1.1819326877593994],
        last: &[-0.8506500124931335, -2.9692859649658203, 1.9620028734207153, -1.5587824583053589],
        sum: 3.6492922846227884,
        sum_sq: 507.6080761045942,
        pooler: &[0.7444336414337158, -0.4495031237602234, -0.588559091091156, -0.14358794689178467],
        pooler_sum: -8.178412901237607,
        mean: &[-0.9903687079747517, -2.582350730895996, 1.125504054625829, -1.235816740989685],
        mean_sum: 0.2432861523081864,
    },
    Ref {
        ids: &[2, 31, 3],
        first: &[-0.32651421427726746, -3.2499115467071533, 1.1298655271530151, -1.0078682899475098],
        last: &[-0.7211674451828003, -2.5264530181884766, 0.6926133632659912, -1.3969790935516357],
        sum: 0.6850844100117683,
        sum_sq: 104.00215933312518,
        pooler: &[0.4635396897792816, -0.5611475706100464, -0.3767203390598297, 0.3475848436355591],
        pooler_sum: -7.617607640102506,
        mean: &[-0.6064416666825613, -2.699834664662679, 0.9765700499216715, -1.1481647491455078],
        mean_sum: 0.22836147000392293,
    },
    Ref {
        ids: &[2, 4, 15, 16, 18, 24, 21, 4, 34, 22, 4, 7, 11, 12, 22, 3],
        first: &[-0.8157172799110413, -3.1264729499816895, 1.3626104593276978, -1.2207396030426025],
        last: &[-1.1853457689285278, -2.549668550491333, 1.3873966932296753, -1.7091821432113647],
        sum: 4.988553696486633,
        sum_sq: 536.3167544557692,
        pooler: &[0.6734240055084229, -0.4610145092010498, -0.5050368905067444, -0.10838127136230469],
        pooler_sum: -7.307076811790466,
        mean: &[-1.0606004446744919, -2.5917986929416656, 0.9156110975891352, -1.2843372412025928],
        mean_sum: 0.3117846060304146,
    },
];
// MINILM: scripts/reference/ref_bert.py, transformers 5.23.0, torch 2.15.0+cu132, f32, max_len 32
const MINILM: &[Ref] = &[
    Ref {
        ids: &[101, 1037, 2158, 2003, 2652, 1037, 2858, 1012, 102],
        first: &[0.09885335713624954, 0.08067802339792252, -0.09786556661128998, -0.4972653388977051],
        last: &[0.15487030148506165, 0.014880942180752754, -0.22912445664405823, -0.17514586448669434],
        sum: 1.7858226782108417,
        sum_sq: 534.8176650943678,
        pooler: &[0.012011929415166378, -0.0403158999979496, 0.028556128963828087, 0.022250685840845108],
        pooler_sum: -0.8167526308970992,
        mean: &[0.10676193040692145, -0.023971214786999755, -0.04755134632190069, -0.31244533467623925],
        mean_sum: 0.19842474202342564,
    },
    Ref {
        ids: &[101, 1996, 4248, 2829, 4419, 14523, 2058, 1996, 13971, 3899, 999, 102],
        first: &[-0.02505725994706154, 0.3182337284088135, 0.19376550614833832, 0.7117103338241577],
        last: &[0.07727210223674774, 0.18818335235118866, 0.30285993218421936, 0.7714712023735046],
        sum: 8.018098197346845,
        sum_sq: 943.8510261566785,
        pooler: &[-0.057059451937675476, 0.02271874248981476, 0.08437741547822952, 0.12327154725790024],
        pooler_sum: 2.9174790138495155,
        mean: &[0.10102746930594246, 0.33112969622015953, 0.33259424737965065, 0.3242722650369008],
        mean_sum: 0.6681748497789037,
    },
    Ref {
        ids: &[101, 5688, 3512, 4083, 1997, 6251, 7861, 8270, 4667, 2015, 102],
        first: &[0.16617339849472046, -0.3639073073863983, 0.0707186833024025, 0.3050452172756195],
        last: &[-0.16708911955356598, -0.8876768350601196, 0.11940798163414001, 0.1867513358592987],
        sum: 18.585991956408257,
        sum_sq: 1268.8761868310903,
        pooler: &[-0.022678138688206673, 0.023316672071814537, 0.06404265016317368, 0.02530749887228012],
        pooler_sum: 0.7369422991469037,
        mean: &[0.4204479997808283, -0.8123725192113356, -0.1643113283948465, 0.43128697167743335],
        mean_sum: 1.6896356324007513,
    },
    Ref {
        ids: &[101, 7632, 102],
        first: &[0.028779711574316025, 0.1273559331893921, 0.0014874916523694992, 0.1552601307630539],
        last: &[-0.8470354676246643, 0.15878461301326752, 0.11046876013278961, 0.9036390781402588],
        sum: 13.545337897815372,
        sum_sq: 307.40448710080335,
        pooler: &[-0.0046404507011175156, 0.006475671194493771, 0.0033677222672849894, 0.07257898896932602],
        pooler_sum: 0.3458026639127638,
        mean: &[-0.5549436522026857, 0.24803942938645682, 0.14662743049363294, 0.3615623265504837],
        mean_sum: 4.515112632605123,
    },
    Ref {
        ids: &[
            101, 5500, 2731, 2442, 2507, 1996, 2168, 17978, 2015, 2004, 2028, 2832, 2058, 1996, 3795, 14108, 1010, 3649, 1996,
            2193, 1997, 6938, 1010, 2164, 1996, 4530, 5833, 15806, 1998, 1996, 11687, 102,
        ],
        first: &[0.057934436947107315, -0.48564645648002625, -0.2412489801645279, 0.019547708332538605],
        last: &[-0.14687858521938324, -0.8792711496353149, -0.16516511142253876, 0.063696950674057],
        sum: 40.81549378141737,
        sum_sq: 1414.4263299973961,
        pooler: &[-0.030897941440343857, -0.0068329619243741035, 0.00578365009278059, 0.005466179456561804],
        pooler_sum: -1.2369559074286371,
        mean: &[-0.14952605369035155, -0.4619787004776299, -0.08919480454642326, 0.017579774217665545],
        mean_sum: 1.275484180669293,
    },
];
