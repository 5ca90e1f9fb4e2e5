"""The per-channel mean and std of a folder's images (pixels in [0, 1]), as the --mean / --std flags to
train on them with: for images that are not ImageNet photos (grey scans, microscopy, satellite RGB).

  python scripts/mean_std.py /data/train [--max-images 5000] [--in-chans N]

Reads up to --max-images images, evenly spaced over the sorted file list (a class folder layout or a flat
folder), each as training reads it with --in-chans N (common.read_image: RGB, grey, or N-channel .npy /
.tif stacks), and pools every pixel of them."""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402


def mean_std(folder, max_images=5000, chans=3):
    """((chans,) mean, (chans,) std) over every pixel of up to max_images images under folder."""
    C.set_mean_std([0.5] * chans, [1.0] * chans)                     # read_image reads `chans` channels
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs
                   if f.lower().endswith(C.image_exts()))
    if not files:
        raise C.UserError(f"{folder}: no images")
    pick = np.unique(np.linspace(0, len(files) - 1, min(max_images, len(files))).round().astype(int))
    total, sq, n = np.zeros(chans), np.zeros(chans), 0
    for i in pick:
        try:
            t = C.to_uint8(C.read_image(files[i]))
        except ValueError as e:
            raise C.UserError(f"cannot read {files[i]}: {e}") from None
        x = t.double().numpy().reshape(chans, -1) / (255 if t.dtype == C.torch.uint8 else 1)
        total += x.sum(1)
        sq += (x ** 2).sum(1)
        n += x.shape[1]
    mean = total / n
    return mean, np.sqrt(np.maximum(sq / n - mean ** 2, 0))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder")
    p.add_argument("--max-images", type=int, default=5000)
    p.add_argument("--in-chans", type=int, default=3, help="the channels training reads (its --in-chans)")
    a = p.parse_args()
    try:
        m, s = mean_std(a.folder, a.max_images, a.in_chans)
    except C.UserError as e:
        sys.exit(f"error: {e}")
    chans = f"--in-chans {a.in_chans} " if a.in_chans != 3 else ""
    print(f"{chans}--mean {' '.join(f'{v:.4f}' for v in m)} --std {' '.join(f'{v:.4f}' for v in s)}")
