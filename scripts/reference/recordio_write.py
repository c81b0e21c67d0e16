#!/usr/bin/env python3
"""Writes small indexed RecordIO face data sets, as insightface's training sets are laid out,
and what a reader must get back from them, for crates/allgrad-data/tests/data_tests/recordio.rs.

    python scripts/reference/recordio_write.py OUT_DIR --writer mxnet|format

--writer mxnet: MXNet's own `mxnet.recordio` (`MXIndexedRecordIO`, `pack`, `IRHeader`); needs
  mxnet 1.9.1 in its own environment (scripts/ci/get_mxnet.sh).
--writer format: a writer written here from MXNet's published RecordIO format, for machines
  without mxnet: each record a little-endian u32 magic 0xced7230a, a u32 whose top 3 bits are the
  continuation flag and low 29 bits the length, the data, zero padding to 4 bytes; data holding
  the magic at a 4-aligned position is split there into parts (flag 1, 2..., 3) and the magic
  dropped; the data an IRHeader (struct 'IfQQ': flag, label, id, id2), then `flag` f32 labels
  when flag > 0, then the image bytes; train.idx one "key\\toffset" line per record.

Writes OUT_DIR/plain (keys 0..5, every key a sample) and OUT_DIR/with_header (key 0 a header
record with flag 2 and label [7, 7], samples keys 1..6, then key 7, an identity record that is
no sample, as in MS1M), each with train.rec, train.idx and property ("4,112,112"), and
OUT_DIR/expected.json: for each sample in order its class, format, and the pixels Pillow decodes
(RGB, row-major HWC). The samples: PNG RGB, JPEG RGB, PNG gray, JPEG gray, a label vector whose
second value's bytes are the magic number (so the record is written in parts), a scalar label.
The JPEGs are 4:4:4 (no chroma subsampling), so that the pixels compared are the record's and not
two decoders' ways of upsampling chroma (Pillow's libjpeg and zune-jpeg differ by up to 4 there).
"""

import argparse
import io
import json
import os
import struct

import numpy as np
from PIL import Image

MAGIC = 0xCED7230A


def images():
    rng = np.random.default_rng(54)
    smooth = lambda h, w, c: (np.add.outer(np.arange(h) * 9, np.arange(w) * 5)[..., None] + np.arange(c) * 40) % 256
    out = []
    # (array, mode, format, label): a scalar, or a list (the label vector, first value the class).
    out.append((rng.integers(0, 256, (5, 7, 3)), "RGB", "PNG", 3.0))
    out.append((smooth(16, 16, 3), "RGB", "JPEG", [1.0, 5.5]))
    out.append((rng.integers(0, 256, (6, 6)), "L", "PNG", 0.0))
    out.append((smooth(8, 8, 1)[..., 0], "L", "JPEG", 2.0))
    magic_as_f32 = struct.unpack("<f", struct.pack("<I", MAGIC))[0]
    out.append((rng.integers(0, 256, (4, 4, 3)), "RGB", "PNG", [2.0, magic_as_f32]))
    out.append((rng.integers(0, 256, (3, 9, 3)), "RGB", "PNG", 1.0))
    encoded = []
    for arr, mode, fmt, label in out:
        buf = io.BytesIO()
        Image.fromarray(arr.astype(np.uint8), mode).save(buf, format=fmt, **({"quality": 95, "subsampling": 0} if fmt == "JPEG" else {}))
        encoded.append((buf.getvalue(), fmt, label))
    return encoded


def pack_format(label, payload, rid):
    if isinstance(label, list):
        head = struct.pack("<IfQQ", len(label), 0.0, rid, 0) + struct.pack("<%df" % len(label), *label)
    else:
        head = struct.pack("<IfQQ", 0, label, rid, 0)
    return head + payload


def frame(data):
    magic = struct.pack("<I", MAGIC)
    out, start = b"", 0
    for i in range(0, len(data) // 4 * 4, 4):
        if data[i:i + 4] == magic:
            out += magic + struct.pack("<I", ((1 if start == 0 else 2) << 29) | (i - start)) + data[start:i]
            start = i + 4
    out += magic + struct.pack("<I", ((3 if start else 0) << 29) | (len(data) - start)) + data[start:]
    return out + b"\0" * ((4 - len(data) % 4) % 4)


class FormatWriter:
    def __init__(self, idx, rec):
        self.rec, self.idx = open(rec, "wb"), open(idx, "w")

    def write_idx(self, key, data):
        self.idx.write("%d\t%d\n" % (key, self.rec.tell()))
        self.rec.write(frame(data))

    def close(self):
        self.rec.close()
        self.idx.close()


def writer(kind, d):
    os.makedirs(d, exist_ok=True)
    idx, rec = os.path.join(d, "train.idx"), os.path.join(d, "train.rec")
    if kind == "mxnet":
        import mxnet as mx

        w = mx.recordio.MXIndexedRecordIO(idx, rec, "w")

        def pack(label, payload, rid):
            lab = np.array(label, dtype=np.float32) if isinstance(label, list) else label
            return mx.recordio.pack(mx.recordio.IRHeader(0, lab, rid, 0), payload)

        return w, pack
    return FormatWriter(idx, rec), pack_format


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--writer", choices=["mxnet", "format"], required=True)
    args = ap.parse_args()
    samples = images()
    for layout in ["plain", "with_header"]:
        d = os.path.join(args.out, layout)
        w, pack = writer(args.writer, d)
        first = 0 if layout == "plain" else 1
        if layout == "with_header":
            n = len(samples)
            w.write_idx(0, pack([float(n + 1), float(n + 1)], b"", 0))
        for k, (payload, _, label) in enumerate(samples):
            w.write_idx(first + k, pack(label, payload, first + k))
        if layout == "with_header":
            w.write_idx(len(samples) + 1, pack([1.0, 3.0], b"", 0))
        w.close()
        with open(os.path.join(d, "property"), "w") as f:
            f.write("4,112,112\n")
    expected = []
    for payload, fmt, label in samples:
        img = np.asarray(Image.open(io.BytesIO(payload)).convert("RGB"))
        cls = label[0] if isinstance(label, list) else label
        expected.append({"label": int(cls), "format": fmt, "shape": list(img.shape), "pixels": img.reshape(-1).tolist()})
    with open(os.path.join(args.out, "expected.json"), "w") as f:
        json.dump({"writer": args.writer, "samples": expected}, f)


if __name__ == "__main__":
    main()
