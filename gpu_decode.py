"""`--gpu-decode` (msn.py): JPEG decoding, crops and flips on the device, for a host whose CPU
workers cannot make the views as fast as the GPU trains on them (MSN's 12 views per image: about
109 images/s per core measured on an H100 host, so 15 workers cap a run near 1,600 img/s).

Workers read each file's bytes and parse only its header, then draw every view's crop box and flip
with the CPU path's own calls, in its order (RandomResizedCrop(size, scale).get_params, then
RandomHorizontalFlip's draw, per view) under `common.Views`' seed: the same boxes and flips as
without the flag, image by image (tests/test_gpu_decode.py). The device decodes the batch in one
call (torchvision.io.decode_jpeg: nvJPEG on CUDA) and cuts all the views of one size from an
image in one torchvision.ops.roi_align call. Colour augmentation then runs batched (--gpu-aug).
The batched CUDA decode uses the GPU's hardware JPEG decoder where it has one (A100, H100):
pytorch/vision#8496 reports over 8,000 images/s on one A100 (their number; not measured here).

Differences from the CPU path (measured in tests/test_gpu_decode.py):
  - Resampling: roi_align averages ceil(box / output) x ceil(box / output) bilinear samples per
    output pixel (a box filter) where PIL resizes with its triangle filter, and its bilinear taps
    reach one pixel beyond the box where PIL's stop at it: views differ by about 1 level of 255 on
    average. The views stay float (no rounding to uint8).
  - Non-JPEG files, CMYK JPEGs and JPEGs that do not end with their end-of-image marker (most
    truncated files) are decoded by PIL in the worker, as without the flag (an unreadable one is
    skipped and counted the same way). A JPEG the device and then PIL cannot decode is replaced by
    another image of the batch (its views) and counted as unreadable for --max-unreadable.
  - torchvision 0.29 deprecates its image decoders (moving them to TorchCodec); a torchvision
    without decode_jpeg cannot use this flag (one-line error).
Imported only for --gpu-decode; a method file + common.py run without it.
"""
import hashlib
import io
import sys
import warnings

import numpy as np
import torch
from PIL import Image

import common as C

try:
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.ops import roi_align
except ImportError as e:                                             # pragma: no cover
    raise C.UserError(f"--gpu-decode needs torchvision's decode_jpeg and roi_align ({e}); run "
                      "without it") from None


def read_encoded(path):
    """ImageFiles reader in the workers: (file bytes, the PIL image opened lazily: header only) for
    a JPEG the device can decode; anything else decoded here to RGB (a failure is an unreadable
    file)."""
    with open(path, "rb") as f:
        data = f.read()
    img = Image.open(io.BytesIO(data))
    whole = data.rstrip(b"\0").endswith(b"\xff\xd9")                 # ends with its end-of-image marker
    if img.format == "JPEG" and img.mode in ("RGB", "L") and whole:
        return data, img
    return C.to_rgb(img)


def encoded(dataset):
    """The dataset, its workers reading bytes where it reads files (C.ImageFiles: its `reader`);
    others, e.g. synthetic, are decoded in the workers as before and go through the same device
    crops."""
    if hasattr(dataset, "reader"):
        dataset.reader = read_encoded
    return dataset


def loader(dataset, args, run, per, specs):
    """--gpu-decode: a loader whose workers read the files and draw the boxes and flips of `specs`
    (the method's view_specs: (size, scale, count, ...) per group, in view order), each batch
    decoded and cut on the run's device as the loop takes it: (the views, labels), as the workers'
    loader gives them."""
    if not args.gpu_aug:
        raise C.UserError("--gpu-decode needs --gpu-aug: the workers send undecoded files, colour "
                          "runs on the device")
    boxes = Boxes(specs)
    files = C.Views(encoded(dataset), boxes, args.seed)
    loader = C.make_loader(files, per, args.workers, args.seed, collate=collate)
    return Decoding(loader, run.device, boxes.sizes, dataset)


class Decoding:
    """What common.Batches uses of a DataLoader (sampler, batch_size, dataset, len, iter), each
    batch of `loader` decoded and cut on `device` (views()) as it is taken: that time is the loop's
    data wait."""

    def __init__(self, loader, device, sizes, images):
        self.loader = loader
        self.sampler = loader.sampler
        self.batch_size = loader.batch_size
        self.dataset = loader.dataset
        self.device = device
        self.sizes = sizes
        self.images = images

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for batch, labels in self.loader:
            yield views(batch, self.device, self.sizes, self.images), labels


class Boxes:
    """Worker transform: (bytes, lazy image) or a decoded PIL image -> (pixels, rois (V, 5), flips
    (V,)). pixels: the encoded JPEG (1-d uint8) or decoded (3, H, W) uint8. views: [(size, scale,
    count, ...), ...] in the method's view order. Each view draws what the CPU path's
    RandomResizedCrop(size, scale) + RandomHorizontalFlip() draw, in that order."""

    def __init__(self, views):
        from torchvision import transforms as T
        self.crops = [T.RandomResizedCrop(size, scale=scale) for size, scale, n, *_ in views
                      for _ in range(n)]
        self.sizes = [size for size, _, n, *_ in views for _ in range(n)]     # each view's, for views()

    def __call__(self, item):
        data, img = item if isinstance(item, tuple) else (None, item)
        rois, flips = [], []
        for crop in self.crops:
            top, left, h, w = crop.get_params(img, crop.scale, crop.ratio)
            rois.append([0, left, top, left + w, top + h])        # roi_align: (index, x1, y1, x2, y2), pixel edges
            flips.append(bool(torch.rand(1) < 0.5))
        if data is None:
            pixels = C.to_uint8(img)
        else:
            pixels = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return pixels, torch.tensor(rois, dtype=torch.float32), torch.tensor(flips)


def collate(batch):
    """DataLoader collate: ((pixels list, rois (B, V, 5), flips (B, V)), labels (B,))."""
    items, labels = zip(*batch)
    pixels, rois, flips = zip(*items)
    return (list(pixels), torch.stack(rois), torch.stack(flips)), torch.tensor(labels)


def decode(pixels, device, dataset=None):
    """Encoded JPEGs -> (3, H, W) uint8 on device, one batched decode_jpeg call (nvJPEG on CUDA);
    already decoded images are copied over. If the batched call fails, each JPEG is decoded alone,
    then by PIL; one that nothing decodes is None (counted in dataset.bad once per run, with a
    warning)."""
    out = [p.to(device, non_blocking=True) if p.dim() == 3 else None for p in pixels]
    enc = [i for i, p in enumerate(pixels) if p.dim() == 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)          # torchvision >= 0.29: moving to TorchCodec
        try:
            dec = []
            if enc:
                dec = decode_jpeg([pixels[i] for i in enc], mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            dec = [decode_one(pixels[i], device, dataset) for i in enc]
    for i, d in zip(enc, dec):
        out[i] = d
    return out


def decode_one(data, device, dataset):
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        pass
    try:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as img:
            return C.to_uint8(img).to(device)
    except Exception as e:
        seen = vars(dataset).setdefault("undecodable", set()) if dataset is not None else set()   # SHA-1s
        key = hashlib.sha1(data.numpy().tobytes()).digest()        # decoded in the main process: met before?
        if key not in seen:                                         # each file counts once per run, as ImageFiles'
            seen.add(key)
            if hasattr(dataset, "bad"):                              # C.ImageFiles' count of unreadable files
                with dataset.bad.get_lock():
                    dataset.bad.value += 1
            print(f"warning: a JPEG of this batch cannot be decoded on {device} nor by PIL ({e}); "
                  "replaced by another image of the batch and counted as unreadable",
                  file=sys.stderr, flush=True)
        return None


def views(batch, device, sizes, dataset=None):
    """Loader batch -> the views, a list of V float tensors (B, 3, S_v, S_v) in [0, 1] on device, in
    the workers' view order. sizes: (V,) the output size of each view (equal sizes adjacent)."""
    pixels, rois, flips = batch
    imgs = decode(pixels, device, dataset)
    ok = [i for i, im in enumerate(imgs) if im is not None]
    if not ok:
        raise C.UserError("no image of a batch could be decoded: is --data a folder of images?")
    keep = [i if imgs[i] is not None else ok[(np.searchsorted(ok, i)) % len(ok)]
            for i in range(len(imgs))]                               # an undecodable one: the next one's
    rois = rois[keep].to(device, non_blocking=True)
    flips = flips[keep].to(device, non_blocking=True)
    imgs = [imgs[i].float() for i in keep]
    out, v0 = [], 0
    while v0 < len(sizes):                                            # each run of equal sizes: one call per image
        S = sizes[v0]
        v1 = next((v for v in range(v0, len(sizes)) if sizes[v] != S), len(sizes))
        x = torch.stack([roi_align(im[None], r[v0:v1], S, 1.0, 0, True)
                         for im, r in zip(imgs, rois)], 1)
        f = flips[:, v0:v1].T.reshape(v1 - v0, -1, 1, 1, 1)          # (k, B, 1, 1, 1)
        out += list(torch.where(f, x.flip(-1), x).div_(255).clamp_(0, 1).unbind(0))   # averages can pass 255 by ulps
        v0 = v1
    return out
