"""`--gpu-aug` (MSN, CMAE, ConMIM, CAN; the default on CUDA): the workers' photometric augmentation
(common.color_augment: ColorJitter, RandomGrayscale, Gaussian blur, RandomSolarize on PIL images)
batched on the device. Each image draws its own parameters from the same distributions, so the
augmentation is the same in law, not draw by draw: tests/test_gpu_aug.py compares the two with
two-sample KS tests and each op with torchvision's tensor op, image by image. The workers then only
decode, crop and flip, and ship uint8.

A step calls it once per group of same-size views (MSN: twice, for its anchor-size and focal views),
with the normalisation inside, and never waits for the device (no host sync; tests/test_cuda.py runs
real steps under torch.cuda.set_sync_debug_mode("error")).

Imported only for --gpu-aug: a method file + common.py, copied without this file, keep the colour
ops in the workers (harness.setup says so at start; an explicit --gpu-aug is then an error).
"""
import math

import torch
import torch.nn.functional as F

import common as C


def blur_taps(sigma_max=C.BLUR_SIGMA[1], size=None):
    """Taps of the batched Gaussian blur: odd, covering +-3 sigma_max (13 for sigma 2), whatever
    the image size (a kernel of ~10% of the image, torchvision's SimCLR habit, truncates the
    Gaussian on small views: 9 taps at 96 px cut sigma 2 to about 1.85). Capped below the image
    size, which reflect padding needs."""
    k = 2 * math.ceil(3 * sigma_max) + 1
    return k if size is None else min(k, (size - 1) // 2 * 2 + 1)


GREY = (0.2989, 0.587, 0.114)                                       # torchvision's rgb_to_grayscale weights


def _gray(x):                                                        # (B, 3, H, W) -> (B, 1, H, W)
    return (GREY[0] * x[:, 0] + GREY[1] * x[:, 1] + GREY[2] * x[:, 2]).unsqueeze(1)


def _hue(x, f):
    """Shift the hue of float RGB (B, 3, H, W) in [0, 1] by f (B, 1, 1, 1) turns, via HSV: hue in
    sextants from the channel differences, shifted, back to RGB in closed form. Elementwise only
    (Python constants, no tensor built from host data: no copy to the device, nothing that stops
    fusion)."""
    R, G, B = x.split(1, dim=1)                                      # (B, 1, H, W) each
    v = torch.maximum(torch.maximum(R, G), B)                        # value
    c = v - torch.minimum(torch.minimum(R, G), B)                    # chroma
    h = torch.where(v == R, G - B, torch.where(v == G, 2 * c + B - R, 4 * c + R - G))   # 6 x hue x c
    h = (h / c.clamp_min(1e-12) / 6 + f).remainder(1.0) * 6        # shifted hue in [0, 6)
    k = torch.cat([(n + h).remainder(6) for n in (5.0, 3.0, 1.0)], dim=1)             # R, G, B
    return v - torch.minimum(k, 4 - k).clamp(0, 1) * c              # HSV -> RGB: v - c clamp(min(k, 4 - k))


def color_jitter_batch(x, fb, fc, fs, fh, order):
    """torchvision ColorJitter applied per image: factors (B, 1, 1, 1) for brightness, contrast,
    saturation, hue; order (B, 4) per image a permutation of the ops 0..3, or all -1 (not applied).
    x float in [0, 1]. Brightness / contrast / saturation are the blends f x + (1 - f) ref, clamped,
    with ref 0, the image's mean grey, the grey image: at each of the 4 positions one per-pixel
    blend whose f and ref are chosen per image (x itself where that position is not a blend or the
    image is not jittered). The hue shift (the costly op) runs once on the batch: each image's
    blends placed before its hue, then the hue, then its blends placed after it (the same ops in the
    same order, image by image). Per-pixel arithmetic and one mean per position: it fuses when
    compiled."""
    B = x.shape[0]
    hue_at = (order == 3).float().argmax(1).masked_fill(order[:, 0] < 0, 4).view(B, 1, 1, 1)   # 4: no jitter

    def blend(x, k, apply):                          # the k-th op of the images where it is a blend and applied
        op = order[:, k].view(B, 1, 1, 1)
        g = _gray(x)
        ref = torch.where(op == 2, g, torch.where(op == 1, g.mean((2, 3), keepdim=True), 0.0))
        f = torch.where(op == 0, fb, torch.where(op == 1, fc, fs))
        return torch.where(apply & (op >= 0) & (op <= 2), (f * x + (1 - f) * ref).clamp(0, 1), x)
    for k in range(3):                                               # a permutation's last op never precedes its hue
        x = blend(x, k, k < hue_at)
    x = torch.where(hue_at < 4, _hue(x, fh), x)
    for k in range(1, 4):
        x = blend(x, k, k > hue_at)
    return x


def blur_batch(x, sigma, k):
    """Per-image separable Gaussian blur, k taps, reflect padding; sigma (B,), 0 = none (a delta: x
    exactly). A weighted sum of k shifted slices per direction: elementwise, one kernel each when
    compiled."""
    B, _, H, W = x.shape
    t = torch.arange(k, device=x.device, dtype=x.dtype) - (k - 1) / 2
    w = torch.exp(-0.5 * (t / sigma.clamp_min(1e-6)[:, None]) ** 2)  # (B, k); sigma 0 -> delta
    w = (w / w.sum(1, keepdim=True)).view(B, 1, 1, 1, k)
    y = F.pad(x, [k // 2] * 4, mode="reflect")                       # (B, 3, H + k - 1, W + k - 1)
    y = sum(w[..., j] * y[..., j:j + W] for j in range(k))          # along the rows: (B, 3, H + k - 1, W)
    return sum(w[..., j] * y[:, :, j:j + H] for j in range(k))      # along the columns: (B, 3, H, W)


def color_augment_batch(x, jitter=(0.4, 0.4, 0.4, 0.1), p_jitter=0.8, p_gray=0.2, p_blur=0.5,
                        p_solarize=0.0, normalize=False):
    """Batched, on-device twin of `common.color_augment` for uint8 or [0, 1] float (B, 3, H, W) ->
    float [0, 1] (normalize: ImageNet-normalised, as the networks take it). Each image draws its own
    parameters from the torchvision distributions: ColorJitter with probability p_jitter (factors
    U[1-j, 1+j], hue U[-h, h], the four ops in a random order), RandomGrayscale, Gaussian blur with
    probability p_blur (sigma U[0.1, 2], blur_taps() taps: +-3 sigma; every image goes through the
    blur, sigma 0 where it is off: no data-dependent shapes) and RandomSolarize(128). It works in
    float, so unlike the PIL pipeline there is no rounding to uint8 between ops. Nothing waits for
    the device: every random draw is made on it and no tensor is built from host data."""
    x = x.float() / 255 if x.dtype == torch.uint8 else x.float()
    B = x.shape[0]
    dev = x.device
    u = lambda lo, hi: torch.empty(B, 1, 1, 1, device=dev).uniform_(lo, hi)   # noqa: E731
    b, c, s, h = jitter
    fb = u(max(0, 1 - b), 1 + b)                                     # drawn in this order
    fc = u(max(0, 1 - c), 1 + c)
    fs = u(max(0, 1 - s), 1 + s)
    fh = u(-h, h)
    order = torch.rand(B, 4, device=dev).argsort(1)                  # uniform random permutation per image
    order = torch.where(torch.rand(B, 1, device=dev) < p_jitter, order, -1)
    x = color_jitter_batch(x, fb, fc, fs, fh, order)
    x = torch.where(torch.rand(B, 1, 1, 1, device=dev) < p_gray, _gray(x).expand_as(x), x)
    if p_blur > 0:
        on = torch.rand(B, device=dev) < p_blur
        sigma = torch.where(on, torch.empty(B, device=dev).uniform_(*C.BLUR_SIGMA), 0.0)
        x = blur_batch(x, sigma, blur_taps(size=min(x.shape[-2:])))
    if p_solarize > 0:
        on = torch.rand(B, 1, 1, 1, device=dev) < p_solarize
        x = torch.where(on & (x >= 128 / 255), 1 - x, x)
    return _normalize(x) if normalize else x


def _normalize(x):
    """common.normalize of float [0, 1] images, with the channel constants as Python numbers (traced
    into the compiled graph as constants; common.normalize keeps one tensor per device instead)."""
    constants = enumerate(zip(*C.MEAN_STD))
    return torch.cat([(x[:, i:i + 1] - m) / s for i, (m, s) in constants], 1)


def color_augmenter(compile=False):
    """What the loops apply with --gpu-aug (each method file imports it for the flag; the benchmarks
    time the same): compiled (one graph per view shape, fused elementwise kernels; the loops ask for
    it on CUDA whether or not the networks are compiled, since eager it is ~250 kernel launches a
    call), or color_augment_batch itself. Inductor draws its own random numbers (KS-tested)."""
    return torch.compile(color_augment_batch, dynamic=False) if compile else color_augment_batch
