#!/usr/bin/env python3
"""Writes data/clip-tiny: a small CLIP (transformers' CLIPModel, random weights from a
fixed seed) with a byte-level BPE tokenizer learned here from the words of the Fashion-MNIST
demo (configs/clip.yaml), saved with save_pretrained. No download: the vocabulary, the merges
and the weights are made by this script.

    $PYTHON scripts/data/make_tiny_clip.py [--out data/clip-tiny]          # the folder
    $PYTHON scripts/data/make_tiny_clip.py --reference [--out data/clip-tiny]  # reference values

With --reference it loads the folder and prints what
crates/allgrad-models/tests/models/clip_reference.rs compares against: token ids, image and
text features (projected, not normalised), logits and the CLIP loss of three images and
captions. Needs torch and transformers (PyPI).
"""
import argparse
import json
import math
import os
import re
from collections import Counter

import torch

# The demo's words: class names, synonyms and templates (train and held out) of configs/clip.yaml.
WORDS = """
t-shirt top tee shirt trouser trousers pants slacks pullover sweater jumper dress gown frock
coat jacket parka sandal sandals flip-flop shirt blouse button-up sneaker sneakers trainer
trainers running shoe bag handbag purse tote ankle boot boots
a photo of the an image picture close-up small large black and white grayscale product shot
this is there is item clothing for sale catalog showing one some good bad cropped low-res
""".split()

MERGES = 600


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def learn_merges(words, count):
    """Byte-pair merges over the words (CLIP's format: the last symbol of a word ends in </w>)."""
    b2u = bytes_to_unicode()
    corpus = Counter()
    for w in words:
        for piece in re.findall(r"[a-z]+|[0-9]|[^\sa-z0-9]+", w.lower()):
            sym = [b2u[b] for b in piece.encode("utf-8")]
            sym[-1] += "</w>"
            corpus[tuple(sym)] += 1
    merges = []
    for _ in range(count):
        pairs = Counter()
        for word, n in corpus.items():
            for a, b in zip(word, word[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        best = max(sorted(pairs), key=lambda p: pairs[p])
        merges.append(best)
        new = Counter()
        for word, n in corpus.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new[tuple(out)] += n
        corpus = new
    return merges


def make(out):
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    b2u = bytes_to_unicode()
    vocab = list(b2u.values())
    vocab += [v + "</w>" for v in vocab]
    merges = learn_merges(WORDS, MERGES)
    vocab += ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    tok = CLIPTokenizer(
        vocab={t: i for i, t in enumerate(vocab)}, merges=[(a, b) for a, b in merges], model_max_length=16
    )
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=16, hidden_act="quick_gelu", bos_token_id=eot - 1, eos_token_id=eot, pad_token_id=eot,
        ),
        vision_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_channels=1,
            image_size=28, patch_size=7, hidden_act="quick_gelu",
        ),
        projection_dim=32,
    )
    torch.manual_seed(0)
    model = CLIPModel(config).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"wrote {out}: vocabulary {len(vocab)}, {sum(p.numel() for p in model.parameters())} parameters")


CAPTIONS = ["a photo of a sneaker.", "a black and white photo of the dress", "this is an ankle boot for sale"]


def pixels():
    """Three 1 x 28 x 28 inputs: pixel (b, y, x) = sin(0.37 (28 y + x) + b) + 0.1 b."""
    v = torch.zeros(3, 1, 28, 28, dtype=torch.float64)
    for b in range(3):
        for y in range(28):
            for x in range(28):
                v[b, 0, y, x] = math.sin(0.37 * (28 * y + x) + b) + 0.1 * b
    return v.float()


def features(out):
    """The projected, unnormalised features (a tensor, or the pooler output of a model output)."""
    return out if torch.is_tensor(out) else out.pooler_output


def reference(out):
    from transformers import CLIPModel, CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(out)
    model = CLIPModel.from_pretrained(out).eval()
    enc = tok(CAPTIONS, padding=True, return_tensors="pt")
    with torch.no_grad():
        o = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], pixel_values=pixels(), return_loss=True)
        img = features(model.get_image_features(pixel_values=pixels()))
        txt = features(model.get_text_features(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]))
    fmt = lambda t: ", ".join(f"{x:.9e}" for x in t.flatten().tolist())
    for i, c in enumerate(CAPTIONS):
        ids = [t for t, m in zip(enc["input_ids"][i].tolist(), enc["attention_mask"][i].tolist()) if m]
        print(f"ids {c!r}: {ids}")
    print(f"image features: [{fmt(img)}]")
    print(f"text features: [{fmt(txt)}]")
    print(f"logits_per_image: [{fmt(o.logits_per_image)}]")
    print(f"loss: {o.loss.item():.9e}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="data/clip-tiny")
    ap.add_argument("--reference", action="store_true")
    a = ap.parse_args()
    reference(a.out) if a.reference else make(a.out)
