#!/usr/bin/env python3
"""Writes the photographs of the CLIP preprocessing test
(crates/allgrad-models/tests/data/clip-images/): small windows of the two photographs
scikit-learn ships (sklearn/datasets/images/china.jpg and flower.jpg, 640x427, CC BY 2.0 as
stated in scikit-learn's images/README.txt), in several aspect ratios, as baseline JPEGs
(quality 90, 4:2:0), one grayscale JPEG and one PNG. Never downloaded: the photographs are
read from an installed scikit-learn, or from the folder given (the files of its wheel).

    python scripts/data/make_clip_images.py [--photos DIR] [--out crates/allgrad-models/tests/data/clip-images]

The same bytes on every run with the same Pillow (13.0.0 wrote the committed files).
"""

import argparse
import os

from PIL import Image

# name, photograph, window (left, top, right, bottom), size written, mode, format
FIXTURES = [
    ("wide.jpg", "china.jpg", (0, 100, 640, 388), (200, 90), "RGB", "JPEG"),
    ("tall.jpg", "flower.jpg", (200, 0, 456, 427), (96, 160), "RGB", "JPEG"),
    ("square.jpg", "china.jpg", (250, 60, 550, 360), (120, 120), "RGB", "JPEG"),
    ("small.jpg", "flower.jpg", (100, 50, 500, 350), (50, 37), "RGB", "JPEG"),
    ("gray.jpg", "china.jpg", (300, 0, 640, 427), (100, 126), "L", "JPEG"),
    ("photo.png", "flower.jpg", (0, 0, 640, 427), (150, 100), "RGB", "PNG"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--photos", help="folder holding china.jpg and flower.jpg (default: scikit-learn's)")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "../../crates/allgrad-models/tests/data/clip-images"))
    args = ap.parse_args()
    photos = args.photos
    if photos is None:
        import sklearn.datasets

        photos = os.path.join(os.path.dirname(sklearn.datasets.__file__), "images")
    os.makedirs(args.out, exist_ok=True)
    for name, photo, window, size, mode, fmt in FIXTURES:
        img = Image.open(os.path.join(photos, photo)).convert("RGB").crop(window).resize(size, Image.Resampling.LANCZOS)
        img = img.convert(mode)
        path = os.path.join(args.out, name)
        if fmt == "JPEG":
            img.save(path, "JPEG", quality=90, subsampling="4:2:0", optimize=False, progressive=False)
        else:
            img.save(path, "PNG")
        print(f"{path}: {img.size[0]}x{img.size[1]} {mode}, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
