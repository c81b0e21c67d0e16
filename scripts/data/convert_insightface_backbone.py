#!/usr/bin/env python3
"""Converts an insightface backbone checkpoint (arcface_torch's `backbone.pth`, the state dict
of an IResNet or MobileFaceNet) to a safetensors file under the same names, for allgrad's
`model.init_from` (`model.kind: iresnet` or `mobilefacenet`):

    python scripts/data/convert_insightface_backbone.py backbone.pth model.safetensors

Needs a Python with torch and safetensors (the PyTorch environment of scripts/ci/get_torch.sh
has both). The checkpoint is read with `torch.load(..., weights_only=True)` (tensors only, no
code runs). A `module.` prefix (a state dict saved from a DistributedDataParallel wrapper) is
removed; floating-point tensors are written as f32 (a checkpoint saved in f16 is widened),
`num_batches_tracked` as it is (allgrad ignores it). Prints the number of tensors and
parameters, and the names that tell the architecture (`layer4.*` for IResNet, `conv_sep.*` for
MobileFaceNet). The reverse direction needs no script: `export --format safetensors` of a run
writes insightface's names, and `load_state_dict(safetensors.torch.load_file(path),
strict=True)` loads them into insightface's `iresnet50()` etc.
"""

import argparse
import sys

import torch
from safetensors.torch import save_file


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pth", help="insightface's backbone.pth (a state dict)")
    p.add_argument("out", help="the safetensors file to write")
    a = p.parse_args()
    sd = torch.load(a.pth, map_location="cpu", weights_only=True)
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        sys.exit(f"{a.pth}: not a state dict of tensors (insightface saves backbone.module.state_dict())")
    out = {}
    for k, v in sd.items():
        k = k[len("module.") :] if k.startswith("module.") else k
        out[k] = (v.float() if v.is_floating_point() else v).contiguous()
    save_file(out, a.out)
    params = sum(v.numel() for k, v in out.items() if v.is_floating_point() and "running_" not in k)
    arch = "IResNet" if "layer4.0.conv1.weight" in out else "MobileFaceNet" if "conv_sep.layers.0.weight" in out else "unknown"
    print(f"{a.out}: {len(out)} tensors, {params} parameter values ({arch}; fc.weight {list(out['fc.weight'].shape) if 'fc.weight' in out else '-'})")


if __name__ == "__main__":
    main()
