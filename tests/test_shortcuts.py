"""Shortcut probes: each objective must need the image content. An objective that a network can
lower from positions alone, from a blank input or with another image's targets teaches nothing about
images, however correct its arithmetic. Each probe evaluates the method's own loss on inputs that
carry no content (or the wrong image's) and asserts it stays at chance, at initialisation and after
a short training run on a fixed batch (where a shortcut, if the architecture offers one, is learnt
first: ConMIM with learned absolute position embeddings drops from ln 16 = 2.77 to ~0.3 here).

Methods and their probes:
  ConMIM  every patch masked; the teacher's keys from another image; a blank (grey) teacher input
  MSN     an anchor with every patch dropped: the same prediction for every image
  CMAE    InfoNCE with each positive taken from another image
  CAN     InfoNCE with each positive taken from another image
SiamMAE's objective (reconstruct f2 from f1) is probed against ground-truth motion in test_siammae.py.
"""
import math

import pytest
import torch

import common as C
import synthetic as S


def _images(n, size, seed=0):
    """(n, 3, size, size) normalised synthetic images, two crops' worth of content each."""
    from torchvision.transforms.functional import resize
    imgs = [C.to_uint8(S.synthetic_image(i, seed=seed)[0]) for i in range(n)]
    return C.normalize(resize(torch.stack(imgs), [size, size], antialias=True))


# ----------------------------------------------------------------------------------------------
# ConMIM: patch-level InfoNCE over the N patches of one image (chance: ln N)
# ----------------------------------------------------------------------------------------------
def conmim_probes(student, teacher, x, mask, tau):
    """The four losses of the probe table (no grad): the objective, every patch masked, the teacher's
    keys from another image (batch rolled by one), and the teacher fed a blank grey image."""
    import conmim
    with torch.no_grad():
        keys = teacher(x)
        full = torch.ones_like(mask)
        return {"objective": conmim.conmim_loss(student(x, mask), keys, mask, tau).item(),
                "all_masked": conmim.conmim_loss(student(x, full), keys, full, tau).item(),
                "other_image": conmim.conmim_loss(student(x, mask), keys.roll(1, 0), mask, tau).item(),
                "blank_teacher": conmim.conmim_loss(student(x, mask), teacher(torch.zeros_like(x)), mask, tau).item()}


@pytest.fixture(scope="module")
def conmim_trained():
    """A nano ConMIM (16 patches) at init and after 60 steps of its own train_step on a fixed batch of
    16 images (same view for student and teacher, fresh masks each step): (probes at init, after)."""
    import conmim
    from test_conmim import tiny_args
    torch.manual_seed(0)
    a = tiny_args("/tmp/unused", lr=3e-3, proj_hidden=64, proj_dim=32)
    model = conmim.Net(a)
    teacher = conmim.make_teacher(model)
    opt = C.make_optimizer(model, a.lr, a.weight_decay, a.betas, torch.device("cpu"), conmim.no_decay)
    x = _images(16, 16)
    grid = a.img_size // a.patch_size
    probe_mask = conmim.random_masking(16, grid, a.mask_ratio, a.mask_unit)
    before = conmim_probes(model.train(), teacher.train(), x, probe_mask, a.tau)
    for step in range(60):
        mask = conmim.random_masking(16, grid, a.mask_ratio, a.mask_unit)
        opt.zero_grad(set_to_none=True)
        conmim.train_step(model, teacher, x, x, mask, a)
        opt.step()
        conmim.ema_update(teacher, model, 0.9)
    return before, conmim_probes(model, teacher, x, probe_mask, a.tau)


@pytest.mark.parametrize("when", ["init", "trained"])
@pytest.mark.parametrize("probe", ["all_masked", "other_image", "blank_teacher"])
def test_conmim_objective_needs_the_image(conmim_trained, when, probe):
    """No pixels for the student, the wrong image's keys, or a blank teacher: the loss stays at
    chance (ln 16). With every input token of the student equal ([MASK]) or every teacher token equal
    (blank), nothing but position could break the tie, and BEiT's backbone adds no position to a
    token: the student's outputs (or the keys) are then equal, and the loss is >= ln N exactly."""
    losses = conmim_trained[when == "trained"]
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


def test_print_conmim_probe_table(conmim_trained, capsys):
    with capsys.disabled():
        for name, losses in zip(("init", "trained"), conmim_trained):
            print(f"\nconmim probes {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in losses.items()))
