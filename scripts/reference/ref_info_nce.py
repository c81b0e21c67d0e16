"""Reference values for SimCSE's InfoNCE (crates/allgrad-models/tests/models/simcse_info_nce.rs).

PyTorch, f64, one process over the whole batch, written from the paper's formula (cosine
similarity / temperature, cross-entropy with the positive on the diagonal; supervised: the
hard negatives appended as extra columns, `w` added to each anchor's own hard negative).
Inputs are a formula the test repeats: x[i, k] = sin(0.7 * (i * d + k) + phase) + 0.1 * k.
The temperature is a tensor too; `*_GRAD_T` is its gradient (a learned temperature).

    python3 scripts/reference/ref_info_nce.py    (a Python with torch)
"""
import torch

B, D, T = 6, 4, 0.05


def inputs(phase):
    i = torch.arange(B, dtype=torch.float64).unsqueeze(1)
    k = torch.arange(D, dtype=torch.float64).unsqueeze(0)
    return (torch.sin(0.7 * (i * D + k) + phase) + 0.1 * k).requires_grad_()


def temperature():
    return torch.tensor(T, dtype=torch.float64, requires_grad=True)


def loss(a, p, t, n=None, w=0.0):
    a, p = torch.nn.functional.normalize(a, dim=1), torch.nn.functional.normalize(p, dim=1)
    logits = a @ p.T / t
    if n is not None:
        n = torch.nn.functional.normalize(n, dim=1)
        extra = a @ n.T / t + w * torch.eye(B, dtype=torch.float64)
        logits = torch.cat([logits, extra], 1)
    return torch.nn.functional.cross_entropy(logits, torch.arange(B))


def show(name, value, tensors, t):
    print(f"const {name}_LOSS: f64 = {value.item()!r};")
    for x, tag in tensors:
        flat = ", ".join(repr(v) for v in x.grad.flatten().tolist())
        print(f"const {name}_GRAD_{tag}: [f64; {B * D}] = [{flat}];")
    print(f"const {name}_GRAD_T: f64 = {t.grad.item()!r};")


a, p, t = inputs(0.0), inputs(1.3), temperature()
l = loss(a, p, t)
l.backward()
show("UNSUP", l, [(a, "A"), (p, "P")], t)
a, p, n, t = inputs(0.0), inputs(1.3), inputs(2.9), temperature()
l = loss(a, p, t, n, 0.5)
l.backward()
show("SUP", l, [(a, "A"), (p, "P"), (n, "N")], t)
