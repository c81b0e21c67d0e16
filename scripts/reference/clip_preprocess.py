#!/usr/bin/env python3
"""Pixel values of transformers' CLIP image processor on image files, for the test of
allgrad's CLIP preprocessing (crates/allgrad-models/tests/models/clip_preprocess.rs).

    python scripts/reference/clip_preprocess.py OUT [--shortest S] [--crop C] [--resample R] IMAGE...

Writes the processor's `preprocessor_config.json` into the folder OUT (save_pretrained: what
allgrad reads on import) and prints one JSON object: for each image (by file name) the shape
and the values of `pixel_values` (float32, channels first), and the RGB bytes Pillow decoded
(`decoded`, height x width x 3), so that the preprocessing can be compared apart from the
JPEG decoder. The processor is transformers'
Pillow backend (`CLIPImageProcessorPil`, which `CLIPImageProcessor` is without torchvision):
Pillow's resize, as OpenCLIP's transforms on PIL images do it; images are opened with Pillow
(libjpeg-turbo's decoder). Needs transformers 5.24.0 and Pillow (scripts/ci/get_torch.sh).
"""

import argparse
import json
import os

import numpy as np
from PIL import Image
from transformers import CLIPImageProcessorPil


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("images", nargs="+")
    ap.add_argument("--shortest", type=int, default=None)
    ap.add_argument("--crop", type=int, default=None)
    ap.add_argument("--resample", type=int, default=None)
    args = ap.parse_args()
    kwargs = {}
    if args.shortest is not None:
        kwargs["size"] = {"shortest_edge": args.shortest}
    if args.crop is not None:
        kwargs["crop_size"] = {"height": args.crop, "width": args.crop}
    if args.resample is not None:
        kwargs["resample"] = args.resample
    proc = CLIPImageProcessorPil(**kwargs)
    proc.save_pretrained(args.out)
    out = {}
    for path in args.images:
        img = Image.open(path)
        px = proc(images=img, return_tensors="np")["pixel_values"][0].astype(np.float32)
        rgb = np.array(img.convert("RGB"))
        out[os.path.basename(path)] = {
            "shape": list(px.shape),
            "values": [float(v) for v in px.reshape(-1)],
            "decoded": {"width": rgb.shape[1], "height": rgb.shape[0], "bytes": rgb.reshape(-1).tolist()},
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
