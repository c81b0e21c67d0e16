#!/usr/bin/env python3
"""Writes the bundled glyph identities (data/glyphs) in insightface's formats, for
configs/face_recordio.yaml:

    python scripts/data/make_face_recordio.py [GLYPHS_DIR] [OUT_DIR] [--pairs N] [--writer mxnet|format]

(defaults: data/glyphs, data/glyphs-recordio, 3000 pairs, `format`). Needs a Python with NumPy
and Pillow (the PyTorch environment of scripts/ci/get_torch.sh has both).

- OUT_DIR/train.rec, train.idx, property: the 32,000 training images (identities 0..1999), one
  record each in file order, an IRHeader with the scalar label and the image as a grayscale JPEG
  (quality 95), as insightface's MS1M/Glint360K `train.rec` hold their faces; `property` is
  "2000,32,32". Written by scripts/reference/recordio_write.py's writer: MXNet's own
  `mxnet.recordio` with --writer mxnet (scripts/ci/get_mxnet.sh), else the writer that follows the
  published format (byte-identical to MXNet's on the reference test's records).
- OUT_DIR/glyphs_val.bin: a verification set of the 500 held-out identities (data/glyphs' test
  split) as insightface's `.bin` files are: a pickle of (list of JPEG bytes, list of bool), pair i
  images 2i and 2i+1. Half the pairs show one identity in two photos (styles), half two
  identities, in an order drawn from a seeded generator (random.Random(54)).

Deterministic: the same inputs give the same bytes.
"""

import argparse
import gzip
import io
import os
import pickle
import random
import struct
import sys

from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
import recordio_write  # noqa: E402


def read_idx(images, labels):
    with gzip.open(images) as f:
        magic, n, rows, cols = struct.unpack(">IIII", f.read(16))
        assert magic == 0x803, images
        pixels = f.read()
    with gzip.open(labels) as f:
        magic, m = struct.unpack(">II", f.read(8))
        raw = f.read()
    assert m == n, (images, labels)
    labs = list(struct.unpack(">%di" % n, raw)) if magic == 0xC01 else list(raw)
    size = rows * cols
    return [pixels[i * size:(i + 1) * size] for i in range(n)], labs, rows, cols


def jpeg(raw, rows, cols):
    buf = io.BytesIO()
    Image.frombytes("L", (cols, rows), raw).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("glyphs", nargs="?", default="data/glyphs")
    ap.add_argument("out", nargs="?", default="data/glyphs-recordio")
    ap.add_argument("--pairs", type=int, default=3000)
    ap.add_argument("--writer", choices=["mxnet", "format"], default="format")
    args = ap.parse_args()
    g = args.glyphs
    imgs, labs, rows, cols = read_idx(os.path.join(g, "train-images-idx3-ubyte.gz"), os.path.join(g, "train-labels-idx1-ubyte.gz"))
    w, pack = recordio_write.writer(args.writer, args.out)
    for k, (raw, lab) in enumerate(zip(imgs, labs)):
        w.write_idx(k, pack(float(lab), jpeg(raw, rows, cols), k))
    w.close()
    classes = max(labs) + 1
    with open(os.path.join(args.out, "property"), "w") as f:
        f.write("%d,%d,%d\n" % (classes, rows, cols))

    timgs, tlabs, _, _ = read_idx(os.path.join(g, "t10k-images-idx3-ubyte.gz"), os.path.join(g, "t10k-labels-idx1-ubyte.gz"))
    by_id = {}
    for i, lab in enumerate(tlabs):
        by_id.setdefault(lab, []).append(i)
    ids = sorted(by_id)
    rng = random.Random(54)
    bins, issame = [], []
    for p in range(args.pairs):
        same = p % 2 == 0
        a = rng.choice(ids)
        if same:
            i, j = rng.sample(by_id[a], 2)
        else:
            b = rng.choice([x for x in ids if x != a])
            i, j = rng.choice(by_id[a]), rng.choice(by_id[b])
        bins += [jpeg(timgs[i], rows, cols), jpeg(timgs[j], rows, cols)]
        issame.append(same)
    with open(os.path.join(args.out, "glyphs_val.bin"), "wb") as f:
        pickle.dump((bins, issame), f, protocol=pickle.HIGHEST_PROTOCOL)
    print("%d records of %d identities, %d verification pairs in %s" % (len(imgs), classes, len(issame), args.out))


if __name__ == "__main__":
    main()
