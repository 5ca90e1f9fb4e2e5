"""The per-channel mean and std of a folder's images (pixels in [0, 1]), as the --mean / --std flags to
train on them with: for images that are not ImageNet photos (grey scans, microscopy, satellite RGB).

  python scripts/mean_std.py /data/train [--max-images 5000]

Reads up to --max-images images, evenly spaced over the sorted file list (a class folder layout or a flat
folder), each converted to RGB as training reads it (common.to_uint8), and pools every pixel of them."""
import argparse
import os
import sys

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402


def mean_std(folder, max_images=5000):
    """((3,) mean, (3,) std) over every pixel of up to max_images images under folder."""
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs
                   if f.lower().endswith(C.IMG_EXTS))
    if not files:
        raise C.UserError(f"{folder}: no images")
    pick = np.unique(np.linspace(0, len(files) - 1, min(max_images, len(files))).round().astype(int))
    total, sq, n = np.zeros(3), np.zeros(3), 0
    for i in pick:
        with Image.open(files[i]) as im:
            x = C.to_uint8(im).double().numpy().reshape(3, -1) / 255
        total += x.sum(1)
        sq += (x ** 2).sum(1)
        n += x.shape[1]
    mean = total / n
    return mean, np.sqrt(np.maximum(sq / n - mean ** 2, 0))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder")
    p.add_argument("--max-images", type=int, default=5000)
    a = p.parse_args()
    try:
        m, s = mean_std(a.folder, a.max_images)
    except C.UserError as e:
        sys.exit(f"error: {e}")
    print(f"--mean {' '.join(f'{v:.4f}' for v in m)} --std {' '.join(f'{v:.4f}' for v in s)}")
