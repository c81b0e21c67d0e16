#!/usr/bin/env python3
"""The torchvision side of scripts/bench/bench_loader.sh: SimCLR's two views at 224 with
torchvision's transforms on PIL images in a PyTorch DataLoader, what users run today; or
(`--pipeline eval`) the evaluation / CLIP view: decode, shortest side resized to 224 (bicubic),
the centre 224x224, ToTensor, Normalize with CLIP's statistics.

    python scripts/bench/bench_loader.py --images DIR loader --workers 2 --samples 512
    python scripts/bench/bench_loader.py --images DIR stages --samples 200
    python scripts/bench/bench_loader.py --images DIR --pipeline eval --name pillow-simd loader --workers 1

Prints the same RESULT lines as crates/allgrad-bench/src/bin/bench_loader.rs:
`RESULT\tloader\t<name>\t<workers>\t<samples/s>` and
`RESULT\tstage\t<name>\t<stage>\t<ms per sample>` (`loader-eval` and `stage-eval` for the
evaluation view), `<name>` from `--name` (default `torchvision`: the same script runs on plain
Pillow and on Pillow-SIMD, whichever the Python imports). The SimCLR recipe is the same: RandomResizedCrop
224 (scale 0.08-1, bilinear with antialiasing), flip 0.5, RandomApply(ColorJitter(0.4, 0.4, 0.4,
0.1), p 0.8), RandomGrayscale 0.2, RandomApply(GaussianBlur(23, (0.1, 2)), p 0.5), ToTensor,
Normalize with ImageNet's statistics. The DataLoader takes batches of --batch in file order
(shuffle off, as the Rust side) with --workers processes; one warm-up batch is not timed.
torch uses one thread per process (torch.set_num_threads(1), as DataLoader workers do).
"""

import argparse
import io
import time

import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets, transforms as T


def recipe(size):
    return T.Compose([
        T.RandomResizedCrop(size, scale=(0.08, 1.0)),
        T.RandomHorizontalFlip(),
        T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        T.RandomGrayscale(p=0.2),
        T.RandomApply([T.GaussianBlur(23, sigma=(0.1, 2.0))], p=0.5),
        T.ToTensor(),
        T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])


# CLIP's normalisation (OpenAI CLIP, OpenCLIP's default).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def eval_view(size):
    return T.Compose([
        T.Resize(size, interpolation=T.InterpolationMode.BICUBIC),
        T.CenterCrop(size),
        T.ToTensor(),
        T.Normalize(CLIP_MEAN, CLIP_STD),
    ])


class TwoViews:
    def __init__(self, t):
        self.t = t

    def __call__(self, img):
        return self.t(img), self.t(img)


def loader(args):
    torch.set_num_threads(1)
    transform = TwoViews(recipe(args.size)) if args.pipeline == "simclr" else eval_view(args.size)
    data = datasets.ImageFolder(f"{args.images}/train", transform=transform)
    total = args.samples + args.batch
    if total > len(data):
        raise SystemExit(f"{total} samples asked for (with a warm-up batch of {args.batch}), the set has {len(data)}")
    subset = torch.utils.data.Subset(data, range(total))
    dl = DataLoader(subset, batch_size=args.batch, shuffle=False, num_workers=args.workers,
                    prefetch_factor=2 if args.workers > 0 else None, drop_last=True)
    it = iter(dl)
    next(it)
    start = time.perf_counter()
    n = 0
    for views, _labels in it:
        n += (views[0] if isinstance(views, (list, tuple)) else views).shape[0]
    rate = n / (time.perf_counter() - start)
    print(f"RESULT\t{kind('loader', args)}\t{args.name}\t{args.workers}\t{rate:.1f}", flush=True)


def kind(base, args):
    return base if args.pipeline == "simclr" else f"{base}-eval"


def stages_eval(args):
    torch.set_num_threads(1)
    data = datasets.ImageFolder(f"{args.images}/train")
    resize = T.Compose([T.Resize(args.size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(args.size)])
    tensor = T.Compose([T.ToTensor(), T.Normalize(CLIP_MEAN, CLIP_STD)])
    names = ["read", "decode", "resize+crop", "to tensor"]
    secs = [0.0] * 4
    n = min(args.samples, len(data))
    for i in range(n):
        path = data.samples[i][0]
        t = time.perf_counter()
        with open(path, "rb") as f:
            raw = f.read()
        secs[0] += time.perf_counter() - t
        t = time.perf_counter()
        img = Image.open(io.BytesIO(raw)).convert("RGB")
        secs[1] += time.perf_counter() - t
        t = time.perf_counter()
        x = resize(img)
        secs[2] += time.perf_counter() - t
        t = time.perf_counter()
        tensor(x)
        secs[3] += time.perf_counter() - t
    for name, s in zip(names, secs):
        print(f"RESULT\tstage-eval\t{args.name}\t{name}\t{s / n * 1e3:.3f}")
    print(f"RESULT\tstage-eval\t{args.name}\ttotal\t{sum(secs) / n * 1e3:.3f}", flush=True)


def stages(args):
    torch.set_num_threads(1)
    data = datasets.ImageFolder(f"{args.images}/train")
    crop = T.Compose([T.RandomResizedCrop(args.size, scale=(0.08, 1.0)), T.RandomHorizontalFlip()])
    jitter = T.Compose([T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8), T.RandomGrayscale(p=0.2)])
    blur = T.RandomApply([T.GaussianBlur(23, sigma=(0.1, 2.0))], p=0.5)
    tensor = T.Compose([T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    names = ["read", "decode", "crop+resize", "jitter", "blur", "to tensor"]
    secs = [0.0] * 6
    n = min(args.samples, len(data))
    torch.manual_seed(0)
    for i in range(n):
        path = data.samples[i][0]
        t = time.perf_counter()
        with open(path, "rb") as f:
            raw = f.read()
        secs[0] += time.perf_counter() - t
        t = time.perf_counter()
        img = Image.open(io.BytesIO(raw)).convert("RGB")  # what ImageFolder's loader does
        secs[1] += time.perf_counter() - t
        for _view in range(2):
            x = img
            for k, stage in ((2, crop), (3, jitter), (4, blur), (5, tensor)):
                t = time.perf_counter()
                x = stage(x)
                secs[k] += time.perf_counter() - t
    for name, s in zip(names, secs):
        print(f"RESULT\tstage\t{args.name}\t{name}\t{s / n * 1e3:.3f}")
    print(f"RESULT\tstage\t{args.name}\ttotal\t{sum(secs) / n * 1e3:.3f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", required=True)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--pipeline", choices=["simclr", "eval"], default="simclr")
    ap.add_argument("--name", default="torchvision", help="the name on the RESULT lines")
    sub = ap.add_subparsers(dest="mode", required=True)
    lo = sub.add_parser("loader")
    lo.add_argument("--workers", type=int, default=1)
    lo.add_argument("--samples", type=int, default=512)
    lo.add_argument("--batch", type=int, default=64)
    st = sub.add_parser("stages")
    st.add_argument("--samples", type=int, default=200)
    args = ap.parse_args()
    if args.mode == "loader":
        loader(args)
    elif args.pipeline == "simclr":
        stages(args)
    else:
        stages_eval(args)


if __name__ == "__main__":
    main()
