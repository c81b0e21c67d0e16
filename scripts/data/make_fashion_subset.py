#!/usr/bin/env python3
"""Writes the Fashion-MNIST subset bundled in data/fashion-mnist/.

Takes the FIRST 10,000 training and the FIRST 2,000 test images (and their labels) of the
full Fashion-MNIST set, in file order (no shuffling, no class balancing), and writes them as
gzipped IDX files with the standard names, so allgrad's IDX reader opens them like the
originals:

    train-images-idx3-ubyte.gz  train-labels-idx1-ubyte.gz
    t10k-images-idx3-ubyte.gz   t10k-labels-idx1-ubyte.gz

The output is byte-for-byte reproducible: gzip level 9, no file name and mtime 0 in the gzip
header. Only the Python standard library is used.

    python3 scripts/data/make_fashion_subset.py [--src DIR] [--out DIR] [--train N] [--test N]

--src is a folder with the four original files, gzipped or not (default
/usr/share/datasets/fashion-mnist, where Debian's `dataset-fashion-mnist` package puts them;
they are also at https://github.com/zalandoresearch/fashion-mnist, folder data/fashion).
--out defaults to data/fashion-mnist of the repository this script is in.
"""

import argparse
import gzip
import hashlib
import os
import struct
import sys

IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions (count, rows, cols)
LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension (count)


def read_idx(folder, stem):
    """Returns the raw bytes of `stem` (gzipped or not) from `folder`."""
    for name in (stem + ".gz", stem):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                raw = f.read()
            return (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw), path
    sys.exit(f"error: neither {stem}.gz nor {stem} is in {folder}")


def subset(folder, stem, magic, n):
    """The IDX file `stem` cut to its first `n` items (header rewritten with the new count)."""
    data, path = read_idx(folder, stem)
    ndims = magic & 0xFF
    header = 4 + 4 * ndims
    if len(data) < header:
        sys.exit(f"error: {path}: {len(data)} bytes is shorter than the IDX header")
    found, *dims = struct.unpack(">" + "I" * (1 + ndims), data[:header])
    if found != magic:
        sys.exit(f"error: {path}: magic 0x{found:08x}, expected 0x{magic:08x}")
    item = 1
    for d in dims[1:]:
        item *= d
    if len(data) != header + dims[0] * item:
        sys.exit(f"error: {path}: {len(data)} bytes, the header says {header + dims[0] * item}")
    if n > dims[0]:
        sys.exit(f"error: {path} has {dims[0]} items, {n} requested")
    out = struct.pack(">" + "I" * (1 + ndims), magic, n, *dims[1:])
    return out + data[header : header + n * item]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--out", default=os.path.normpath(os.path.join(here, "..", "..", "data", "fashion-mnist")))
    p.add_argument("--train", type=int, default=10_000)
    p.add_argument("--test", type=int, default=2_000)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    jobs = [
        ("train-images-idx3-ubyte", IMAGES_MAGIC, args.train),
        ("train-labels-idx1-ubyte", LABELS_MAGIC, args.train),
        ("t10k-images-idx3-ubyte", IMAGES_MAGIC, args.test),
        ("t10k-labels-idx1-ubyte", LABELS_MAGIC, args.test),
    ]
    for stem, magic, n in jobs:
        data = subset(args.src, stem, magic, n)
        path = os.path.join(args.out, stem + ".gz")
        with open(path, "wb") as raw, gzip.GzipFile(
            filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0
        ) as f:
            f.write(data)
        md5 = hashlib.md5(data).hexdigest()
        print(f"{path}: {n} items, {os.path.getsize(path)} bytes gzipped, md5 (uncompressed) {md5}")


if __name__ == "__main__":
    main()
