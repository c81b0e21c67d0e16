#!/usr/bin/env python3
"""Writes the loader benchmark's image set: ImageNet-like JPEGs made from the two photographs
scikit-learn ships (sklearn.datasets.load_sample_images: china.jpg and flower.jpg, 640x427,
licence CC BY 2.0 as stated in scikit-learn's documentation), never downloaded.

    python scripts/data/make_loader_images.py OUT [--count 2000] [--classes 10] [--seed 0]

Each image is a random window of one photograph (area 35-100% of it, landscape 4:3 or, one
time in five, portrait 3:4), resized to 500x375 (375x500), flipped at random, its colours
scaled by a few percent, with faint Gaussian noise (sigma 5, like a camera's) to give the
files a photograph's entropy (about 63 kB each; ImageNet's average file is about 110 kB at a
similar size, so decoding here is a little faster than there), and saved as a baseline JPEG
of quality 90 (4:2:0). Everything is drawn from numpy's generator seeded with --seed and the
image's number, so the set is the same on every machine with the same Pillow. The layout is
an image folder: OUT/train/class_<k>/<n>.jpg, image n in class n % classes.

scripts/bench/bench_loader.sh runs this in its own virtual environment (scikit-learn, Pillow).
"""

import argparse
import os

import numpy as np
from PIL import Image
from sklearn.datasets import load_sample_images


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    photos = [Image.fromarray(a) for a in load_sample_images().images]
    total = 0
    for n in range(args.count):
        rng = np.random.default_rng([args.seed, n])
        photo = photos[int(rng.integers(len(photos)))]
        pw, ph = photo.size
        portrait = rng.random() < 0.2
        aspect = 3 / 4 if portrait else 4 / 3
        area = rng.uniform(0.35, 1.0) * pw * ph
        w = int(min(pw, round((area * aspect) ** 0.5)))
        h = int(min(ph, round(w / aspect)))
        w = int(round(h * aspect))
        x = int(rng.integers(pw - w + 1))
        y = int(rng.integers(ph - h + 1))
        size = (375, 500) if portrait else (500, 375)
        img = photo.crop((x, y, x + w, y + h)).resize(size, Image.BICUBIC)
        if rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        a = np.asarray(img, dtype=np.float32)
        a = a * rng.uniform(0.9, 1.1, size=3) + rng.normal(0.0, 5.0, size=a.shape)
        img = Image.fromarray(np.clip(a + 0.5, 0, 255).astype(np.uint8))
        folder = os.path.join(args.out, "train", f"class_{n % args.classes}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{n:05d}.jpg")
        img.save(path, quality=90, subsampling=2)
        total += os.path.getsize(path)
    print(f"{args.count} JPEGs in {args.out}/train ({args.classes} classes), {total / args.count / 1000:.0f} kB on average")


if __name__ == "__main__":
    main()
