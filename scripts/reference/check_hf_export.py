#!/usr/bin/env python3
"""Checks a Hugging Face folder written by `export-hf` (or any BERT folder `embed` reads):
transformers.AutoModel and sentence-transformers load it unchanged and give the embeddings
that allgrad's `embed` printed.  Run by hand (needs torch, transformers, sentence-transformers):

    embed --model DIR --pooling mean --max-len 128 SENTENCES.txt > allgrad.jsonl
    $PYTHON scripts/reference/check_hf_export.py DIR allgrad.jsonl [--pooling mean|cls_before_pooler]

Prints the largest absolute differences; exits 1 when one exceeds 1e-4.
"""
import argparse
import json
import sys

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("jsonl", help="the output of `embed --model DIR` (not normalised)")
    ap.add_argument("--pooling", default="mean", choices=["mean", "cls_before_pooler", "cls"])
    ap.add_argument("--max-len", type=int, default=128)
    args = ap.parse_args()
    rows = [json.loads(l) for l in open(args.jsonl, encoding="utf-8") if l.strip()]
    texts = [r["text"] for r in rows]
    ours = np.array([r["embedding"] for r in rows], dtype=np.float64)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModel.from_pretrained(args.model).eval()
    enc = tok(texts, padding=True, truncation=True, max_length=args.max_len, return_tensors="pt")
    ids_ok = all(enc["input_ids"][i][: len(r["ids"])].tolist() == r["ids"] for i, r in enumerate(rows))
    with torch.no_grad():
        out = model(**enc)
    h, m = out.last_hidden_state, enc["attention_mask"].unsqueeze(-1).float()
    if args.pooling == "mean":
        ref = (h * m).sum(1) / m.sum(1)
    elif args.pooling == "cls_before_pooler":
        ref = h[:, 0]
    else:
        ref = out.pooler_output
    ref = ref.double().numpy()
    d_hf = np.abs(ours - ref).max()
    print(f"token ids equal: {ids_ok}")
    print(f"allgrad embed vs transformers.AutoModel: max |diff| {d_hf:.2e}")
    ok = ids_ok and d_hf <= 1e-4
    if args.pooling != "cls":
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(args.model, device="cpu")
        st_emb = st.encode(texts, convert_to_numpy=True, normalize_embeddings=False).astype(np.float64)
        d_st = np.abs(ours - st_emb).max()
        print(f"allgrad embed vs sentence-transformers:  max |diff| {d_st:.2e}")
        ok = ok and d_st <= 1e-4
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
