#!/usr/bin/env python3
"""insightface's face backbones (arcface_torch's IResNet and MobileFaceNet) in PyTorch, the
reference that allgrad's `model.kind: iresnet` and `mobilefacenet` are compared with.

No package on PyPI ships arcface_torch's backbones (the `insightface` package carries ONNX
models and their runtime, not `recognition/arcface_torch/backbones`), so the two networks are
written here, independently of allgrad's code, from the architecture of insightface's
`iresnet.py` and `mobilefacenet.py`: the same modules in the same order, so that
`state_dict()` has the names and shapes of insightface's `backbone.pth`. Beyond insightface,
`width`, `in_channels` and `input_size` may differ from its 64, 3 and 112, so that tests run
small networks on a CPU (with the defaults the module is insightface's).

    insightface_backbones.py layout --arch iresnet100 [--next layout --arch mbf ...]
        prints {name: shape} of the state dict (one JSON line per configuration; `--next`
        separates several, run in one process)
    insightface_backbones.py make --arch iresnet18 --width 16 --out DIR [--n 3]
        random parameters, running statistics set by training-mode forwards of random
        images, then in evaluation mode: DIR/backbone.pth (the state dict saved by
        torch.save, as insightface saves it), DIR/weights.safetensors (the same, as
        scripts/data/convert_insightface_backbone.py converts it) and
        DIR/io.safetensors (`x`: N random faces, `emb`: the f32 embeddings, `emb64`: the same
        network's embeddings in f64)
    insightface_backbones.py check --arch iresnet18 --width 16 --weights FILE --inputs IO
        builds the network, loads FILE with load_state_dict(strict=True) and prints one JSON
        line: the largest absolute difference of its f32 and f64 embeddings of IO's `x` from
        IO's `emb`, each divided by the largest |emb|

The architecture options: --arch iresnet18|34|50|100|200 or mbf (get_mbf) or mbf_large
(get_mbf_large), --width (IResNet), --scale and --blocks (MobileFaceNet), --in-channels,
--input-size, --embedding, --dropout.
"""

import argparse
import json
import sys

import torch
from torch import nn
from safetensors.torch import load_file, save_file

STAGES = {18: [2, 2, 2, 2], 34: [3, 4, 6, 3], 50: [3, 4, 14, 3], 100: [3, 13, 30, 3], 200: [6, 26, 60, 6]}


class IBasicBlock(nn.Module):
    """BN, conv3x3, BN, PReLU, conv3x3 (the stride), BN, plus the (downsampled) input."""

    def __init__(self, cin, planes, stride, downsample):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin, eps=1e-5)
        self.conv1 = nn.Conv2d(cin, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes, eps=1e-5)
        self.prelu = nn.PReLU(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes, eps=1e-5)
        self.downsample = downsample

    def forward(self, x):
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        skip = x if self.downsample is None else self.downsample(x)
        return out + skip


class IResNet(nn.Module):
    def __init__(self, depth, width=64, in_channels=3, input_size=112, num_features=512, dropout=0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width, eps=1e-5)
        self.prelu = nn.PReLU(width)
        cin = width
        for stage, n in enumerate(STAGES[depth]):
            planes = width * 2**stage
            blocks = []
            for i in range(n):
                down = None
                if i == 0:
                    down = nn.Sequential(nn.Conv2d(cin, planes, 1, 2, bias=False), nn.BatchNorm2d(planes, eps=1e-5))
                blocks.append(IBasicBlock(cin, planes, 2 if i == 0 else 1, down))
                cin = planes
            setattr(self, f"layer{stage + 1}", nn.Sequential(*blocks))
        side = input_size // 16
        self.bn2 = nn.BatchNorm2d(cin, eps=1e-5)
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(cin * side * side, num_features)
        self.features = nn.BatchNorm1d(num_features, eps=1e-5)
        nn.init.constant_(self.features.weight, 1.0)
        self.features.weight.requires_grad = False

    def forward(self, x):
        x = self.prelu(self.bn1(self.conv1(x)))
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        x = torch.flatten(self.bn2(x), 1)
        return self.features(self.fc(self.dropout(x)))


class Block(nn.Module):
    """A module holding its layers in `layers` (MobileFaceNet's ConvBlock, LinearBlock,
    Residual and GDC all name them so)."""

    def __init__(self, *mods):
        super().__init__()
        self.layers = nn.Sequential(*mods)

    def forward(self, x):
        return self.layers(x)


def conv_block(cin, cout, k, stride, groups, linear=False):
    """Conv, BN and (unless linear) PReLU."""
    mods = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    if not linear:
        mods.append(nn.PReLU(cout))
    return Block(*mods)


class DepthWise(nn.Module):
    def __init__(self, cin, cout, residual, stride, hidden):
        super().__init__()
        self.residual = residual
        self.layers = nn.Sequential(
            conv_block(cin, hidden, 1, 1, 1),
            conv_block(hidden, hidden, 3, stride, hidden),
            conv_block(hidden, cout, 1, 1, 1, linear=True),
        )

    def forward(self, x):
        y = self.layers(x)
        return x + y if self.residual else y


def residual(c, n, hidden):
    return Block(*[DepthWise(c, c, True, 1, hidden) for _ in range(n)])


class MobileFaceNet(nn.Module):
    def __init__(self, num_features=512, blocks=(1, 4, 6, 2), scale=2, in_channels=3, input_size=112):
        super().__init__()
        c = 64 * scale
        first = conv_block(c, c, 3, 1, 64) if blocks[0] == 1 else residual(c, blocks[0], 128)
        self.layers = nn.ModuleList(
            [
                conv_block(in_channels, c, 3, 2, 1),
                first,
                DepthWise(c, c, False, 2, 128),
                residual(c, blocks[1], 128),
                DepthWise(c, 2 * c, False, 2, 256),
                residual(2 * c, blocks[2], 256),
                DepthWise(2 * c, 2 * c, False, 2, 512),
                residual(2 * c, blocks[3], 256),
            ]
        )
        self.conv_sep = conv_block(2 * c, 512, 1, 1, 1)
        k = input_size // 16
        # GDC: the global depthwise convolution (one k x k kernel per channel on the k x k
        # map, no padding) and BN, then flatten, a bias-free linear layer and BN.
        self.features = Block(
            Block(nn.Conv2d(512, 512, k, 1, 0, groups=512, bias=False), nn.BatchNorm2d(512)),
            nn.Flatten(),
            nn.Linear(512, num_features, bias=False),
            nn.BatchNorm1d(num_features),
        )

    def forward(self, x):
        for m in self.layers:
            x = m(x)
        return self.features(self.conv_sep(x))


def build(a):
    if a.arch.startswith("iresnet"):
        return IResNet(int(a.arch[7:]), a.width, a.in_channels, a.input_size, a.embedding, a.dropout)
    scale, blocks = (4, (2, 8, 12, 4)) if a.arch == "mbf_large" else (2, (1, 4, 6, 2))
    if a.scale:
        scale = a.scale
    if a.blocks:
        blocks = tuple(int(b) for b in a.blocks.split(","))
    return MobileFaceNet(a.embedding, blocks, scale, a.in_channels, a.input_size)


def randomize(model, gen, n_calib, shape):
    """Random weights, then running statistics from training-mode forwards (cumulative)."""
    rand = lambda t, lo, hi: t.copy_(lo + (hi - lo) * torch.rand(t.shape, generator=gen))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                fan_in = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * (2.0 / fan_in) ** 0.5)
                if m.bias is not None:
                    m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
            elif isinstance(m, nn.PReLU):
                rand(m.weight, 0.1, 0.4)
            elif isinstance(m, nn.modules.batchnorm._BatchNorm):
                # IResNet's `features` keeps its weight at 1, as insightface holds it.
                if not (isinstance(model, IResNet) and m is model.features):
                    rand(m.weight, 0.5, 1.5)
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
                m.momentum = None
        model.train()
        for _ in range(2):
            model(torch.randn((n_calib,) + shape, generator=gen))
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.momentum = 0.1
    model.eval()


def main():
    argv, groups = sys.argv[1:], [[]]
    for arg in argv:
        if arg == "--next":
            groups.append([])
        else:
            groups[-1].append(arg)
    for g in groups:
        run(g)


def run(argv):
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["layout", "make", "check"])
    p.add_argument("--arch", required=True)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--scale", type=int, default=0)
    p.add_argument("--blocks", default="")
    p.add_argument("--in-channels", type=int, default=3)
    p.add_argument("--input-size", type=int, default=112)
    p.add_argument("--embedding", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--out")
    p.add_argument("--n", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights")
    p.add_argument("--inputs")
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    if a.mode == "layout":
        with torch.device("meta"):
            sd = build(a).state_dict()
        print(json.dumps({k: list(v.shape) for k, v in sd.items()}))
        return
    model = build(a)
    shape = (a.in_channels, a.input_size, a.input_size)
    if a.mode == "make":
        gen = torch.Generator().manual_seed(a.seed)
        randomize(model, gen, 8, shape)
        x = torch.randn((a.n,) + shape, generator=gen)
        with torch.no_grad():
            emb = model(x)
            emb64 = model.double()(x.double())
        sd = {k: v.detach().float().contiguous() if v.is_floating_point() else v for k, v in model.float().state_dict().items()}
        save_file(sd, f"{a.out}/weights.safetensors")
        torch.save(model.state_dict(), f"{a.out}/backbone.pth")
        save_file({"x": x, "emb": emb, "emb64": emb64}, f"{a.out}/io.safetensors")
        print(json.dumps({"tensors": len(sd), "emb": list(emb.shape)}))
        return
    model.load_state_dict(load_file(a.weights), strict=True)
    model.eval()
    io = load_file(a.inputs)
    with torch.no_grad():
        emb = model(io["x"])
        emb64 = model.double()(io["x"].double())
    ref = io["emb"].double()
    scale = ref.abs().max().item()
    print(
        json.dumps(
            {
                "emb": list(emb.shape),
                "f32_rel": (emb.double() - ref).abs().max().item() / scale,
                "f64_rel": (emb64 - ref).abs().max().item() / scale,
            }
        )
    )


if __name__ == "__main__":
    main()
