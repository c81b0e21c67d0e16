"""Unsupervised SimCSE written independently in PyTorch: the pieces that
`scripts/reference/simcse_loss_compare.py` and `scripts/bench/bench_simcse_step.py` share.

The model is transformers' `BertModel` (no pooler) loaded from a Hugging Face folder,
sentence embeddings are the mask-aware mean of the last hidden states (or the [CLS] state),
followed during training by an MLP head (dense + tanh), as allgrad's `simcse` method with
`model.mlp_head: true`. The loss is the paper's: cosine similarities of the anchors against
the positives (unsupervised: the second views; supervised: the positives and the hard
negatives) of the batch, divided by the temperature, cross-entropy with each anchor's own
positive as the target.

Not a script: imported by the two above (a Python with torch, transformers, tokenizers).
"""
import csv

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import BertModel
from transformers.utils import logging as hf_logging


def read_sentences(path):
    """One sentence a line, blank lines skipped (allgrad's `read_sentences`)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return [line.rstrip("\r") for line in text.split("\n") if line.strip()]


def read_triplets(path):
    """(anchor, positive, hard negative) of an `nli_for_simcse.csv`-style file (header
    sent0,sent1,hard_neg), as allgrad's `read_nli_triplets`."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        return [(r["sent0"], r["sent1"], r["hard_neg"]) for r in csv.DictReader(f)]


def tokenize(tokenizer_json, sentences, max_len):
    """Token ids of each sentence, special tokens included, truncated to `max_len`, unpadded."""
    tok = Tokenizer.from_file(tokenizer_json)
    tok.enable_truncation(max_length=max_len)
    tok.no_padding()
    pad_id = tok.token_to_id("[PAD]")
    return [tok.encode(s).ids for s in sentences], (0 if pad_id is None else pad_id)


def pad(rows, pad_id):
    """`ids` and `mask` `[len(rows), longest]` (int64), padded with `pad_id`."""
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


class SimCse(torch.nn.Module):
    """BERT (no pooler), pooling, and the training-time MLP head (`head`, Linear + tanh)."""

    def __init__(self, model_dir, pooling="mean", mlp_head=True, **config_overrides):
        super().__init__()
        hf_logging.set_verbosity_error()  # the folder's unused pooler weights are expected
        self.bert, info = BertModel.from_pretrained(
            model_dir, add_pooling_layer=False, output_loading_info=True, **config_overrides
        )
        if info["missing_keys"] or info["mismatched_keys"]:
            raise ValueError(f"{model_dir}: missing {info['missing_keys']}, mis-shaped {info['mismatched_keys']}")
        h = self.bert.config.hidden_size
        self.head = torch.nn.Linear(h, h) if mlp_head else None
        if pooling not in ("mean", "cls_before_pooler"):
            raise ValueError(f"pooling {pooling!r}: mean or cls_before_pooler")
        self.pooling = pooling

    def forward(self, ids, mask):
        hidden = self.bert(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)).last_hidden_state
        if self.pooling == "mean":
            m = mask.unsqueeze(-1).to(hidden.dtype)
            z = (hidden * m).sum(1) / m.sum(1)
        else:
            z = hidden[:, 0]
        return torch.tanh(self.head(z)) if self.head is not None else z


def simcse_loss(model, views, pad_id, temperature, hard_negative_weight=0.0):
    """The SimCSE loss of one batch. `views` holds token rows per view: unsupervised, the same
    b sentences twice (anchors, then positives: two dropout masks when dropout is on);
    supervised, anchors, positives and hard negatives. All rows go through the encoder in
    one forward, padded to the longest. Each anchor is scored (cosine / temperature) against
    every candidate (the positives, then the hard negatives), `hard_negative_weight` added to
    its own hard negative's logit; the target is its own positive; mean over anchors."""
    b = len(views[0])
    ids, mask = pad([row for view in views for row in view], pad_id)
    dev = next(model.parameters()).device
    z = model(ids.to(dev), mask.to(dev))
    a, candidates = z[:b], z[b:]
    a = a / a.norm(dim=1, keepdim=True)
    candidates = candidates / candidates.norm(dim=1, keepdim=True)
    logits = a @ candidates.t() / temperature
    if len(views) == 3 and hard_negative_weight != 0.0:
        weight = torch.zeros_like(logits)
        weight[torch.arange(b), b + torch.arange(b)] = hard_negative_weight
        logits = logits + weight
    return F.cross_entropy(logits, torch.arange(b))
