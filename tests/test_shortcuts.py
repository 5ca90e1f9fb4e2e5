"""Shortcut probes: each objective must need the image content. An objective that a network can
lower from positions alone, from a blank input or with another image's targets teaches nothing about
images, however correct its arithmetic. Each probe evaluates the method's own loss on inputs that
carry no content (or the wrong image's) and asserts it stays at chance, at initialisation and after
a short training run on a fixed batch (where a shortcut, if the architecture offers one, is learnt
first: ConMIM with learned absolute position embeddings drops from ln 16 = 2.77 to ~0.3 here).

Methods and their probes:
  ConMIM  every patch masked; the teacher's keys from another image; a blank (grey) teacher input
  MSN     an anchor with every patch dropped: the same prediction for every image, so its cross-entropy
          with any image's target equals that with another image's
  CAN     InfoNCE with each positive taken from another image: at chance, and above the objective, after
          training on a fixed batch
  CMAE    the same, with each EMA target taken from another image
SiamMAE's probe (f1 replaced by another clip's
frame) runs on a trained checkpoint in scripts/eval_correspondence.py: measured, it does NOT need f1 at CPU
scale (docs/RESULTS.md), so it is not asserted here.
"""
import math
import os
import sys

import pytest
import torch

import common as C
import synthetic as S
from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))


def _images(n, size, seed=0):
    """(n, 3, size, size) normalised synthetic images, two crops' worth of content each."""
    from torchvision.transforms.functional import resize
    imgs = [C.to_uint8(S.synthetic_image(i, seed=seed)[0]) for i in range(n)]
    return C.normalize(resize(torch.stack(imgs), [size, size], antialias=True))


# ----------------------------------------------------------------------------------------------
# ConMIM: patch-level InfoNCE over the N patches of one image (chance: ln N)
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[1, 300], ids=["official", "table_lr_x300"])
def conmim_trained(request):
    """A nano ConMIM (16 patches) at init and after 60 steps of its own train_step on a fixed batch of
    16 images (same view for student and teacher, fresh masks each step): (probes at init, after). Twice: with
    the official optimiser, and with the short-run presets' rule for the symmetric start (the relative position
    bias table at 300 x the lr), which must not open a shortcut either. The probes are scripts/conmim_probe.py's."""
    import conmim
    from conmim_probe import probes
    from test_conmim import tiny_args
    torch.manual_seed(0)
    a = tiny_args("/tmp/unused", lr=3e-3, proj_hidden=64, proj_dim=32, rel_pos_lr=request.param)
    model = conmim.Net(a)
    teacher = conmim.make_teacher(model)
    opt = conmim.make_optimizer(model, a, torch.device("cpu"))
    x = _images(16, 16)
    grid = a.img_size // a.patch_size
    probe_mask = conmim.random_masking(16, grid, a.mask_ratio, a.mask_unit)
    before = probes(model.train(), teacher.train(), x, probe_mask, a.tau)
    for step in range(60):
        mask = conmim.random_masking(16, grid, a.mask_ratio, a.mask_unit)
        opt.zero_grad(set_to_none=True)
        conmim.train_step(model, teacher, x, x, mask, a)
        opt.step()
        conmim.ema_update(teacher, model, 0.9)
    return before, probes(model, teacher, x, probe_mask, a.tau), (model, teacher, x, probe_mask, a.tau)


@pytest.mark.parametrize("when", ["init", "trained"])
@pytest.mark.parametrize("probe", ["all_masked", "other_image", "blank_teacher"])
def test_conmim_objective_needs_the_image(conmim_trained, when, probe):
    """No pixels for the student, the wrong image's keys, or a blank teacher: the loss stays at
    chance (ln 16). With every input token of the student equal ([MASK]) or every teacher token equal
    (blank), nothing but position could break the tie, and BEiT's backbone adds no position to a
    token: the student's outputs (or the keys) are then equal, and the loss is >= ln N exactly."""
    losses = conmim_trained[int(when == "trained")]
    chance = math.log(16)
    assert losses[probe] > 0.95 * chance, (probe, losses)


def test_conmim_blank_and_fully_masked_inputs_give_identical_tokens_at_init():
    """The mechanism behind the probes: BEiT's ViT adds no position to a token, so at init (bias table
    0) a fully masked student or a blank teacher gives the same token at every position. A learned
    bias can still leak some position (a border token sees fewer offsets, which changes its share of
    attention to [CLS]): the trained probes above measure that this stays near chance."""
    import conmim
    from test_conmim import tiny_args
    model = conmim.Net(tiny_args("/tmp/unused")).eval()
    with torch.no_grad():
        out = model.encoder(torch.randn(2, 3, 16, 16), torch.ones(2, 16), model.mask_token)
        blank = model.encoder(torch.zeros(2, 3, 16, 16))
    for t in (out, blank):
        torch.testing.assert_close(t[:, 1:], t[:, 1:2].expand_as(t[:, 1:]), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# MSN: an anchor with no patch carries no image
# ----------------------------------------------------------------------------------------------
def test_msn_anchor_without_patches_is_the_same_for_every_image():
    """With every patch dropped (ids_keep empty) the anchor is the [CLS] token alone: the same
    prototype assignment for every image, hence the same cross-entropy against any image's target
    as against its own (the loss cannot be lowered without content), in train mode (BatchNorm heads)."""
    import msn
    from test_msn import tiny_args
    a = tiny_args("/tmp/unused")
    model = msn.MSN(a).train()
    x = _images(8, a.img_size)
    with torch.no_grad():
        z = model.net(x, torch.zeros(8, 0, dtype=torch.long))                # (B, d), no patch kept
        torch.testing.assert_close(z, z[:1].expand_as(z), atol=1e-5, rtol=1e-5)
        target = model.net(x)
        own, _ = msn.msn_loss(z, target, model.prototypes)
        other, _ = msn.msn_loss(z, target.roll(1, 0), model.prototypes)
    torch.testing.assert_close(own, other, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# CAN: InfoNCE with the wrong positives
# ----------------------------------------------------------------------------------------------
def _two_views(x, g):
    """Two random crops (scale 0.4-1) + flips of each image, resized back: (2, B, 3, H, W)."""
    import torch.nn.functional as F
    B, _, H, W = x.shape
    out = []
    for _ in range(2):
        views = []
        for i in range(B):
            s = float(torch.empty(1).uniform_(0.63, 1.0, generator=g))
            h = w = max(4, int(H * s))
            top, left = (int(torch.randint(0, H - h + 1, (1,), generator=g)), int(torch.randint(0, W - w + 1, (1,),
                                                                                                generator=g)))
            v = F.interpolate(x[i:i + 1, :, top:top + h, left:left + w], size=(H, W), mode="bilinear",
                              align_corners=False)
            views.append(v.flip(-1) if torch.rand(1, generator=g) < 0.5 else v)
        out.append(torch.cat(views))
    return torch.stack(out)


def test_can_infonce_needs_the_right_positive():
    """A nano CAN after 40 steps of its own train_step on a fixed batch of 16 images (fresh views,
    masks and noise each step): the InfoNCE of its embeddings with each positive taken from another
    image stays at least at chance ln(2n - 1) and above the objective's."""
    import can
    from test_can import tiny_args
    torch.manual_seed(0)
    a = tiny_args("/tmp/unused", lr=3e-3, weights=(1.0, 0.67, 0.3))
    model = can.CAN(a).train()
    opt = C.make_optimizer(model, a.lr, a.weight_decay, a.betas, torch.device("cpu"))
    x, g, B = _images(16, a.img_size), torch.Generator().manual_seed(0), 16
    grid = a.img_size // a.patch_size

    def batch():
        v = _two_views(x, g)
        sigma = torch.rand(2, B) * a.sigma_max
        keep, restore, mask = (t.view(2, B, -1) for t in can.random_masking(2 * B, grid, a.mask_ratio))
        return v, sigma, sigma[..., None, None, None] * torch.randn_like(v), keep, restore, mask
    for _ in range(40):
        opt.zero_grad(set_to_none=True)
        can.train_step(model, *batch(), a)
        opt.step()
    v, sigma, noise, keep, restore, mask = batch()
    with torch.no_grad():
        _, u = model((v + noise).flatten(0, 1), sigma.flatten(0, 1), keep.flatten(0, 1), restore.flatten(0, 1))
        u1, u2 = u.view(2, B, -1)
        own, other = can.info_nce(u1, u2, a.tau).item(), can.info_nce(u1, u2.roll(1, 0), a.tau).item()
    assert other > 0.95 * math.log(2 * B - 1) and own < other - 0.5, (own, other, math.log(2 * B - 1))
    print(f"\ncan infonce: own {own:.3f}, positives from other images {other:.3f}, chance {math.log(2 * B - 1):.3f}")


def test_cmae_infonce_needs_the_right_positive():
    """A nano CMAE after 40 steps of its own train_step on a fixed batch of 16 images (a fresh source
    and target view each step, EMA target at 0.9): its InfoNCE with each target taken from another
    image stays at least at chance (2 tau ln B, CMAE's scale) and above the objective's."""
    import cmae
    from test_cmae import tiny_args
    torch.manual_seed(0)
    a = tiny_args("/tmp/unused", lr=3e-3, lambda_c=1.0)
    model, B = cmae.CMAE(a).train(), 16
    target = cmae.Target(model).train()
    opt = C.make_optimizer(model, a.lr, a.weight_decay, a.betas, torch.device("cpu"))
    x, g = _images(B, a.img_size), torch.Generator().manual_seed(0)
    grid = a.img_size // a.patch_size
    for _ in range(40):
        x_s, x_t = _two_views(x, g)
        keep, restore, mask = cmae.random_masking(B, grid, a.mask_ratio, a.mask_unit)
        opt.zero_grad(set_to_none=True)
        cmae.train_step(model, target, x_s, x_t, keep, restore, mask, a)
        opt.step()
        cmae.ema_update(target, target.online_params(model), 0.9)
    x_s, x_t = _two_views(x, g)
    keep, restore, mask = cmae.random_masking(B, grid, a.mask_ratio, a.mask_unit)
    with torch.no_grad():
        u, v = model(x_s, keep, restore, pixels=False)[1], target(x_t)
        own, other = cmae.cmae_contrastive_loss(u, v, a.tau).item(), cmae.cmae_contrastive_loss(u, v.roll(1, 0),
                                                                                                a.tau).item()
    chance = 2 * a.tau * math.log(B)
    print(f"\ncmae infonce: own {own:.3f}, targets from other images {other:.3f}, chance {chance:.3f}")
    assert other > 0.95 * chance and own < other - 0.1 * chance, (own, other, chance)


def test_conmim_other_image_probe_reads_another_images_keys(conmim_trained):
    """The other-image probe scores each image's queries against another image's keys (the teacher's batch rolled by
    one), not its own, which would report the objective itself: it is the rolled loss, and stands apart from the
    objective, after the short training (either optimiser). Not asserted: that the trained queries match their own
    keys better than another image's. In 60-300 steps on these 16 images the objective stays above chance and that
    gap is one trajectory's (measured with seeds 0-2 at 1, 2 and 4 threads: -0.4 to +2.2; it failed at 0.14 < 0.4 on
    another machine); on CIFAR-10 the preset's teacher: 4.95 vs 2.75 (docs/RESULTS.md, scripts/conmim_probe.py)."""
    import conmim
    _, after, (student, teacher, x, mask, tau) = conmim_trained
    with torch.no_grad():
        keys, queries = teacher(x), student(x, mask)
        rolled = conmim.conmim_loss(queries, keys.roll(1, 0), mask, tau).item()
        own = conmim.conmim_loss(queries, keys, mask, tau).item()
    assert after["other_image"] == pytest.approx(rolled, abs=1e-5)
    assert after["objective"] == pytest.approx(own, abs=1e-5)
    assert abs(rolled - own) > 1e-4, (rolled, own)                   # own keys would make them equal
