#!/usr/bin/env python3
"""OpenCLIP's training recipe in PyTorch, the reference of allgrad's CLIP trainer
(tests/repo/clip_recipe_parity.rs runs it through ALLGRAD_PYTHON).

    $PYTHON scripts/reference/clip_recipe_parity.py data --out DIR [--samples 36]
    $PYTHON scripts/reference/clip_recipe_parity.py train --model data/clip-tiny --data DIR \
        --world 2 --steps 6 --batch 12 --loss clip --lr 2e-3 --warmup 2 --wd 0.2 \
        --groups '[{"params": ["logit_scale"], "lr_scale": 400}]' --out DIR/torch

`data` writes DIR/pairs.csv (header `image,caption`) and DIR/img/NNN.png: the first Fashion-MNIST
training images of data/fashion-mnist as 28x28 grayscale PNGs, each captioned from its class
("a photo of a trouser.").

`train` runs `--world` gloo ranks (CPU, float64), each a process, of the loop OpenCLIP's
open_clip_train/train.py runs, on transformers' CLIPModel loaded from `--model` (the same folder
allgrad starts from, `model.pretrained: true`):

- the model in DistributedDataParallel, which averages the gradients over the ranks;
- the global batch of step s is pairs (s mod steps-per-epoch) * B .. + B of the CSV, in order
  (allgrad's `train.shuffle: false`), rank r taking the r-th contiguous slice;
- features: CLIPModel's `image_embeds` and `text_embeds` (projected and normalised), the logit
  scale `exp(logit_scale)` uncapped, as OpenCLIP's CLIP.forward returns it;
- the loss: OpenCLIP's own `ClipLoss(local_loss=True, gather_with_grad=True)` or
  `SigLipLoss()` (its default exchange between neighbours) with a `logit_bias` parameter
  (initial -10, allgrad's `loss.siglip_bias_init`) on the same CLIP towers;
- torch.optim.AdamW with OpenCLIP's parameter groups (main.py: `p.ndim < 2 or "bn" in n or
  "ln" in n or "bias" in n or "logit_scale" in n` take no weight decay, the rest `--wd`),
  split further by `--groups` (allgrad's `param_groups.groups`: name patterns, each with its
  `lr_scale`, its `weight_decay` for every parameter of it, or `frozen`: requires_grad off and
  left out of the optimizer);
- OpenCLIP's own schedule, open_clip_train.scheduler.cosine_lr (warmup, then half a cosine to
  0), called before every step as train.py does; it sets every group's rate, which is then
  multiplied by the group's `lr_scale`;
- after every step, as train.py: `logit_scale.clamp_(0, math.log(100))`.

Writes OUT.safetensors (every parameter after the last step, float64, transformers' names, the
frozen ones included) and OUT.json (the loss of every step: the mean over ranks of the local
losses, which is the global batch's; and `logit_scale` after every step).

OpenCLIP's loss.py is loaded from its file: the package's __init__ imports its tokenizer and
image transforms, whose requirements (ftfy, regex, torchvision) the environment does not hold
(scripts/ci/get_torch.sh installs open-clip-torch with --no-deps); loss.py needs torch only.
"""
import argparse
import csv
import fnmatch
import gzip
import importlib.util
import json
import math
import os
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist

CLASSES = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot"]
MISSING = 3  # exit status when open-clip-torch is not installed


def openclip_modules():
    """OpenCLIP's loss module (from its file) and its cosine schedule."""
    try:
        spec = importlib.util.find_spec("open_clip")
        from open_clip_train.scheduler import cosine_lr
    except ImportError:
        spec, cosine_lr = None, None
    if spec is None or cosine_lr is None:
        print("open-clip-torch is not installed in this Python: run scripts/ci/get_torch.sh", file=sys.stderr)
        sys.exit(MISSING)
    path = os.path.join(os.path.dirname(spec.origin), "loss.py")
    loss_spec = importlib.util.spec_from_file_location("openclip_loss", path)
    loss = importlib.util.module_from_spec(loss_spec)
    loss_spec.loader.exec_module(loss)
    return loss, cosine_lr


def make_data(a):
    from PIL import Image

    root = os.path.join(os.path.dirname(__file__), "..", "..", "data", "fashion-mnist")
    with gzip.open(os.path.join(root, "train-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), dtype=np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(os.path.join(root, "train-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), dtype=np.uint8, offset=8)
    os.makedirs(os.path.join(a.out, "img"), exist_ok=True)
    with open(os.path.join(a.out, "pairs.csv"), "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["image", "caption"])
        for i in range(a.samples):
            name = f"img/{i:03d}.png"
            Image.fromarray(images[i], mode="L").save(os.path.join(a.out, name))
            w.writerow([name, f"a photo of a {CLASSES[labels[i]]}."])


def pixels(path, mean=0.5, std=0.5):
    """A grayscale PNG as allgrad's `Pixels::chw` computes it: (p / 255 - mean) / std in f32."""
    from PIL import Image

    p = torch.from_numpy(np.asarray(Image.open(path).convert("L"), dtype=np.uint8).copy()).to(torch.float32)
    m, s = torch.tensor(mean, dtype=torch.float32), torch.tensor(std, dtype=torch.float32)
    return ((p / torch.tensor(255.0, dtype=torch.float32) - m) / s).unsqueeze(0)


def param_groups(model, wd, groups):
    """OpenCLIP's two groups (main.py's exclude rule), each parameter of a `groups` entry moved to
    that entry's group; frozen ones switched off and left out."""
    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
    buckets = {}
    for n, p in model.named_parameters():
        owners = [i for i, g in enumerate(groups) if any(fnmatch.fnmatchcase(n, pat) for pat in g["params"])]
        assert len(owners) <= 1, f"{n} is in groups {owners}"
        g = groups[owners[0]] if owners else {}
        if g.get("frozen"):
            p.requires_grad_(False)
            continue
        decay = g.get("weight_decay", 0.0 if exclude(n, p) else wd)
        key = (owners[0] if owners else -1, decay)
        buckets.setdefault(key, {"params": [], "weight_decay": decay, "lr_scale": g.get("lr_scale", 1.0), "names": []})
        buckets[key]["params"].append(p)
        buckets[key]["names"].append(n)
    return list(buckets.values())


def rank_main(rank, a, port):
    from safetensors.torch import save_file
    from transformers import CLIPModel, CLIPTokenizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=a.world)
    W = a.world
    loss_mod, cosine_lr = openclip_modules()
    model = CLIPModel.from_pretrained(a.model).double()
    tok = CLIPTokenizer.from_pretrained(a.model)
    if a.loss == "siglip":
        model.logit_bias = torch.nn.Parameter(torch.tensor(a.bias_init, dtype=torch.float64))
    groups = param_groups(model, a.wd, json.loads(a.groups))
    ddp = DDP(model)
    opt = torch.optim.AdamW(
        [{k: v for k, v in g.items() if k != "names"} for g in groups], lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps
    )
    scheduler = cosine_lr(opt, a.lr, a.warmup, a.steps)
    if a.loss == "clip":
        loss_fn = loss_mod.ClipLoss(local_loss=True, gather_with_grad=True, cache_labels=True, rank=rank, world_size=W)
    else:
        loss_fn = loss_mod.SigLipLoss(rank=rank, world_size=W)
    with open(os.path.join(a.data, "pairs.csv"), encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    per_epoch = len(rows) // a.batch
    b = a.batch // W
    losses, scales = [], []
    for step in range(a.steps):
        scheduler(step)
        for g in opt.param_groups:
            g["lr"] = g["lr"] * g["lr_scale"]
        first = (step % per_epoch) * a.batch + rank * b
        mine = rows[first:first + b]
        px = torch.stack([pixels(os.path.join(a.data, r["image"])) for r in mine]).double()
        enc = tok([r["caption"] for r in mine], padding=True, truncation=True,
                  max_length=model.config.text_config.max_position_embeddings, return_tensors="pt")
        out = ddp(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], pixel_values=px)
        scale = model.logit_scale.exp()
        if a.loss == "clip":
            loss = loss_fn(out.image_embeds, out.text_embeds, scale)
        else:
            loss = loss_fn(out.image_embeds, out.text_embeds, scale, model.logit_bias)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / W)
        scales.append(model.logit_scale.item())
    if rank == 0:
        params = {n: p.detach().contiguous() for n, p in model.named_parameters()}
        save_file(params, a.out + ".safetensors")
        groups_out = [{"names": g["names"], "weight_decay": g["weight_decay"], "lr_scale": g["lr_scale"]} for g in groups]
        with open(a.out + ".json", "w", encoding="utf-8") as f:
            json.dump({"losses": losses, "logit_scale": scales, "groups": groups_out}, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("--out", required=True)
    d.add_argument("--samples", type=int, default=36)
    t = sub.add_parser("train")
    t.add_argument("--model", required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--world", type=int, default=2)
    t.add_argument("--steps", type=int, default=6)
    t.add_argument("--batch", type=int, default=12)
    t.add_argument("--loss", choices=["clip", "siglip"], default="clip")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--beta1", type=float, default=0.9)
    t.add_argument("--beta2", type=float, default=0.98)
    t.add_argument("--eps", type=float, default=1e-6)
    t.add_argument("--wd", type=float, default=0.2)
    t.add_argument("--warmup", type=int, default=2)
    t.add_argument("--bias-init", type=float, default=-10.0)
    t.add_argument("--groups", default="[]", help="JSON list of {params, lr_scale, weight_decay, frozen}")
    a = ap.parse_args()
    if a.cmd == "data":
        return make_data(a)
    openclip_modules()  # fail early, before any process starts, when it is missing
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_main, args=(a, port), nprocs=a.world, join=True)


if __name__ == "__main__":
    main()
