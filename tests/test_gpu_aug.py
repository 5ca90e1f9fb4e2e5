"""The batched on-device photometric augmentation (gpu_aug.py), the CUDA default of every method that
has one, run here on CPU: each op equals torchvision's image by image, the whole has the workers'
distribution (KS), and in the loops (--gpu-aug forced) it reaches the right views with the method's
parameters, the workers then only crop and flip, and runs stay deterministic (exact resume)."""
import math
import shutil
import sys

import pytest
import torch

import can
import cmae
import common as C
import harness as H
import gpu_aug as GA
import synthetic as S
import conmim
import msn
from helpers import exact_resume
from test_can import tiny_args as can_args
from test_cmae import tiny_args as cmae_args
from test_conmim import tiny_args as conmim_args
from test_msn import tiny_args as msn_args

# (module, tiny args, calls of the augmentation per step (one per view size), parameters that must be passed,
#  train_step arguments that must be the augmented views, and those that must not)
CASES = {"msn": (msn, msn_args, 2, {}, (2, 3, 4), ()),                  # target + random anchors; focal anchors
         "cmae": (cmae, cmae_args, 1, {}, (3,), (2,)),                  # the target view x_t only, not x_s
         "conmim": (conmim, conmim_args, 1, conmim.STRONG, (3,), (2,)),  # x_strong (teacher), not x_weak
         "can": (can, can_args, 1, {}, (1,), ())}                       # both views, in one call


def jitter_case(n, h, w):
    """Inputs of the batched ops from one seeded generator: images (n, 3, h, w) in [0, 1], brightness /
    contrast / saturation factors U[0.6, 1.4], hue U[-0.5, 0.5], an op order per image, blur sigma U[0, 2]."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 3, h, w, generator=g)
    fb, fc, fs = (0.6 + 0.8 * torch.rand(n, 1, 1, 1, generator=g) for _ in range(3))
    fh = torch.rand(n, 1, 1, 1, generator=g) - 0.5
    order = torch.rand(n, 4, generator=g).argsort(1)
    return x, fb, fc, fs, fh, order, 2 * torch.rand(n, generator=g)


def test_color_jitter_and_blur_match_torchvision_per_image():
    """The batched ops equal torchvision's tensor ops image by image, for given factors and order."""
    import torchvision.transforms.functional as TF
    B = 12
    x, fb, fc, fs, fh, order, sigma = jitter_case(B, 10, 14)
    order[3] = -1                                                               # jitter not applied
    ops = [lambda im, i: TF.adjust_brightness(im, fb[i].item()), lambda im, i: TF.adjust_contrast(im, fc[i].item()),
           lambda im, i: TF.adjust_saturation(im, fs[i].item()), lambda im, i: TF.adjust_hue(im, fh[i].item())]
    ref = []
    for i in range(B):
        im = x[i]
        for o in order[i].tolist():
            im = ops[o](im, i) if o >= 0 else im
        ref.append(im)
    torch.testing.assert_close(GA.color_jitter_batch(x, fb, fc, fs, fh, order), torch.stack(ref), atol=1e-5, rtol=0)
    sigma[1] = 0                                                                # blur not applied
    ref = [TF.gaussian_blur(x[i], 5, sigma[i].item()) if sigma[i] > 0 else x[i] for i in range(B)]
    torch.testing.assert_close(GA.blur_batch(x, sigma, 5), torch.stack(ref), atol=1e-6, rtol=0)


def _ks(a, b):
    """Two-sample Kolmogorov-Smirnov statistic."""
    a, b = a.sort()[0], b.sort()[0]
    z = torch.cat([a, b])
    return (torch.searchsorted(a, z, right=True) / len(a) - torch.searchsorted(b, z,
                                                                               right=True) / len(b)).abs().max().item()


@pytest.mark.parametrize("params", [{}, dict(jitter=(0.4, 0.4, 0.2, 0.1), p_blur=0.1, p_solarize=0.2)],
                         ids=["default", "conmim-strong"])
def test_color_augment_batch_has_the_torchvision_distribution(params, device="cpu", augment=None):
    """Per-image statistics of the GPU-side augmentation vs torchvision's transforms on the same image:
    two-sample KS below the p = 0.001 critical value (Bonferroni over the 5 statistics); a wrong grey or
    blur probability or jitter strength is caught. The reference is the workers' path: PIL in, uint8 out.
    Both samples are compared at uint8 levels: images left untouched (no jitter, grey or blur: ~12%) form
    a point mass, and float noise splits it. Measured on an H200 (torch 2.11): the same parameters gave
    CUDA outputs within 1e-6 of the CPU ones, yet KS 0.127 instead of 0.062 on the red mean (critical
    0.107) without the rounding; with it, the two are equal.
    augment: the function under test (default GA.color_augment_batch; compiled in the test below)."""
    augment = augment or GA.color_augment_batch
    import torchvision.transforms.functional as TF
    torch.manual_seed(0)
    img = torch.tensor([0.8, 0.3, 0.2]).view(3, 1, 1).repeat(1, 16, 16)
    img[..., :8] = torch.tensor([0.1, 0.5, 0.7]).view(3, 1, 1)
    img = (img + 0.1 * torch.rand_like(img)).clamp(0, 1)
    N = 800
    crit = math.sqrt(-math.log(0.001 / 5 / 2) / 2) * math.sqrt(2 / N)

    def stats(x):
        x = (x * 255).round() / 255     # uint8 levels, as the reference's: 1e-6 float noise cannot split a tie
        g = GA._gray(x)
        return [x[:, 0].mean((1, 2)), x[:, 2].mean((1, 2)), g.std((1, 2, 3)),      # colour, contrast
                (x.max(1)[0] - x.min(1)[0]).mean((1, 2)),                           # saturation
                (g[..., 1:] - g[..., :-1]).abs().mean((1, 2, 3))]                   # sharpness (blur)

    pil = TF.to_pil_image(img)                                                   # the workers' input
    img = C.to_uint8(pil)
    tv = C.color_augment(**params)
    ref = stats(torch.stack([C.to_uint8(tv(pil)) for _ in range(N)]).float() / 255)
    batch = img.expand(N, -1, -1, -1).to(device)
    ks = [_ks(r, o) for r, o in zip(ref, stats(augment(batch, **params).cpu()))]
    assert max(ks) < crit, (ks, crit)
    for wrong in (dict(p_gray=0.4), dict(jitter=(0.8, 0.4, 0.4, 0.1)), dict(p_solarize=0.5)) + \
            ((dict(p_blur=0.25),) if not params else ()):
        ks = [_ks(r, o) for r, o in zip(ref, stats(augment(batch, **{**params, **wrong}).cpu()))]
        assert max(ks) > crit, (wrong, ks)


@pytest.mark.compiles
@pytest.mark.skipif(not any(map(shutil.which, ("g++", "c++", "clang++"))),
                    reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_color_augment_batch_has_the_torchvision_distribution():
    """What train() runs under --compile (gpu_aug.color_augmenter(True), compiled color_augment_batch):
    inductor draws its own random numbers, so the KS test above, not equality, says it is the same
    augmentation (each parameter set a graph of its own: the wrong ones are caught too)."""
    augment = GA.color_augmenter(True)
    assert augment is not GA.color_augment_batch
    test_color_augment_batch_has_the_torchvision_distribution({}, augment=augment)


def test_blur_taps_cover_three_sigma_below_the_image_size():
    assert GA.blur_taps() == 13 and GA.blur_taps(1.0) == 7                          # 2 * ceil(3 sigma) + 1
    assert GA.blur_taps(size=224) == 13 and GA.blur_taps(size=12) == 11 and GA.blur_taps(size=8) == 7


def test_color_jitter_order_is_a_uniform_random_permutation_per_image(monkeypatch):
    seen = []
    real = GA.color_jitter_batch
    monkeypatch.setattr(GA, "color_jitter_batch", lambda x, *a: (seen.append(a[-1]), real(x, *a))[1])
    torch.manual_seed(0)
    GA.color_augment_batch(torch.rand(4800, 3, 2, 2), p_jitter=1.0, p_blur=0.0)
    order = seen[0]
    assert torch.equal(order.sort(1).values, torch.arange(4).expand(4800, 4))
    counts = torch.unique(order, dim=0, return_counts=True)[1]
    assert len(counts) == 24 and counts.min() > 120 and counts.max() < 280          # 200 each expected


def test_blur_sigma_is_uniform_in_the_official_range_with_probability_p_blur(monkeypatch):
    """As common.GaussianBlur (MSN / DINO): with probability p_blur, sigma ~ U[0.1, 2]; else 0 (off)."""
    seen = []
    real = GA.blur_batch
    monkeypatch.setattr(GA, "blur_batch", lambda x, sigma, k: (seen.append(sigma), real(x, sigma, k))[1])
    torch.manual_seed(0)
    GA.color_augment_batch(torch.rand(2000, 3, 2, 2), p_jitter=0.0, p_blur=0.5)
    sigma = seen[0]
    on = sigma[sigma > 0]
    assert 900 < len(on) < 1100                                                    # 1000 expected
    assert 0.1 <= on.min() < 0.11 and 1.99 < on.max() <= 2.0 and abs(on.mean() - 1.05) < 0.05


def test_every_image_goes_through_the_blur_and_sigma_0_leaves_it_exactly_as_it_is(monkeypatch):
    """No data-dependent shapes (what compiles, and needs no host sync): every image is blurred, those whose
    coin says no with sigma 0, a delta, which returns them bit for bit. Per position and per call the coins
    are independent with probability p (the views of one image sit at one position in every batch)."""
    x = torch.rand(5, 3, 9, 11)
    assert torch.equal(GA.blur_batch(x, torch.zeros(5), 7), x)
    seen = []
    monkeypatch.setattr(GA, "blur_batch", lambda x, sigma, k: (seen.append(sigma), x)[1])
    torch.manual_seed(0)
    for _ in range(4000):
        GA.color_augment_batch(torch.zeros(8, 3, 4, 4), p_jitter=0.0, p_blur=0.25)
    hits = (torch.stack(seen) > 0).float()                                             # (4000, 8)
    assert len(seen) == 4000 and all(len(s) == 8 for s in seen)
    freq, n = hits.mean(0), hits.sum(1)
    assert ((freq - 0.25).abs() < 0.03).all(), freq                                  # sd 0.007 per position
    assert abs(n.mean() - 2.0) < 0.1 and abs(n.var() - 8 * 0.25 * 0.75) < 0.15        # Binomial(8, 1/4)
    pair = (hits[:, 0] * hits[:, 1]).mean()                                            # independent positions
    assert abs(pair - 0.25 ** 2) < 0.015, pair


@pytest.mark.parametrize("method", sorted(CASES))
def test_gpu_aug_reaches_the_right_views_with_the_method_parameters(method, tmp_path, monkeypatch):
    mod, args, n_views, params, augmented, plain = CASES[method]
    calls, steps = [], []

    def record(x, **kw):                                               # an augmentation we can recognise:
        calls.append((x.dtype, kw))                                    # every image a flat grey
        return torch.full(x.shape, 0.5, device=x.device)            # on the batch's device (CUDA on a GPU host)
    monkeypatch.setattr(GA, "color_augment_batch", record)
    real_step = mod.train_step
    monkeypatch.setattr(mod, "train_step", lambda *a, **kw: (steps.append(a), real_step(*a, **kw))[1])
    mod.train(args(tmp_path, gpu_aug=True, epochs=1, steps_per_epoch=1, warmup_epochs=0))
    assert len(calls) == n_views and all(d == torch.uint8 and kw == {**params, "normalize": True} for d, kw in calls)
    flat = lambda t: t.flatten(-2).std(-1).max() == 0                 # noqa: E731  (spatially constant)
    assert len(steps) == 1 and all(flat(steps[0][i]) for i in augmented)
    assert not any(flat(steps[0][i]) for i in plain)


@pytest.mark.parametrize("method", sorted(CASES))
def test_with_compile_the_loop_augments_through_the_compiled_function(method, tmp_path, monkeypatch):
    """--compile also compiles the colour ops (harness.setup), and every view the method augments goes
    through that compiled function (torch.compile replaced by a marker; networks pass through)."""
    mod, args, n_views = CASES[method][:3]
    calls = []
    monkeypatch.setattr(GA, "color_augment_batch", lambda x, normalize=False, **kw: (calls.append("eager"),
                                                                                     x.float() / 255)[1])

    def fake_compile(fn, **kw):
        if isinstance(fn, torch.nn.Module):
            return fn

        def compiled(*a, **k):
            calls.append("compiled")
            return fn(*a, **k)
        return compiled
    monkeypatch.setattr(torch, "compile", fake_compile)
    mod.train(args(tmp_path, gpu_aug=True, compile=True, epochs=1, steps_per_epoch=1, warmup_epochs=0))
    assert calls == ["compiled", "eager"] * n_views


def test_workers_skip_the_colour_ops_with_gpu_aug():
    img = S.SyntheticImages().load(3)[0]
    a = cmae_args("/tmp/u", gpu_aug=True, master_size=16)               # no shift: target = source crop
    torch.manual_seed(0)
    src, tgt, _ = cmae.PixelShiftViews(a, color=not a.gpu_aug)(img)
    assert torch.equal(src, tgt)
    a = conmim_args("/tmp/u", gpu_aug=True)
    [crop] = conmim.WeakStrongViews(a)(img)                         # one crop, sent once: both views


@pytest.mark.parametrize("method", ["cmae", "conmim", "can"])
def test_gpu_aug_resume_is_exact(method, tmp_path):
    mod, args = CASES[method][:2]
    exact_resume(mod.train, lambda p, **kw: args(p, gpu_aug=True, **kw), tmp_path, method, ("model", "encoder"))


def test_without_gpu_aug_py_the_colour_ops_stay_in_the_workers(monkeypatch, capsys):
    """A method file + common.py + harness.py copied without gpu_aug.py: on CUDA the default falls back to the
    workers with a line saying so; an explicit --gpu-aug is a one-line error."""
    real = C.sibling
    monkeypatch.setattr(C, "sibling", lambda name: "/absent/gpu_aug.py" if name == "gpu_aug" else real(name))
    monkeypatch.setitem(sys.modules, "gpu_aug", None)                  # import gpu_aug fails as if absent
    a = msn.Args(data="synthetic", compile=False)
    H.device_defaults(a, torch.device("cuda"))
    assert a.gpu_aug is False
    assert "no gpu_aug.py next to this file: the colour augmentation runs in the workers" in capsys.readouterr().out
    a = H.parse_args(msn.Args, ["--data", "synthetic", "--gpu-aug", "--no-compile"])
    with pytest.raises(C.UserError, match="--gpu-aug needs gpu_aug.py next to this file"):
        H.device_defaults(a, torch.device("cuda"))


def test_the_step_builds_no_constant_from_host_data_after_its_first_call(monkeypatch):
    """A tensor built from Python data on a GPU is a copy the host waits for (a sync each call, several per view):
    common.normalize keeps its mean / std per device and the augmentation uses Python numbers, so after a first
    call neither builds a tensor from host data (torch.tensor / as_tensor / eye counted)."""
    x = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    C.normalize(x), GA.color_augment_batch(x, normalize=True, p_solarize=0.2)            # first calls may build
    built = []
    for name in ("tensor", "as_tensor", "eye"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _n=name, **kw: (built.append(_n), _real(*a, **kw))[1])
    C.normalize(x)
    C.normalize(x.float() / 255)
    GA.color_augment_batch(x, normalize=True, p_solarize=0.2)
    GA.color_augment_batch(x, **conmim.STRONG)
    assert built == []
