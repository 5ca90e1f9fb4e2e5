"""The training kit of the method files (`import common as C`), in the order a training loop calls
it: the process and the collectives a loss over the global batch needs; checkpointed blocks,
pictures, schedules, the optimiser step; micro-batches and the gradient cache; data; after each
step; checkpoints; the log. harness.py starts, sizes and stops a run and imports this module; this
one imports nothing of the repository but synthetic.py (for --data synthetic). Nothing here makes a
method that method: each method file defines its ViT, masking, EMA target, heads, loss and step."""
import contextlib
import dataclasses
import hashlib
import importlib.util
import itertools
import json
import math
import os
import re
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from PIL import Image


class UserError(Exception):
    """Bad input (data dir, checkpoint, flags): printed as one line by harness.main, no
    traceback."""


_OPTIONAL = {}


def sibling(name):
    """The path of name.py beside this file (an optional sibling's, present or not)."""
    return os.path.join(os.path.dirname(os.path.realpath(__file__)), f"{name}.py")


def optional(name, missing=None):
    """The optional sibling name.py (recipes, synthetic, gpu_aug, gpu_decode, gpu_data, weights,
    eval_linear: each for a flag), read from the file beside this one and from nowhere else (a
    namesake on the path, such as a project's recipes/ package, is not it). Where it was not copied
    along: None, or the one-line error `missing` when given."""
    path = sibling(name)
    mod = sys.modules.get(name)
    if mod is not None and os.path.realpath(getattr(mod, "__file__", None) or "") == path:
        return mod                                               # imported already (e.g. `import gpu_aug`)
    if name not in _OPTIONAL and os.path.isfile(path):
        spec = importlib.util.spec_from_file_location(name, path)
        _OPTIONAL[name] = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(name, _OPTIONAL[name])              # unless a namesake holds the name
        try:
            spec.loader.exec_module(_OPTIONAL[name])
        except ModuleNotFoundError as e:                         # a module it imports was not copied along
            raise UserError(f"{name}.py needs {e.name}.py next to it") from None
    if name not in _OPTIONAL and missing:
        raise UserError(missing)
    return _OPTIONAL.get(name)


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def is_main():
    return rank() == 0


def print0(*a, **kw):
    if is_main():
        print(*a, **kw, flush=True)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x.contiguous())
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad):
        # d(sum of every rank's loss)/d(my rows) = sum over ranks of their grads on my rows
        grad = grad.contiguous()
        dist.all_reduce(grad)
        n = grad.shape[0] // dist.get_world_size()
        return grad[dist.get_rank() * n:(dist.get_rank() + 1) * n]


def all_gather(x, grad=True):
    """Concatenate x (equal shapes) from all ranks along dim 0, rank order; autograd-aware: what
    gives a loss over the global batch (MSN's Sinkhorn and ME-MAX, the InfoNCE negatives) its
    one-process value and gradient."""
    if world_size() == 1:
        return x
    return _AllGather.apply(x) if grad else _AllGather.forward(None, x)


def all_reduce_sum_(x):
    """In-place sum over ranks, no autograd (for statistics under no_grad)."""
    if world_size() > 1:
        dist.all_reduce(x)
    return x


# ---- Activation checkpointing, pictures, schedules, the optimiser and its step -----------------
def run_blocks(blocks, x, checkpoint=False, *ctx):
    """x through each block (blk(x, *ctx)); checkpoint: activation checkpointing per block (RNG
    replayed)."""
    for blk in blocks:
        if checkpoint and torch.is_grad_enabled():
            x = torch.utils.checkpoint.checkpoint(blk, x, *ctx, use_reentrant=False,
                                                  preserve_rng_state=True)
        else:
            x = blk(x, *ctx)
    return x


def set_grad_checkpointing(model, on=True):
    """Turn activation checkpointing on for every sub-module that runs blocks (attribute
    grad_ckpt)."""
    for m in model.modules():
        if hasattr(m, "grad_ckpt"):
            m.grad_ckpt = on
    return model


def save_image_grid(path, rows, labels, step=None, tb=None):
    """rows: (B, C, H, W) normalised tensors (normalize()) -> one PNG (rank 0), a labelled row each,
    tiles >= 64 px (one channel drawn grey, more than 3: the first three as RGB); also to `tb` (the
    run's TensorBoard writer)."""
    if not is_main():
        return
    from PIL import ImageDraw
    from torchvision.utils import make_grid
    mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in MEAN_STD)
    imgs = torch.cat([(r.detach().float().cpu() * std + mean).clamp(0, 1) for r in rows])
    imgs = imgs.expand(-1, 3, -1, -1) if imgs.shape[1] == 1 else imgs[:, :3]   # grey; N: the first 3
    k = max(1, math.ceil(64 / imgs.shape[-2]))
    imgs = F.interpolate(imgs, scale_factor=k, mode="nearest")
    grid = make_grid(imgs, nrow=rows[0].shape[0], padding=2, pad_value=1.0)              # (3, H', W')
    tile = imgs.shape[-2] + 2
    canvas = Image.new("RGB", (grid.shape[-1] + 200, grid.shape[-2]), "white")
    pixels = (grid.permute(1, 2, 0).numpy() * 255).round().astype("uint8")
    canvas.paste(Image.fromarray(pixels), (200, 0))
    draw = ImageDraw.Draw(canvas)
    for i, text in enumerate(labels):
        draw.text((6, i * tile + tile // 2 - 6), text, fill="black")
    canvas.save(path)
    if tb is not None:                                           # tagged by the file's name less epoch / step
        tb.add(step, image=(re.sub(r"_ep\d+.*", "", os.path.basename(path)), grid))


def cosine_schedule(step, total, base, final=0.0, warmup=0, start=0.0):
    """Linear warm-up start -> base over `warmup` steps, then half-cosine base -> final at
    `total`."""
    if step < warmup:
        return start + (base - start) * step / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return final + 0.5 * (base - final) * (1 + math.cos(math.pi * t))


def no_decay_1d(name, p):
    """timm's add_weight_decay rule (MAE, CAN, SiamMAE): no decay for biases and 1-d tensors."""
    return p.ndim <= 1 or name.endswith(".bias")


def make_optimizer(model, lr, weight_decay, betas, device, no_decay=no_decay_1d, eps=1e-8):
    """AdamW, weight decay on every trainable tensor but those no_decay(name, param) names (the
    method's rule)."""
    decay, skip = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (skip if no_decay(n, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "apply_wd": True},
              {"params": skip, "weight_decay": 0.0, "apply_wd": False}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=device.type == "cuda")


def optimizer_step(run, optimizer, params, max_norm=0.0):
    """Unscale (fp16), clip to max_norm (0: none), step; returns the gradient norm as a device
    tensor (no sync)."""
    run.scaler.unscale_(optimizer)
    if max_norm:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:                                                        # norm only: no pass rescaling by 1
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    run.scaler.step(optimizer)
    run.scaler.update()
    return norm


def set_hparams(optimizer, lr, weight_decay=None):
    """Every group's lr (times its lr_scale: layer-wise decay) and, where apply_wd, weight decay."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
        if weight_decay is not None and g["apply_wd"]:
            g["weight_decay"] = weight_decay


# ---- One optimiser step over a batch in micro-batches (exact gradient accumulation) ------------
def rng_state():
    """This process's [CPU, current CUDA] generator states (to replay a forward, or to
    checkpoint)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return [torch.get_rng_state(), cuda]


def set_rng_state(state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def allreduce_grads(params):
    """Average .grad over processes (what DDP does), for steps that bypass DDP's reducer."""
    grads = [p.grad for p in params if p.grad is not None]
    if world_size() == 1 or not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= world_size()
    for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(r)


def micro_batches(n, micro, ddp=None):
    """slice(0, micro), slice(micro, 2 micro), ... over n samples, for a loss that is a sum over
    samples (the caller back-propagates each slice's share of the batch loss: the exact batch
    gradient). Under DDP the reducer waits for the last slice."""
    slices = [slice(i, min(i + micro, n)) for i in range(0, n, micro)]
    if ddp is None or len(slices) == 1:
        yield from slices
        return
    with ddp.no_sync():
        yield from slices                                # the caller's backward runs in here
    allreduce_grads(list(ddp.parameters()))


def gradient_cache(forward, coupled, n, micro, scale=None, ddp=None):
    """The gradient cache (Gao et al. 2021): one step's exact forward + backward over n samples in
    micro-batches when the loss couples the batch (Sinkhorn, ME-MAX, InfoNCE negatives). forward(sl,
    local) -> (local_loss or None, emb (len(sl), ...), parts to log) for the samples of slice sl;
    coupled(emb of all n) -> (loss, parts). A no-grad pass embeds every micro-batch (saving its RNG
    state); coupled and its gradient G w.r.t. the embeddings are computed once; each micro-batch
    runs again from its RNG state and back-propagates local + <emb, G>: the one-pass gradient up to
    rounding (tests/test_step.py), BatchNorm statistics aside. scale: GradScaler.scale; ddp:
    bypassed, gradients averaged once. Returns the loss and parts, detached."""
    scale = scale or (lambda t: t)
    slices = list(micro_batches(n, micro))
    sync = ddp.no_sync if ddp is not None else contextlib.nullcontext
    states, embs = [], []
    with torch.no_grad():
        for sl in slices:
            states.append(rng_state())
            embs.append(forward(sl, False)[1])
    E = torch.cat(embs).float().requires_grad_()
    loss, cparts = coupled(E)
    with sync():
        scale(loss).backward()
    G = E.grad                                                       # d scale(L) / d embeddings
    total = loss.detach()
    parts = {}
    for state, sl in zip(states, slices):
        set_rng_state(state)
        with sync():
            local, emb, p = forward(sl, True)
            t = (emb.float() * G[sl]).sum()
            (t if local is None else scale(local) + t).backward()
        total = total if local is None else total + local.detach()
        for k, v in p.items():
            parts[k] = parts.get(k, 0.0) + v.detach()
    if ddp is not None:
        allreduce_grads(list(ddp.parameters()))
    return total, {**parts, **cparts}


# ---- Data --------------------------------------------------------------------------------------
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MEAN_STD = [IMAGENET_MEAN, IMAGENET_STD]               # what normalize() uses now (set_mean_std)
IMG_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".tif", ".tiff")   # + .npy: image_exts()


def frame_order(name):
    """Sort key of frame files: digit runs as numbers (frame_2.jpg before frame_10.jpg, ffmpeg's %d
    names)."""
    return [int(t) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", name))]   # odd: the digit runs


_MEAN_STD = {}                                           # device -> (mean, std): built once (a copy to a GPU waits)


def set_mean_std(mean=None, std=None, chans=None):
    """The per-channel mean and std (of pixels in [0, 1]) that normalize() uses from now on, in
    this process and the DataLoader workers it starts later, and with them the number of channels
    read_image() reads (`chans`, default len(mean)): a run's --mean / --std / --in-chans
    (harness.setup), a weights file's (weights.load_encoder); None: ImageNet's (one channel: their
    average). Returns them as tuples."""
    mean, std = tuple(mean or IMAGENET_MEAN), tuple(std or IMAGENET_STD)
    chans = chans or len(mean)
    if chans == 1 and (mean, std) == (IMAGENET_MEAN, IMAGENET_STD):
        mean, std = (round(sum(mean) / 3, 3),), (round(sum(std) / 3, 3),)   # grey: (0.449,), (0.226,)
    if len(mean) != chans or len(std) != chans or min(std) <= 0:
        raise UserError(f"--mean / --std take {chans} numbers each (one per channel of --in-chans "
                        f"{chans}, pixels in [0, 1]), std > 0; got {' '.join(map(str, mean))} / "
                        f"{' '.join(map(str, std))} (python scripts/mean_std.py DIR --in-chans "
                        f"{chans} measures them)")
    MEAN_STD[:] = mean, std
    _MEAN_STD.clear()
    return mean, std


def channels():
    """The channels of the images in force (set_mean_std): 3 RGB unless a run or file said other."""
    return len(MEAN_STD[0])


def image_exts():
    """The files a folder's images are: IMG_EXTS, and .npy arrays where the channels are not RGB."""
    return IMG_EXTS + ((".npy",) if channels() != 3 else ())


def normalize(x):
    """uint8 (or float in [0, 1]) (..., C, H, W) on any device -> float, (x - mean) / std with the
    MEAN_STD in force (ImageNet's unless set_mean_std changed them)."""
    if x.device not in _MEAN_STD:
        _MEAN_STD[x.device] = [torch.tensor(v, device=x.device).view(-1, 1, 1) for v in MEAN_STD]
    mean, std = _MEAN_STD[x.device]
    return ((x.float() / 255 if x.dtype == torch.uint8 else x) - mean) / std


def to_rgb(img):
    """A PIL image as 8-bit RGB. 16-bit greyscale (PNG / TIFF: mode I;16, or I from a PNG) is scaled
    to 8 bits, where Pillow's convert would clip it (white); other 32-bit integer and float images
    are refused (ValueError)."""
    if img.mode.startswith("I;16") or (img.mode == "I" and img.format == "PNG"):
        img = Image.fromarray((np.asarray(img).astype(np.uint32) >> 8).astype(np.uint8))
    elif img.mode in ("I", "F"):
        raise ValueError(f"{img.mode} (32-bit) pixels: save the image with 8 or 16 bits per "
                         "channel")
    return img.convert("RGB")                                        # a loaded copy: the file may close


def to_uint8(img):
    """PIL image -> uint8 tensor (3, H, W): workers ship uint8, 4x less than float. A tensor (what
    read_image gives for other channel counts) passes as it is."""
    if isinstance(img, torch.Tensor):
        return img
    img = img if img.mode == "RGB" else to_rgb(img)
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)


def read_image(path):
    """An image file as training and evaluation read it, by the channels in force (channels()): 3:
    an 8-bit RGB PIL image (any image converted, to_rgb); 1: a (1, H, W) tensor (colour converted
    to grey); N: a (N, H, W) tensor from a .npy array ((N, H, W) or (H, W, N)), a multi-page TIFF
    (one page per channel) or an image with N bands. Tensors hold uint8, or float32 in [0, 1]
    (16-bit values / 65535; float arrays must lie in [0, 1]). ValueError on anything else."""
    c = channels()
    if str(path).lower().endswith(".npy"):
        return array_image(np.load(path), c)
    with Image.open(path) as img:
        if c == 3:
            return to_rgb(img)
        if c == 1 and img.mode in ("L", "P", "RGB", "RGBA", "LA", "CMYK", "YCbCr"):
            return torch.from_numpy(np.asarray(img.convert("L")).copy())[None]
        from PIL import ImageSequence
        pages = [np.asarray(p) for p in ImageSequence.Iterator(img)]   # a TIFF stack: a page a channel
        return array_image(pages[0] if len(pages) == 1 else np.stack(pages), c)


def array_image(a, c):
    """An array of c channels, (c, H, W) or (H, W, c) (or (H, W) for c = 1) -> (c, H, W) tensor:
    uint8 kept, other integers (16-bit) / 65535, floats as they are (in [0, 1])."""
    a = a[None] if a.ndim == 2 else a
    if a.ndim == 3 and a.shape[0] != c and a.shape[-1] == c:
        a = a.transpose(2, 0, 1)
    if a.ndim != 3 or a.shape[0] != c:
        raise ValueError(f"an array of shape {tuple(a.shape)}, not {c} channels ((C, H, W) or "
                         f"(H, W, C) with C = --in-chans {c})")
    if a.dtype == np.uint8:
        return torch.from_numpy(np.ascontiguousarray(a))
    if a.dtype.kind in "ui" and a.size and (a.min() < 0 or a.max() > 65535):
        raise ValueError(f"{a.dtype} values outside 0-65535: save 8 or 16 bits per channel")
    if a.dtype.kind in "ui":
        return torch.from_numpy(a.astype(np.float32) / 65535)
    if a.dtype.kind != "f" or not (np.isfinite(a).all() and 0 <= a.min() and a.max() <= 1):
        raise ValueError(f"{a.dtype} values: floats must lie in [0, 1] (or save uint8 / uint16)")
    return torch.from_numpy(a.astype(np.float32))


BLUR_SIGMA = (0.1, 2.0)


class GaussianBlur:
    """With probability p, PIL's (untruncated) Gaussian blur, sigma ~ U[0.1, 2] (MSN's, DINO's);
    torch's RNG."""

    def __init__(self, p=0.5, sigma=BLUR_SIGMA):
        self.p = p
        self.sigma = sigma

    def __call__(self, img):
        if torch.rand(()) >= self.p:
            return img
        s = self.sigma[0] + float(torch.rand(())) * (self.sigma[1] - self.sigma[0])
        if isinstance(img, torch.Tensor):                            # N channels: torchvision's, cut at 3 sigma
            from torchvision.transforms import functional as TF
            return TF.gaussian_blur(img, 2 * math.ceil(3 * s) + 1, s)
        from PIL import ImageFilter
        return img.filter(ImageFilter.GaussianBlur(radius=s))


def color_augment(jitter=(0.4, 0.4, 0.4, 0.1), p_jitter=0.8, p_gray=0.2, p_blur=0.5,
                  p_solarize=0.0):
    """SimCLR/BYOL photometric augmentation of PIL images: colour jitter, greyscale, blur,
    solarisation. Other channel counts (tensors): brightness and contrast jitter per channel, blur,
    solarisation (saturation, hue and greyscale are RGB's: harness.setup says they are left out)."""
    from torchvision import transforms as T
    if channels() != 3:
        return T.Compose([T.RandomApply([ChannelJitter(*jitter[:2])], p=p_jitter),
                          *([GaussianBlur(p_blur)] if p_blur > 0 else []),
                          T.RandomApply([solarize], p=p_solarize)])
    ops = [T.RandomApply([T.ColorJitter(*jitter)], p=p_jitter), T.RandomGrayscale(p=p_gray)]
    if p_blur > 0:
        ops.append(GaussianBlur(p_blur))
    if p_solarize > 0:
        ops.append(T.RandomSolarize(128, p=p_solarize))
    return T.Compose(ops)


class ChannelJitter:
    """ColorJitter's brightness and contrast for (C, H, W) tensors of any C, a factor per channel:
    x_c * b_c, then blended with its mean by k_c (b_c ~ U[1 - brightness, 1 + brightness], k_c ~
    U[1 - contrast, 1 + contrast]), clipped to the value range (uint8 or [0, 1])."""

    def __init__(self, brightness, contrast):
        self.b, self.k = brightness, contrast

    def __call__(self, x):
        top = 255 if x.dtype == torch.uint8 else 1.0
        c = x.shape[0]
        b = 1 + (2 * torch.rand(c, 1, 1) - 1) * self.b
        k = 1 + (2 * torch.rand(c, 1, 1) - 1) * self.k
        y = (x.float() * b).clamp(0, top)
        m = y.mean(dim=(1, 2), keepdim=True)
        y = ((y - m) * k + m).clamp(0, top)
        return y.round().to(torch.uint8) if x.dtype == torch.uint8 else y


def solarize(x):
    """RandomSolarize(threshold half the range) for tensors of any channel count."""
    top = 255 if x.dtype == torch.uint8 else 1.0
    return torch.where(x >= (128 if top == 255 else 0.5), top - x, x)


class CountsUnreadable:
    """`bad`: the distinct unreadable items (files, videos) met by this process and its workers
    (--max-unreadable)."""

    def count_unreadable_of(self, n):
        import multiprocessing                          # shared with forked DataLoader workers:
        self.bad = multiprocessing.Value("l", 0)         # distinct unreadable items met so far
        self.is_bad = multiprocessing.Array("b", n, lock=False)   # per item, 1 = counted
        self.reported = set()

    def unreadable(self, i, path, e, what, instead):
        with self.bad.get_lock():                        # each item counts once, however often it is met
            if not self.is_bad[i]:
                self.is_bad[i] = 1
                self.bad.value += 1
        if path not in self.reported:
            self.reported.add(path)
            print(f"warning: cannot read {what} {path} ({e}); {instead}", file=sys.stderr,
                  flush=True)


class ImageFiles(torch.utils.data.Dataset, CountsUnreadable):
    """Images under a directory, class = first-level sub-folder (or one class; every: every image
    under it, one class, as --mode embed and visualize.py read a folder). skip_unreadable
    (training): an unreadable image is replaced by the next readable one (deterministic: resume
    stays exact), reported and counted."""

    def __init__(self, root, skip_unreadable=False, every=False):
        if not os.path.isdir(root):
            raise UserError(f"--data {root}: no such directory (give an image folder or "
                            "'synthetic')")
        classes = [] if every else sorted(d.name for d in os.scandir(root) if d.is_dir())
        self.samples = []
        exts = image_exts()
        for ci, c in enumerate(classes or [""]):
            for dirpath, _, files in sorted(os.walk(os.path.join(root, c), followlinks=True)):
                self.samples += [(os.path.join(dirpath, f), ci) for f in sorted(files)
                                 if f.lower().endswith(exts)]
            if not classes:
                break
        if not self.samples:
            raise UserError(f"--data {root}: no images found ({'/'.join(exts)}) in it or its "
                            "sub-folders")
        self.root = root
        self.classes = classes or ["all"]
        self.skip = skip_unreadable
        self.held = []
        self.count_unreadable_of(len(self.samples))
        self.reader = read_image                         # gpu_decode.encoded() swaps in its reader

    def fingerprint(self):
        """What a resumed run must find again (harness.resume_run): the counts, the files (and
        held-out ones)."""
        held = {"held_out": digest(self.held, self.root)} if self.held else {}
        return {"images": len(self), "classes": len(self.classes),
                "files": digest([p for p, _ in self.samples], self.root), **held}

    def __len__(self):
        return len(self.samples)

    def load(self, i):
        for k in range(min(len(self.samples), 100) if self.skip else 1):
            j = (i + k) % len(self.samples)
            path, label = self.samples[j]
            try:
                return self.reader(path), label
            except Exception as e:
                if not self.skip:
                    raise UserError(f"cannot read image {path}: {e}; remove or replace the "
                                    "file") from None
                self.unreadable(j, path, e, "image", "using the next readable image")
        raise UserError(f"100 consecutive unreadable images from {self.samples[i][0]}: is --data "
                        "right?")


def image_dataset(data, split="train", skip_unreadable=False, holdout=0):
    """`synthetic`, or DIR (DIR/<split> when present, else DIR itself for training). holdout n:
    "train" without the n images held_out() keeps back, "holdout" those n."""
    if data == "synthetic":
        if holdout:
            raise UserError("--holdout: the synthetic data has its own val split; leave --holdout "
                            "out")
        synthetic = optional("synthetic", "--data synthetic needs synthetic.py next to this file")
        return synthetic.SyntheticImages(split)
    sub = "train" if split == "holdout" else split
    root = os.path.join(data, sub)
    if not os.path.isdir(root):                             # training reads DIR itself without DIR/train
        root = data if sub == "train" else None
    ds = ImageFiles(root, skip_unreadable) if root else None
    if ds is not None and sub == "train" and holdout:
        ds.held = [p for p, _ in held_out(ds.samples, holdout, True)]
        ds.samples = held_out(ds.samples, holdout, split == "holdout")
        ds.count_unreadable_of(len(ds.samples))
    return ds


def digest(paths, root):
    """A short hash of a list of files by their paths relative to root: a folder moved whole keeps
    it; a file added, removed, renamed or moved to another class changes it."""
    names = "\n".join(os.path.relpath(p, root) for p in paths)
    return hashlib.sha1(names.encode()).hexdigest()[:16]


def held_out(items, n, held=False):
    """--holdout n: the n of sorted `items` that training never sees (held: those, else the others),
    a draw fixed by n and len(items) alone (not --seed): every run and evaluation agree."""
    if n and not 0 < n < len(items):
        raise UserError(f"--holdout {n}: there are {len(items)} training items (hold back fewer)")
    out = set(torch.randperm(len(items), generator=torch.Generator().manual_seed(0))[:n].tolist())
    return [x for i, x in enumerate(items) if (i in out) == held]


class Views(torch.utils.data.Dataset):
    """`transform` of dataset.load(i) under an RNG seeded by (seed, epoch, i): the same views
    whatever the workers."""

    def __init__(self, dataset, transform, seed=0):
        self.dataset = dataset
        self.transform = transform
        self.seed = seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        i, epoch = key if isinstance(key, tuple) else (key, 0)
        img, label = self.dataset.load(i)
        with torch.random.fork_rng(devices=[]):                      # leave the caller's RNG alone
            seed = np.random.SeedSequence([self.seed, epoch, i]).generate_state(1)[0]
            torch.manual_seed(int(seed))
            return self.transform(img), label


class EpochSampler(torch.utils.data.DistributedSampler):
    """DistributedSampler yielding (index, epoch) for `Views`, skipping `skip` of the first epoch
    (mid-epoch resume); with `ipe` set it runs on through the epochs, each cut to ipe batches
    (workers prefetch across them)."""
    skip, ipe, batch = 0, None, 1

    def __iter__(self):
        epoch, skip = self.epoch, self.skip
        while True:
            self.set_epoch(epoch)                                    # the shuffle is seeded by seed + epoch
            n = None if self.ipe is None else self.ipe * self.batch
            yield from ((i, epoch) for i in itertools.islice(super().__iter__(), skip, n))
            if self.ipe is None:
                return
            epoch, skip = epoch + 1, 0


def seed_epoch(seed, epoch, rank):
    """A fresh epoch's draws (masks, drop path) from (seed, epoch, rank); a resumed one keeps the
    checkpoint's."""
    torch.manual_seed(int(np.random.SeedSequence([seed, epoch, rank, 7]).generate_state(1)[0]))


class Batches:
    """The training batches epoch by epoch from the checkpoint's step on, on one iterator of the
    loader (its workers run on from one epoch into the next), and what the log reports of them:
    `wait`, the seconds next() blocked (MAE's "data" time) since the log took it (take_wait), and
    `bad`, the epoch's unreadable images so far (None: none). More than --max-unreadable of an
    epoch's reads unreadable stops the run (check_unreadable)."""

    def __init__(self, loader, ipe, max_unreadable):
        self.loader = loader
        self.ipe = ipe
        self.max_unreadable = max_unreadable
        self.wait = 0.0
        self.bad = None
        self.at = None                                              # (epoch, batch) the iterator stands at
        self.stream = None

    def epoch(self, epoch, start_step):
        """enumerate(the batches of `epoch`) after those a checkpoint at start_step covers."""
        loader = self.loader
        first = min(self.ipe, max(0, start_step - epoch * self.ipe))
        if self.at != (epoch, first):                               # a new or resumed run: the stream starts here
            loader.sampler.set_epoch(epoch)
            loader.sampler.skip = first * loader.batch_size
            loader.sampler.ipe = self.ipe
            self.stream = iter(loader)
        self.at = (epoch + 1, 0)
        data = getattr(loader.dataset, "dataset", loader.dataset)   # the images under Views
        bad0 = bad_reads(data)
        t = time.perf_counter()
        for it, batch in enumerate(itertools.islice(self.stream, self.ipe - first), start=first):
            self.wait += time.perf_counter() - t                    # the time next() blocked
            reads = (it + 1) * loader.batch_size
            self.bad = check_unreadable(data, reads, bad0, self.max_unreadable)
            yield it, batch
            t = time.perf_counter()
        check_unreadable(data, self.ipe * loader.batch_size, bad0, self.max_unreadable, final=True)

    def take_wait(self):
        """The seconds blocked since the last call."""
        wait, self.wait = self.wait, 0.0
        return wait


STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


def ignore_stop_signals(_worker_id=None):
    """DataLoader worker_init_fn: workers outlive a signal to the process group while the checkpoint
    is written."""
    import signal
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def epoch_sampler(dataset, batch_size, seed):
    """The training order (EpochSampler): shuffled, this process's share, full batches of batch_size
    only."""
    sampler = EpochSampler(dataset, world_size(), rank(), shuffle=True, seed=seed, drop_last=True)
    if len(sampler) < batch_size:
        raise UserError(f"dataset has {len(dataset)} images: too few for --batch-size {batch_size} "
                        f"x {world_size()} process(es); lower --batch-size")
    sampler.batch = batch_size
    return sampler


def make_loader(dataset, batch_size, workers, seed, collate=None):
    """The training loader: epoch_sampler's order, full batches only (the last partial one is
    dropped)."""
    sampler = epoch_sampler(dataset, batch_size, seed)
    return torch.utils.data.DataLoader(          # own generator: iterating never touches the global RNG
        dataset, batch_size, sampler=sampler, num_workers=workers,
        pin_memory=torch.cuda.is_available(), drop_last=True, persistent_workers=workers > 0,
        generator=torch.Generator(), collate_fn=collate,
        worker_init_fn=ignore_stop_signals if workers > 0 else None)


# ---- After each step: the log line's watches, unreadable images --------------------------------
def end_step(run, log, save, batches, step, epoch, parts, **scalars):
    """After each step: the non-finite watch, the log line (with the data wait and the epoch's
    unreadable images, from `batches`), a checkpoint when due (--save-every*, a stop signal,
    --stop-step), the evaluated encoder every --keep-every steps. True: stop now (the checkpoint is
    written)."""
    run.guard.update(step, parts, run.scaler)
    due, snapshot, stop = run.control.poll(step)
    log.step(step, epoch, parts, force=stop, wait=batches.take_wait(), bad_images=batches.bad,
             **scalars)                                             # a stopping step is logged
    if due:
        save(step)
    if snapshot:
        save(step, snapshot=True)
    if stop:
        why = run.control.signal or f"--stop-step {step}"
        print0(f"stopping after step {step} ({why}); checkpoint {run.ckpt} written: rerun the same "
               "command to resume")
    return stop


def bad_reads(dataset):
    """Distinct unreadable files (videos) met so far by this process and its workers (0 where not
    counted)."""
    return dataset.bad.value if hasattr(dataset, "bad") else 0


def check_unreadable(dataset, reads, bad0, max_frac, final=False):
    """Stop when more than max_frac of the `reads` of this epoch met unreadable files (bad0: the
    count at its start), judged from 1000 reads on and at the epoch's end. Returns the epoch's new
    ones, or None (for the log)."""
    bad = bad_reads(dataset) - bad0
    unit = getattr(dataset, "unit", "images")
    if (final or reads >= 1000) and bad > max_frac * reads:
        raise UserError(f"{bad} of {reads} {unit} read in this epoch were unreadable (> "
                        f"--max-unreadable {max_frac:g}); fix the dataset (the warnings above "
                        "name the files)")
    return bad or None


# ---- Checkpoints -------------------------------------------------------------------------------
def unwrap(model):
    """Strip DistributedDataParallel and torch.compile wrappers (for saving / EMA)."""
    model = getattr(model, "_orig_mod", model)
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def save_checkpoint(path, state):
    """Atomic write (a temp file, then a rename): a failed write leaves the previous file and is a
    one-line error."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        kept = "the previous one is intact" if os.path.isfile(path) else "none was written before"
        raise UserError(f"cannot write checkpoint {path} ({type(e).__name__}: {e}); "
                        f"{kept}") from None


def load_checkpoint(path, method=None, ours=True):
    """Load a checkpoint (tensors only) of this project's format (ours; of `method` if given), or
    any (ours=False); clear errors for missing, unreadable, foreign and other-method files."""
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"{path} is not a readable checkpoint ({type(e).__name__}); was it written "
                        "by one of these scripts, or is it a state dict?") from None
    if not ours:
        return ckpt
    if not isinstance(ckpt, dict) or "method" not in ckpt or "encoder" not in ckpt:
        raise UserError(f"{path} is not a checkpoint of this project (no 'method'/'encoder' keys)")
    if method and ckpt["method"] != method:
        raise UserError(f"{path} is a {ckpt['method']} checkpoint, not {method}: use another "
                        "--output-dir or --resume a checkpoint of this method")
    ckpt["encoder"].pop("mask_token", None)                      # ConMIM's before its BEiT backbone
    return ckpt


def save_run(run, method, args, epoch, step, encoder, model, optimizer, target=None,
             snapshot=False):
    """The checkpoint format, written by rank 0 (every rank calls: the RNG states are gathered, so a
    mid-epoch checkpoint resumes exactly). `encoder`: the ViT the paper evaluates. Never writes
    non-finite weights. snapshot: only the evaluated encoder (what eval_linear.py reads), as
    encoder_step<step>.pth (--keep-every)."""
    run.guard.check()
    meta = {"method": method, "args": dataclasses.asdict(args), "epoch": epoch, "step": step,
            "vit": unwrap(encoder).config, "encoder": unwrap(encoder).state_dict(),
            "dataset": getattr(run, "data", None)}
    if snapshot:
        if is_main():
            save_checkpoint(os.path.join(run.out, f"encoder_step{step:07d}.pth"), meta)
        return
    rng = [rng_state()] * world_size()
    if world_size() > 1:
        dist.all_gather_object(rng, rng_state())                 # every process's generator states
    if not is_main():
        return
    sd = unwrap(model).state_dict()
    if not all(torch.isfinite(v).all() for v in sd.values() if v.is_floating_point()):
        raise UserError(f"non-finite weights at step {step}: not written; {run.ckpt} keeps the "
                        "last finite checkpoint")
    save_checkpoint(run.ckpt, {**meta, "model": sd,
                               "target": target.state_dict() if target else None,
                               "optimizer": optimizer.state_dict(),
                               "scaler": run.scaler.state_dict(), "rng": rng})
    run.guard.saved = step


# ---- The log: a console line, log.jsonl, TensorBoard -------------------------------------------
def _logged_step(line):
    """The step of a log.jsonl record (0 for records without one; inf for a line cut off by a
    kill)."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return math.inf


class TensorBoard:
    """--tensorboard: every logged scalar and the pictures also in <output-dir>/tensorboard, each
    write flushed (a run's last records are on disk when it returns). The package is imported for
    this flag only; the folder is opened at the first write, after a run from step 0 moved an
    earlier one aside (Logger)."""

    def __init__(self, out):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("--tensorboard needs the tensorboard package (pip install "
                            "tensorboard), or leave the flag out") from None
        self.folder = os.path.join(out, "tensorboard")
        self.open = SummaryWriter
        self.writer = None

    def add(self, step, rec=(), image=None):
        """Every number of a log record but its epoch and step; an image: (tag, (3, H, W) in [0,
        1])."""
        self.writer = self.writer or self.open(self.folder)
        for k, v in dict(rec).items():
            if isinstance(v, (int, float)) and k not in ("epoch", "step"):
                self.writer.add_scalar(k, v, step)
        if image:
            self.writer.add_image(*image, step or 0)
        self.writer.flush()


class Logger:
    """Every --log-every steps and at the run's last step: one host sync, a console line and a
    log.jsonl record (rank 0). A resumed run first drops the records of steps after its checkpoint:
    each step is logged once. per_step: the images (SiamMAE: pairs) a step trains, default
    --batch-size."""

    def __init__(self, run, args, total_steps, start_step, ipe, per_step=None):
        self.run = run
        self.guard = run.guard
        self.total = total_steps
        self.batch = per_step or args.batch_size
        self.every = args.log_every
        self.stop = args.stop_epoch * ipe
        self.path = os.path.join(run.out, "log.jsonl")
        self.t = time.time()
        self.last = start_step
        self.first = start_step + 1
        self.wait = 0.0                                                  # seconds blocked on data since the line
        ends = {"--epochs": (total_steps, args.epochs),                  # flag: (last step, its value)
                "--stop-epoch": (self.stop or total_steps, args.stop_epoch),
                "--stop-step": (args.stop_step or total_steps, args.stop_step)}
        end = self.end = min(e for e, _ in ends.values())                # this invocation's last step
        self.done = start_step >= end                                    # a finished or stopped run, rerun
        if self.done:
            why = ", ".join(f"{k} {v}" for k, (e, v) in ends.items()
                            if e == end and (k == "--epochs" or e != total_steps))
            print0(f"the checkpoint is at step {start_step} and this run ends at step {end} "
                   f"({why}): nothing to train; raise --epochs / --stop-epoch / --stop-step to "
                   "train on")
        if start_step and is_main() and os.path.isfile(self.path):      # drop the records after the checkpoint
            with open(self.path) as f:
                keep = [ln for ln in f if _logged_step(ln) <= start_step]
            with open(self.path + ".tmp", "w") as f:
                f.writelines(keep)
            os.replace(self.path + ".tmp", self.path)

    def due(self, step):
        """Whether step is a log step (--log-every, the run's last, a --stop-epoch's last)."""
        return not step % self.every or step in (self.total, self.stop)

    def step(self, step, epoch, parts, force=False, wait=0.0, **scalars):
        """parts: dict of 0-d tensors (loss terms), kept on device until logged; wait: the seconds
        this step blocked on its batch."""
        self.wait += wait
        logged = self.due(step) or force
        first = not logged and step == self.first                        # an early console line and ETA only
        if not (logged or first):
            return None
        rec = {k: round(float(v), 5) for k, v in parts.items()}      # the one sync
        self.guard.check()
        dt = time.time() - self.t
        ips = (step - self.last) * self.batch / max(dt, 1e-9)
        eta = (self.total - step) * dt / max(1, step - self.last)
        self.t = time.time()
        self.last = step
        wait, self.wait = self.wait, 0.0
        given = {k: float(v) for k, v in scalars.items() if v is not None}
        rec = {"epoch": epoch, "step": step, **rec, **given, "img_s": round(ips, 1),
               "data_wait": round(min(1.0, wait / max(dt, 1e-9)), 3)}
        if torch.cuda.is_available():
            rec["mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if is_main():
            kv = " ".join(f"{k} {v:.4g}" for k, v in rec.items() if k not in ("epoch", "step"))
            print(f"ep {epoch} step {step}/{self.total} {kv} eta {eta / 60:.1f}m", flush=True)
            if logged:
                self.append(rec)
        return rec if logged else None

    def write(self, rec):
        if is_main():
            print(json.dumps(rec), flush=True)
            self.append(rec)

    def append(self, rec):
        if getattr(self.run, "tb", None) is not None:                  # --tensorboard
            self.run.tb.add(rec.get("step", self.last), rec)
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as e:
            last = self.guard.ckpt if self.guard.saved is not None else "not written yet"
            raise UserError(f"cannot write the log {self.path} ({e.strerror or type(e).__name__}); "
                            f"the last checkpoint is {last}") from None


