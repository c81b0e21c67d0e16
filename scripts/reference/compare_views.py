#!/usr/bin/env python3
"""How far allgrad's views are from torchvision's on the same crop box and the same random
factors, stage by stage, on the loader benchmark's images (scripts/bench/bench_loader.sh makes them).

    target/release/bench_loader --images data/loader-bench decoded --samples 50 --out /tmp/decoded.bin
    python scripts/reference/compare_views.py --images data/loader-bench --decoded /tmp/decoded.bin

allgrad computes every stage after the decode in float (values in [0, 1]) with the formulas of
torchvision's tensor functions; torchvision's usual pipeline (the benchmark's peer) works on PIL
images and rounds to 8 bits after each stage. So each difference below is measured as
torchvision's PIL path against the same torchvision function on a float tensor (which is
allgrad's arithmetic: the resize is PIL's bilinear filter with antialiasing, computed in floats,
checked against PIL's float-image resize in crates/allgrad-data/src/augment/crop.rs; the jitter
functions are torchvision's tensor formulas, checked in jitter.rs; the blur kernel and the
reflected borders are torchvision's). The decode compares Pillow (libjpeg-turbo) with
allgrad's zune-jpeg on the same files. Differences are in 8-bit levels (1 level = 1/255),
before normalisation: mean and largest absolute difference over all pixel values, and the
share of values that differ by more than one level.

Needs torch, torchvision and Pillow (the benchmark's environment).
"""

import argparse
import struct

import numpy as np
import torch
import torchvision.transforms.functional as F
from PIL import Image
from torchvision import datasets


def levels(a, b):
    d = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) * 255.0
    return d


def to_float(pil):
    return torch.from_numpy(np.asarray(pil, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()


def to_unit(pil):
    return np.asarray(pil, dtype=np.float64).transpose(2, 0, 1) / 255.0


def report(name, diffs):
    d = np.concatenate([x.ravel() for x in diffs])
    print(f"{name:<22} mean {d.mean():6.3f}  max {d.max():6.2f}  >1 level {100 * (d > 1.0).mean():6.2f}%")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", required=True)
    ap.add_argument("--decoded", help="bench_loader's `decoded` file for the same images")
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args()
    data = datasets.ImageFolder(f"{args.images}/train")
    rng = np.random.default_rng(0)
    out = {k: [] for k in ["decode", "crop+resize", "brightness", "contrast", "saturation", "hue", "grayscale", "blur (23 taps)"]}
    decoded = open(args.decoded, "rb").read() if args.decoded else None
    at = 0
    for i in range(min(args.samples, len(data))):
        pil = Image.open(data.samples[i][0]).convert("RGB")
        if decoded is not None:
            w, h = struct.unpack_from("<II", decoded, at)
            ours = np.frombuffer(decoded, dtype=np.uint8, count=w * h * 3, offset=at + 8).reshape(h, w, 3)
            at += 8 + w * h * 3
            out["decode"].append(levels(ours / 255.0, np.asarray(pil) / 255.0))
        W, H = pil.size
        # A box as RandomResizedCrop draws them (area 8-100 %, ratio 3/4-4/3).
        area = rng.uniform(0.08, 1.0) * W * H
        ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        w = int(min(W, round((area * ratio) ** 0.5)))
        h = int(min(H, round((area / ratio) ** 0.5)))
        top, left = int(rng.integers(H - h + 1)), int(rng.integers(W - w + 1))
        size = [args.size, args.size]
        crop_pil = F.resized_crop(pil, top, left, h, w, size)  # 8 bits, PIL's bilinear
        crop_f = F.resized_crop(to_float(pil), top, left, h, w, size, antialias=True)  # floats
        out["crop+resize"].append(levels(to_unit(crop_pil), crop_f.numpy()))
        # Each jitter operation on the same (PIL-rounded) crop, the same factor.
        x_pil, x_f = crop_pil, to_float(crop_pil)
        for name, fn, lo, hi in [
            ("brightness", F.adjust_brightness, 0.6, 1.4),
            ("contrast", F.adjust_contrast, 0.6, 1.4),
            ("saturation", F.adjust_saturation, 0.6, 1.4),
            ("hue", F.adjust_hue, -0.1, 0.1),
        ]:
            f = float(rng.uniform(lo, hi))
            out[name].append(levels(to_unit(fn(x_pil, f)), fn(x_f, f).numpy()))
        g_pil = F.rgb_to_grayscale(x_pil, num_output_channels=3)
        g_f = F.rgb_to_grayscale(x_f, num_output_channels=3)
        out["grayscale"].append(levels(to_unit(g_pil), g_f.numpy()))
        sigma = float(rng.uniform(0.1, 2.0))
        b_pil = F.gaussian_blur(x_pil, [23, 23], [sigma, sigma])
        b_f = F.gaussian_blur(x_f, [23, 23], [sigma, sigma])
        out["blur (23 taps)"].append(levels(to_unit(b_pil), b_f.numpy()))
    n = min(args.samples, len(data))
    print(f"torchvision's PIL pipeline against float arithmetic (allgrad's), {n} images, in 8-bit levels:")
    for name, diffs in out.items():
        if diffs:
            report(name, diffs)


if __name__ == "__main__":
    main()
