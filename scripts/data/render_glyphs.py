#!/usr/bin/env python3
"""Renders CJK glyphs as a face-recognition stand-in: every character is one identity and
every font style is one "photo" of it (Noto Sans CJK and Noto Serif CJK, Regular and Bold,
each with its Japanese, Korean, Simplified and Traditional Chinese glyph forms: 16 photos),
with a small per-photo shift and size change. Writes MNIST-style IDX files (images: unsigned
bytes; labels: 32-bit integers, IDX type 0x0C) to OUT/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz:
the first TRAIN identities for training, the next TEST for open-set verification (disjoint).

The fonts come from Debian's `fonts-noto-cjk` (SIL Open Font License 1.1):
    apt-get download fonts-noto-cjk && dpkg -x fonts-noto-cjk_*.deb fonts
    python scripts/data/render_glyphs.py fonts/usr/share/fonts/opentype/noto data/glyphs [TRAIN TEST SIZE]
Needs Pillow (pip install pillow); only this script does.
"""
import gzip
import hashlib
import struct
import sys
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

FIRST = 0x4E00  # CJK Unified Ideographs
FACES = [("NotoSansCJK-Regular.ttc", "Sans Regular"), ("NotoSansCJK-Bold.ttc", "Sans Bold"),
         ("NotoSerifCJK-Regular.ttc", "Serif Regular"), ("NotoSerifCJK-Bold.ttc", "Serif Bold")]
REGIONS = [(0, "JP"), (1, "KR"), (2, "SC"), (3, "TC")]


def jitter(code, photo):
    h = hashlib.sha256(f"{code}:{photo}".encode()).digest()
    return h[0] % 5 - 2, h[1] % 5 - 2, h[2] % 5 - 2  # dx, dy, size change


def render(font_dir, code, photo, size, cache):
    face, region = FACES[photo // len(REGIONS)], REGIONS[photo % len(REGIONS)]
    dx, dy, ds = jitter(code, photo)
    key = (face[0], region[0], size - 6 + ds)
    if key not in cache:
        cache[key] = ImageFont.truetype(str(font_dir / face[0]), key[2], index=region[0])
    font = cache[key]
    img = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(img)
    l, t, r, b = draw.textbbox((0, 0), chr(code), font=font)
    draw.text(((size - (r - l)) / 2 - l + dx, (size - (b - t)) / 2 - t + dy), chr(code), fill=255, font=font)
    return img.tobytes()


def write(out, prefix, images, labels, size):
    with gzip.open(out / f"{prefix}-images-idx3-ubyte.gz", "wb", compresslevel=9) as f:
        f.write(struct.pack(">IIII", 0x803, len(labels), size, size))
        f.write(b"".join(images))
    with gzip.open(out / f"{prefix}-labels-idx1-ubyte.gz", "wb", compresslevel=9) as f:
        f.write(struct.pack(">II", 0xC01, len(labels)))
        f.write(struct.pack(f">{len(labels)}i", *labels))


def main():
    font_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    train, test, size = (int(a) for a in (sys.argv[3:6] + ["3000", "600", "32"][len(sys.argv[3:6]):]))
    out.mkdir(parents=True, exist_ok=True)
    cache = {}
    photos = len(FACES) * len(REGIONS)
    for prefix, first, count in [("train", 0, train), ("t10k", train, test)]:
        images, labels = [], []
        for ident in range(count):
            code = FIRST + first + ident
            for p in range(photos):
                images.append(render(font_dir, code, p, size, cache))
                labels.append(ident)
        write(out, prefix, images, labels, size)
        print(f"{prefix}: {count} identities x {photos} photos, {size}x{size}")


if __name__ == "__main__":
    main()
