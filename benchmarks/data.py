"""Data-pipeline throughput of each method's real view pipeline (decode + all views).

  python benchmarks/data.py --method all --data /imagenet --workers 8
  python benchmarks/data.py --method msn --gpu-aug            # on a generated folder of JPEGs

Two numbers per method, with the method's default ImageNet recipe (its own view class and its
`Args` defaults; nothing re-implemented here):
  per worker: images/s of one process running dataset.load (JPEG decode) + the view transform on
              one thread, the work a DataLoader worker does (SiamMAE: clips/s and pairs/s);
  loader:     images/s out of the training DataLoader (common.make_loader) with --workers
              processes and --batch-size, timed after the first batch (worker start-up excluded).
With --gpu-aug (MSN), the workers only crop and flip; the batched colour augmentation
(common.color_augment_batch) is timed separately on --device for one step's views.

Without --data, a folder of --n-images JPEGs (500x375, quality 90, like ImageNet's typical image)
and --n-images/8 clips of 8 frames (854x480, like DAVIS 480p) is written to a temporary directory
from the synthetic generator, with noise added so that decoding costs what a photo costs.
"""
import argparse
import importlib
import os
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402

METHODS = ("msn", "cmae", "conmim", "can", "siammae")
VIEWS = dict(msn="MultiView", cmae="PixelShiftViews", conmim="WeakStrongViews", can="TwoViews", siammae="FramePair")


def write_folder(root, n):
    """n photo-sized JPEGs in root/images/train/<class>/ and n // 8 clips in root/videos/<clip>/."""
    rng = np.random.default_rng(0)

    def photo(i, w, h):
        img = np.asarray(C.synthetic_image(i, size=64)[0].resize((w, h), Image.BICUBIC), np.float32)
        return Image.fromarray(np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8))
    for i in range(n):
        d = os.path.join(root, "images", "train", f"c{i % 10}")
        os.makedirs(d, exist_ok=True)
        photo(i, 500, 375).save(os.path.join(d, f"{i:05d}.jpg"), quality=90)
    for v in range(max(2, n // 8)):
        d = os.path.join(root, "videos", f"clip{v:03d}")
        os.makedirs(d, exist_ok=True)
        for t in range(8):
            photo(v * 8 + t, 854, 480).save(os.path.join(d, f"{t:05d}.jpg"), quality=90)


def pipeline(method, data, gpu_aug):
    mod = importlib.import_module(method)
    argv = ["--data", data] + (["--gpu-aug"] if gpu_aug and method == "msn" else [])
    args = C.parse_args(mod.Args, argv)
    ds = mod.video_dataset(data) if method == "siammae" else C.image_dataset(data, "train")
    if ds is None or len(ds) == 0:
        raise SystemExit(f"error: no data for {method} under {data}")
    per_item = args.repeated_sampling if method == "siammae" else 1     # pairs per clip
    return args, C.Views(ds, getattr(mod, VIEWS[method])(args), seed=0), per_item


def per_worker(views, n):
    torch.set_num_threads(1)                                         # as in a DataLoader worker
    for i in range(min(3, len(views))):
        views[(i, 0)]
    t, k = time.perf_counter(), 0
    while k < n:
        views[(k % len(views), 1)]
        k += 1
    return k / (time.perf_counter() - t)


def loader_rate(views, batch, workers, batches):
    torch.set_num_threads(max(1, os.cpu_count() // 2))
    loader = C.make_loader(views, batch, workers, seed=0)

    def stream():                                                    # epochs back to back
        for epoch in range(10 ** 6):
            loader.sampler.set_epoch(epoch)
            yield from loader
    it = stream()
    next(it)                                                         # worker start-up excluded
    t = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * batch / (time.perf_counter() - t)


def gpu_aug_rate(args, B, device, reps=5):
    """img/s of color_augment_batch + normalize over one step's MSN views (target + anchors + focal)."""
    views = [torch.randint(0, 256, (B, 3, args.img_size, args.img_size), dtype=torch.uint8, device=device)
             for _ in range(1 + args.rand_views)]
    views += [torch.randint(0, 256, (B, 3, args.focal_size, args.focal_size), dtype=torch.uint8, device=device)
              for _ in range(args.focal_views)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for r in range(reps + 1):
        if r == 1:
            sync()
            t = time.perf_counter()
        [C.normalize(C.color_augment_batch(v)) for v in views]
    sync()
    return reps * B / (time.perf_counter() - t)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="all", choices=METHODS + ("all",))
    p.add_argument("--data", default=None, help="image folder (DIR/train used if present); for siammae a video folder")
    p.add_argument("--video-data", default=None, help="video folder for siammae (default: --data)")
    p.add_argument("--n-images", type=int, default=256, help="JPEGs to generate when --data is not given")
    p.add_argument("--images", type=int, default=40, help="images timed per worker")
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--gpu-aug", action="store_true", help="MSN: colour augmentation on --device")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    tmp = None
    if a.data is None:
        tmp = tempfile.TemporaryDirectory()
        print(f"writing {a.n_images} JPEGs (500x375) and {max(2, a.n_images // 8)} clips x 8 frames (854x480) "
              f"to {tmp.name}", flush=True)
        write_folder(tmp.name, a.n_images)
        a.data, a.video_data = os.path.join(tmp.name, "images"), os.path.join(tmp.name, "videos")
    a.video_data = a.video_data or a.data
    cpu = f"{os.cpu_count()} CPUs"
    print(f"device: {cpu}, torch {torch.__version__}, workers {a.workers}, batch {a.batch_size}, data {a.data}")
    print("| method | views per image | per worker img/s | loader img/s | GPU aug img/s |")
    print("|---|---|---|---|---|")
    for m in METHODS if a.method == "all" else (a.method,):
        args, views, per_item = pipeline(m, a.video_data if m == "siammae" else a.data, a.gpu_aug)
        out = views[(0, 0)][0]
        n_views = (f"{sum(getattr(v, 'ndim', 0) == 3 for v in out)}" if isinstance(out, (list, tuple))
                   else f"{per_item} pairs")                         # image tensors (not CMAE's shift)
        w = per_worker(views, a.images)
        bs = max(1, a.batch_size // per_item) if m == "siammae" else a.batch_size
        ld = loader_rate(views, min(bs, len(views)), a.workers, a.batches)
        unit = " (pairs)" if m == "siammae" else ""
        g = f"{gpu_aug_rate(args, a.batch_size, torch.device(a.device)):.0f} ({a.device})" if a.gpu_aug and m == "msn" else "-"
        print(f"| {m}{unit} | {n_views} | {w * per_item:.1f} | {ld * per_item:.1f} | {g} |", flush=True)
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    try:
        main()
    except C.UserError as e:                                         # bad --data: one line, no traceback
        raise SystemExit(f"error: {e}")
