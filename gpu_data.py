"""`--resident S` (MSN, CMAE, ConMIM, CAN): the training images decoded once into one uint8 tensor
(N, 3, S, S) on the device, and every view cut from it there: for small datasets (CIFAR-10,
Tiny-ImageNet, ImageNet-100 at 64-96 px) whose PIL workers, not the GPU, set a run's speed. A step
then reads no file, has no worker and copies nothing from the host; its views cost a fixed number of
device calls whatever the batch (tests/test_gpu_data.py counts them).

  python can.py --data /data/cifar10 --preset gpu                    # --resident 32: 32 px
  python cmae.py --data /data/tiny-imagenet --resident 64 --gpu-aug  # 100,000 images: 1.2 GB

What stays as without it: the order (common.EpochSampler: the shuffle, mid-epoch resume, each
process's share), the unreadable images (skipped and counted once, at the start), --holdout, the
colour ops (gpu_aug.py, batched). What each view is: the method's own geometry (its file's
`view_specs`: which crops, sizes, scales, resampling; cut()) drawn here per (seed, epoch, image,
view) for the whole epoch at its first batch, so that a view does not depend on the batching or the
process count and a resumed run draws the same ones. Each box is drawn as torchvision's
RandomResizedCrop.get_params draws it (ten tries, then the central crop), in law, not draw for draw
(the tests' KS checks); each crop is resampled as PIL resizes it (`Image.crop` then `Image.resize`:
its bilinear or bicubic filter, widened where it shrinks, two passes rounded to 8 bits), as two
matrix products for the whole batch: the same pixels as the CPU path for the same box, to one level
in 255 (tests/test_gpu_data.py). Differences from the CPU path: an image of another size than S x S
is resized to it once (PIL bicubic), its boxes drawn in its own size and scaled, so a crop covers
the same region at the store's resolution; the draws are another random stream than the workers';
the unreadable images are counted once, when the store is built (the log's per-epoch count stays
empty). Imported only for --resident; a method file + common.py run without it.
"""
import itertools

import numpy as np
import torch

import common as C

RATIO = (3 / 4, 4 / 3)                                   # RandomResizedCrop's default aspect ratio range


def cubic(x):
    """PIL's bicubic filter (a = -0.5), support 2."""
    x = x.abs()
    near = ((-0.5 + 2) * x - (-0.5 + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * -0.5
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


FILTERS = {"bilinear": (1.0, lambda x: (1 - x.abs()).clamp(min=0)), "bicubic": (2.0, cubic)}


def resample_weights(start, length, size, out, mode):
    """(M, out, size): PIL's resampling of the span [start, start + length) of an axis of `size`
    pixels onto `out` pixels, as Image.crop then Image.resize compute it: output pixel u's centre
    maps to start + (u + 0.5) * scale; the filter is widened by the scale where it shrinks
    (antialias), its taps clipped to the span, each row normalised. start, length: (M,) in pixels
    (whole for integer boxes, where it is PIL's own)."""
    support, f = FILTERS[mode]
    scale = length / out                                                       # (M,)
    widen = scale.clamp(min=1.0)
    u = torch.arange(out, device=start.device, dtype=start.dtype)
    center = start[:, None] + (u + 0.5) * scale[:, None]                       # (M, out)
    reach = (support * widen)[:, None]
    lo = torch.maximum(torch.floor(center - reach + 0.5), start.floor()[:, None])
    hi = torch.minimum(torch.floor(center + reach + 0.5), (start + length).ceil()[:, None])
    px = torch.arange(size, device=start.device, dtype=start.dtype)            # each input pixel's left edge
    w = f((px + 0.5 - center[..., None]) / widen[:, None, None])               # (M, out, size)
    w = w * ((px >= lo[..., None]) & (px < hi[..., None]))
    return w / w.sum(-1, keepdim=True)


def resample(x, boxes, out, mode):
    """PIL's crop + resize of each box, batched: x (B, 3, S, S) float in 0..255, boxes (B, n, 4) as
    (top, left, height, width) -> (B, n, 3, out, out) rounded to 8 bits. PIL rounds after each of
    its two passes too (their order varies with the Pillow version and the shapes); rounding once,
    the result is within one level of its. The crops use float64 (tiny matrices): TF32, on in the
    runs, would cost another level."""
    B, n, _ = boxes.shape
    S = x.shape[-1]                                                              # square: H = W = S
    b = boxes.reshape(B * n, 4)
    w = resample_weights(torch.cat([b[:, 0], b[:, 1]]), torch.cat([b[:, 2], b[:, 3]]), S, out, mode)
    wy, wx = (t.view(B, n, out, S) for t in w.chunk(2))                          # rows, columns
    t = torch.einsum("bchw,bnxw->bnchx", x, wx)                                  # (B, n, 3, S, out)
    return torch.floor(torch.einsum("bnyh,bnchx->bncyx", wy, t) + 0.5).clamp_(0, 255)


def random_resized_boxes(gen, heights, widths, n, scale, ratio=RATIO, tries=10):
    """(N, n, 4) float (top, left, height, width) and flips (N, n) bool: for each of N images of its
    (height, width), n boxes as torchvision's RandomResizedCrop.get_params draws one (an area share
    ~ U(scale), a log aspect ~ U(log ratio), `tries` tries, the first that fits kept, else the
    central crop) and a flip each, from `gen`."""
    N = len(heights)
    Hs = heights.double()[:, None, None]                                        # (N, 1, 1)
    Ws = widths.double()[:, None, None]
    area = Hs * Ws * torch.empty(N, n, tries, dtype=torch.float64).uniform_(*scale, generator=gen)
    lr = torch.log(torch.tensor(ratio, dtype=torch.float64))
    log_aspect = torch.empty(N, n, tries, dtype=torch.float64).uniform_(lr[0], lr[1], generator=gen)
    aspect = torch.exp(log_aspect)
    w = torch.round(torch.sqrt(area * aspect))
    h = torch.round(torch.sqrt(area / aspect))
    fits = (w > 0) & (w <= Ws) & (h > 0) & (h <= Hs)                          # (N, n, tries)
    first = fits.double().argmax(-1, keepdim=True)                              # the first try that fits
    w = w.gather(-1, first)[..., 0]
    h = h.gather(-1, first)[..., 0]
    ok = fits.any(-1)
    Hs = Hs[..., 0].expand(N, n)
    Ws = Ws[..., 0].expand(N, n)
    in_ratio = Ws / Hs                                                           # the central crop's fallback
    wide = torch.where(in_ratio > max(ratio), torch.round(Hs * max(ratio)), Ws)
    cw = torch.where(in_ratio < min(ratio), Ws, wide)
    ch = torch.where(in_ratio < min(ratio), torch.round(Ws / min(ratio)), Hs)
    w = torch.where(ok, w, cw)
    h = torch.where(ok, h, ch)
    u = torch.rand(N, n, 2, dtype=torch.float64, generator=gen)
    top = torch.where(ok, torch.floor(u[..., 0] * (Hs - h + 1)), torch.floor((Hs - h) / 2))
    left = torch.where(ok, torch.floor(u[..., 1] * (Ws - w + 1)), torch.floor((Ws - w) / 2))
    flips = torch.rand(N, n, generator=gen) < 0.5
    return torch.stack([top, left, h, w], -1).float(), flips


class Decoded(torch.utils.data.Dataset):
    """dataset.load(i) as (uint8 (3, S, S), its own (height, width), label), resized to S x S where
    it differs."""

    def __init__(self, dataset, S):
        self.dataset, self.S = dataset, S

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        from PIL import Image
        img, label = self.dataset.load(i)
        size = torch.tensor([img.height, img.width])
        if (img.height, img.width) != (self.S, self.S):
            img = img.resize((self.S, self.S), Image.BICUBIC)
        return C.to_uint8(img), size, label


class Store:
    """Every image of `dataset` (its load(i): unreadable ones replaced and counted, as in training)
    decoded once into uint8 (N, 3, S, S) on `device`, with labels (N,) and each image's own (height,
    width). An image of another size is resized to S x S (PIL bicubic); its boxes are drawn in its
    own size and scaled (draw())."""

    def __init__(self, dataset, S, device, workers, seed, max_unreadable=1.0):
        loader = torch.utils.data.DataLoader(Decoded(dataset, S), batch_size=256,
                                             num_workers=workers)
        # filled in place: the host holds a batch, not the store (twice)
        self.pixels = torch.empty(len(dataset), 3, S, S, dtype=torch.uint8, device=device)
        self.sizes = torch.empty(len(dataset), 2, dtype=torch.long)
        labels = torch.empty(len(dataset), dtype=torch.long)
        for b, (pixels, sizes, label) in enumerate(loader):
            rows = slice(b * 256, b * 256 + len(pixels))
            self.pixels[rows] = pixels.to(device)
            self.sizes[rows] = sizes
            labels[rows] = label
        C.check_unreadable(dataset, len(dataset), 0, max_unreadable, final=True)
        self.labels = labels.to(device)
        self.S = S
        self.seed = seed
        self.device = device
        self.tables = {}                                             # the epoch's draws
        self.dataset = dataset

    def __len__(self):
        return len(self.labels)

    def gb(self):
        return self.pixels.numel() / 2**30

    def draw(self, epoch, key, n, scale, ratio=RATIO):
        """The epoch's boxes (N, n, 4) in store pixels and flips (N, n) of view group `key` (a small
        int), drawn at the epoch's first batch for every image from (seed, epoch, key) and kept on
        the device for the epoch."""
        if (epoch, "boxes", key) not in self.tables:
            gen = self.generator(epoch, key, 11)
            boxes, flips = random_resized_boxes(gen, self.sizes[:, 0], self.sizes[:, 1], n, scale,
                                                ratio)
            to_store = self.S / self.sizes                                   # (N, 2): (h, w)
            boxes *= torch.cat([to_store, to_store], 1)[:, None, :].float()
            self.tables[epoch, "boxes", key] = boxes.to(self.device), flips.to(self.device)
        return self.tables[epoch, "boxes", key]

    def integers(self, epoch, key, n, high):
        """(N, n) long in [0, high) (all 0 where high is 0) from (seed, epoch, key), kept for the
        epoch as draw()."""
        if (epoch, "integers", key) not in self.tables:
            gen = self.generator(epoch, key, 13)
            draw = torch.randint(0, max(high, 1), (len(self), n), generator=gen)
            self.tables[epoch, "integers", key] = draw.to(self.device)
        return self.tables[epoch, "integers", key]

    def generator(self, epoch, key, kind):
        """A CPU generator of (seed, epoch, key, kind): portable, so a resumed run draws the same;
        the tables of earlier epochs are dropped."""
        self.tables = {k: v for k, v in self.tables.items() if k[0] == epoch}
        seed = np.random.SeedSequence([self.seed, epoch, key, kind]).generate_state(1)[0]
        return torch.Generator().manual_seed(int(seed))

    def crops(self, idx, boxes, flips, size, mode):
        """The images idx (B,) cut by boxes (B, n, 4), resampled to size x size as PIL does (`mode`:
        bilinear or bicubic), flipped where flips (B, n): uint8 (n, B, 3, size, size),
        view-major."""
        x = resample(self.pixels[idx].double(), boxes.double(), size, mode)         # (B, n, 3, s, s)
        x = torch.where(flips[..., None, None, None], x.flip(-1), x)
        return x.to(torch.uint8).transpose(0, 1)


class Loader:
    """What the loops and common.Batches use of a DataLoader (sampler, batch_size, dataset, len,
    iter) over a Store: batches of the EpochSampler's (index, epoch) pairs, each epoch's indices
    copied to the device once; make(store, idx, epoch) -> the method's batch, as its workers'
    collate would give it (uint8 views)."""

    def __init__(self, store, batch_size, seed, make):
        self.sampler = C.epoch_sampler(store.dataset, batch_size, seed)     # the workers' loader's order
        self.store = store
        self.batch_size = batch_size
        self.dataset = store.dataset
        self.make = make

    def __len__(self):
        return len(self.sampler) // self.batch_size

    def __iter__(self):
        for epoch, pairs in itertools.groupby(self.sampler, key=lambda p: p[1]):
            order = torch.tensor([i for i, _ in pairs], dtype=torch.long)
            order = order.to(self.store.device, non_blocking=True)
            for b in range(len(order) // self.batch_size):
                idx = order[b * self.batch_size:(b + 1) * self.batch_size]
                yield self.make(self.store, idx, epoch), self.store.labels[idx]


def cut(specs):
    """make(store, idx, epoch) -> the views of images idx as the workers give them, from a method's
    view_specs: each group (size, scale, n, mode[, W]) is n RandomResizedCrop(size, scale) boxes +
    flips drawn per (seed, epoch, image, group), resampled with `mode` (bilinear / bicubic),
    view-major; with a window W (CMAE's pixel shift) the group's one crop gives (its top-left W x W,
    the W x W window at (dh, dw) ~ U{0..size-W-1} drawn the same way, (dh, dw) (B, 2))."""
    def make(store, idx, epoch):
        views = []
        for key, (size, scale, n, mode, *window) in enumerate(specs):
            if not n:
                continue
            boxes, flips = store.draw(epoch, key, n, scale)                   # (N, n, 4), (N, n)
            crops = store.crops(idx, boxes[idx], flips[idx], size, mode)    # (n, B, 3, size, size)
            if not window:
                views += crops.unbind(0)
                continue
            W, m = window[0], crops[0]
            d = store.integers(epoch, key + 1, 2, size - W)[idx]           # (B, 2): dh, dw
            rows, cols = (d[:, k, None] + torch.arange(W, device=m.device) for k in (0, 1))   # (B, W)
            shifted = m.gather(2, rows[:, None, :, None].expand(len(m), 3, W, size))
            shifted = shifted.gather(3, cols[:, None, None, :].expand(len(m), 3, W, W))   # m[dh:dh+W, dw:dw+W]
            views += [m[..., :W, :W], shifted, d]
        return views
    return make


def loader(dataset, args, run, per, specs):
    """--resident S: the store of `dataset` on the run's device and its loader of the views of
    `specs` (the method's view_specs, cut())."""
    if not args.gpu_aug:
        raise C.UserError("--resident needs --gpu-aug: the views are made on the device, their "
                          "colour ops too")
    S, need = args.resident, len(dataset) * 3 * args.resident ** 2
    if S < args.img_size:                                            # every view would be upsampled from S
        raise C.UserError(f"--resident {S} is below --img-size {args.img_size}: every view would "
                          "be cut from images stored smaller than it; give --resident >= "
                          f"{args.img_size} (the images' own size)")
    free = torch.cuda.mem_get_info(run.device)[0] if run.device.type == "cuda" else None
    if free is not None and need > free / 2:                         # checked before hours of decoding
        raise C.UserError(f"--resident {S}: {len(dataset)} images take {need / 2**30:.1f} GB of "
                          f"uint8, over half of the {free / 2**30:.1f} GB free on {run.device} "
                          "(training needs the rest): lower --resident or leave it out (the "
                          "workers' loader)")
    store = Store(dataset, S, run.device, args.workers, args.seed, args.max_unreadable)
    C.print0(f"--resident {S}: {len(store)} images decoded once, {store.gb():.2f} GB of uint8 on "
             f"{run.device}; every view cut there")
    big = (store.sizes > S).any(1)
    if big.any():                                                    # said, not silent: views of less detail
        h, w = store.sizes.max(0).values.tolist()
        C.print0(f"warning: {int(big.sum())} of {len(store)} images are larger than --resident {S} "
                 f"(up to {h}x{w}): stored at {S}x{S}, their views are cut from that (the workers' "
                 f"loader crops the originals); give --resident {max(h, w)} to keep them whole")
    return Loader(store, per, args.seed, cut(specs))
