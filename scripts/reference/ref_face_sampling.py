#!/usr/bin/env python3
"""Independent reference for Partial FC's class sampling (crates/allgrad-models/src/face/sampling.rs).

Plain Python, no dependencies, written from the rule's documentation: a negative class c is
sampled at step t with probability `rate` when the top 53 bits of
key_hash([seed, 0x5A3F1E0C00000002, t, c]), as a draw in [0, 1), are below `rate`; key_hash
is allgrad-rng's SplitMix64 chain over the key words and their count. Prints, for the cases
the face tests use, the classes whose negative draw is below the rate (the tests add the
positives, the labels of the step's batch, themselves).

    python3 scripts/reference/ref_face_sampling.py
"""
M64 = (1 << 64) - 1
SAMPLE_KEY = 0x5A3F1E0C00000002


def splitmix(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def key_hash(key):
    h = 0x243F6A8885A308D3 ^ len(key)
    for k in key:
        h = splitmix(h ^ splitmix(k))
    return splitmix(h)


def sampled_negatives(seed, step, classes, rate):
    return [c for c in range(classes) if (key_hash([seed, SAMPLE_KEY, step, c]) >> 11) / float(1 << 53) < rate]


# (test, seed, steps, classes, rate)
CASES = [
    ("crates/allgrad-models/tests/models/face_head.rs", 3, [2], 10, 0.3),
    ("crates/allgrad-train/tests/train/face.rs", 5, [0, 1, 2], 40, 0.1),
]
for test, seed, steps, classes, rate in CASES:
    for step in steps:
        print(f"{test}: seed {seed}, step {step}, {classes} classes, rate {rate}: {sampled_negatives(seed, step, classes, rate)}")
