"""Reference values for the BERT encoder (crates/allgrad-models/tests/models/bert_reference.rs).

1. Writes the tiny test BERT into crates/allgrad-models/tests/data/tiny-bert/ (config.json,
   model.safetensors in f16 to keep it small, a word-level tokenizer.json). The weights are a
   deterministic function of a seeded torch generator, scaled so that attention is far from
   uniform and every LayerNorm parameter matters.
2. Runs transformers' BertModel (CPU, f32, eval: dropout off) on a few sentences, batched and
   padded to the longest, for the tiny model and, when present, all-MiniLM-L6-v2 in
   data/models/ (scripts/data/get_minilm.sh), and prints Rust constants to paste into the test:
   token ids, a few hidden-state values, per-sentence sum and sum of squares of the last
   hidden states over real tokens, and the three poolings.

    python3 scripts/reference/ref_bert.py        (a Python with torch and transformers)
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import BertConfig, BertModel

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TINY = os.path.join(ROOT, "crates/allgrad-models/tests/data/tiny-bert")
MINILM = os.path.join(ROOT, "data/models/all-MiniLM-L6-v2")

WORDS = ("the a cat dog sat on mat ran fast slow big small red blue house tree under over "
         "and is was very bird sings loud quiet sun rain falls in park").split()
TINY_SENTENCES = [
    "The cat sat on the mat.",
    "a dog ran",
    "Blue birds sing under the big tree and the sun is very quiet",
    "rain",
    "the small red house was over the park and the dog ran fast and slow and loud under the tree",
]
TINY_MAX_LEN = 16
MINILM_SENTENCES = [
    "A man is playing a guitar.",
    "The quick brown fox jumps over the lazy dog!",
    "Contrastive learning of sentence embeddings",
    "hi",
    "Distributed training must give the same gradients as one process over the global batch, "
    "whatever the number of ranks, including the dropout masks and the padding of every sequence.",
]
MINILM_MAX_LEN = 32


def tiny_config():
    return dict(vocab_size=len(WORDS) + 4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=37, hidden_act="gelu", hidden_dropout_prob=0.1,
                attention_probs_dropout_prob=0.1, max_position_embeddings=40, type_vocab_size=2,
                layer_norm_eps=1e-12, initializer_range=0.02, pad_token_id=0, model_type="bert",
                architectures=["BertModel"])


def write_tiny():
    os.makedirs(TINY, exist_ok=True)
    cfg = tiny_config()
    with open(os.path.join(TINY, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    model = BertModel(BertConfig(**cfg)).eval()
    g = torch.Generator().manual_seed(20251122)
    state = {}
    for name, p in sorted(model.state_dict().items()):
        if name.endswith("position_ids"):
            continue
        r = torch.randn(p.shape, generator=g)
        if "LayerNorm.weight" in name:
            v = 1.0 + 0.2 * r
        elif name.endswith("bias"):
            v = 0.1 * r
        elif "embeddings" in name:
            v = 0.4 * r
        else:
            v = 0.2 * r
        state[name] = v.to(torch.float16).contiguous()
    save_file(state, os.path.join(TINY, "model.safetensors"))
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3}
    for w in WORDS:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(os.path.join(TINY, "tokenizer.json"))


def load(dir_):
    from safetensors.torch import load_file
    cfg = json.load(open(os.path.join(dir_, "config.json")))
    model = BertModel(BertConfig(**cfg)).eval()
    state = {k.removeprefix("bert."): v.float() for k, v in load_file(os.path.join(dir_, "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not [m for m in missing if "position_ids" not in m], missing
    tok = Tokenizer.from_file(os.path.join(dir_, "tokenizer.json"))
    return model, tok


def fmt(xs):
    return "[" + ", ".join(repr(float(x)) for x in xs) + "]"


def reference(name, dir_, sentences, max_len):
    model, tok = load(dir_)
    tok.no_padding()
    tok.enable_truncation(max_length=max_len)
    ids = [tok.encode(s).ids for s in sentences]
    n = max(len(i) for i in ids)
    input_ids = torch.zeros(len(ids), n, dtype=torch.long)
    mask = torch.zeros(len(ids), n, dtype=torch.long)
    for r, row in enumerate(ids):
        input_ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=mask, token_type_ids=torch.zeros_like(input_ids))
    h = out.last_hidden_state.double()
    m = mask.unsqueeze(-1).double()
    mean = (h * m).sum(1) / m.sum(1)
    print(f"// {name}: scripts/reference/ref_bert.py, transformers {__import__('transformers').__version__}, "
          f"torch {torch.__version__}, f32, max_len {max_len}")
    print(f"const {name}: &[Ref] = &[")
    for r, row in enumerate(ids):
        k = len(row)
        real = h[r, :k]
        print("    Ref {")
        print(f"        ids: &{list(row)},")
        print(f"        first: &{fmt(h[r, 0, :4])},")
        print(f"        last: &{fmt(h[r, k - 1, :4])},")
        print(f"        sum: {float(real.sum())!r},")
        print(f"        sum_sq: {float((real ** 2).sum())!r},")
        print(f"        pooler: &{fmt(out.pooler_output[r, :4])},")
        print(f"        pooler_sum: {float(out.pooler_output[r].double().sum())!r},")
        print(f"        mean: &{fmt(mean[r, :4])},")
        print(f"        mean_sum: {float(mean[r].sum())!r},")
        print("    },")
    print("];")


if __name__ == "__main__":
    torch.set_num_threads(1)
    if "--keep-tiny" not in sys.argv:
        write_tiny()
    reference("TINY", TINY, TINY_SENTENCES, TINY_MAX_LEN)
    if os.path.exists(os.path.join(MINILM, "model.safetensors")):
        reference("MINILM", MINILM, MINILM_SENTENCES, MINILM_MAX_LEN)
    else:
        print(f"// {MINILM} absent: run scripts/data/get_minilm.sh", file=sys.stderr)
