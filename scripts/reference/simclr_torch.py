#!/usr/bin/env python3
"""SimCLR re-implemented independently in PyTorch, from the config allgrad's `train` reads.

It trains allgrad's main job (`configs/simclr.yaml`: SimCLR on the bundled Fashion-MNIST
subset, IDX files) in one process, to compare allgrad's monitor figures with:

    /path/to/python-with-torch scripts/reference/simclr_torch.py --config configs/simclr.yaml
    /path/to/python-with-torch scripts/reference/simclr_torch.py --config configs/simclr.yaml \\
        --set train.max_steps=3 --set data.knn.bank=500 --set data.knn.queries=200   # a quick look

Needs torch, numpy and PyYAML (`pip install torch numpy pyyaml`; kept out of CI). Options:
`--config FILE`, `--set KEY=VALUE` (repeatable; the value is parsed as YAML, paths given
this way are taken from the current directory, those in the file from the file's folder, as
`train` does), `--seed N` (the same as `--set seed=N`), `--threads N` (torch.set_num_threads,
default 2), `--init allgrad|torch` (see below).

It prints the kNN and linear-probe accuracies of the untrained encoder, then after every
epoch (and at the end of a run cut short by `train.max_steps`), one line each:

    epoch 0 (step 0): knn 0.6935 linear 0.7820
    ...
    knn gain +0.0150, linear gain +0.0215
    wall time 812.4 s (training 700.1 s, evaluation 112.3 s), 2 threads

What it mirrors, in one process on the global batch (allgrad's W ranks with SyncBatchNorm
compute the same thing as one process with plain batch norm over the global batch):

- Data: `data.dir` in IDX format; each epoch a permutation of the training set, cut into
  `train.global_batch`-sized steps (the remainder dropped); `train.epochs`,
  `train.max_steps`, `train.shuffle`.
- Views (allgrad-data's `Augment`): values in [0, 1]; RandomResizedCrop (up to 10 tries of
  an area fraction uniform in `scale` and a log-uniform aspect ratio, sides rounded, uniform
  position, else the centre crop at the nearest allowed ratio), resized with a triangle
  filter widened when shrinking (PIL's / torchvision's antialiased bilinear) using only the
  box's pixels; horizontal flip; with probability p the colour jitter, its four operations
  in a random order (brightness: multiply, contrast: blend with the image mean, both clamped
  to [0, 1]); random grayscale; Gaussian blur (sigma uniform in the range, reflected
  borders); normalisation. The images are one-channel, on which saturation, hue and
  grayscale are no-ops in allgrad as in torchvision, so they are no-ops here too.
- Network: ResNet-18/34/50 (`model.encoder`: depth, width, in_channels, `stem: cifar` =
  3x3 stride-1 conv and no max-pool, `imagenet` = 7x7/2 conv and 3x3/2 max-pool), bias-free
  convolutions each followed by batch norm (eps 1e-5, momentum 0.1, weight 1, bias 0; no
  zero-initialised last batch norm in a block), global average pooling; the projector
  (`model.projector`: `layers` linear layers, hidden width `hidden` or the encoder's feature
  width when 0, output `out`, biases when `bias`; ReLU between layers, and batch norm
  before that ReLU on every hidden layer when layers >= 3). Both views of the batch go
  through the network as one batch of 2B images (batch norm sees them together).
- Loss: NT-Xent over the 2B L2-normalised projections at `loss.temperature`, each anchor's
  positive the other view of its sample, its own similarity masked, the mean over the 2B
  anchors.
- Optimizer (`optim`): LARS as allgrad's (for each parameter of 2 or more dimensions
  d = g + wd w, scaled by trust_coefficient |w| / |d| (1 when a norm is 0); parameters of 1
  dimension, biases and batch-norm parameters, take d = g with no weight decay and no
  scaling when `exclude_1d`; then buf = momentum buf + d, w -= lr buf); SGD (momentum,
  nesterov, L2 weight decay) and AdamW (decoupled weight decay) as torch.optim's, which
  use allgrad's formulas. `train.clip_grad_norm` clips the global gradient norm.
- Schedule (`schedule`): linear warmup over `warmup_steps` (step s gets (s + 1) / warmup of
  the peak), then cosine or linear decay to `final_fraction` of the peak at the last step,
  or constant; the peak is `optim.lr` x global_batch / 256 with `scale_by_batch`.
- Evaluation (allgrad's monitor): features of the un-augmented, normalised images from the
  encoder (before the projector) in eval mode (batch norm's running statistics), L2-normalised;
  the bank is the first `data.knn.bank` training images (0: all), the queries the first
  `data.knn.queries` test images (0: all). kNN: the `k` most cosine-similar bank images vote
  for their class with weight exp(similarity / temperature) (InstDisc's weighted vote);
  top-1 accuracy. Linear probe: the same L2-normalised features standardised with the bank's
  mean and standard deviation (population, +1e-6 under the root), a linear layer from zeros
  trained by `data.knn.linear_probe_steps` (default 300) full-batch gradient steps on the
  mean cross-entropy with learning rate 0.5 and heavy-ball momentum 0.9; top-1 on the
  queries. Run before training and whenever an epoch ends or the run ends (`train.eval`).

What it deliberately does not mirror:

- Random streams: allgrad draws every number from streams keyed by (seed, epoch, sample,
  view, stage); here numpy and torch generators seeded from `seed` draw from the same
  distributions in a different order, so no single view, batch or initial weight is the
  same, and results agree only statistically (compare over seeds).
- Initial weights: with `--init allgrad` (the default) the distributions of allgrad's
  initialisation (convolution and linear weights Kaiming-normal, fan-in, std sqrt(2 / fan_in);
  linear biases uniform in +-1/sqrt(fan_in)), with `--init torch` PyTorch's defaults
  (Kaiming-uniform with a = sqrt(5), i.e. weights uniform in +-1/sqrt(fan_in)).
- Arithmetic: PyTorch's kernels and summation orders (f32, or f64 with `dtype: f64`).
- Checkpoints, logs, plots, the loader threads, gradient caching and accumulation
  (`train.cache_chunk` and `train.accumulate` > 1 are refused: they change the batch-norm
  statistics and the negatives); `train.on_nonfinite` is always `error`. With
  `encoder.sync_bn: false`, allgrad on W > 1 ranks normalises each rank's share on its own;
  this script is then allgrad on one rank.
"""
import argparse
import gzip
import math
import os
import struct
import sys
import time


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="the YAML config allgrad's train reads")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value (YAML)")
    ap.add_argument("--seed", type=int, default=None, help="override the config's seed")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--init", choices=["allgrad", "torch"], default="allgrad", help="initial weight distributions")
    return ap.parse_args()


ARGS = parse_args()
# Before torch is imported, so that its thread pools start at this size.
os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))
os.environ.setdefault("MKL_NUM_THREADS", str(ARGS.threads))

try:
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import yaml
except ImportError as e:
    sys.exit(f"simclr_torch.py needs torch, numpy and pyyaml ({e}); pip install torch numpy pyyaml")


class ConfigError(Exception):
    pass


# ---------------------------------------------------------------------------------------
# Config: the file, --set overrides, and each section with allgrad's defaults.


def load_config(path, sets, seed):
    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f) or {}
    base = os.path.dirname(os.path.abspath(path))
    data = cfg.get("data")
    if isinstance(data, dict) and isinstance(data.get("dir"), str):
        data["dir"] = os.path.join(base, data["dir"])  # from the config file's folder
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        node, parts = cfg, key.split(".")
        for i, p in enumerate(parts[:-1]):
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: `{'.'.join(parts[: i + 1])}` is not a section")
            node = nxt
        node[parts[-1]] = yaml.safe_load(value)  # --set paths stay relative to the current directory
    if seed is not None:
        cfg["seed"] = seed
    return cfg


def section(cfg, path, defaults, allow_extra=()):
    """The mapping at `path` (dotted) merged over `defaults`; unknown keys are an error."""
    node = cfg
    for p in path.split("."):
        node = node.get(p, {}) if isinstance(node, dict) else None
    if node is None:
        node = {}
    if not isinstance(node, dict):
        raise ConfigError(f"`{path}` must be a mapping, got {node!r}")
    unknown = set(node) - set(defaults) - set(allow_extra)
    if unknown:
        raise ConfigError(f"`{path}`: unknown key(s) {sorted(unknown)}; known: {sorted(defaults)}")
    return {**defaults, **node}


def resolve(cfg):
    """Every section this script uses, with allgrad's defaults filled in."""
    if cfg.get("method") != "simclr":
        raise ConfigError(f"method is {cfg.get('method')!r}; this script implements `simclr`")
    c = {"seed": int(cfg.get("seed", 0)), "dtype": cfg.get("dtype", "f32")}
    if c["dtype"] not in ("f32", "f64"):
        raise ConfigError(f"dtype {c['dtype']!r}: f32 or f64")
    data = section(cfg, "data", {"kind": "images", "dir": None, "format": None, "augment": {}, "knn": {}},
                   allow_extra=("loader", "folder"))
    if data["kind"] != "images" or data["format"] != "idx" or not data["dir"]:
        raise ConfigError(f"data: kind images, format idx and a dir are needed; got kind {data['kind']!r}, "
                          f"format {data['format']!r}, dir {data['dir']!r}")
    aug = section(cfg, "data.augment", {"crop": {}, "flip": {}, "color_jitter": {}, "grayscale": {}, "blur": {},
                                        "normalize": {}})
    a = {
        "crop": None if aug["crop"] is None else
        section(cfg, "data.augment.crop", {"size": 32, "scale": [0.08, 1.0], "ratio": [3 / 4, 4 / 3]}),
        "flip": section(cfg, "data.augment.flip", {"p": 0.5}),
        "jitter": section(cfg, "data.augment.color_jitter",
                          {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": 0.1, "p": 0.8}),
        "gray": section(cfg, "data.augment.grayscale", {"p": 0.2}),
        "blur": section(cfg, "data.augment.blur", {"kernel": 3, "sigma": [0.1, 2.0], "p": 0.0}),
        "norm": section(cfg, "data.augment.normalize",
                        {"mean": [0.4914, 0.4822, 0.4465], "std": [0.2470, 0.2435, 0.2616]}),
    }
    if a["blur"]["kernel"] < 1 or a["blur"]["kernel"] % 2 == 0:
        raise ConfigError(f"data.augment.blur.kernel must be odd and positive, got {a['blur']['kernel']}")
    knn = section(cfg, "data.knn", {"k": 200, "temperature": 0.1, "bank": 0, "queries": 0, "linear_probe_steps": 300})
    model = section(cfg, "model", {"kind": "resnet", "encoder": {}, "projector": {}})
    if model["kind"] != "resnet":
        raise ConfigError(f"model.kind {model['kind']!r}: this script implements `resnet`")
    enc = section(cfg, "model.encoder", {"depth": 18, "width": 64, "in_channels": 3, "stem": "cifar", "sync_bn": True})
    proj = section(cfg, "model.projector", {"hidden": 0, "out": 128, "layers": 2, "bias": True})
    if proj["layers"] < 2 or proj["out"] < 1:
        raise ConfigError(f"model.projector: layers >= 2 and out >= 1 needed, got {proj['layers']}, {proj['out']}")
    loss = section(cfg, "loss", {"kind": "nt_xent", "temperature": 0.2})
    if loss["kind"] != "nt_xent":
        raise ConfigError(f"loss.kind {loss['kind']!r}: simclr uses nt_xent")
    kind = (cfg.get("optim") or {}).get("kind", "sgd")
    optim_defaults = {
        "sgd": {"lr": 0.1, "momentum": 0.0, "nesterov": False, "weight_decay": 0.0},
        "lars": {"lr": None, "momentum": 0.9, "weight_decay": 0.0, "trust_coefficient": 0.001, "exclude_1d": True},
        "adamw": {"lr": None, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01},
    }
    if kind not in optim_defaults:
        raise ConfigError(f"optim.kind {kind!r}: one of {sorted(optim_defaults)}")
    optim = section(cfg, "optim", {"kind": kind, **optim_defaults[kind]})
    if "optim" not in cfg:  # allgrad's default optimizer section
        optim.update(lr=0.1, momentum=0.9)
    if not (optim["lr"] and optim["lr"] > 0):
        raise ConfigError(f"optim.lr must be a positive number, got {optim['lr']}")
    sched = section(cfg, "schedule", {"warmup_steps": 0, "decay": "cosine", "final_fraction": 0.0,
                                      "scale_by_batch": False})
    if sched["decay"] not in ("cosine", "linear", "constant"):
        raise ConfigError(f"schedule.decay {sched['decay']!r}: cosine, linear or constant")
    train = section(cfg, "train", {"global_batch": None, "epochs": 1, "max_steps": None, "accumulate": 1,
                                   "clip_grad_norm": None, "on_nonfinite": "error", "shuffle": True, "eval": True,
                                   "cache_chunk": None})
    if not train["global_batch"] or train["global_batch"] < 1:
        raise ConfigError(f"train.global_batch must be at least 1, got {train['global_batch']}")
    if train["accumulate"] != 1 or train["cache_chunk"] is not None:
        raise ConfigError("train.accumulate > 1 and train.cache_chunk are not implemented here (see the docstring)")
    if train["epochs"] == 0 and train["max_steps"] is None:
        raise ConfigError("train.epochs is 0 and train.max_steps is not set: nothing to train")
    log = section(cfg, "log", {"every": 10, "progress": "auto", "plot": True})
    c.update(data=data, aug=a, knn=knn, enc=enc, proj=proj, loss=loss, optim=optim, sched=sched, train=train,
             log_every=max(int(log["every"]), 1))
    return c


# ---------------------------------------------------------------------------------------
# Data: IDX files and allgrad-data's augmentations, on one-channel float images [H, W].


def read_idx(path, magic, dims):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    (m,) = struct.unpack(">I", raw[:4])
    if m != magic:
        raise ConfigError(f"{path}: magic {m:#010x}, expected {magic:#010x}")
    shape = struct.unpack(">" + "I" * dims, raw[4:4 + 4 * dims])
    arr = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims)
    if arr.size != int(np.prod(shape)):
        raise ConfigError(f"{path}: {arr.size} bytes of data for shape {shape}")
    return arr.reshape(shape)


def open_split(directory, prefix):
    def find(stem):
        gz = os.path.join(directory, stem + ".gz")
        return gz if os.path.exists(gz) or not os.path.exists(os.path.join(directory, stem)) else os.path.join(directory, stem)

    images = read_idx(find(f"{prefix}-images-idx3-ubyte"), 0x803, 3)
    labels = read_idx(find(f"{prefix}-labels-idx1-ubyte"), 0x801, 1).astype(np.int64)
    if len(images) != len(labels):
        raise ConfigError(f"{directory}: {len(images)} {prefix} images but {len(labels)} labels")
    return images, labels


_FILTERS = {}


def resize_matrix(offset, length, out, full):
    """[out, full] weights of the triangle filter that resizes pixels offset..offset+length
    to `out` pixels (widened by the shrink factor when shrinking; weights outside the box are
    dropped and each row renormalised), as allgrad's `resize_bilinear`."""
    key = (offset, length, out, full)
    if key not in _FILTERS:
        scale = length / out
        support = max(scale, 1.0)
        m = np.zeros((out, full), dtype=np.float64)
        for o in range(out):
            centre = (o + 0.5) * scale
            lo = max(int(math.floor(centre - support)), 0)
            hi = min(int(math.ceil(centre + support)), length)
            w = np.array([max(0.0, 1.0 - abs((i + 0.5 - centre) / support)) for i in range(lo, hi)])
            m[o, offset + lo:offset + hi] = w / w.sum()
        _FILTERS[key] = m.astype(np.float32)
    return _FILTERS[key]


def crop_box(width, height, crop, rng):
    """(x, y, w, h) of torchvision's RandomResizedCrop, as allgrad draws it."""
    area = width * height
    log_r = (math.log(crop["ratio"][0]), math.log(crop["ratio"][1]))
    for _ in range(10):
        target = area * rng.uniform(crop["scale"][0], crop["scale"][1])
        aspect = math.exp(rng.uniform(*log_r))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            y = int(rng.integers(0, height - h + 1))
            x = int(rng.integers(0, width - w + 1))
            return x, y, w, h
    in_ratio = width / height
    if in_ratio < crop["ratio"][0]:
        w, h = width, min(max(int(round(width / crop["ratio"][0])), 1), height)
    elif in_ratio > crop["ratio"][1]:
        w, h = min(max(int(round(height * crop["ratio"][1])), 1), width), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def gaussian_blur(x, kernel, sigma):
    half = (kernel - 1) / 2
    k = np.exp(-0.5 * ((np.arange(kernel) - half) / sigma) ** 2)
    k = (k / k.sum()).astype(np.float32)
    r = kernel // 2
    p = np.pad(x, r, mode="reflect")  # mirrored, edge pixel not repeated
    h, w = x.shape
    rows = sum(k[i] * p[:, i:i + w] for i in range(kernel))  # [h + 2r, w]
    return sum(k[i] * rows[i:i + h, :] for i in range(kernel))


def augment(img, a, rng):
    """One training view of a uint8 [H, W] image: float32 [H', W'], normalised."""
    x = img.astype(np.float32) / 255.0
    if a["crop"] is not None:
        height, width = x.shape
        bx, by, bw, bh = crop_box(width, height, a["crop"], rng)
        size = a["crop"]["size"]
        x = resize_matrix(by, bh, size, height) @ x @ resize_matrix(bx, bw, size, width).T
    if rng.random() < a["flip"]["p"]:
        x = x[:, ::-1]
    j = a["jitter"]
    if rng.random() < j["p"]:
        order = rng.permutation(4)  # brightness, contrast, saturation, hue
        b = rng.uniform(max(0.0, 1 - j["brightness"]), 1 + j["brightness"]) if j["brightness"] > 0 else None
        c = rng.uniform(max(0.0, 1 - j["contrast"]), 1 + j["contrast"]) if j["contrast"] > 0 else None
        for op in order:
            if op == 0 and b is not None:
                x = np.clip(x * np.float32(b), 0.0, 1.0)
            elif op == 1 and c is not None:
                x = np.clip(np.float32(c) * x + np.float32(1 - c) * x.mean(dtype=np.float64).astype(np.float32), 0.0, 1.0)
            # op 2 (saturation) and 3 (hue): no-ops on one channel.
    # Random grayscale: a no-op on one channel.
    if rng.random() < a["blur"]["p"]:
        x = gaussian_blur(x, a["blur"]["kernel"], rng.uniform(*a["blur"]["sigma"]))
    return normalise(x, a["norm"])


def normalise(x, norm):
    if len(norm["mean"]) != 1 or len(norm["std"]) != 1:
        raise ConfigError(f"data.augment.normalize: one mean and one std for one-channel images, "
                          f"got {len(norm['mean'])} and {len(norm['std'])}")
    return ((x - np.float32(norm["mean"][0])) / np.float32(norm["std"][0])).astype(np.float32)


# ---------------------------------------------------------------------------------------
# Model: ResNet encoder and projector.


class Block(nn.Module):
    def __init__(self, cin, planes, stride, bottleneck):
        super().__init__()
        exp = 4 if bottleneck else 1
        cout = planes * exp
        if bottleneck:
            specs = [(cin, planes, 1, 1), (planes, planes, 3, stride), (planes, cout, 1, 1)]
        else:
            specs = [(cin, planes, 3, stride), (planes, planes, 3, 1)]
        self.convs = nn.ModuleList(nn.Conv2d(i, o, k, s, k // 2, bias=False) for i, o, k, s in specs)
        self.bns = nn.ModuleList(nn.BatchNorm2d(o) for _, o, _, _ in specs)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        skip = x if self.down is None else self.down(x)
        h = x
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            h = bn(conv(h))
            h = F.relu(h + skip) if i + 1 == len(self.convs) else F.relu(h)
        return h


class ResNet(nn.Module):
    def __init__(self, depth, width, in_channels, stem):
        super().__init__()
        counts, bottleneck = {18: ([2, 2, 2, 2], False), 34: ([3, 4, 6, 3], False), 50: ([3, 4, 6, 3], True)}[depth]
        k, s = {"cifar": (3, 1), "imagenet": (7, 2)}[stem]
        self.conv1 = nn.Conv2d(in_channels, width, k, s, k // 2, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.pool = stem == "imagenet"
        blocks, cin = [], width
        for stage, n in enumerate(counts):
            planes = width << stage
            for i in range(n):
                blocks.append(Block(cin, planes, 2 if stage > 0 and i == 0 else 1, bottleneck))
                cin = planes * (4 if bottleneck else 1)
        self.blocks = nn.Sequential(*blocks)
        self.feature_dim = cin

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        if self.pool:
            h = F.max_pool2d(h, 3, 2, 1)
        return F.adaptive_avg_pool2d(self.blocks(h), 1).flatten(1)


class Projector(nn.Module):
    def __init__(self, cin, hidden, out, layers, bias):
        super().__init__()
        hidden = hidden or cin
        mods = []
        for i in range(layers):
            last = i + 1 == layers
            cout = out if last else hidden
            mods.append(nn.Linear(cin, cout, bias=bias))
            if not last:
                if layers >= 3:
                    mods.append(nn.BatchNorm1d(cout))
                mods.append(nn.ReLU())
            cin = cout
        self.net = nn.Sequential(*mods)

    def forward(self, x):
        return self.net(x)


def init_like_allgrad(model):
    """Kaiming-normal (fan-in, ReLU gain) weights for convolutions and linear layers, linear
    biases uniform in +-1/sqrt(fan_in), batch norm 1 and 0: candle-nn's and allgrad's."""
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            if m.bias is not None:
                bound = 1 / math.sqrt(m.weight.shape[1])
                nn.init.uniform_(m.bias, -bound, bound)
        elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def nt_xent(z1, z2, temperature):
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n = z1.shape[0]
    logits = z @ z.t() / temperature
    logits = logits.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])
    return F.cross_entropy(logits, target)


# ---------------------------------------------------------------------------------------
# Optimizer and schedule.


class Lars:
    """allgrad's LARS (see the docstring)."""

    def __init__(self, params, momentum, weight_decay, trust_coefficient, exclude_1d):
        self.params = list(params)
        self.momentum, self.wd, self.eta, self.exclude_1d = momentum, weight_decay, trust_coefficient, exclude_1d
        self.bufs = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self, lr):
        for p, buf in zip(self.params, self.bufs):
            g = p.grad
            if self.exclude_1d and p.dim() <= 1:
                d = g
            else:
                d = g + self.wd * p if self.wd > 0 else g
                wn, dn = p.double().norm().item(), d.double().norm().item()
                d = d * (self.eta * wn / dn if wn > 0 and dn > 0 else 1.0)
            buf.mul_(self.momentum).add_(d)
            p.sub_(lr * buf)


def make_optimizer(o, params):
    if o["kind"] == "lars":
        opt = Lars(params, o["momentum"], o["weight_decay"], o["trust_coefficient"], o["exclude_1d"])
        return lambda lr: opt.step(lr)
    if o["kind"] == "sgd":
        opt = torch.optim.SGD(params, lr=o["lr"], momentum=o["momentum"], nesterov=o["nesterov"],
                              weight_decay=o["weight_decay"])
    else:
        opt = torch.optim.AdamW(params, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"],
                                weight_decay=o["weight_decay"])

    def step(lr):
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()

    return step


def schedule_lr(s, base_lr, step, total, global_batch):
    """allgrad's `ScheduleConfig::lr` for the 0-based `step` of `total`."""
    peak = base_lr * global_batch / 256 if s["scale_by_batch"] else base_lr
    if step < s["warmup_steps"]:
        return peak * (step + 1) / s["warmup_steps"]
    t = min((step - s["warmup_steps"]) / max(total - s["warmup_steps"], 1), 1.0)
    low = peak * s["final_fraction"]
    if s["decay"] == "constant":
        return peak
    if s["decay"] == "cosine":
        return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * t))
    return peak - (peak - low) * t


# ---------------------------------------------------------------------------------------
# Evaluation: kNN monitor and linear probe on the frozen encoder's features.


@torch.no_grad()
def features(encoder, images, norm, dtype):
    x = torch.from_numpy(normalise(images.astype(np.float32) / 255.0, norm)).unsqueeze(1).to(dtype)
    return F.normalize(torch.cat([encoder(x[i:i + 256]) for i in range(0, len(x), 256)]), dim=1)


def knn_accuracy(queries, bank, bank_labels, query_labels, classes, k, temperature):
    k = min(max(k, 1), len(bank_labels))
    hits = 0
    for i in range(0, len(queries), 512):
        sim = queries[i:i + 512] @ bank.t()
        top, idx = sim.topk(k, dim=1)
        votes = torch.zeros(len(top), classes, dtype=torch.float64)
        votes.scatter_add_(1, bank_labels[idx], (top.double() / temperature).exp())
        hits += (votes.argmax(1) == query_labels[i:i + 512]).sum().item()
    return hits / max(len(queries), 1)


def linear_probe(train, train_labels, test, test_labels, classes, steps):
    train, test = train.float(), test.float()
    mean = train.mean(0, keepdim=True)
    std = ((train - mean).pow(2).mean(0, keepdim=True) + 1e-6).sqrt()
    xtr, xte = (train - mean) / std, (test - mean) / std
    w = torch.zeros(xtr.shape[1], classes, requires_grad=True)
    b = torch.zeros(classes, requires_grad=True)
    vw, vb = torch.zeros_like(w), torch.zeros_like(b)
    lr, momentum = 0.5, 0.9
    for _ in range(steps):
        gw, gb = torch.autograd.grad(F.cross_entropy(xtr @ w + b, train_labels), [w, b])
        with torch.no_grad():
            vw.mul_(momentum).add_(gw)
            vb.mul_(momentum).add_(gb)
            w.sub_(lr * vw)
            b.sub_(lr * vb)
    with torch.no_grad():
        return ((xte @ w + b).argmax(1) == test_labels).float().mean().item()


def evaluate(encoder, c, train_set, test_set, dtype):
    was_training = encoder.training
    encoder.eval()
    knn = c["knn"]
    n_bank = len(train_set[0]) if knn["bank"] == 0 else min(knn["bank"], len(train_set[0]))
    n_query = len(test_set[0]) if knn["queries"] == 0 else min(knn["queries"], len(test_set[0]))
    bank = features(encoder, train_set[0][:n_bank], c["aug"]["norm"], dtype)
    queries = features(encoder, test_set[0][:n_query], c["aug"]["norm"], dtype)
    bank_labels = torch.from_numpy(train_set[1][:n_bank])
    query_labels = torch.from_numpy(test_set[1][:n_query])
    classes = int(max(train_set[1].max(), test_set[1].max())) + 1
    out = {"knn": knn_accuracy(queries, bank, bank_labels, query_labels, classes, knn["k"], knn["temperature"])}
    if knn["linear_probe_steps"] > 0:
        out["linear"] = linear_probe(bank, bank_labels, queries, query_labels, classes, knn["linear_probe_steps"])
    encoder.train(was_training)
    return out


# ---------------------------------------------------------------------------------------


def main():
    torch.set_num_threads(ARGS.threads)
    try:
        c = resolve(load_config(ARGS.config, ARGS.set, ARGS.seed))
        train_set = open_split(c["data"]["dir"], "train")
        test_set = open_split(c["data"]["dir"], "t10k")
    except (ConfigError, OSError, yaml.YAMLError) as e:
        sys.exit(f"simclr_torch.py: {e}")
    enc_cfg, t = c["enc"], c["train"]
    if enc_cfg["in_channels"] != 1:
        sys.exit(f"simclr_torch.py: model.encoder.in_channels is {enc_cfg['in_channels']}, the IDX images have 1 channel")
    seed = c["seed"]
    dtype = torch.float64 if c["dtype"] == "f64" else torch.float32
    torch.manual_seed(seed)
    encoder = ResNet(enc_cfg["depth"], enc_cfg["width"], 1, enc_cfg["stem"])
    p = c["proj"]
    projector = Projector(encoder.feature_dim, p["hidden"], p["out"], p["layers"], p["bias"])
    model = nn.Sequential(encoder, projector).to(dtype)
    if ARGS.init == "allgrad":
        init_like_allgrad(model)
    params = list(model.parameters())
    step_optimizer = make_optimizer(c["optim"], params)

    n, gb = len(train_set[0]), t["global_batch"]
    per_epoch = n // gb
    if per_epoch == 0:
        sys.exit(f"simclr_torch.py: train.global_batch = {gb} is larger than the {n} training images")
    total = t["epochs"] * per_epoch  # allgrad's rule: max_steps overrides the epochs when smaller (or epochs is 0)
    if t["max_steps"] is not None:
        total = t["max_steps"] if t["epochs"] == 0 else min(t["max_steps"], total)
    print(f"simclr_torch: {n} training / {len(test_set[0])} test images, ResNet-{enc_cfg['depth']} width "
          f"{enc_cfg['width']} ({sum(q.numel() for q in params)} parameters), global batch {gb}, {total} steps "
          f"({per_epoch} per epoch), {c['optim']['kind']}, seed {seed}, init {ARGS.init}, torch {torch.__version__}, "
          f"{ARGS.threads} threads", flush=True)

    started = time.time()
    eval_seconds = 0.0
    results = []

    def run_eval(step):
        nonlocal eval_seconds
        t0 = time.time()
        r = evaluate(encoder, c, train_set, test_set, dtype)
        eval_seconds += time.time() - t0
        done = step / per_epoch
        label = f"epoch {step // per_epoch}" if step % per_epoch == 0 else f"epoch {done:.2f}"
        text = " ".join(f"{k} {v:.4f}" for k, v in r.items())
        print(f"{label} (step {step}): {text}", flush=True)
        results.append(r)

    if t["eval"] and total > 0:
        run_eval(0)
    model.train()
    window = time.time()
    perm = None
    for step in range(total):
        epoch = step // per_epoch
        if step % per_epoch == 0 or perm is None:
            perm = np.random.default_rng([seed, 0x5A3B, epoch]).permutation(n) if t["shuffle"] else np.arange(n)
        pos = step % per_epoch
        idx = perm[pos * gb:(pos + 1) * gb]
        rng = np.random.default_rng([seed, epoch, step])
        v1 = np.stack([augment(train_set[0][i], c["aug"], rng) for i in idx])
        v2 = np.stack([augment(train_set[0][i], c["aug"], rng) for i in idx])
        x = torch.from_numpy(np.concatenate([v1, v2])).unsqueeze(1).to(dtype)
        lr = schedule_lr(c["sched"], c["optim"]["lr"], step, total, gb)
        z = model(x)
        loss = nt_xent(z[:gb], z[gb:], c["loss"]["temperature"])
        model.zero_grad(set_to_none=False)
        loss.backward()
        grad_norm = math.sqrt(sum(q.grad.double().pow(2).sum().item() for q in params))
        if not (math.isfinite(loss.item()) and math.isfinite(grad_norm)):
            sys.exit(f"simclr_torch.py: non-finite loss {loss.item()} or gradient norm {grad_norm} at step {step + 1}")
        if t["clip_grad_norm"] is not None and grad_norm > t["clip_grad_norm"]:
            with torch.no_grad():
                for q in params:
                    q.grad.mul_(t["clip_grad_norm"] / (grad_norm + 1e-6))
        step_optimizer(lr)
        if (step + 1) % c["log_every"] == 0 or step + 1 == total:
            print(f"step {step + 1}/{total}: loss {loss.item():.4f} lr {lr:.4g} grad_norm {grad_norm:.4g} "
                  f"({time.time() - window:.1f} s)", flush=True)
            window = time.time()
        if t["eval"] and ((step + 1) % per_epoch == 0 or step + 1 == total):
            run_eval(step + 1)

    wall = time.time() - started
    if len(results) >= 2:
        gains = ", ".join(f"{k} gain {results[-1][k] - results[0][k]:+.4f}" for k in results[0])
        print(gains)
    print(f"wall time {wall:.1f} s (training {wall - eval_seconds:.1f} s, evaluation {eval_seconds:.1f} s), "
          f"{ARGS.threads} threads")


if __name__ == "__main__":
    main()
