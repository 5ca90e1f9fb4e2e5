"""The batched on-device photometric augmentation, the CUDA default of every method that has one,
run here on CPU (--gpu-aug forced): it reaches the right views with the method's parameters, the
workers then only crop and flip, and runs stay deterministic (exact resume)."""
import pytest
import torch

import can
import cmae
import common as C
import synthetic as S
import conmim
import msn
from helpers import exact_resume
from test_can import tiny_args as can_args
from test_cmae import tiny_args as cmae_args
from test_conmim import tiny_args as conmim_args
from test_msn import tiny_args as msn_args

# (module, tiny args, uint8 views augmented per step, parameters that must be passed,
#  train_step arguments that must be the augmented views, and those that must not)
CASES = {"msn": (msn, msn_args, 1 + 1 + 2, {}, (2, 3, 4), ()),          # target, random and focal anchors
         "cmae": (cmae, cmae_args, 1, {}, (3,), (2,)),                  # the target view x_t only, not x_s
         "conmim": (conmim, conmim_args, 1, conmim.STRONG, (3,), (2,)),  # x_strong (teacher), not x_weak
         "can": (can, can_args, 2, {}, (1,), ())}                       # both views


@pytest.mark.parametrize("method", sorted(CASES))
def test_gpu_aug_reaches_the_right_views_with_the_method_parameters(method, tmp_path, monkeypatch):
    mod, args, n_views, params, augmented, plain = CASES[method]
    calls, steps = [], []

    def record(x, **kw):                                               # an augmentation we can recognise:
        calls.append((x.dtype, kw))                                    # every image a flat grey
        return torch.full(x.shape, 0.5)
    monkeypatch.setattr(C, "color_augment_batch", record)
    real_step = mod.train_step
    monkeypatch.setattr(mod, "train_step", lambda *a, **kw: (steps.append(a), real_step(*a, **kw))[1])
    mod.train(args(tmp_path, gpu_aug=True, epochs=1, steps_per_epoch=1, warmup_epochs=0))
    assert len(calls) == n_views and all(d == torch.uint8 and kw == params for d, kw in calls)
    flat = lambda t: t.flatten(-2).std(-1).max() == 0                 # noqa: E731  (spatially constant)
    assert len(steps) == 1 and all(flat(steps[0][i]) for i in augmented)
    assert not any(flat(steps[0][i]) for i in plain)


@pytest.mark.parametrize("method", sorted(CASES))
def test_with_compile_the_loop_augments_through_the_compiled_function(method, tmp_path, monkeypatch):
    """--compile also compiles the colour ops (common.setup), and every view the method augments goes
    through that compiled function (torch.compile replaced by a marker; networks pass through)."""
    mod, args, n_views = CASES[method][:3]
    calls = []
    monkeypatch.setattr(C, "color_augment_batch", lambda x, **kw: (calls.append("eager"), x.float() / 255)[1])

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
    weak, strong = conmim.WeakStrongViews(a)(img)
    assert torch.equal(weak, strong)


@pytest.mark.parametrize("method", ["cmae", "conmim", "can"])
def test_gpu_aug_resume_is_exact(method, tmp_path):
    mod, args = CASES[method][:2]
    exact_resume(mod.train, lambda p, **kw: args(p, gpu_aug=True, **kw), tmp_path, method, ("model", "encoder"))
