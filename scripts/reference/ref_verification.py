#!/usr/bin/env python3
"""insightface's verification protocol, re-implemented in NumPy from its `verification.py`
(`test` and `evaluate` -> `calculate_roc` -> `calculate_accuracy`), and verification `.bin`
files pickled as insightface's scripts write them, for the tests of
crates/allgrad-models/tests/models/face_bin.rs.

    python scripts/reference/ref_verification.py evaluate EMB.json
    python scripts/reference/ref_verification.py write-bin OUT_DIR

evaluate: EMB.json holds {"name", "plain", "flipped" (each image's raw embedding and its mirror
  image's, rows of floats), "issame"}. As `test` does: the two added in float64, each row
  L2-normalised (scikit-learn's `normalize`), then `evaluate`: pairs (0, 1), (2, 3), ...,
  squared distances, thresholds np.arange(0, 4, 0.01), 10 folds of KFold(shuffle=False), the
  best threshold (np.argmax: the first of the best) of nine folds applied to the tenth;
  accuracy np.mean and np.std of the ten. scikit-learn's KFold and normalize when scikit-learn
  imports; otherwise their NumPy equivalents here (fold f holds n // 10 pairs, one more for the
  first n % 10; a zero row left as it is), and the output says which ("kfold"). Prints one JSON
  object: accuracy, std, the fold accuracies (also as the bits of each f64, "bits", for an exact
  comparison that does not rest on a JSON reader's decimal parsing), and insightface's line
  "[name]Accuracy-Flip: %1.5f+-%1.5f".
write-bin: OUT_DIR/p2.bin and OUT_DIR/p5.bin, the same set pickled with protocols 2 and 5
  (insightface's files: `pickle.dump((bins, issame_list), f, protocol=pickle.HIGHEST_PROTOCOL)`),
  bins six PNG and JPEG images (`bytes`), issame_list three bools; and OUT_DIR/expected.json:
  issame and each image's pixels as Pillow decodes them (RGB, HWC).
"""

import io
import json
import os
import pickle
import struct
import sys

import numpy as np

try:
    import sklearn.preprocessing
    from sklearn.model_selection import KFold

    KFOLD = "sklearn"
except ImportError:
    KFOLD = "numpy"


def normalize(x):
    if KFOLD == "sklearn":
        return sklearn.preprocessing.normalize(x)
    norms = np.sqrt(np.einsum("ij,ij->i", x, x))
    norms[norms == 0.0] = 1.0
    return x / norms[:, None]


def folds(n, k):
    if KFOLD == "sklearn":
        return list(KFold(n_splits=k, shuffle=False).split(np.arange(n)))
    sizes = np.full(k, n // k, dtype=int)
    sizes[: n % k] += 1
    out, start = [], 0
    idx = np.arange(n)
    for s in sizes:
        test = idx[start:start + s]
        out.append((np.concatenate([idx[:start], idx[start + s:]]), test))
        start += s
    return out


def calculate_accuracy(threshold, dist, actual_issame):
    predict_issame = np.less(dist, threshold)
    tp = np.sum(np.logical_and(predict_issame, actual_issame))
    tn = np.sum(np.logical_and(np.logical_not(predict_issame), np.logical_not(actual_issame)))
    return float(tp + tn) / dist.size


def evaluate(embeddings, actual_issame, nrof_folds=10):
    thresholds = np.arange(0, 4, 0.01)
    e1, e2 = embeddings[0::2], embeddings[1::2]
    actual_issame = np.asarray(actual_issame)
    n = min(len(actual_issame), e1.shape[0])
    dist = np.sum(np.square(np.subtract(e1, e2)), 1)
    accuracy = np.zeros(nrof_folds)
    for f, (train_set, test_set) in enumerate(folds(n, nrof_folds)):
        acc_train = np.zeros(len(thresholds))
        for t, threshold in enumerate(thresholds):
            acc_train[t] = calculate_accuracy(threshold, dist[train_set], actual_issame[train_set])
        best = np.argmax(acc_train)
        accuracy[f] = calculate_accuracy(thresholds[best], dist[test_set], actual_issame[test_set])
    return accuracy


def cmd_evaluate(path):
    with open(path) as f:
        d = json.load(f)
    plain = np.zeros((len(d["plain"]), len(d["plain"][0])))
    flipped = np.zeros_like(plain)
    plain[:, :] = np.asarray(d["plain"], dtype=np.float32)
    flipped[:, :] = np.asarray(d["flipped"], dtype=np.float32)
    embeddings = normalize(plain + flipped)
    accuracy = evaluate(embeddings, d["issame"])
    acc, std = np.mean(accuracy), np.std(accuracy)
    bits = lambda x: struct.unpack("<Q", struct.pack("<d", float(x)))[0]
    print(json.dumps({
        "accuracy": float(acc),
        "std": float(std),
        "folds": accuracy.tolist(),
        "bits": {"accuracy": bits(acc), "std": bits(std), "folds": [bits(a) for a in accuracy]},
        "line": "[%s]Accuracy-Flip: %1.5f+-%1.5f" % (d["name"], acc, std),
        "kfold": KFOLD,
    }))


def cmd_write_bin(out):
    from PIL import Image

    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(2)
    bins, pixels = [], []
    for i in range(6):
        arr = rng.integers(0, 256, (5, 4, 3)).astype(np.uint8) if i % 2 == 0 else np.full((6, 6), 40 * i, np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG" if i != 3 else "JPEG", quality=95)
        bins.append(buf.getvalue())
        pixels.append(np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB")).reshape(-1).tolist())
    issame = [True, False, True]
    for proto in [2, 5]:
        with open(os.path.join(out, "p%d.bin" % proto), "wb") as f:
            pickle.dump((bins, issame), f, protocol=proto)
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump({"issame": issame, "pixels": pixels, "jpeg": [3]}, f)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("evaluate", "write-bin"):
        sys.exit("usage: ref_verification.py evaluate EMB.json | write-bin OUT_DIR")
    (cmd_evaluate if sys.argv[1] == "evaluate" else cmd_write_bin)(sys.argv[2])
