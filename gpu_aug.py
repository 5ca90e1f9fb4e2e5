"""`--gpu-aug` (MSN, CMAE, ConMIM, CAN; the default on CUDA): the workers' photometric augmentation
(common.color_augment: ColorJitter, RandomGrayscale, Gaussian blur, RandomSolarize on PIL images)
batched on the device. Each image draws its own parameters from the same distributions, so the
augmentation is the same in law, not draw by draw: tests/test_gpu_aug.py compares the two with
two-sample KS tests and each op with torchvision's tensor op, image by image. The workers then only
decode, crop and flip, and ship uint8.

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
    sextants from the channel differences, shifted, back to RGB in closed form."""
    R, G, B = x.split(1, dim=1)                                      # (B, 1, H, W) each
    v = torch.maximum(torch.maximum(R, G), B)                        # value (elementwise: faster than a
    c = v - torch.minimum(torch.minimum(R, G), B)                    # reduction over dim 1); chroma
    h = torch.where(v == R, G - B, torch.where(v == G, 2 * c + B - R, 4 * c + R - G))   # 6 x hue x c
    h = h.div_(c.clamp_min(1e-12)).div_(6).add_(f).remainder_(1.0).mul_(6)             # shifted hue in [0, 6)
    k = (torch.tensor([5.0, 3.0, 1.0], device=x.device).view(1, 3, 1, 1) + h).remainder_(6)
    k = torch.minimum(k, 4 - k).clamp_(0, 1)
    return torch.sub(v, k.mul_(c), out=k)                           # HSV -> RGB: v - c clamp(min(k, 4 - k))


def color_jitter_batch(x, fb, fc, fs, fh, order):
    """torchvision ColorJitter applied per image: factors (B, 1, 1, 1) for brightness, contrast,
    saturation, hue; order (B, 4) per image a permutation of the ops 0..3, or all -1 (not applied).
    x float in [0, 1]. Brightness / contrast / saturation are the blends f*x + (1-f)*ref, clamped,
    with ref = 0, the image's mean grey, the grey image: each is one per-pixel colour transform,
    y = M x + t with M = f I (+ (1-f) 1 grey^T for saturation) and t = (1-f) mean grey (contrast), so
    a blend position is one batched 3 x 3 matrix product over all images (baddbmm) and a clamp, with
    M = I, t = 0 (x exactly) for the images whose op it is not. The hue shift (an HSV round trip, the
    costly op) runs once on the batch: each image's blends placed before its hue, then the hue, then
    its blends placed after it (the same ops in the same order, image by image; no host sync)."""
    B, _, H, W = x.shape
    hue_at = (order == 3).float().argmax(1).masked_fill(order[:, 0] < 0, 4)    # (B,); 4: no jitter
    grey = torch.tensor(GREY, device=x.device)
    eye = torch.eye(3, device=x.device)
    fb, fc, fs = fb.view(B), fc.view(B), fs.view(B)

    def blend(x, k, apply):                          # the k-th op of the images where it is a blend and applied
        op = order[:, k]
        on = apply & (op >= 0) & (op <= 2)
        f = torch.where(on, torch.where(op == 0, fb, torch.where(op == 1, fc, fs)), 1.0)            # (B,)
        sat, con = (1 - f) * (op == 2), (1 - f) * (op == 1)                                         # 0 where off
        M = f.view(B, 1, 1) * eye + sat.view(B, 1, 1) * grey                 # (B, 3, 3): rows f e_c + (1-f) grey
        t = (con * (x.mean((2, 3)) @ grey)).view(B, 1, 1).expand(B, 3, 1)   # (1-f) x the image's mean grey
        return torch.baddbmm(t, M, x.reshape(B, 3, H * W)).clamp_(0, 1).view(B, 3, H, W)
    for k in range(3):                                               # a permutation's last op never precedes its hue
        x = blend(x, k, k < hue_at)
    x = torch.where((hue_at < 4).view(B, 1, 1, 1), _hue(x, fh), x)
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


@torch.compiler.disable                              # a data-dependent batch: kept out of the compiled graph
def blur_some(x, p_blur):
    """Blur each image with probability p_blur (sigma ~ U[0.1, 2]), computing only those: their number
    n ~ Binomial(B, p_blur) is drawn on the host (CPU generator, no device sync) and the images are a
    uniformly random n-subset, which is the same law as an independent coin per image."""
    B = x.shape[0]
    n = int(torch.binomial(torch.tensor(float(B)), torch.tensor(float(p_blur))))
    if n == 0:
        return x
    idx = torch.randperm(B, device=x.device)[:n]
    sigma = torch.empty(n, device=x.device).uniform_(*C.BLUR_SIGMA)
    return x.index_copy(0, idx, blur_batch(x.index_select(0, idx), sigma, blur_taps(size=min(x.shape[-2:]))))


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
        x = blur_some(x, p_blur)
    if p_solarize > 0:
        x = torch.where((torch.rand(B, 1, 1, 1, device=dev) < p_solarize) & (x >= 128 / 255), 1 - x, x)
    return x


def color_augmenter(compile=False):
    """What the loops apply with --gpu-aug (each method file imports it for the flag; the benchmarks
    time the same): with --compile, color_augment_batch compiled, fused elementwise kernels (an H100 took
    31.9 ms instead of 74.5 per MSN step, issue #27), one graph per view shape; inductor draws its own
    random numbers (KS-tested)."""
    return torch.compile(color_augment_batch, dynamic=False) if compile else color_augment_batch
