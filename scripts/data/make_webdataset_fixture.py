#!/usr/bin/env python3
"""Writes the webdataset shards that crates/allgrad-data/tests/data_tests/webdataset.rs reads:
shards made by the Python `webdataset` package (webdataset.ShardWriter, version 1.0.2 from
PyPI), so that the test holds allgrad's reader to what the format's reference implementation
writes.

    python scripts/data/make_webdataset_fixture.py crates/allgrad-data/tests/data/webdataset

Writes py-000000.tar and py-000001.tar (5 samples each, the second with a PNG and a sample
under a sub-folder key) and manifest.json: per sample its key, the CRC-32 and length of each
member, its class and caption. The images are synthetic (numpy, seeded), 40x30 JPEG of quality
90 or PNG: no outside content. Needs webdataset, Pillow and numpy
(`pip install webdataset==1.0.2 pillow numpy`).
"""

import io
import json
import os
import sys
import zlib

import numpy as np
import webdataset as wds
from PIL import Image


def image(n, fmt):
    rng = np.random.default_rng(n)
    y, x = np.mgrid[0:30, 0:40]
    base = np.stack([x * 6, y * 8, (x + y) * 3], axis=-1) + rng.integers(0, 40, size=(30, 40, 3))
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, format=fmt, quality=90) if fmt == "JPEG" else img.save(buf, format=fmt)
    return buf.getvalue()


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    manifest = []
    with wds.ShardWriter(os.path.join(out, "py-%06d.tar"), maxcount=5) as sink:
        for n in range(10):
            key = f"sample{n:03d}" if n != 7 else "sub/dir/sample007"
            ext = "png" if n == 6 else "jpg"
            sample = {
                "__key__": key,
                ext: image(n, "PNG" if ext == "png" else "JPEG"),
                "cls": str(n % 3).encode(),
                "txt": f"a synthetic picture number {n}".encode(),
                "json": json.dumps({"n": n}).encode(),
            }
            sink.write(sample)
            members = {k: {"crc32": zlib.crc32(v), "len": len(v)} for k, v in sample.items() if k != "__key__"}
            manifest.append({"key": key, "members": members, "cls": n % 3, "txt": sample["txt"].decode()})
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"wrote {out}/py-000000.tar, py-000001.tar and manifest.json (webdataset {wds.__version__})")


if __name__ == "__main__":
    main()
