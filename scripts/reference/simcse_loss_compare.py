#!/usr/bin/env python3
"""Loss curves of SimCSE, allgrad against PyTorch: same weights, same batches, dropout off,
the same AdamW steps (learning-rate schedule and gradient clipping included).

1. Copies the model folder of the config (symlinks) with dropout 0 in its config.json, so
   both sides read the same weights and train without dropout.
2. Runs allgrad's `train` on the config for `--steps` steps with `train.shuffle=false` (the
   sampler's sequential order: step s takes samples s*B .. (s+1)*B of the file after
   `data.limit`), `log.every=1`, no evaluation; once on 1 rank and once on 2 ranks through
   `launch` (`--ranks 1,2`). The losses come from the run's metrics.jsonl.
3. With `model.mlp_head`, the head is a fresh parameter in allgrad (initialised from the
   seed and its name): its initial value is read from a one-step run with a learning rate of
   1e-30 (an update of at most 1e-30 leaves every f32 weight unchanged; zero biases may move
   to +-1e-30). The encoder's weights are read by transformers from the folder.
4. Trains the same steps with transformers' BertModel and a loss written independently
   (scripts/reference/simcse_torch.py: unsupervised sentences, or supervised triplets with hard
   negatives), torch.optim.AdamW and clip_grad_norm_, and prints per step the loss of the
   untrained model on that step's batch (what the updates change), PyTorch's loss and each
   allgrad run's loss with the absolute difference. Exits 1 when any |difference|
   exceeds `--tol` (default 1e-4).

    scripts/reference/simcse_loss_compare.sh                       (builds, then runs three cases)
    python3 scripts/reference/simcse_loss_compare.py --bin target/release [--config configs/simcse.yaml]
        [--ranks 1,2] [--steps 20] [--set loss.temperature=0.5]

Unsupervised with dropout off, both views of a sentence are the same vector: at temperature
0.05 the loss is about 1e-5 and its absolute difference says little; `--set
loss.temperature=0.5` gives a loss near 2.3 that every part of the step moves.

Needs the weights (scripts/data/get_minilm.sh) and a Python with torch, transformers, tokenizers,
safetensors and PyYAML. Correctness, not speed: minutes per case on 2 cores.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import torch
import yaml
from safetensors.torch import load_file

sys.dont_write_bytecode = True  # no __pycache__ in scripts/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simcse_torch import SimCse, read_sentences, read_triplets, simcse_loss, tokenize  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/simcse.yaml", help="an unsupervised simcse config")
    ap.add_argument("--bin", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"), "release"),
                    help="folder with allgrad's `train` and `launch` binaries")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ranks", default="1,2", help="allgrad runs to compare, by world size")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest allowed |loss difference|")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config overrides for both sides (e.g. optim.weight_decay=0.01)")
    ap.add_argument("--keep", help="keep the run folders here (default: a temporary folder)")
    return ap.parse_args()


def set_key(cfg, dotted, value):
    node = cfg
    *path, last = dotted.split(".")
    for k in path:
        node = node.setdefault(k, {})
    node[last] = value


def without_dropout(model_dir, dest):
    """A copy of `model_dir` (files symlinked) whose config.json turns dropout off."""
    os.makedirs(dest)
    for name in os.listdir(model_dir):
        if name != "config.json":
            os.symlink(os.path.abspath(os.path.join(model_dir, name)), os.path.join(dest, name))
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["hidden_dropout_prob"] = 0.0
    cfg["attention_probs_dropout_prob"] = 0.0
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def run_allgrad(args, overrides, out_dir, ranks, extra=()):
    """Runs `train` (through `launch` for more than one rank); returns {step: loss}."""
    train = [os.path.join(args.bin, "train"), "--config", args.config, "--output-dir", out_dir]
    for k, v in list(overrides.items()) + list(extra):
        train += ["--set", f"{k}={v}"]
    cmd = train if ranks == 1 else [os.path.join(args.bin, "launch"), "--nproc-per-node", str(ranks)] + train
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    losses = {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("loss") is not None:
                losses[r["step"]] = r["loss"]
    return losses


def lr_at(step, total, peak, sched):
    """allgrad's schedule (crates/allgrad-train/src/schedule.rs), step from 0."""
    warmup = sched.get("warmup_steps", 0)
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min((step - warmup) / max(total - warmup, 1), 1.0)
    low = peak * sched.get("final_fraction", 0.0)
    decay = sched.get("decay", "cosine")
    if decay == "constant":
        return peak
    if decay == "linear":
        return peak - (peak - low) * t
    return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * t))


def run_torch(cfg, model_dir, head, steps):
    m, d, t, o, s = cfg["model"], cfg["data"], cfg["train"], cfg["optim"], cfg.get("schedule", {})
    assert o["kind"] == "adamw", "the comparison covers optim.kind adamw"
    assert not s.get("scale_by_batch", False), "schedule.scale_by_batch is not replicated"
    tokenizer, max_len, limit = os.path.join(model_dir, "tokenizer.json"), m.get("max_len", 32), d.get("limit")
    if "triplets" in d:
        samples = read_triplets(os.path.join(ROOT, d["triplets"]))[:limit]
        columns = [tokenize(tokenizer, [x[v] for x in samples], max_len) for v in range(3)]
        pad_id, columns = columns[0][1], [c[0] for c in columns]
    else:
        rows, pad_id = tokenize(tokenizer, read_sentences(os.path.join(ROOT, d["sentences"]))[:limit], max_len)
        columns = [rows, rows]  # each sentence twice: views 0 and 1
    model = SimCse(model_dir, m.get("pooling", "cls_before_pooler"), m.get("mlp_head", True))
    model.train()  # dropout is 0 in the folder's config
    if model.head is not None:
        with torch.no_grad():
            model.head.weight.copy_(head["head.dense.weight"])
            model.head.bias.copy_(head["head.dense.bias"])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=o["lr"], betas=(o.get("beta1", 0.9), o.get("beta2", 0.999)),
                            eps=o.get("eps", 1e-8), weight_decay=o.get("weight_decay", 0.01))
    b = t["global_batch"]
    per_epoch = len(columns[0]) // b
    temperature = cfg.get("loss", {}).get("temperature", 0.05)
    hard_negative_weight = cfg.get("loss", {}).get("hard_negative_weight", 0.0)
    batches = [[c[(s % per_epoch) * b:(s % per_epoch + 1) * b] for c in columns] for s in range(steps)]
    with torch.no_grad():  # the same batches through the initial model: what training changes
        untrained = {s + 1: simcse_loss(model, v, pad_id, temperature, hard_negative_weight).item()
                     for s, v in enumerate(batches)}
    losses = {}
    for step, views in enumerate(batches):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, o["lr"], s)
        opt.zero_grad()
        loss = simcse_loss(model, views, pad_id, temperature, hard_negative_weight)
        loss.backward()
        if t.get("clip_grad_norm") is not None:
            torch.nn.utils.clip_grad_norm_(params, t["clip_grad_norm"])
        opt.step()
        losses[step + 1] = loss.item()
    return losses, untrained


def main():
    args = parse_args()
    with open(os.path.join(ROOT, args.config)) as f:
        cfg = yaml.safe_load(f)
    if cfg.get("method") != "simcse":
        sys.exit(f"{args.config}: needs method simcse")
    # Relative paths in a config are taken from its folder, as `train` takes them.
    folder = os.path.dirname(os.path.join(ROOT, args.config))
    for section, key in [("data", "sentences"), ("data", "triplets"), ("model", "dir")]:
        value = cfg.get(section, {}).get(key)
        if isinstance(value, str):
            cfg[section][key] = os.path.normpath(os.path.join(folder, value))
    if cfg.get("dtype", "f32") != "f32":
        sys.exit(f"{args.config}: the comparison runs in f32 (dtype: {cfg.get('dtype')})")
    work = args.keep or tempfile.mkdtemp(prefix="simcse_loss_compare.")
    os.makedirs(work, exist_ok=True)
    model_dir = os.path.join(work, "model-no-dropout")
    if os.path.exists(model_dir):
        shutil.rmtree(model_dir)
    without_dropout(os.path.join(ROOT, cfg["model"]["dir"]), model_dir)
    overrides = {"model.dir": model_dir, "train.shuffle": "false", "train.max_steps": args.steps,
                 "train.epochs": 0, "train.eval": "false", "log.every": 1, "log.plot": "false"}
    for kv in args.set:
        k, v = kv.split("=", 1)
        overrides[k] = v
    for k, v in overrides.items():
        set_key(cfg, k, yaml.safe_load(str(v)))

    head = {}
    if cfg["model"].get("mlp_head", True):
        init_dir = os.path.join(work, "init")
        run_allgrad(args, overrides, init_dir, 1, extra=[("optim.lr", "1e-30"), ("train.max_steps", 1)])
        ck = load_file(os.path.join(init_dir, "checkpoints", "step_1", "model.safetensors"))
        head = {k: v for k, v in ck.items() if k.startswith("head.")}

    ranks = [int(r) for r in args.ranks.split(",") if r]
    ours = {w: run_allgrad(args, overrides, os.path.join(work, f"allgrad-{w}"), w) for w in ranks}
    print("PyTorch: transformers BertModel, torch.optim.AdamW", flush=True)
    theirs, untrained = run_torch(cfg, model_dir, head, args.steps)

    header = f"{'step':>4}  {'untrained':>12}  {'PyTorch':>12}" + "".join(f"  {f'allgrad {w} rank':>14}  {'|diff|':>9}" for w in ranks)
    print(header)
    worst = 0.0
    for step in range(1, args.steps + 1):
        line = f"{step:>4}  {untrained[step]:>12.7f}  {theirs[step]:>12.7f}"
        for w in ranks:
            a = ours[w].get(step, float("nan"))
            diff = abs(a - theirs[step])
            worst = max(worst, diff) if not math.isnan(diff) else math.inf
            line += f"  {a:>14.7f}  {diff:>9.2e}"
        print(line)
    moved = max(abs(theirs[s] - untrained[s]) for s in theirs)
    print(f"(untrained: PyTorch's loss of the same batch before any update; training moved the loss by up to {moved:.2e})")
    ok = worst <= args.tol
    print(f"max |diff| = {worst:.2e} over {args.steps} steps and {len(ranks)} allgrad run(s): "
          f"{'OK' if ok else 'FAIL'} (tolerance {args.tol:g})")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
