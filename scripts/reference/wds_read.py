#!/usr/bin/env python3
"""Reads webdataset shards with webdataset's own reader and prints what it yields: one JSON
line per sample, in order, `{"key": ..., "members": {ext: [length, CRC-32], ...}}`, then a
last line `{"webdataset": version, "samples": n}`.

    python scripts/reference/wds_read.py SHARD [SHARD ...]

`webdataset.WebDataset` over the shards in the order given, without shuffling and without
decoding (each member is the bytes in the shard). crates/allgrad-data/tests/data_tests/webdataset.rs
runs it on shards allgrad wrote and compares keys and bytes with what it wrote. Needs
webdataset (`pip install webdataset==1.0.2`; scripts/ci/get_torch.sh installs it).
"""

import json
import sys
import zlib

import webdataset as wds


def main():
    shards = sys.argv[1:]
    if not shards:
        sys.exit("usage: wds_read.py SHARD [SHARD ...]")
    n = 0
    for sample in wds.WebDataset(shards, shardshuffle=False, empty_check=False):
        members = {
            k: [len(v), zlib.crc32(v)]
            for k, v in sample.items()
            if not k.startswith("__")
        }
        print(json.dumps({"key": sample["__key__"], "members": members}, ensure_ascii=False))
        n += 1
    print(json.dumps({"webdataset": wds.__version__, "samples": n}))


if __name__ == "__main__":
    main()
