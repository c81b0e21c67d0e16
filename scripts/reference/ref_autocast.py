#!/usr/bin/env python3
"""Reference losses and gradients of fixed batches under PyTorch's bf16 autocast, for allgrad's
`precision: bf16` (`crates/allgrad-models/tests/models/autocast_reference.rs` pastes the output).

    python3 scripts/reference/ref_autocast.py

Two fixed batches, each in f32 (autocast off), under `torch.autocast("cpu", torch.bfloat16)`,
and in f64:

1. SimCLR: a ResNet-18 of width 4 with the CIFAR stem (3x3 conv, no pooling; batch norm in
   training mode with batch statistics, eps 1e-5), projector Linear(32, 32)-ReLU-Linear(32, 16),
   on 2 views of 8 images of 3x16x16; NT-Xent at temperature 0.5 on the 16-dimensional
   embeddings. Parameters and images are closed-form (below), so the test builds the same
   numbers without this script.
2. SimCSE: the committed tiny BERT (crates/allgrad-models/tests/data/tiny-bert: 2 layers,
   hidden 32, 4 heads, GELU, post-LayerNorm), written here with plain torch ops from its
   safetensors file, dropout off, on 4 fixed rows of token ids (padded with id 0, padding
   masked out of attention and pooling); mean pooling; the unsupervised InfoNCE of the paper
   with the second view equal to the first (no dropout), temperature 0.05.

Under autocast the convolutions and linear layers compute in bf16 (PyTorch's CPU autocast
list), batch norm, ReLU, pooling, GELU and attention (`scaled_dot_product_attention`) take
their bf16 inputs; the residual sums of BERT with its f32 residual stream promote to f32.
The loss itself runs with autocast off on the embeddings cast to f32 (`z.float()`): the
logits and the loss in f32, as allgrad's losses compute them.

Gradients: the loss's gradient with respect to every parameter that gets one, summarised per
parameter (in name order) as its projection on a closed-form direction,
    sum_j grad[j] * noise(0.53 j + 0.017 h + 2.5),  h = FNV-1a-64(name) mod 1000,
one number per parameter tensor (the full gradients are too many to paste; a wrong gradient of
any tensor changes its projection), in f64, f32 and under autocast (the parameters stay f32,
so their gradients come back f32).

Closed-form values, with noise(t) = 2 frac(43758.5453 sin t) - 1 (in [-1, 1), random-looking:
smooth closed forms make features nearly equal across samples, and batch norm then magnifies
bf16's rounding of them by the inverse of their small spread): the parameter named `name` with
`n` elements and fan-in `f` (elements per output row; 1 for vectors) holds, at flat index j,
    weights (rank >= 2): noise(0.37 j + 0.011 h + 0.5) / sqrt(f)
    batch-norm weights:  1 + 0.2 noise(0.37 j + 0.011 h + 0.5)
    biases:              0.1 noise(0.37 j + 0.011 h + 0.5)
with h = FNV-1a-64(name) mod 1000. Images: x[n, c, y, x] = noise(0.9 n + 1.7 c + 0.31 y - 0.23 x),
views 0..7 then 8..15 (the two views of the 8 images).

Requires PyTorch and safetensors (`pip install torch safetensors`); not needed by the tests.
"""
import math
import os
import sys

try:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
except ImportError:
    print("ref_autocast.py: needs torch and safetensors (pip install torch safetensors)", file=sys.stderr)
    sys.exit(2)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TINY = os.path.join(ROOT, "crates/allgrad-models/tests/data/tiny-bert")


def fnv1a(name):
    h = 0xCBF29CE484222325
    for b in name.encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h % 1000


def noise(t):
    """A value in [-1, 1) that looks random in `t`: the fractional part of 43758.5453 sin(t)."""
    v = math.sin(t) * 43758.5453
    return 2 * (v - math.floor(v)) - 1


def closed_form(name, shape):
    h = fnv1a(name)
    n = math.prod(shape)
    base = torch.tensor([noise(0.37 * j + 0.011 * h + 0.5) for j in range(n)], dtype=torch.float64).reshape(shape)
    if len(shape) >= 2:
        return base / math.sqrt(n // shape[0])
    if name.endswith("bn1.weight") or name.endswith("bn2.weight") or name.endswith("downsample.1.weight"):
        return 1 + 0.2 * base
    return 0.1 * base


WIDTH, IMAGES, SIZE = 4, 8, 16


def resnet_params():
    """Names and shapes of allgrad's ResNet-18 (torchvision names) and the projector."""
    p = {"conv1.weight": (WIDTH, 3, 3, 3), "bn1.weight": (WIDTH,), "bn1.bias": (WIDTH,)}
    cin = WIDTH
    for stage in range(4):
        planes = WIDTH << stage
        for i in range(2):
            pre = f"layer{stage + 1}.{i}"
            stride = 2 if stage > 0 and i == 0 else 1
            p[f"{pre}.conv1.weight"] = (planes, cin, 3, 3)
            p[f"{pre}.conv2.weight"] = (planes, planes, 3, 3)
            for bn in ("bn1", "bn2"):
                p[f"{pre}.{bn}.weight"] = (planes,)
                p[f"{pre}.{bn}.bias"] = (planes,)
            if stride != 1 or cin != planes:
                p[f"{pre}.downsample.0.weight"] = (planes, cin, 1, 1)
                p[f"{pre}.downsample.1.weight"] = (planes,)
                p[f"{pre}.downsample.1.bias"] = (planes,)
            cin = planes
    p.update({"proj.0.weight": (32, 32), "proj.0.bias": (32,), "proj.1.weight": (16, 32), "proj.1.bias": (16,)})
    return {k: closed_form(k, s) for k, s in p.items()}


def images(dtype):
    v = [[[[noise(0.9 * n + 1.7 * c + 0.31 * y - 0.23 * x) for x in range(SIZE)]
           for y in range(SIZE)] for c in range(3)] for n in range(2 * IMAGES)]
    return torch.tensor(v, dtype=dtype)


def bn(x, w, b):
    return F.batch_norm(x, None, None, w, b, training=True, eps=1e-5)


def resnet_embeddings(p, x):
    h = F.relu(bn(F.conv2d(x, p["conv1.weight"], padding=1), p["bn1.weight"], p["bn1.bias"]))
    for stage in range(4):
        for i in range(2):
            pre = f"layer{stage + 1}.{i}"
            stride = 2 if stage > 0 and i == 0 else 1
            out = F.relu(bn(F.conv2d(h, p[f"{pre}.conv1.weight"], stride=stride, padding=1), p[f"{pre}.bn1.weight"], p[f"{pre}.bn1.bias"]))
            out = bn(F.conv2d(out, p[f"{pre}.conv2.weight"], padding=1), p[f"{pre}.bn2.weight"], p[f"{pre}.bn2.bias"])
            if f"{pre}.downsample.0.weight" in p:
                skip = bn(F.conv2d(h, p[f"{pre}.downsample.0.weight"], stride=stride), p[f"{pre}.downsample.1.weight"], p[f"{pre}.downsample.1.bias"])
            else:
                skip = h
            h = F.relu(out + skip)
    f = F.adaptive_avg_pool2d(h, 1).flatten(1)
    return F.linear(F.relu(F.linear(f, p["proj.0.weight"], p["proj.0.bias"])), p["proj.1.weight"], p["proj.1.bias"])


def nt_xent(z, t):
    n = z.shape[0] // 2
    z = F.normalize(z, dim=1)
    logits = (z @ z.t() / t).masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    return F.cross_entropy(logits, (torch.arange(2 * n) + n) % (2 * n))


# Token ids of the SimCSE batch (the tiny vocabulary has 35 ids; 0 is padding).
ROWS = [[2, 7, 11, 5, 9, 3], [2, 14, 6, 3], [2, 30, 12, 8, 19, 21, 25, 17, 3], [2, 4, 3]]
HEADS, LN_EPS = 4, 1e-12


def bert_embeddings(w, ids, mask):
    pos = torch.arange(ids.shape[1])
    e = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][pos][None] \
        + w["embeddings.token_type_embeddings.weight"][torch.zeros_like(ids)]
    h = F.layer_norm(e, (e.shape[-1],), w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], LN_EPS)
    b, n, d = h.shape
    bias = ((1 - mask) * -1e4)[:, None, None, :].to(h.dtype)  # padded keys out of the softmax
    for layer in range(2):
        pre = f"encoder.layer.{layer}"
        lin = lambda x, name: F.linear(x, w[f"{pre}.{name}.weight"], w[f"{pre}.{name}.bias"])
        heads = lambda t: t.reshape(b, n, HEADS, d // HEADS).transpose(1, 2)
        q, k, v = (heads(lin(h, f"attention.self.{m}")) for m in ("query", "key", "value"))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype)).transpose(1, 2).reshape(b, n, d)
        a = F.layer_norm(lin(ctx, "attention.output.dense") + h, (d,), w[f"{pre}.attention.output.LayerNorm.weight"],
                         w[f"{pre}.attention.output.LayerNorm.bias"], LN_EPS)
        inter = F.gelu(lin(a, "intermediate.dense"))
        h = F.layer_norm(lin(inter, "output.dense") + a, (d,), w[f"{pre}.output.LayerNorm.weight"],
                         w[f"{pre}.output.LayerNorm.bias"], LN_EPS)
    m = mask[:, :, None].to(h.dtype)
    return (h * m).sum(1) / m.sum(1)


def info_nce(z, t):
    # Unsupervised SimCSE without dropout: the positives are the anchors themselves.
    a = F.normalize(z, dim=1)
    logits = a @ a.t() / t
    return F.cross_entropy(logits, torch.arange(z.shape[0]))


def projections(params):
    """Each parameter's gradient projected on its closed-form direction, in name order."""
    out = []
    for name in sorted(params):
        g = params[name].grad
        if g is None:
            continue
        g = g.double().flatten()
        h = fnv1a(name)
        u = torch.tensor([noise(0.53 * j + 0.017 * h + 2.5) for j in range(g.numel())], dtype=torch.float64)
        out.append(float(g @ u))
    return out


def loss_and_projections(params, run):
    """`run(params)`'s loss (a scalar tensor) and its gradients' projections."""
    params = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    loss = run(params)
    loss.backward()
    return loss.item(), projections(params)


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    out = []
    p64 = resnet_params()
    x64 = images(torch.float64)
    p32 = {k: v.float() for k, v in p64.items()}
    x32 = x64.float()
    results = {}

    def resnet_bf16(p):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = resnet_embeddings(p, x32)
        assert z.dtype == torch.bfloat16
        return nt_xent(z.float(), 0.5)

    results["RESNET_F64"] = loss_and_projections(p64, lambda p: nt_xent(resnet_embeddings(p, x64), 0.5))
    results["RESNET_F32"] = loss_and_projections(p32, lambda p: nt_xent(resnet_embeddings(p, x32), 0.5))
    results["RESNET_BF16"] = loss_and_projections(p32, resnet_bf16)

    w32 = {k: v.float() for k, v in load_file(os.path.join(TINY, "model.safetensors")).items()}
    w64 = {k: v.double() for k, v in w32.items()}
    longest = max(len(r) for r in ROWS)
    ids = torch.tensor([r + [0] * (longest - len(r)) for r in ROWS])
    mask = torch.tensor([[1] * len(r) + [0] * (longest - len(r)) for r in ROWS])

    def bert_bf16(w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = bert_embeddings(w, ids, mask)
        return info_nce(z.float(), 0.05)

    results["BERT_F64"] = loss_and_projections(w64, lambda w: info_nce(bert_embeddings(w, ids, mask), 0.05))
    results["BERT_F32"] = loss_and_projections(w32, lambda w: info_nce(bert_embeddings(w, ids, mask), 0.05))
    results["BERT_BF16"] = loss_and_projections(w32, bert_bf16)
    out.append(f"// python3 scripts/reference/ref_autocast.py  (torch {torch.__version__})")
    for k, (loss, _) in results.items():
        out.append(f"const {k}: f64 = {loss!r};")
    for k, (_, proj) in results.items():
        values = ", ".join(repr(v) for v in proj)
        out.append(f"const {k}_GRAD: [f64; {len(proj)}] = [{values}];")
    print("\n".join(out))


if __name__ == "__main__":
    main()
