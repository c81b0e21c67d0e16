#!/usr/bin/env python3
"""Reads a run directory's TensorBoard events files with TensorBoard's own reader and prints
every scalar it returns: one JSON line per value, `{"tag": ..., "step": ..., "value": ...}`,
ordered by tag and step, then a last line `{"tensorboard": version, "scalars": n}`.

    python scripts/reference/tb_read.py RUN_DIR

`EventAccumulator` over the directory (every `events.out.tfevents.*` in it, in name order),
every value kept (no sampling), orphaned data purged as TensorBoard does after a restart.
tests/repo/tensorboard.rs runs it on a `train` run and compares with metrics.jsonl. Needs
tensorboard (`pip install tensorboard==2.21.0`; scripts/ci/get_torch.sh installs it).
"""

import json
import sys

import tensorboard
from tensorboard.backend.event_processing import event_accumulator as ea


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0})
    acc.Reload()
    n = 0
    for tag in sorted(acc.Tags()["scalars"]):
        for e in acc.Scalars(tag):
            print(json.dumps({"tag": tag, "step": e.step, "value": e.value}))
            n += 1
    print(json.dumps({"tensorboard": tensorboard.__version__, "scalars": n}))


if __name__ == "__main__":
    main()
