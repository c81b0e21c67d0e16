#!/usr/bin/env python3
"""Writes WebP files with Pillow (libwebp) and Pillow's own decode of each, for
crates/allgrad-data/tests/data_tests/webp.rs.

    python scripts/reference/pillow_webp.py PHOTOS_DIR OUT_DIR

From the committed photographs in PHOTOS_DIR (crates/allgrad-models/tests/data/clip-images:
wide.jpg, tall.jpg, gray.jpg) writes, in OUT_DIR:
- NAME-lossless.webp: lossless WebP (`lossless=True`);
- NAME-lossy.webp: lossy WebP of quality 80 (4:2:0 chroma, as libwebp always writes it);
- wide-alpha-lossless.webp, wide-alpha-lossy.webp: the wide photograph with an alpha channel
  (a gradient; VP8L with alpha, and VP8X with an ALPH chunk);
- NAME.webp.rgb for each: Pillow's decode of the file, `convert("RGB")` (alpha dropped), as raw
  bytes, row-major HWC;
- manifest.json: for each file its width, height and whether it is lossless.
Needs Pillow built with WebP (`python -c "from PIL import features; print(features.check('webp'))"`).
"""

import json
import os
import sys

from PIL import Image, features


def main():
    photos, out = sys.argv[1], sys.argv[2]
    if not features.check("webp"):
        sys.exit("this Pillow has no WebP support")
    os.makedirs(out, exist_ok=True)
    manifest = {}

    def write(name, img, lossless):
        path = os.path.join(out, name)
        if lossless:
            img.save(path, format="WEBP", lossless=True)
        else:
            img.save(path, format="WEBP", quality=80)
        decoded = Image.open(path)
        decoded.load()
        rgb = decoded.convert("RGB")
        with open(path + ".rgb", "wb") as f:
            f.write(rgb.tobytes())
        manifest[name] = {"width": rgb.width, "height": rgb.height, "lossless": lossless}

    for stem in ["wide", "tall", "gray"]:
        img = Image.open(os.path.join(photos, stem + ".jpg")).convert("RGB")
        write(f"{stem}-lossless.webp", img, True)
        write(f"{stem}-lossy.webp", img, False)
    wide = Image.open(os.path.join(photos, "wide.jpg")).convert("RGB")
    alpha = Image.linear_gradient("L").resize(wide.size)
    rgba = wide.copy()
    rgba.putalpha(alpha)
    write("wide-alpha-lossless.webp", rgba, True)
    write("wide-alpha-lossy.webp", rgba, False)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
