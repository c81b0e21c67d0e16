#!/usr/bin/env python3
"""Checks a CLIP folder written by `export-hf` (or any CLIP folder allgrad reads):
transformers' CLIPModel and CLIPTokenizer load it unchanged and give the token ids, image and
text features, logits and loss that allgrad printed for the same inputs.  tests/repo/clip_launch.rs
runs it on a trained export through ALLGRAD_PYTHON; by hand (needs torch and transformers):

    cargo run --release --example clip_features -- DIR > allgrad.json
    $PYTHON scripts/reference/check_clip_export.py DIR allgrad.json

Prints the relative errors (norm-wise); exits 1 when the ids differ or an error exceeds 1e-5.
"""
import argparse
import json
import math
import sys

import numpy as np
import torch
from transformers import CLIPModel, CLIPTokenizer


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("json", help="the output of the clip_features example")
    a = ap.parse_args()
    ours = json.load(open(a.json, encoding="utf-8"))
    model = CLIPModel.from_pretrained(a.model).eval()
    tok = CLIPTokenizer.from_pretrained(a.model)
    v = model.config.vision_config
    c, s = v.num_channels, v.image_size
    px = torch.tensor(
        [[[[math.sin(0.37 * (s * y + x) + b + ch) + 0.1 * b for x in range(s)] for y in range(s)] for ch in range(c)] for b in range(3)],
        dtype=torch.float64,
    ).float()
    enc = tok(ours["captions"], padding=True, return_tensors="pt")
    ids = [[t for t, m in zip(r, k) if m] for r, k in zip(enc["input_ids"].tolist(), enc["attention_mask"].tolist())]
    with torch.no_grad():
        o = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], pixel_values=px, return_loss=True)
        img = model.get_image_features(pixel_values=px)
        txt = model.get_text_features(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
    img = img if torch.is_tensor(img) else img.pooler_output
    txt = txt if torch.is_tensor(txt) else txt.pooler_output
    errs = {
        "image features": rel(ours["image_features"], img.numpy()),
        "text features": rel(ours["text_features"], txt.numpy()),
        "logits_per_image": rel(ours["logits_per_image"], o.logits_per_image.numpy()),
        "loss": rel([ours["loss"]], [o.loss.item()]),
    }
    ids_ok = ids == ours["ids"]
    print(f"token ids equal: {ids_ok}")
    for k, e in errs.items():
        print(f"allgrad vs transformers CLIPModel, {k}: relative error {e:.2e}")
    ok = ids_ok and all(e <= 1e-5 for e in errs.values())
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
