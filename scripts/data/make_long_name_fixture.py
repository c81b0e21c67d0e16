#!/usr/bin/env python3
"""Writes the long-name webdataset shards that crates/allgrad-data/tests/data_tests/webdataset.rs
reads: the same 8 samples, with keys over 100 bytes, non-ASCII keys and keys whose member
names are exactly 100 bytes, in the tar dialects Python writes them in.

    python scripts/data/make_long_name_fixture.py crates/allgrad-data/tests/data/webdataset

Writes, in OUT:

- long-wds.tar: webdataset's own writer (webdataset.TarWriter, webdataset 1.0.2 from PyPI),
  which writes through tarfile's default format, PAX (a PAX header before every member whose
  name is over 100 bytes or not ASCII);
- long-pax.tar, long-gnu.tar: Python's tarfile with format=PAX_FORMAT and GNU_FORMAT (GNU
  long-name `././@LongLink` members before the long names);
- long-ustar.tar: tarfile with USTAR_FORMAT, for the keys that fit ustar's 155-byte prefix
  and 100-byte name (the long name split at a `/`);
- long-manifest.json: per shard, each sample's key, class and each member's length and CRC-32.

Each sample has a `png` (a 6x4 RGB image, different for every sample, written here with zlib:
no imaging package needed), a `cls` and a `txt` (its key). Needs only webdataset
(`pip install webdataset==1.0.2`); tarfile writes the other three.
"""

import io
import json
import os
import struct
import sys
import tarfile
import zlib

import webdataset as wds

KEYS = [
    "short000",
    "a" * 120,  # one path component over 100 bytes
    "café/naïve-ñandú-日本語-002",  # non-ASCII, short
    "長い名前" * 10 + "_003",  # non-ASCII, 124 bytes
    "dir_" + "d" * 60 + "/sub_" + "e" * 60 + "/x004",  # over 100 bytes in folders of under 100
    "b" * 96,  # member names of exactly 100 bytes (`<key>.png`, `.cls`, `.txt`)
    "c" * 99,  # member names of 103 bytes
    "über/" + "ß" * 60 + "/" + "ø" * 40 + "-007",  # non-ASCII, 214 bytes, in folders
]


def png(n):
    """A 6x4 RGB PNG whose pixels depend on n."""
    w, h = 6, 4
    raw = b"".join(
        b"\0" + b"".join(bytes(((x * 40 + n * 7) % 256, (y * 60 + n) % 256, (n * 31) % 256)) for x in range(w))
        for y in range(h)
    )

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def samples(keys):
    out = []
    for n, key in enumerate(keys):
        out.append({"__key__": key, "png": png(n), "cls": str(n % 3).encode(), "txt": key.encode()})
    return out


def fits_ustar(key):
    name = key.encode() + b".png"
    if len(name) <= 100:
        return True
    head, _, tail = key.encode().rpartition(b"/")
    return 0 < len(head) <= 155 and len(tail) + 4 <= 100


def write_tarfile(path, items, fmt):
    with tarfile.open(path, "w", format=fmt, encoding="utf-8") as tar:
        for sample in items:
            for ext in ("png", "cls", "txt"):
                data = sample[ext]
                info = tarfile.TarInfo(f"{sample['__key__']}.{ext}")
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                tar.addfile(info, io.BytesIO(data))


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    every = samples(KEYS)
    shards = {}
    with wds.TarWriter(os.path.join(out, "long-wds.tar"), mtime=0) as sink:
        for sample in every:
            sink.write(sample)
    shards["long-wds.tar"] = every
    write_tarfile(os.path.join(out, "long-pax.tar"), every, tarfile.PAX_FORMAT)
    shards["long-pax.tar"] = every
    write_tarfile(os.path.join(out, "long-gnu.tar"), every, tarfile.GNU_FORMAT)
    shards["long-gnu.tar"] = every
    ustar = [s for s in every if fits_ustar(s["__key__"])]
    write_tarfile(os.path.join(out, "long-ustar.tar"), ustar, tarfile.USTAR_FORMAT)
    shards["long-ustar.tar"] = ustar
    manifest = {
        name: [
            {
                "key": s["__key__"],
                "cls": int(s["cls"]),
                "members": {e: {"len": len(s[e]), "crc32": zlib.crc32(s[e])} for e in ("png", "cls", "txt")},
            }
            for s in items
        ]
        for name, items in shards.items()
    }
    with open(os.path.join(out, "long-manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)
    print(f"wrote {', '.join(shards)} and long-manifest.json in {out} (webdataset {wds.__version__})")


if __name__ == "__main__":
    main()
