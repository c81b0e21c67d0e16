#!/usr/bin/env python3
"""Times one SimCLR training step in PyTorch on the CPU: ResNet-18 (CIFAR stem, width 64) on 2B
random 3x32x32 views, projector 512-2048-128, NT-Xent, SGD update — the same step as allgrad's
`examples/bench_simclr_step.rs`. PyTorch installs with `pip install torch` (kept out of CI).

    python3 scripts/bench_simclr_step.py 64 256
"""
import sys
import time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    print("bench_simclr_step.py: PyTorch is not installed (pip install torch)", file=sys.stderr)
    sys.exit(2)


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers, cin = [], width
        for stage in range(4):
            cout = width << stage
            for i in range(2):
                layers.append(Block(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        h = self.layers(F.relu(self.bn1(self.conv1(x))))
        return F.adaptive_avg_pool2d(h, 1).flatten(1)


def nt_xent(z1, z2, t):
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n = z1.shape[0]
    logits = z @ z.t() / t
    logits.fill_diagonal_(float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])
    return F.cross_entropy(logits, target)


def main():
    torch.set_num_threads(2)
    batches = [int(a) for a in sys.argv[1:]] or [64, 256]
    for b in batches:
        torch.manual_seed(0)
        enc = ResNet18()
        proj = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 128))
        opt = torch.optim.SGD(list(enc.parameters()) + list(proj.parameters()), lr=0.1)
        x = torch.randn(2 * b, 3, 32, 32)
        times = []
        for step in range(4):
            t = time.perf_counter()
            z = proj(enc(x))
            loss = nt_xent(z[:b], z[b:], 0.5)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step > 0:
                times.append(time.perf_counter() - t)
        times.sort()
        print(f"pytorch batch {b} ({2 * b} views): {times[len(times) // 2]:.3f} s per step (median of {len(times)})")


if __name__ == "__main__":
    main()
