#!/usr/bin/env python3
"""Pillow's scaled JPEG decode (`Image.draft`: libjpeg-turbo decoding at 1/2, 1/4 or 1/8 in the
DCT domain) of the committed photographs, for
crates/allgrad-data/tests/data_tests/scaled_decode.rs.

    python scripts/reference/pillow_draft.py PHOTOS_DIR OUT_DIR

For each of square.jpg, wide.jpg, tall.jpg and gray.jpg in PHOTOS_DIR
(crates/allgrad-models/tests/data/clip-images) and each factor s of 2, 4 and 8, writes in
OUT_DIR NAME.S.rgb: the image drafted to 1/s (asked for (width // s, height // s), which gives
(ceil(width / s), ceil(height / s))) and converted to
RGB, raw bytes, row-major HWC; and manifest.json: for each file its width and height.
"""

import json
import math
import os
import sys

from PIL import Image


def main():
    photos, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    manifest = {}
    for name in ["square.jpg", "wide.jpg", "tall.jpg", "gray.jpg"]:
        for s in [2, 4, 8]:
            im = Image.open(os.path.join(photos, name))
            w, h = im.size
            want = (math.ceil(w / s), math.ceil(h / s))
            # Pillow picks the largest factor that keeps the image at least the size asked for.
            im.draft(im.mode, (w // s, h // s))
            if im.size != want:
                sys.exit(f"{name}: draft to {want} gave {im.size}")
            rgb = im.convert("RGB")
            key = f"{name}.{s}.rgb"
            with open(os.path.join(out, key), "wb") as f:
                f.write(rgb.tobytes())
            manifest[key] = {"width": rgb.size[0], "height": rgb.size[1]}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    main()
