#!/usr/bin/env python3
"""A ResNet written by allgrad's `export` loaded by torchvision and timm, compared with allgrad.

    python check_resnet_export.py --dir RUN/export/FORMAT --inputs INPUTS.safetensors --loaders torchvision,timm

INPUTS.safetensors holds `x` (images [N, C, H, W], normalised as the run's data), `features`
(allgrad's encoder features of `x` in evaluation mode, [N, F]) and `projections` (the head's
outputs of those features, [N, D]). Each loader builds its model from the names in config.json
(torchvision.models.<architecture>(); timm.create_model(<architecture>, num_classes=0,
in_chans=C)), loads model.safetensors with load_state_dict(strict=True), and computes the
features of `x` in evaluation mode, in f32; the head is rebuilt as the torch.nn.Sequential that
config.json describes and loads the head's file with strict=True. `cifar` is torchvision's model
with the stem config.json's note gives for the cifar stem (conv1 3x3 stride 1, no max-pool).
Prints one JSON line per loader: the largest absolute difference from allgrad's features and
projections, each divided by the largest absolute value of allgrad's. A load that fails
(strict=True) raises, and the script exits non-zero.
"""

import argparse
import json
import os

import torch
from safetensors.torch import load_file


def sequential(layers):
    mods = []
    for desc in layers:
        mods.append(eval("torch.nn." + desc, {"torch": torch, "True": True, "False": False}))
    return torch.nn.Sequential(*mods)


def build(loader, cfg):
    arch, c, width = cfg["architecture"], cfg["in_channels"], cfg["width"]
    if loader == "torchvision":
        import torchvision

        m = getattr(torchvision.models, arch)()
        m.fc = torch.nn.Identity()
    elif loader == "timm":
        import timm

        m = timm.create_model(arch, num_classes=0, in_chans=c, pretrained=False)
    elif loader == "cifar":
        import torchvision

        m = getattr(torchvision.models, arch)()
        m.conv1 = torch.nn.Conv2d(c, width, 3, 1, 1, bias=False)
        m.maxpool = torch.nn.Identity()
        m.fc = torch.nn.Identity()
    else:
        raise SystemExit(f"unknown loader {loader}")
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--loaders", default="torchvision,timm")
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = json.load(open(os.path.join(a.dir, "config.json")))
    backbone = load_file(os.path.join(a.dir, "model.safetensors"))
    head_key = "projector" if "projector" in cfg else "embedding"
    head_cfg = cfg[head_key]
    head_sd = load_file(os.path.join(a.dir, head_cfg["file"]))
    inputs = load_file(a.inputs)
    x, want_f, want_p = inputs["x"].float(), inputs["features"].float(), inputs["projections"].float()
    for loader in a.loaders.split(","):
        m = build(loader, cfg)
        m.load_state_dict(backbone, strict=True)
        m.eval()
        head = sequential(head_cfg["sequential"])
        head.load_state_dict(head_sd, strict=True)
        head.eval()
        with torch.no_grad():
            f = m(x)
            p = head(f)
        rel = lambda got, want: float((got - want).abs().max() / want.abs().max())
        print(json.dumps({"loader": loader, "strict": True, "features": list(f.shape), "features_rel": rel(f, want_f),
                          "projections_rel": rel(p, want_p)}), flush=True)


if __name__ == "__main__":
    main()
