"""Wiring of each method's train_step and of the evaluation loops: which view reaches which network,
which patches each loss reads, where noise and masks apply, that targets are deterministic, the
direction of every schedule. Each test is written so that a realistic one-line bug in the wiring
fails it (see the note in the issue for the lines that were broken on purpose)."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import can
import cmae
import common as C
import conmim
import weights
import eval_video as V
import msn
import siammae
from test_can import tiny_args as can_args
from test_cmae import tiny_args as cmae_args
from test_conmim import tiny_args as conmim_args
from test_msn import tiny_args as msn_args
from test_siammae import tiny_args as siammae_args
from test_step import bn_eval


class Calls:
    """Records every forward call of a module: positional args and keyword args."""

    def __init__(self, module):
        self.calls = []
        module.register_forward_pre_hook(lambda m, args, kw: self.calls.append((args, kw)), with_kwargs=True)

    def arg(self, i, k=0, name=None):
        args, kw = self.calls[i]
        return kw.get(name) if name is not None and name in kw else (args[k] if len(args) > k else None)


def replace_output(module, fn):
    """Forward hook: the module's output becomes fn(output)."""
    return module.register_forward_hook(lambda m, inp, out: fn(out))


def rand(*s, seed=0):
    return torch.randn(*s, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# MSN
# ---------------------------------------------------------------------------------------------
def msn_setup():
    a = msn_args("/tmp/unused")
    model = msn.MSN(a)
    target = msn.make_target(model.net)
    xt, xr, xf = rand(8, 3, 16, 16, seed=1), rand(1, 8, 3, 16, 16, seed=2), rand(2, 8, 3, 8, 8, seed=3)
    ids = msn.random_masking(8, 4, 0.5).view(1, 8, -1)
    return a, model, target, xt, xr, xf, ids


def test_msn_target_sees_only_the_unmasked_target_view_and_anchors_reach_the_online_net():
    a, model, target, xt, xr, xf, ids = msn_setup()
    t_enc, o_enc = Calls(target.encoder), Calls(model.net.encoder)
    msn.train_step(model, target, xt, xr, xf, ids, a)
    assert len(t_enc.calls) == 1 and torch.equal(t_enc.arg(0), xt)
    assert t_enc.arg(0, 1, "ids_keep") is None                           # target: no mask
    assert torch.equal(o_enc.arg(0), xr[0]) and torch.equal(o_enc.arg(0, 1, "ids_keep"), ids[0])   # masked anchors
    assert torch.equal(o_enc.arg(1), xf.flatten(0, 1)) and o_enc.arg(1, 1, "ids_keep") is None    # focal: unmasked


def test_msn_loss_is_msn_loss_of_the_view_major_anchors_and_the_target_embeddings():
    a, model, target, xt, xr, xf, ids = msn_setup()
    bn_eval(model, target)
    loss, parts = msn.train_step(model, target, xt, xr, xf, ids, a)
    with torch.no_grad():
        z = torch.cat([model.net(xr[0], ids[0]), model.net(xf.flatten(0, 1))])   # (M*B, d) view-major
        ref, _ = msn.msn_loss(z, target(xt), model.prototypes, a.tau, a.tau_plus, a.me_max_weight, a.sinkhorn_iters)
    torch.testing.assert_close(loss, ref)


def test_msn_heads_read_the_cls_token_after_the_final_norm():
    """MSN's representation is the [CLS] output (paper; official deit.forward: norm, then x[:, 0]),
    for the anchors (masked and focal) and the target alike."""
    a, model, target, xt, xr, xf, ids = msn_setup()
    o_head, t_head = Calls(model.net.head), Calls(target.head)
    msn.train_step(model, target, xt, xr, xf, ids, a)
    with torch.no_grad():
        torch.testing.assert_close(o_head.arg(0), model.net.encoder(xr[0], ids[0])[:, 0])
        torch.testing.assert_close(o_head.arg(1), model.net.encoder(xf.flatten(0, 1))[:, 0])
        torch.testing.assert_close(t_head.arg(0), target.encoder(xt)[:, 0])


def test_targets_and_teachers_are_deterministic_frozen_copies():
    """The EMA target / teacher: outputs deterministic in train mode (drop path off), no parameter
    that autograd would track, and its own storage (an update of the online net must not move it)."""
    a, model, target, xt, *_ = msn_setup()
    msn_net = msn.MSN(msn_args("/tmp/u", drop_path=0.5)).net
    cmae_net = cmae.CMAE(cmae_args("/tmp/u", drop_path=0.5))
    conmim_net = conmim.Net(conmim_args("/tmp/u", drop_path=0.5))
    for online, net in ((msn_net, msn.make_target(msn_net)), (cmae_net, cmae.Target(cmae_net)),
                        (conmim_net, conmim.make_teacher(conmim_net))):
        net.train()
        torch.testing.assert_close(net(xt), net(xt), rtol=0, atol=0)
        assert not any(p.requires_grad for p in net.parameters())
        mine = {p.data_ptr() for p in online.parameters()}
        assert not any(p.data_ptr() in mine for p in net.parameters())


# ---------------------------------------------------------------------------------------------
# CMAE
# ---------------------------------------------------------------------------------------------
def cmae_setup():
    a = cmae_args("/tmp/unused")
    model = cmae.CMAE(a)
    target = cmae.Target(model)
    bn_eval(model, target)
    xs, xt = rand(8, 3, 16, 16, seed=1), rand(8, 3, 16, 16, seed=2)
    ids, rest, mask = cmae.random_masking(8, 4, 0.5, 2)
    return a, model, target, xs, xt, ids, rest, mask


def test_cmae_views_reach_the_right_networks():
    a, model, target, xs, xt, ids, rest, mask = cmae_setup()
    t_enc, o_enc = Calls(target.encoder), Calls(model.encoder)
    cmae.train_step(model, target, xs, xt, ids, rest, mask, a)
    assert torch.equal(t_enc.arg(0), xt) and t_enc.arg(0, 1, "ids_keep") is None   # shifted view, unmasked
    assert torch.equal(o_enc.arg(0), xs) and torch.equal(o_enc.arg(0, 1, "ids_keep"), ids)


def test_cmae_reconstruction_reads_masked_patches_of_the_source_view():
    a, model, target, xs, xt, ids, rest, mask = cmae_setup()
    px = cmae.norm_pix(cmae.patchify(xs, 4))
    def oracle(out):                                                     # perfect predictions (B, 1+N, P)
        return torch.cat([out[:, :1], px], 1)
    h = replace_output(model.pixel_decoder, oracle)
    _, parts = cmae.train_step(model, target, xs, xt, ids, rest, mask, a)
    assert parts["l_r"] < 1e-10                                          # target = norm-pix of x_s itself
    h.remove()
    m = mask.bool()[..., None]
    for where, changes in ((~m, False), (m, True)):                      # perturb visible / masked predictions
        h = replace_output(model.pixel_decoder, lambda out: torch.cat([out[:, :1], torch.where(where, px + 1, px)], 1))
        _, parts = cmae.train_step(model, target, xs, xt, ids, rest, mask, a)
        h.remove()
        assert (parts["l_r"] > 0.5) == changes


def test_cmae_contrastive_term_uses_the_feature_branch_and_the_target_embeddings():
    a, model, target, xs, xt, ids, rest, mask = cmae_setup()
    _, parts = cmae.train_step(model, target, xs, xt, ids, rest, mask, a)
    with torch.no_grad():
        _, u = model(xs, ids, rest)
        ref = cmae.cmae_contrastive_loss(u, target(xt), a.tau)
    torch.testing.assert_close(parts["l_c"], ref)


def test_cmae_online_embedding_is_the_mean_patch_token_of_the_feature_decoder():
    """y_s: the feature decoder's output averaged over the patch tokens ([CLS] left out), then projector and
    predictor; the target's z_t: its encoder's patch tokens averaged, without the final norm."""
    a, model, target, xs, xt, ids, rest, mask = cmae_setup()
    o_proj, t_proj = Calls(model.projector), Calls(target.projector)
    cmae.train_step(model, target, xs, xt, ids, rest, mask, a)
    with torch.no_grad():
        latent = model.encoder(xs, ids)
        torch.testing.assert_close(o_proj.arg(0), model.feature_decoder(latent, rest)[:, 1:].mean(1))
        torch.testing.assert_close(t_proj.arg(0), target.encoder(xt, norm=False)[:, 1:].mean(1))


def test_cmae_total_is_l_r_plus_lambda_c_l_c_in_both_step_paths():
    a, model, target, xs, xt, ids, rest, mask = cmae_setup()
    a.lambda_c = 0.25                                                    # the default 1.0 would hide a lost weight
    for micro in (8, 4):                                                 # one pass; the gradient cache
        loss, parts = cmae.train_step(model, target, xs, xt, ids, rest, mask, a, micro)
        torch.testing.assert_close(loss, parts["l_r"] + 0.25 * parts["l_c"])
        torch.testing.assert_close(parts["loss"], loss)


# ---------------------------------------------------------------------------------------------
# ConMIM
# ---------------------------------------------------------------------------------------------
def conmim_setup():
    a = conmim_args("/tmp/unused")
    model = conmim.Net(a)
    teacher = conmim.make_teacher(model)
    bn_eval(model, teacher)
    xw, xs = rand(8, 3, 16, 16, seed=1), rand(8, 3, 16, 16, seed=2)
    mask = conmim.random_masking(8, 4, 0.75, 2)
    return a, model, teacher, xw, xs, mask


def test_conmim_teacher_sees_the_strong_view_without_mask_and_student_the_masked_weak_view():
    a, model, teacher, xw, xs, mask = conmim_setup()
    t_enc, s_enc = Calls(teacher.encoder), Calls(model.encoder)
    conmim.train_step(model, teacher, xw, xs, mask, a)
    assert torch.equal(t_enc.arg(0), xs) and t_enc.arg(0, 2, "mask") is None
    assert torch.equal(s_enc.arg(0), xw) and torch.equal(s_enc.arg(0, 2, "mask"), mask)


def test_conmim_loss_is_eq2_of_the_masked_student_and_the_whole_teacher_view():
    a, model, teacher, xw, xs, mask = conmim_setup()
    loss, parts = conmim.train_step(model, teacher, xw, xs, mask, a, micro=4)     # 2 micro-batches, 6 masked each
    with torch.no_grad():
        ref = conmim.conmim_loss(model(xw, mask), teacher(xs), mask, a.tau)      # one Eq. (2) over the batch
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(parts["loss"], ref)


def test_conmim_loss_reads_the_student_at_masked_positions_only():
    a, model, teacher, xw, xs, mask = conmim_setup()
    base, _ = conmim.train_step(model, teacher, xw, xs, mask, a)
    m = mask.bool()[..., None]
    for where, changes in ((~m, False), (m, True)):
        noise = rand(8, 16, 16, seed=5)
        h = replace_output(model.projector, lambda out: torch.cat([out[:, :1], torch.where(where, out[:, 1:] + noise,
                                                                                              out[:, 1:])], 1))
        loss, _ = conmim.train_step(model, teacher, xw, xs, mask, a)
        h.remove()
        assert (not torch.allclose(loss, base)) == changes


# ---------------------------------------------------------------------------------------------
# CAN
# ---------------------------------------------------------------------------------------------
def can_setup():
    a = can_args("/tmp/unused")
    model = can.CAN(a)
    bn_eval(model)
    x, sigma = rand(2, 8, 3, 16, 16, seed=1), 0.05 * torch.rand(2, 8)
    noise = sigma.view(2, 8, 1, 1, 1) * rand(2, 8, 3, 16, 16, seed=2)
    ids, rest, mask = (t.view(2, 8, -1) for t in can.random_masking(16, 4, 0.5))
    return a, model, x, sigma, noise, ids, rest, mask


def test_can_noise_goes_into_the_encoder_input_and_sigma_into_the_decoder_embedding():
    a, model, x, sigma, noise, ids, rest, mask = can_setup()
    enc, emb = Calls(model.encoder), Calls(model.noise_embed)
    can.train_step(model, x, sigma, noise, ids, rest, mask, a)
    torch.testing.assert_close(enc.arg(0), (x + noise).flatten(0, 1))
    assert torch.equal(enc.arg(0, 1, "ids_keep"), ids.flatten(0, 1))
    assert torch.equal(emb.arg(0), sigma.flatten())


def test_can_reconstructs_the_clean_image_on_masked_and_the_noise_on_visible_patches():
    a, model, x, sigma, noise, ids, rest, mask = can_setup()
    clean, npx = can.patchify(x.flatten(0, 1), 4), can.patchify(noise.flatten(0, 1), 4)
    m = mask.flatten(0, 1).bool()[..., None]
    oracle = torch.where(m, clean, npx)                                 # the ideal prediction of both heads
    for pert, rec, den in ((None, False, False), (~m, False, True), (m, True, False)):
        h = replace_output(model.decoder_pred, lambda out: torch.cat([out[:, :1],
                                                                      oracle + (0 if pert is None else pert * 1.0)], 1))
        _, parts = can.train_step(model, x, sigma, noise, ids, rest, mask, a)
        h.remove()
        assert (parts["rec"] > 0.5) == rec and (parts["denoise"] > 0.5) == den, (parts, rec, den)
        if pert is None:
            assert parts["rec"] < 1e-10 and parts["denoise"] < 1e-10


def test_can_contrastive_embedding_projects_the_mean_of_the_visible_patch_tokens():
    """Paper: mean-pool the encoder outputs of the unmasked tokens ([CLS] left out), then the projector."""
    a, model, x, sigma, noise, ids, rest, mask = can_setup()
    proj = Calls(model.projector)
    can.train_step(model, x, sigma, noise, ids, rest, mask, a)
    with torch.no_grad():
        latent = model.encoder((x + noise).flatten(0, 1), ids.flatten(0, 1))      # (2B, 1 + n_visible, D)
    torch.testing.assert_close(proj.arg(0), latent[:, 1:].mean(1))


def test_can_total_is_can_loss_with_the_two_views_paired():
    a, model, x, sigma, noise, ids, rest, mask = can_setup()
    loss, _ = can.train_step(model, x, sigma, noise, ids, rest, mask, a)
    with torch.no_grad():
        pred, u = model((x + noise).flatten(0, 1), sigma.flatten(), ids.flatten(0, 1), rest.flatten(0, 1))
        ref, _ = can.can_loss(u[:8], u[8:], pred, can.patchify(x.flatten(0, 1), 4), can.patchify(noise.flatten(0, 1),
                                                                                                 4),
                              mask.flatten(0, 1), a.tau, a.weights)
    torch.testing.assert_close(loss, ref)


# ---------------------------------------------------------------------------------------------
# SiamMAE
# ---------------------------------------------------------------------------------------------
def siammae_setup(decoder="cross-self", depth=2):
    a = siammae_args(decoder=decoder, decoder_depth=depth)
    model = siammae.SiamMAE(a)
    f1, f2 = rand(6, 3, 16, 16, seed=1), rand(6, 3, 16, 16, seed=2)
    ids, rest, mask = siammae.random_masking(6, 4, 0.75)
    return a, model, f1, f2, ids, rest, mask


def test_siammae_f1_is_encoded_whole_f2_masked_and_the_loss_reads_f2():
    a, model, f1, f2, ids, rest, mask = siammae_setup()
    enc = Calls(model.encoder)
    siammae.train_step(model, f1, f2, ids, rest, mask, a)
    assert torch.equal(enc.arg(0), f1) and enc.arg(0, 1, "ids_keep") is None
    assert torch.equal(enc.arg(1), f2) and torch.equal(enc.arg(1, 1, "ids_keep"), ids)
    px = siammae.norm_pix(siammae.patchify(f2, 4))
    m = mask.bool()[..., None]
    for pert, changes in ((None, False), (~m, False), (m, True)):
        h = replace_output(model.pred, lambda out: torch.cat([out[:, :1], px + (0 if pert is None else pert * 1.0)], 1))
        loss, _ = siammae.train_step(model, f1, f2, ids, rest, mask, a)
        h.remove()
        assert (loss > 0.5) == changes
        if pert is None:
            assert loss < 1e-10                                         # target: f2's own norm-pix patches


@pytest.mark.parametrize("decoder", ["cross-self", "cross", "joint"])
def test_siammae_decoder_predicts_f2_from_f1(decoder):
    """The prediction depends on f1 (the decoder reads it); with no decoder block it must not (the
    returned tokens are f2's, not f1's); f2's dropped patches never matter."""
    a, model, f1, f2, ids, rest, mask = siammae_setup(decoder)
    model.eval()
    with torch.no_grad():
        out = model(f1, f2, ids, rest)
        assert not torch.allclose(model(f1 + 1, f2, ids, rest), out)
        f2b = f2 + 5 * mask.view(6, 1, 4, 1, 4, 1).expand(-1, 3, -1, 4, -1, 4).reshape(6, 3, 16, 16)   # masked px
        torch.testing.assert_close(model(f1, f2b, ids, rest), out)
    a, model, f1, f2, ids, rest, mask = siammae_setup(decoder, depth=0)
    with torch.no_grad():
        torch.testing.assert_close(model(f1 + 1, f2, ids, rest), model(f1, f2, ids, rest))


# ---------------------------------------------------------------------------------------------
# Schedules, drop path
# ---------------------------------------------------------------------------------------------
def _log(train, args):
    train(args)
    return [json.loads(line) for line in open(f"{args.output_dir}/log.jsonl") if '"step"' in line]


def test_schedule_directions(tmp_path):
    """lr warms up then decays (every method); MSN weight decay rises 0.04 -> 0.4 and both EMA
    momentums rise towards 1."""
    recs = _log(msn.train, msn_args(tmp_path / "msn", epochs=3, steps_per_epoch=3, warmup_epochs=1, lr=1e-3,
                                   start_lr=1e-4))
    lr, wd, mom = ([r[k] for r in recs] for k in ("lr", "wd", "mom"))
    assert lr[0] < lr[1] < lr[2] < lr[3] and lr[3] > lr[4] > lr[-1]
    assert all(b > a for a, b in zip(wd, wd[1:])) and wd[0] < 0.05 and all(b > a for a, b in zip(mom, mom[1:]))
    recs = _log(conmim.train, conmim_args(tmp_path / "conmim", epochs=3, steps_per_epoch=3, warmup_epochs=1))
    lr, mom = [r["lr"] for r in recs], [r["mom"] for r in recs]
    assert lr[0] < lr[3] and lr[3] > lr[-1] and all(b > a for a, b in zip(mom, mom[1:])) and mom[0] >= 0.996


@pytest.mark.parametrize("mod", [msn, cmae, conmim, can, siammae, weights], ids=lambda m: m.__name__)
def test_drop_path_keeps_the_expected_activation_and_is_identity_in_eval(mod):
    x = torch.ones(20000, 2, 3)                                           # (B, N, D)
    y = mod.drop_path(x, 0.3, training=True)
    assert y.shape == x.shape and abs(y.mean().item() - 1.0) < 0.02
    assert torch.all((y == 0) | torch.isclose(y, torch.tensor(1 / 0.7)))
    assert (y == y[:, :1, :1]).all()                                      # one draw per sample
    assert torch.equal(mod.drop_path(x, 0.3, training=False), x)


# ---------------------------------------------------------------------------------------------
# Evaluation wiring
# ---------------------------------------------------------------------------------------------
def test_sharper_temperature_gives_more_peaked_propagation_weights():
    f0 = F.normalize(torch.tensor([[[1.0, 0.0], [0.6, 0.8]]]), dim=-1)    # 1 x 2 grid, two cells
    query = F.normalize(torch.tensor([[[0.9, 0.1], [0.9, 0.1]]]), dim=-1)  # both closer to cell 0
    lab = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    w = [V.propagate(torch.stack([f0, query]), lab, n_context=1, topk=4, radius=5, temperature=t)[1, 0, 0, 0]
         for t in (0.05, 0.5, 5.0)]
    assert w[0] > w[1] > w[2] > 0.5


class ColourEncoder(torch.nn.Module):
    """A fake encoder whose patch feature is the patch's mean colour: perfect correspondence for
    flat-coloured objects."""
    patch_size = 4

    def forward(self, x, norm=True):
        f = F.avg_pool2d(x, 4).flatten(2).transpose(1, 2)                # (B, N, 3)
        return torch.cat([f[:, :1], f], 1)


def test_eval_video_scores_frame_t_against_mask_t():
    """An object moving 8 px per frame, propagated perfectly by colour: J near 1 (only bilinear
    rounding of the corners) when each frame's prediction is compared with that frame's mask; a
    frame off by one would give J = 1/3."""
    T, H, W = 5, 32, 64
    frames, masks = [], []
    for t in range(T):
        img = np.full((H, W, 3), (30, 60, 90), np.uint8)
        m = np.zeros((H, W), np.uint8)
        m[8:24, 4 + 8 * t:20 + 8 * t] = 1
        img[m == 1] = (250, 20, 20)
        frames.append(__import__("PIL.Image", fromlist=["Image"]).fromarray(img))
        masks.append(m)
    _, per_obj = V.evaluate_video(ColourEncoder(), frames, masks, V.Args(topk=1, radius=20), 0, torch.device("cpu"))
    j, f = per_obj[1]
    assert j > 0.95 and f > 0.95, (j, f)


@pytest.mark.parametrize("method,clip", [("msn", 3.0), ("conmim", 1.0), ("cmae", 0.0), ("can", 0.0), ("siammae", 0.0)])
def test_each_loop_clips_at_its_recipe_max_norm(tmp_path, monkeypatch, method, clip):
    """The loop's optimiser step clips at the official max norm (MSN 3 over encoder + head, not the
    prototypes; ConMIM 1 over the student; the MAE-style recipes do not clip) and steps every
    parameter of the optimiser."""
    calls, real = [], C.optimizer_step

    def spy(run, opt, params, max_norm=0.0):
        params = list(params)
        calls.append((max_norm, {id(p) for p in params}, {id(p) for g in opt.param_groups for p in g["params"]}))
        return real(run, opt, params, max_norm)
    monkeypatch.setattr(C, "optimizer_step", spy)
    mod, make = {"msn": (msn, msn_args), "conmim": (conmim, conmim_args), "cmae": (cmae, cmae_args),
                 "can": (can, can_args), "siammae": (siammae, siammae_args)}[method]
    mod.train(make(tmp_path, stop_step=1))
    assert len(calls) == 1
    max_norm, clipped, stepped = calls[0]
    assert max_norm == clip
    assert clipped <= stepped and len(stepped - clipped) == (1 if method == "msn" else 0)   # MSN: the prototypes
