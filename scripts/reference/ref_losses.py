#!/usr/bin/env python3
"""Independent reference values for allgrad's distributed losses (allgrad-models `losses.rs`):
the loss and the gradients with respect to both views' embeddings, computed by PyTorch (CPU,
float64) with its own textbook formulations, on fixed asymmetric inputs. The output is Rust
source that `crates/allgrad-models/tests/models/losses_reference.rs` pastes.

    python3 scripts/reference/ref_losses.py

Inputs (6 samples, 2 views, dimension 5; the test builds the same numbers):
    z1[i][j] = sin(0.9 i + 0.4 j + 0.3) + 0.1 j
    z2[i][j] = cos(0.5 i - 0.7 j) + 0.05 i j

- NT-Xent (SimCLR): the 2N = 12 embeddings normalised, logits z z^T / t with the diagonal set
  to -inf, cross-entropy of row k against its other view ((k + N) mod 2N), mean over 2N rows.
  The temperature is a tensor too: its gradient (`*_GRAD_T`) checks a learned temperature.
- Cross-correlation (BarlowTwins): each view standardised per dimension with biased batch
  statistics (F.batch_norm, eps 1e-5, no affine), c = z1n^T z2n / N,
  scale * (sum_i (1 - c_ii)^2 + lambda * sum_{i != j} c_ij^2).

Requires PyTorch (`pip install torch`); not needed by the tests, which paste the output.
"""
import math
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("ref_losses.py: PyTorch is not installed (pip install torch)", file=sys.stderr)
    sys.exit(2)

N, D = 6, 5


def inputs():
    z1 = [[math.sin(0.9 * i + 0.4 * j + 0.3) + 0.1 * j for j in range(D)] for i in range(N)]
    z2 = [[math.cos(0.5 * i - 0.7 * j) + 0.05 * i * j for j in range(D)] for i in range(N)]
    return (torch.tensor(z1, dtype=torch.float64, requires_grad=True),
            torch.tensor(z2, dtype=torch.float64, requires_grad=True))


def nt_xent(z1, z2, temperature):
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    logits = z @ z.t() / temperature
    logits = logits.masked_fill(torch.eye(2 * N, dtype=torch.bool), float("-inf"))
    target = (torch.arange(2 * N) + N) % (2 * N)
    return F.cross_entropy(logits, target)


def cross_correlation(z1, z2, lam, scale):
    z1n = F.batch_norm(z1, None, None, training=True, eps=1e-5)
    z2n = F.batch_norm(z2, None, None, training=True, eps=1e-5)
    c = z1n.t() @ z2n / N
    on = (torch.diagonal(c) - 1).pow(2).sum()
    off = (c - torch.diag(torch.diagonal(c))).pow(2).sum()
    return scale * (on + lam * off)


CASES = [
    # name, loss, description of the allgrad call, temperature (None: the loss has none)
    ("NT_XENT_T05", lambda a, b, t: nt_xent(a, b, t), "nt_xent(z1, z2, 0.5, pg)", 0.5),
    ("NT_XENT_T02", lambda a, b, t: nt_xent(a, b, t), "LossConfig::default() (NT-Xent, temperature 0.2)", 0.2),
    ("CC_L0005", lambda a, b, t: cross_correlation(a, b, 0.005, 1.0), "cross_correlation(z1, z2, 0.005, pg)", None),
    ("CC_L03_S0125", lambda a, b, t: cross_correlation(a, b, 0.3, 0.125),
     "LossConfig::CrossCorrelation { lambda: 0.3, scale: 0.125 }", None),
]


def rust_matrix(name, t):
    rows = ",\n".join("    [" + ", ".join(repr(v) for v in row) + "]" for row in t.tolist())
    return f"const {name}: [[f64; {D}]; {N}] = [\n{rows},\n];"


def main():
    print(f"// Printed by `python3 scripts/reference/ref_losses.py` (torch {torch.__version__}, float64).")
    for name, loss_fn, what, temperature in CASES:
        z1, z2 = inputs()
        t = None if temperature is None else torch.tensor(temperature, dtype=torch.float64, requires_grad=True)
        loss = loss_fn(z1, z2, t)
        grads = torch.autograd.grad(loss, [z1, z2] + ([] if t is None else [t]))
        print(f"// {what}")
        print(f"const {name}_LOSS: f64 = {loss.item()!r};")
        print(rust_matrix(f"{name}_GRAD_Z1", grads[0]))
        print(rust_matrix(f"{name}_GRAD_Z2", grads[1]))
        if t is not None:
            print(f"const {name}_GRAD_T: f64 = {grads[2].item()!r};")


if __name__ == "__main__":
    main()
