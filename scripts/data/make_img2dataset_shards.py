#!/usr/bin/env python3
"""Writes image-caption webdataset shards in img2dataset's layout, with the Python `webdataset`
package's own writer (`webdataset.TarWriter`, 1.0.2), for the test that reads them through
CLIP's data path (crates/allgrad-train/tests/train/clip_img2dataset.rs).

    python scripts/data/make_img2dataset_shards.py OUT [--samples 48] [--per-shard 12] [--format jpg|webp]

img2dataset's layout: shards OUT/00000.tar, OUT/00001.tar, ...; in each, per sample,
KEY.jpg (or KEY.webp), KEY.txt (the caption) and KEY.json (url, key, status, width, height,
original size, sha256 of the image, caption), in that order; the key is the shard's number
in 5 digits and the sample's number in its shard in 4 (`000010003`: shard 1, sample 3). Beside
each shard, NNNNN_stats.json as img2dataset writes it (counts), which a reader of the shards
must leave alone.

The images are synthetic, of flat gray (R = G = B) so that each sample's image names its key:
sample n's level is 10 + 5 n (n < 48); sizes vary (aspect ratios from 3:4 to 2:1). JPEG at
quality 95 (img2dataset's default), WebP lossy at quality 95. The captions are the demo's
class names in the demo's templates, a different (template, name) for every sample.
OUT/manifest.json lists, per sample in writing order: key, shard, caption, level, width, height.
Needs webdataset, Pillow (with WebP for --format webp) and nothing else.
"""

import argparse
import hashlib
import io
import json
import os

import webdataset as wds
from PIL import Image

NAMES = [
    "t-shirt", "tee", "top", "trousers", "pants", "slacks", "pullover", "sweater", "jumper", "dress",
    "gown", "frock", "coat", "jacket", "parka", "sandal", "sandals", "flip-flop", "shirt", "blouse",
    "button-up", "sneaker", "trainer", "running shoe", "bag", "handbag", "purse", "ankle boot", "boot", "boots",
]
TEMPLATES = [
    "a photo of a {}.",
    "a photo of the {}.",
    "a picture of a {}.",
    "an image of a {}.",
    "a {} on a white background.",
    "a small {}.",
    "a product photo of a {}.",
    "a gray {}.",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--per-shard", type=int, default=12)
    ap.add_argument("--format", choices=["jpg", "webp"], default="jpg")
    args = ap.parse_args()
    if args.samples > 48:
        raise SystemExit("at most 48 samples (one gray level each)")
    os.makedirs(args.out, exist_ok=True)
    manifest = []
    sizes = [(32, 32), (40, 30), (30, 40), (48, 24), (36, 28)]
    shards = (args.samples + args.per_shard - 1) // args.per_shard
    for shard in range(shards):
        first = shard * args.per_shard
        count = min(args.per_shard, args.samples - first)
        with wds.TarWriter(os.path.join(args.out, f"{shard:05d}.tar")) as sink:
            for i in range(count):
                n = first + i
                key = f"{shard:05d}{i:04d}"
                level = 10 + 5 * n
                width, height = sizes[n % len(sizes)]
                img = Image.new("RGB", (width, height), (level, level, level))
                buf = io.BytesIO()
                if args.format == "jpg":
                    img.save(buf, format="JPEG", quality=95)
                else:
                    img.save(buf, format="WEBP", quality=95)
                data = buf.getvalue()
                caption = TEMPLATES[n % len(TEMPLATES)].format(NAMES[n % len(NAMES)])
                meta = {
                    "url": f"images/{key}.{args.format}",
                    "key": key,
                    "status": "success",
                    "error_message": None,
                    "width": width,
                    "height": height,
                    "original_width": width * 4,
                    "original_height": height * 4,
                    "exif": None,
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "caption": caption,
                }
                sink.write({"__key__": key, args.format: data, "txt": caption, "json": meta})
                manifest.append(
                    {"key": key, "shard": f"{shard:05d}.tar", "caption": caption, "level": level, "width": width, "height": height}
                )
        stats = {"count": count, "successes": count, "failed_to_download": 0, "failed_to_resize": 0}
        with open(os.path.join(args.out, f"{shard:05d}_stats.json"), "w") as f:
            json.dump(stats, f, indent=4)
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"{{00000..{shards - 1:05d}}}.tar")


if __name__ == "__main__":
    main()
