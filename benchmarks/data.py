"""Data-pipeline throughput of each method's real view pipeline (decode + all views), next to a
reference pipeline written from the method's official recipe.

  python benchmarks/data.py --method all --data /imagenet --workers 8
  python benchmarks/data.py --method all                      # on a generated folder of JPEGs
  python benchmarks/data.py --method msn --device cuda        # + the batched GPU augmentation's cost

Per method, with its default ImageNet recipe (its own view class and `Args` defaults):
  ours / official, per core: images/s of one single-threaded process doing dataset.load (JPEG
      decode) + every view, the work of one DataLoader worker, for our pipeline (colour on the CPU,
      --no-gpu-aug) and for a reference pipeline built here from the official recipe (ops,
      parameters and order written from the official code's transform list: PIL in, ToTensor +
      Normalize out, as the official loaders produce), timed in interleaved rounds on the same
      images; ratio = ours / official;
  gpu-aug workers, per core: the same for our CUDA default, where the workers only decode, crop
      and flip (colour runs batched on the device);
  loader: steady-state images/s out of the training DataLoader (common.make_loader) with --workers
      processes (worker start-up, the first prefetch and epoch boundaries excluded);
  device aug: images/s of gpu_aug.color_augment_batch + normalize over one step's views on
      --device (only with --device cuda, or --device-aug); --compile: compiled, as train() runs it.
For MSN, whose 12 views make the CPU workers the bottleneck, a second table times `--gpu-decode`
(gpu_decode.py): its workers (read the file, parse the header, draw the boxes and flips) per core,
interleaved with the gpu-aug workers above, and on --device one batch of --batch-size images
decoded, cropped, flipped, colour-augmented and normalised (with --device cuda, or --device-aug).
SiamMAE has no official code (no reference) and no colour augmentation.

Without --data, a folder of --n-images JPEGs (500x375, quality 90, like ImageNet's typical image)
and --n-images/8 clips of 8 frames (854x480, like DAVIS 480p) is written to a temporary directory
from the synthetic generator, with noise added so that decoding costs what a photo costs.
"""
import argparse
import importlib
import os
import platform
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402
import harness as H  # noqa: E402
import gpu_aug as GA  # noqa: E402
import synthetic as S  # noqa: E402

METHODS = ("msn", "cmae", "conmim", "can", "siammae")
VIEWS = dict(msn="MultiView", cmae="PixelShiftViews", conmim="WeakStrongViews", can="TwoViews", siammae="FramePair")


def write_folder(root, n, images=True, clips=True):
    """n photo-sized JPEGs in root/images/train/<class>/ and n // 8 clips in root/videos/<clip>/."""
    rng = np.random.default_rng(0)

    def photo(i, w, h):
        img = np.asarray(S.synthetic_image(i, size=64)[0].resize((w, h), Image.BICUBIC), np.float32)
        return Image.fromarray(np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8))
    for i in range(n if images else 0):
        d = os.path.join(root, "images", "train", f"c{i % 10}")
        os.makedirs(d, exist_ok=True)
        photo(i, 500, 375).save(os.path.join(d, f"{i:05d}.jpg"), quality=90)
    for v in range(max(2, n // 8) if clips else 0):
        d = os.path.join(root, "videos", f"clip{v:03d}")
        os.makedirs(d, exist_ok=True)
        for t in range(8):
            photo(v * 8 + t, 854, 480).save(os.path.join(d, f"{t:05d}.jpg"), quality=90)


def pipeline(method, data, gpu_aug):
    mod = importlib.import_module(method)
    argv = ["--data", data] + (["--gpu-aug"] if gpu_aug else ["--no-gpu-aug"] if method != "siammae" else [])
    args = H.parse_args(mod.Args, argv)
    ds = mod.video_dataset(data) if method == "siammae" else C.image_dataset(data, "train")
    if ds is None or len(ds) == 0:
        raise SystemExit(f"error: no data for {method} under {data}")
    per_item = args.repeated_sampling if method == "siammae" else 1     # pairs per clip
    return args, C.Views(ds, getattr(mod, VIEWS[method])(args), seed=0), per_item


class PILBlur:
    """The official MSN / DINO GaussianBlur: with probability p, PIL blur of radius U(0.1, 2)."""

    def __init__(self, p):
        self.p = p

    def __call__(self, img):
        from PIL import ImageFilter
        return img.filter(ImageFilter.GaussianBlur(np.random.uniform(0.1, 2.0))) if np.random.rand() < self.p else img


class Solarize:
    def __init__(self, p):
        self.p = p

    def __call__(self, img):
        from PIL import ImageOps
        return ImageOps.solarize(img) if np.random.rand() < self.p else img


def reference(method):
    """The official recipe's view pipeline (ops, parameters, order), written here from the recipe."""
    from torchvision import transforms as T
    bicubic = T.InterpolationMode.BICUBIC
    norm = T.Compose([T.ToTensor(), T.Normalize(C.IMAGENET_MEAN, C.IMAGENET_STD)])
    jitter = lambda s: T.RandomApply([T.ColorJitter(*s)], p=0.8)         # noqa: E731
    if method == "msn":                      # msn src/data_manager.make_transforms, colour strength 0.5
        color = [jitter((0.4, 0.4, 0.4, 0.1)), T.RandomGrayscale(0.2), PILBlur(0.5)]
        rand = T.Compose([T.RandomResizedCrop(224, scale=(0.3, 1.0)), T.RandomHorizontalFlip(), *color, norm])
        focal = T.Compose([T.RandomResizedCrop(96, scale=(0.05, 0.3)), T.RandomHorizontalFlip(), *color, norm])
        return lambda img: [rand(img) for _ in range(2)] + [focal(img) for _ in range(10)]
    if method == "cmae":                     # CMAE config + CMAEDataset: master crop, shifted coloured target
        master = T.Compose([T.RandomResizedCrop(256, scale=(0.2, 1.0), interpolation=bicubic),
                            T.RandomHorizontalFlip()])
        aug = T.Compose([jitter((0.4, 0.4, 0.4, 0.1)), T.RandomGrayscale(0.2), PILBlur(0.5)])

        def cmae_views(img):
            m = master(img)
            dx, dy = np.random.randint(0, 32, 2)
            return norm(m.crop((0, 0, 224, 224))), norm(aug(m.crop((dx, dy, dx + 224, dy + 224))))
        return cmae_views
    if method == "conmim":                   # ConMIM datasets.DataAugmentationForConMIM
        common = T.Compose([T.RandomHorizontalFlip(), T.RandomResizedCrop(224, scale=(0.08, 1.0),
                                                                          interpolation=bicubic)])
        hard = T.Compose([jitter((0.4, 0.4, 0.2, 0.1)), T.RandomGrayscale(0.2), PILBlur(0.1), Solarize(0.2)])

        def conmim_views(img):
            c = common(img)
            return norm(c), norm(hard(c))
        return conmim_views
    if method == "can":                      # two SimCLR views (CAN paper / can.md)
        view = T.Compose([T.RandomResizedCrop(224, scale=(0.2, 1.0), interpolation=bicubic), T.RandomHorizontalFlip(),
                          jitter((0.4, 0.4, 0.4, 0.1)), T.RandomGrayscale(0.2), PILBlur(0.5), norm])
        return lambda img: (view(img), view(img))
    return None


def interleaved(fns, views, n, rounds=4):
    """img/s of each fn(i) over the same n indices, in interleaved rounds, one thread."""
    torch.set_num_threads(1)                                         # as in a DataLoader worker
    for f in fns:
        f(0)
    tot = [0.0] * len(fns)
    for r in range(rounds):
        for j, f in enumerate(fns):
            t = time.perf_counter()
            for k in range(n):
                f((r * n + k) % len(views))
            tot[j] += time.perf_counter() - t
    return [rounds * n / t for t in tot]


def per_worker(views, n):
    torch.set_num_threads(1)                                         # as in a DataLoader worker
    for i in range(min(3, len(views))):
        views[(i, 0)]
    t, k = time.perf_counter(), 0
    while k < n:
        views[(k % len(views), 1)]
        k += 1
    return k / (time.perf_counter() - t)


class Repeat(torch.utils.data.Dataset):
    """The dataset's images repeated `reps` times, so that one epoch spans the whole measurement."""

    def __init__(self, ds, reps):
        self.ds, self.reps = ds, reps

    def __len__(self):
        return len(self.ds) * self.reps

    def load(self, i):
        return self.ds.load(i % len(self.ds))

    @property
    def reader(self):                            # the files' reader (gpu_decode.encoded swaps it)
        return self.ds.reader

    @reader.setter
    def reader(self, fn):
        self.ds.reader = fn


def loader_rate(views, batch, workers, batches):
    """Steady-state images/s out of the training DataLoader: one epoch long enough for every timed
    batch (no epoch boundary inside the measurement), timed after 2 x workers + 1 warm-up batches
    (worker start-up and the first prefetch excluded)."""
    torch.set_num_threads(max(1, os.cpu_count() // 2))
    warm = 2 * workers + 1
    reps = -(-(warm + batches + 1) * batch // len(views.dataset))
    loader = C.make_loader(C.Views(Repeat(views.dataset, reps), views.transform, views.seed), batch, workers, seed=0)
    it = iter(loader)
    for _ in range(warm):
        next(it)
    t = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * batch / (time.perf_counter() - t)


def aug_views(method, args, B, device):
    """One step's views that the method colour-augments, as random uint8 (B, 3, s, s) each, their sizes,
    and the augmentation's parameters (ConMIM: its strong view)."""
    S = args.img_size
    shapes = ([S] * (1 + args.rand_views) + [args.focal_size] * args.focal_views if method == "msn"
              else [S] * (2 if method == "can" else 1))
    kw = importlib.import_module("conmim").STRONG if method == "conmim" else {}
    return [torch.randint(0, 256, (B, 3, s, s), dtype=torch.uint8, device=device) for s in shapes], shapes, kw


def gpu_aug_rate(method, args, B, device, reps=5, aug=GA.color_augment_batch):
    """img/s of color_augment_batch (aug: or its compiled twin) + normalize over one step's views that
    the method augments."""
    views, _, kw = aug_views(method, args, B, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for r in range(reps + 1):
        if r == 1:
            sync()
            t = time.perf_counter()
        [C.normalize(aug(v, **kw)) for v in views]
    sync()
    return reps * B / (time.perf_counter() - t)


def aug_against(rev, methods, B, device, compiled, rounds=5):
    """The batched augmentation of this checkout against gpu_aug.py of git revision `rev`, interleaved
    (rounds of each, the first left out: compilation, allocator warm-up), over one step's views of
    each method: ms per step of B images (median) and the ratio old / new."""
    import subprocess
    import types
    src = subprocess.run(["git", "show", f"{rev}:gpu_aug.py"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if src.returncode:
        raise C.UserError(f"--aug-against {rev}: {(src.stderr.strip().splitlines() or ['git failed'])[-1]}")
    old = types.ModuleType("gpu_aug_old")
    sys.modules[old.__name__] = old               # torch.compile re-imports a traced function's module by name
    exec(compile(src.stdout, f"{rev}:gpu_aug.py", "exec"), old.__dict__)
    augs = {"old": old.color_augmenter(compiled), "new": GA.color_augmenter(compiled)}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"| method | views of {B} images | {rev} ms/step | this checkout ms/step | ratio |\n|---|---|---|---|---|")
    for m in methods:
        args = H.parse_args(importlib.import_module(m).Args, ["--data", "recipe"])    # the recipe's view sizes
        views, shapes, kw = aug_views(m, args, B, device)
        ms = {k: [] for k in augs}
        for r in range(rounds + 1):
            for k, aug in augs.items():
                sync()
                t = time.perf_counter()
                [C.normalize(aug(v, **kw)) for v in views]
                sync()
                if r:
                    ms[k].append(1e3 * (time.perf_counter() - t))
        med = {k: sorted(v)[len(v) // 2] for k, v in ms.items()}
        print(f"| {m} | {'+'.join(map(str, shapes))} px | {med['old']:.1f} | {med['new']:.1f} | "
              f"{med['old'] / med['new']:.2f} |", flush=True)


def decode_pipeline(method, args, data):
    """--gpu-decode's worker side: Views over the encoded files, drawing the method's boxes and flips."""
    import gpu_decode as G
    boxes = G.Boxes(importlib.import_module(method).view_specs(args))
    return C.Views(G.encoded(C.image_dataset(data, "train")), boxes, seed=0)


def decode_rate(dviews, B, device, reps=3, aug=GA.color_augment_batch):
    """img/s of gpu_decode.views (decode + crops + flips) + colour + normalize on one batch of B images."""
    import gpu_decode as G
    sizes = dviews.transform.sizes
    batch = G.collate([dviews[(i % len(dviews), 0)] for i in range(B)])[0]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for r in range(reps + 1):
        if r == 1:
            sync()
            t = time.perf_counter()
        [C.normalize(aug(v)) for v in G.views(batch, device, sizes)]
    sync()
    return reps * B / (time.perf_counter() - t)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="all", choices=METHODS + ("all",))
    p.add_argument("--data", default=None, help="image folder (DIR/train used if present); for siammae a video folder")
    p.add_argument("--video-data", default=None, help="video folder for siammae (default: --data)")
    p.add_argument("--n-images", type=int, default=256, help="JPEGs to generate when --data is not given")
    p.add_argument("--images", type=int, default=40, help="images timed per pipeline and round")
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--device-aug", action="store_true", help="time the batched augmentation on --device also on CPU")
    p.add_argument("--compile", action="store_true", help="time the compiled augmentation, as train() runs it under "
                   "--compile (the default with CUDA); the first calls, which compile, are left out")
    p.add_argument("--aug-against", metavar="REV", help="only time the batched augmentation against gpu_aug.py of git "
                   "revision REV (interleaved, on --device, --batch-size images per step)")
    a = p.parse_args()
    if a.aug_against:
        methods = [m for m in (METHODS if a.method == "all" else (a.method,)) if m != "siammae"]
        print(f"device: {torch.device(a.device)} ({os.cpu_count()} CPUs, {torch.get_num_threads()} threads), torch "
              f"{torch.__version__}, augmentation {'compiled' if a.compile else 'eager'}")
        return aug_against(a.aug_against, methods, a.batch_size, torch.device(a.device), a.compile)
    aug = GA.color_augmenter(a.compile)                               # as train() applies it
    tmp = None
    if a.data is None:
        tmp = tempfile.TemporaryDirectory()
        print(f"writing {a.n_images} JPEGs (500x375) and {max(2, a.n_images // 8)} clips x 8 frames (854x480) "
              f"to {tmp.name}", flush=True)
        write_folder(tmp.name, a.n_images)
        a.data, a.video_data = os.path.join(tmp.name, "images"), os.path.join(tmp.name, "videos")
    a.video_data = a.video_data or a.data
    device = torch.device(a.device)
    print(f"device: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
          f"workers {a.workers}, batch {a.batch_size}, data {a.data}, {a.images} images x 4 interleaved rounds, "
          f"device aug {'compiled' if a.compile else 'eager'}")
    print("| method | views per image | ours img/s per core | official recipe img/s per core | ratio | "
          "gpu-aug workers img/s per core | loader img/s | device aug img/s |")
    print("|---|---|---|---|---|---|---|---|")
    decode_rows = []
    for m in METHODS if a.method == "all" else (a.method,):
        data = a.video_data if m == "siammae" else a.data
        args, views, per_item = pipeline(m, data, False)
        out = views[(0, 0)][0]
        n_views = (f"{sum(getattr(v, 'ndim', 0) == 3 for v in out)}" if isinstance(out, (list, tuple))
                   else f"{per_item} pairs")                         # image tensors (not CMAE's shift)
        ref = reference(m)
        fns = [lambda i: views[(i, 1)]]
        if ref is not None:
            fns += [lambda i: ref(views.dataset.load(i)[0]), lambda i: gviews[(i, 1)]]
            gviews = pipeline(m, data, True)[1]
        if hasattr(args, "gpu_decode"):                                # --gpu-decode workers: read + boxes only
            dviews = decode_pipeline(m, args, data)
            fns.append(lambda i: dviews[(i, 1)])
        rates = interleaved(fns, views, a.images)
        if hasattr(args, "gpu_decode"):
            dev = (f"{decode_rate(dviews, a.batch_size, device, aug=aug):.0f} ({device})"
                   if device.type == "cuda" or a.device_aug else "-")
            decode_rows.append(f"| {m} | {rates[2]:.1f} | {rates[3]:.1f} | {rates[3] / rates[2]:.1f} | {dev} |")
        bs = max(1, a.batch_size // per_item) if m == "siammae" else a.batch_size
        ld = loader_rate(views, min(bs, len(views)), a.workers, a.batches)
        unit = " (pairs)" if m == "siammae" else ""
        ours = f"{rates[0] * per_item:.1f}"
        off, ratio, gw = ((f"{rates[1]:.1f}", f"{rates[0] / rates[1]:.2f}", f"{rates[2]:.1f}") if ref
                          else ("-", "-", "-"))
        g = (f"{gpu_aug_rate(m, args, a.batch_size, device, aug=aug):.0f} ({device})"
             if ref is not None and (device.type == "cuda" or a.device_aug) else "-")
        print(f"| {m}{unit} | {n_views} | {ours} | {off} | {ratio} | {gw} | {ld * per_item:.1f} | {g} |", flush=True)
    if decode_rows:
        print("\n| --gpu-decode | gpu-aug workers img/s per core | gpu-decode workers img/s per core | ratio | "
              "device decode + crops + colour img/s |\n|---|---|---|---|---|\n" + "\n".join(decode_rows))
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    try:
        main()
    except C.UserError as e:                                         # bad --data: one line, no traceback
        raise SystemExit(f"error: {e}")
