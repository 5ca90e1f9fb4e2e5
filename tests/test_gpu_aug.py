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

# (module, tiny args, uint8 views augmented per step, parameters that must be passed)
CASES = {"msn": (msn, msn_args, 1 + 1 + 2, {}), "cmae": (cmae, cmae_args, 1, {}),
         "conmim": (conmim, conmim_args, 1, conmim.STRONG), "can": (can, can_args, 2, {})}


@pytest.mark.parametrize("method", sorted(CASES))
def test_gpu_aug_reaches_the_right_views_with_the_method_parameters(method, tmp_path, monkeypatch):
    mod, args, n_views, params = CASES[method]
    calls = []

    def record(x, **kw):
        calls.append((x.dtype, kw))
        return x.float() / 255
    monkeypatch.setattr(C, "color_augment_batch", record)
    mod.train(args(tmp_path, gpu_aug=True, epochs=1, steps_per_epoch=1, warmup_epochs=0))
    assert len(calls) == n_views and all(d == torch.uint8 and kw == params for d, kw in calls)


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
    mod, args, _, _ = CASES[method]
    exact_resume(mod.train, lambda p, **kw: args(p, gpu_aug=True, **kw), tmp_path, method, ("model", "encoder"))
