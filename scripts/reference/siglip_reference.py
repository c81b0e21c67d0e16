#!/usr/bin/env python3
"""A tiny SigLIP from transformers' SiglipModel, its outputs on fixed inputs, and the check of
a SigLIP folder allgrad wrote. No download: the weights are random from a fixed seed and the
tokenizer is data/clip-tiny's (SigLIP's towers take any vocabulary).

    $PYTHON scripts/reference/siglip_reference.py write OUT     # OUT/: the folder + reference.json
    $PYTHON scripts/reference/siglip_reference.py check DIR allgrad.json

`write` saves a SiglipModel (SiglipConfig written by transformers, every parameter drawn
again from N(0, 0.1), norm gains around 1, logit_scale 1.3 and logit_bias -2.5, so that no
bias or gain is at a neutral value that would hide a misplaced tensor) with save_pretrained,
copies the tokenizer files, and writes OUT/reference.json: the token ids, image and text
features (SiglipModel's pooled, projected outputs, not normalised), logits_per_image and the
sigmoid loss of three images and captions, f32. The text goes in as SigLIP was trained:
padded to the context length with the pad id, no attention mask, pooled at the last position.

`check` loads DIR with SiglipModel.from_pretrained and compares its outputs on the same inputs
with allgrad's (the JSON of the siglip test, or of `cargo run --release --example clip_features
-- DIR` for any SigLIP folder whose tokenizer.json the fast tokenizer reads: captions, ids,
image_features, text_features, logits_per_image, loss); prints the relative errors (norm-wise) and exits 1 when the ids
differ or an error exceeds 1e-5. crates/allgrad-models/tests/models/siglip_reference.rs runs
both through ALLGRAD_PYTHON.
"""
import argparse
import json
import math
import os
import shutil
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CLIP_TINY = os.path.join(HERE, "..", "..", "data", "clip-tiny")
CAPTIONS = ["a photo of a sneaker.", "a black and white photo of the dress", "this is an ankle boot for sale"]
CONTEXT = 16


def pixels(c, s):
    """Three c x s x s inputs: pixel (b, ch, y, x) = sin(0.37 (s y + x) + b + ch) + 0.1 b, f32."""
    v = torch.zeros(3, c, s, s, dtype=torch.float64)
    for b in range(3):
        for ch in range(c):
            for y in range(s):
                for x in range(s):
                    v[b, ch, y, x] = math.sin(0.37 * (s * y + x) + b + ch) + 0.1 * b
    return v.float()


def tokenizer(folder):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"))


def ids_of(tok, pad_id, context):
    """Token ids as allgrad's tokenizer gives them (unpadded), and the batch padded to the context length."""
    ids = [tok(c)["input_ids"] for c in CAPTIONS]
    padded = torch.tensor([r + [pad_id] * (context - len(r)) for r in ids], dtype=torch.long)
    return ids, padded


def outputs(model, tok):
    v = model.config.vision_config
    px = pixels(v.num_channels, v.image_size)
    t = model.config.text_config
    ids, padded = ids_of(tok, t.pad_token_id, t.max_position_embeddings)
    with torch.no_grad():
        o = model(input_ids=padded, pixel_values=px, return_loss=True)
        img = model.get_image_features(pixel_values=px)
        txt = model.get_text_features(input_ids=padded)
    img = img if torch.is_tensor(img) else img.pooler_output
    txt = txt if torch.is_tensor(txt) else txt.pooler_output
    return {
        "captions": CAPTIONS,
        "ids": ids,
        "image_features": img.tolist(),
        "text_features": txt.tolist(),
        "logits_per_image": o.logits_per_image.tolist(),
        "loss": o.loss.item(),
    }


def write(out):
    from transformers import SiglipConfig, SiglipModel

    vocab = json.load(open(os.path.join(CLIP_TINY, "config.json"), encoding="utf-8"))["text_config"]["vocab_size"]
    eot = vocab - 1
    config = SiglipConfig(
        text_config=dict(
            vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=CONTEXT, projection_size=64, pad_token_id=eot, eos_token_id=eot, bos_token_id=eot - 1,
        ),
        vision_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_channels=3,
            image_size=28, patch_size=7,
        ),
    )
    torch.manual_seed(0)
    model = SiglipModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "logit_scale":
                p.fill_(1.3)
            elif name == "logit_bias":
                p.fill_(-2.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(CLIP_TINY, f), os.path.join(out, f))
    ref = outputs(model, tokenizer(out))
    ref["parameters"] = {n: list(p.shape) for n, p in model.state_dict().items()}
    json.dump(ref, open(os.path.join(out, "reference.json"), "w", encoding="utf-8"))
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters())} parameters")


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check(folder, ours_path):
    from transformers import SiglipModel

    ours = json.load(open(ours_path, encoding="utf-8"))
    model = SiglipModel.from_pretrained(folder).eval()
    theirs = outputs(model, tokenizer(folder))
    ids_ok = theirs["ids"] == ours["ids"]
    print(f"token ids equal: {ids_ok}")
    errs = {k: rel(ours[k], theirs[k]) for k in ["image_features", "text_features", "logits_per_image"]}
    errs["loss"] = rel([ours["loss"]], [theirs["loss"]])
    for k, e in errs.items():
        print(f"allgrad vs transformers SiglipModel, {k}: relative error {e:.2e}")
    ok = ids_ok and all(e <= 1e-5 for e in errs.values())
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("out")
    c = sub.add_parser("check")
    c.add_argument("dir")
    c.add_argument("json")
    a = ap.parse_args()
    write(a.out) if a.cmd == "write" else check(a.dir, a.json)
