"""`--gpu-aug` (MSN, CMAE, ConMIM, CAN; the default on CUDA): the workers' photometric augmentation
(common.color_augment: ColorJitter, RandomGrayscale, Gaussian blur, RandomSolarize on PIL images)
batched on the device. Each image draws its own parameters from the same distributions, so the
augmentation is the same in law, not draw by draw: tests/test_gpu_aug.py compares the two with
two-sample KS tests and each op with torchvision's tensor op, image by image. The workers then only
decode, crop and flip, and ship uint8.

Imported only for --gpu-aug: a method file + common.py, copied without this file, keep the colour
ops in the workers (common.setup says so at start; an explicit --gpu-aug is then an error).
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


def _gray(x):                                                        # (B, 3, H, W) -> (B, 1, H, W)
    return (0.2989 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)   # torchvision weights


def _hue(x, f):
    """Shift the hue of float RGB (B, 3, H, W) in [0, 1] by f (B, 1, 1, 1) turns, via HSV."""
    v = x.amax(1, keepdim=True)                                      # value, (B, 1, H, W)
    c = v - x.amin(1, keepdim=True)                                  # chroma = value x saturation
    r, g, b = ((v - x) / c.clamp_min(1e-12)).split(1, dim=1)
    h = torch.where(v == x[:, :1], b - g, torch.where(v == x[:, 1:2], 2 + r - b, 4 + g - r))
    h = torch.remainder(h / 6 + f, 1.0) * 6                          # shifted hue in sextants [0, 6)
    k = torch.remainder(torch.tensor([5.0, 3.0, 1.0], device=x.device).view(1, 3, 1, 1) + h, 6)
    return v - c * torch.minimum(k, 4 - k).clamp_(0, 1)               # HSV -> RGB, closed form


def color_jitter_batch(x, fb, fc, fs, fh, order):
    """torchvision ColorJitter applied per image: factors (B, 1, 1, 1) for brightness, contrast,
    saturation, hue; order (B, 4) per image a permutation of the ops 0..3, or all -1 (not applied).
    x float in [0, 1]. Brightness / contrast / saturation are the blends f*x + (1-f)*ref, clamped,
    with ref = 0, the image's mean grey, the grey image. The hue shift (an HSV round trip, the
    costly op) runs once on the batch: each image's blends placed before its hue, then the hue, then
    its blends placed after it (the same ops in the same order, image by image; no host sync)."""
    hue_at = (order == 3).float().argmax(1).masked_fill(order[:, 0] < 0, 4).view(-1, 1, 1, 1)   # 4: no jitter

    def blend(x, k, apply):                          # the k-th op where it is a blend; elsewhere f = 1: x exactly
        op = order[:, k].view(-1, 1, 1, 1)
        f = torch.where(apply & (op >= 0) & (op <= 2), torch.where(op == 0, fb, torch.where(op == 1, fc, fs)), 1.0)
        g = _gray(x)
        ref = torch.where(op == 2, g, g.mean((2, 3), keepdim=True) * (op == 1))   # grey image, its mean, or 0
        return torch.addcmul((1 - f) * ref, f, x).clamp_(0, 1)                    # f x + (1 - f) ref
    for k in range(3):                                               # a permutation's last op never precedes its hue
        x = blend(x, k, k < hue_at)
    x = torch.where(hue_at < 4, _hue(x, fh), x)
    for k in range(1, 4):
        x = blend(x, k, k > hue_at)
    return x


def blur_batch(x, sigma, k):
    """Per-image separable Gaussian blur, k taps, reflect padding; sigma (B,), 0 = off."""
    B, C3, H, W = x.shape
    t = torch.arange(k, device=x.device, dtype=x.dtype) - (k - 1) / 2
    w = torch.exp(-0.5 * (t / sigma.clamp_min(1e-6)[:, None]) ** 2)  # (B, k); sigma 0 -> delta
    w = (w / w.sum(1, keepdim=True)).repeat_interleave(C3, 0)        # (B*3, k)
    y = F.pad(x.reshape(1, B * C3, H, W), [k // 2] * 4, mode="reflect")
    y = F.conv2d(y, w.view(-1, 1, k, 1), groups=B * C3)
    return F.conv2d(y, w.view(-1, 1, 1, k), groups=B * C3).view(B, C3, H, W)


def color_augment_batch(x, jitter=(0.4, 0.4, 0.4, 0.1), p_jitter=0.8, p_gray=0.2, p_blur=0.5, p_solarize=0.0):
    """Batched, on-device twin of `common.color_augment` for uint8 or [0, 1] float (B, 3, H, W) -> float
    [0, 1]. Each image draws its own parameters from the torchvision distributions: ColorJitter
    with probability p_jitter (factors U[1-j, 1+j], hue U[-h, h], the four ops in a random order),
    RandomGrayscale, Gaussian blur (sigma U[0.1, 2], blur_taps() taps: +-3 sigma) and RandomSolarize(128).
    It works in float, so unlike the PIL pipeline there is no rounding to uint8 between ops."""
    x = x.float() / 255 if x.dtype == torch.uint8 else x.float()
    B, dev = x.shape[0], x.device
    u = lambda lo, hi: torch.empty(B, 1, 1, 1, device=dev).uniform_(lo, hi)
    b, c, s, h = jitter
    fb, fc, fs, fh = u(max(0, 1 - b), 1 + b), u(max(0, 1 - c), 1 + c), u(max(0, 1 - s), 1 + s), u(-h, h)
    order = torch.rand(B, 4, device=dev).argsort(1)                  # uniform random permutation per image
    order = torch.where(torch.rand(B, 1, device=dev) < p_jitter, order, -1)
    x = color_jitter_batch(x, fb, fc, fs, fh, order)
    x = torch.where(torch.rand(B, 1, 1, 1, device=dev) < p_gray, _gray(x).expand_as(x), x)
    if p_blur > 0:
        sigma = torch.empty(B, device=dev).uniform_(*C.BLUR_SIGMA) * (torch.rand(B, device=dev) < p_blur)
        x = blur_batch(x, sigma, blur_taps(size=min(x.shape[-2:])))
    if p_solarize > 0:
        x = torch.where((torch.rand(B, 1, 1, 1, device=dev) < p_solarize) & (x >= 128 / 255), 1 - x, x)
    return x


def color_augmenter(compile=False):
    """What the loops apply with --gpu-aug (each method file imports it for the flag; the benchmarks
    time the same): with --compile, color_augment_batch compiled, fused elementwise kernels (an H100 took
    31.9 ms instead of 74.5 per MSN step, issue #27), one graph per view shape; inductor draws its own
    random numbers (KS-tested)."""
    return torch.compile(color_augment_batch, dynamic=False) if compile else color_augment_batch
