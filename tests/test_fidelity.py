"""Fidelity to the official code (issue: line-by-line comparison): ConMIM's deterministic teacher and
bias-free projector over all tokens, CMAE's non-shared decoders, the untruncated blur, each method's
initialisation and weight-decay groups, SiamMAE's MAE-ST epoch / lr convention."""
import json
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from PIL import Image

import can
import cmae
import common as C
import gpu_aug as GA
import conmim
import msn
import siammae
from test_can import tiny_args as can_args
from test_cmae import tiny_args as cmae_args
from test_conmim import tiny_args as conmim_args
from test_msn import tiny_args as msn_args
from test_siammae import tiny_args as siammae_args


# ---------------------------------------------------------------------------------------------
# ConMIM
# ---------------------------------------------------------------------------------------------
def test_conmim_pretraining_drop_path_is_zero_and_teacher_is_deterministic_in_train_mode():
    assert conmim.Args().drop_path == 0.0                   # official pre-training: --drop_path 0
    model = conmim.Net(conmim_args("/tmp/unused", drop_path=0.5))
    teacher = conmim.make_teacher(model).train()
    x = torch.randn(4, 3, 16, 16)
    torch.testing.assert_close(teacher(x), teacher(x), rtol=0, atol=0)
    assert all(b.drop_path == 0 for b in teacher.encoder.blocks)
    model.train()                                            # the student keeps its drop path
    assert not torch.allclose(model(x), model(x))


def test_conmim_projector_has_no_bias_and_sees_the_cls_token():
    """modeling_pretrain.py: (Linear no bias, BN, ReLU) x 2, Linear no bias, BN(affine=False); over every token."""
    model = conmim.Net(conmim_args("/tmp/unused"))
    assert [type(m) for m in model.projector.mlp] == [nn.Linear, nn.BatchNorm1d, nn.ReLU] * 2 + [nn.Linear,
                                                                                                 nn.BatchNorm1d]
    assert model.projector.mlp[1].affine and not model.projector.mlp[-1].affine
    assert all(m.bias is None for m in model.projector.modules() if isinstance(m, nn.Linear))
    seen = []
    model.projector.register_forward_hook(lambda m, inp, out: seen.append(inp[0].shape))
    out = model(torch.randn(2, 3, 16, 16))
    assert seen == [(2, 17, 64)] and out.shape == (2, 16, 16)   # 1 + N tokens in, N patch features out
    assert "mask_token" not in model.encoder.state_dict()     # training-only: lives in Net


# ---------------------------------------------------------------------------------------------
# CMAE
# ---------------------------------------------------------------------------------------------
def test_cmae_decoders_share_no_parameter():
    model = cmae.CMAE(cmae_args("/tmp/unused"))
    pix = {id(p) for p in model.pixel_decoder.parameters()}
    feat = {id(p) for p in model.feature_decoder.parameters()}
    assert pix and feat and not pix & feat
    for dec in (model.pixel_decoder, model.feature_decoder):  # each has its own embedding and [M] token
        assert isinstance(dec.embed, nn.Linear) and dec.mask_token.shape == (1, 1, 32)
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.startswith(("decoder_embed", "mask_token")) for n in names)


# ---------------------------------------------------------------------------------------------
# Blur: untruncated at every size, CPU (PIL) and batched
# ---------------------------------------------------------------------------------------------
def _impulse_variance(img):                                  # (H, W) float -> horizontal 2nd moment
    w = img.sum(0)
    x = torch.arange(len(w), dtype=torch.float64) - len(w) // 2
    return float((w * x ** 2).sum() / w.sum())


@pytest.mark.parametrize("size", [96, 224])
def test_blur_is_not_truncated(size):
    a = np.zeros((size, size, 3), np.uint8)
    a[size // 2, size // 2] = 255
    pil = C.GaussianBlur(p=1.0, sigma=(2.0, 2.0))(Image.fromarray(a))
    assert abs(_impulse_variance(torch.from_numpy(np.asarray(pil)[..., 0].astype(np.float64))) - 4.0) < 0.2
    x = torch.zeros(1, 3, size, size)
    x[..., size // 2, size // 2] = 1
    k = GA.blur_taps(size=size)
    assert k >= 2 * 3 * 2 + 1                                 # +-3 sigma for sigma 2
    y = GA.blur_batch(x, torch.tensor([2.0]), k)[0, 0].double()
    assert abs(_impulse_variance(y) - 4.0) < 0.1              # 9 taps (old 10% rule at 96 px): 3.43


def test_color_augment_blurs_with_the_recipe_sigma_distribution():
    """Through the whole photometric pipeline (jitter and grey off): the mean impulse-response variance
    is E[sigma^2] for sigma ~ U[0.1, 2], about 1.40, on a 96 px focal view."""
    tf = C.color_augment(p_jitter=0.0, p_gray=0.0, p_blur=1.0)
    a = np.zeros((96, 96, 3), np.uint8)
    a[40:56, 40:56] = 255                                   # a block: uint8 keeps its tails
    base = _impulse_variance(torch.from_numpy(a[..., 0].astype(np.float64)))
    torch.manual_seed(0)
    v = [_impulse_variance(torch.from_numpy(np.asarray(tf(Image.fromarray(a)))[..., 0].astype(np.float64))) - base
         for _ in range(300)]
    expected = (2.0 ** 3 - 0.1 ** 3) / (3 * 1.9)
    assert abs(np.mean(v) - expected) < 0.07 * expected, (np.mean(v), expected)


# ---------------------------------------------------------------------------------------------
# Initialisation
# ---------------------------------------------------------------------------------------------
def _xavier_bound(w):
    fan_out, fan_in = w.shape[0], w[0].numel()
    return math.sqrt(6 / (fan_in + fan_out))


def test_conmim_uses_beit_init():
    torch.manual_seed(0)
    model = conmim.Net(conmim_args("/tmp/unused", model="micro"))
    enc = model.encoder
    assert not enc.rel_pos_bias.relative_position_bias_table.any()   # official: zeros (its trunc_normal_ commented out)
    assert all(not (b.attn.q_bias.any() or b.attn.v_bias.any()) for b in enc.blocks)
    for t in (enc.patch_embed.proj.weight, enc.cls_token, model.mask_token,
              enc.blocks[0].attn.qkv.weight, model.projector.mlp[0].weight):
        assert 0.9 * 0.02 < t.abs().max() <= 0.02 + 1e-7     # trunc-normal(0.02) cut at +-1 std (not zeros)
    for layer, blk in enumerate(enc.blocks, start=1):        # fix_init_weight
        for w in (blk.attn.proj.weight, blk.mlp.fc2.weight):
            assert w.abs().max() <= 0.02 / math.sqrt(2 * layer) + 1e-7
            assert w.abs().max() > 0.9 * 0.02 / math.sqrt(2 * layer)


@pytest.mark.parametrize("build", [lambda: cmae.CMAE(cmae_args("/tmp/unused", model="micro")),
                                   lambda: can.CAN(can_args("/tmp/unused", model="micro")),
                                   lambda: siammae.SiamMAE(siammae_args(model="micro"))])
def test_mae_family_uses_xavier_init(build):
    model = build()
    for w in (model.encoder.blocks[0].attn.qkv.weight, model.encoder.blocks[1].mlp.fc1.weight,
              model.encoder.patch_embed.proj.weight):
        bound = _xavier_bound(w)
        assert w.abs().max() <= bound and w.std() > 0.5 * bound  # uniform(-b, b): std b/sqrt(3)
    assert abs(model.encoder.cls_token.std() - 0.02) < 0.01


@pytest.mark.parametrize("build,parts", [
    (lambda: cmae.CMAE(cmae_args("/tmp/unused", model="micro")), ("pixel_decoder", "feature_decoder")),
    (lambda: can.CAN(can_args("/tmp/unused", model="micro")), ("",)),              # MAE: the whole model
    (lambda: siammae.SiamMAE(siammae_args(model="micro")), ("",))], ids=["cmae", "can", "siammae"])
def test_mae_family_decoders_are_xavier_initialised(build, parts):
    """The decoders (and, where the official code applies it to the whole model, every other Linear):
    xavier-uniform weights, zero biases; their [M] tokens normal(0.02)."""
    model = build()
    for part in parts:
        sub = model.get_submodule(part)
        linears = [m for m in sub.modules() if isinstance(m, nn.Linear)]
        assert len(linears) >= 4
        for m in linears:
            bound = _xavier_bound(m.weight)
            assert m.weight.abs().max() <= bound and m.weight.std() > 0.5 * bound
            assert m.bias is None or not m.bias.any()
        token = sub.mask_token
        assert abs(token.std() - 0.02) < 0.01


@pytest.mark.parametrize("build", [lambda: msn.MSN(msn_args("/tmp/unused")),
                                   lambda: cmae.CMAE(cmae_args("/tmp/unused")),
                                   lambda: conmim.Net(conmim_args("/tmp/unused")),
                                   lambda: can.CAN(can_args("/tmp/unused")),
                                   lambda: siammae.SiamMAE(siammae_args())],
                         ids=["msn", "cmae", "conmim", "can", "siammae"])
def test_every_layernorm_has_eps_1e_6(build):
    """partial(nn.LayerNorm, eps=1e-6) in every official encoder and decoder (timm's ViT default too)."""
    norms = [m for m in build().modules() if isinstance(m, nn.LayerNorm)]
    assert norms and all(m.eps == 1e-6 for m in norms)


def test_cmae_heads_keep_pytorch_default_init_and_bn_eps():
    model = cmae.CMAE(cmae_args("/tmp/unused", model="micro", proj_hidden=256))
    w = model.projector[0].weight                            # kaiming_uniform(a=sqrt 5): bound 1/sqrt(fan_in)
    assert w.abs().max() <= 1 / math.sqrt(w.shape[1]) and w.abs().max() > 0.9 / math.sqrt(w.shape[1])
    assert all(m.eps == 1e-6 for m in model.modules() if isinstance(m, nn.BatchNorm1d))


def test_msn_patch_embedding_is_kaiming_normal():
    """kaiming-normal fan_in (std sqrt(2 / (3 p p))): MSN, and SiamMAE's --weight-init trunc (DeiT's)."""
    for w in (msn.MSN(msn_args("/tmp/unused", model="micro")).net.encoder.patch_embed.proj.weight,
              siammae.SiamMAE(siammae_args(model="micro", weight_init="trunc")).encoder.patch_embed.proj.weight):
        assert abs(w.std().item() - math.sqrt(2 / w[0].numel())) < 0.1 * math.sqrt(2 / w[0].numel())


# ---------------------------------------------------------------------------------------------
# Weight-decay groups
# ---------------------------------------------------------------------------------------------
def _groups(model, no_decay=C.no_decay_1d):
    opt = C.make_optimizer(model, 1e-3, 0.05, (0.9, 0.95), torch.device("cpu"), no_decay)
    names = {id(p): n for n, p in model.named_parameters()}
    return ({names[id(p)] for p in opt.param_groups[0]["params"]},
            {names[id(p)] for p in opt.param_groups[1]["params"]})


def test_weight_decay_groups_follow_each_official_code():
    decay, skip = _groups(conmim.Net(conmim_args("/tmp/unused")), conmim.no_decay)
    assert {"mask_token", "encoder.rel_pos_bias.relative_position_bias_table"} <= decay   # 2-d: decayed (official)
    assert {"encoder.cls_token", "encoder.blocks.0.gamma_1", "encoder.blocks.0.attn.q_bias",
            "encoder.blocks.0.attn.v_bias"} <= skip
    model = cmae.CMAE(cmae_args("/tmp/unused"))
    decay, skip = _groups(model, cmae.no_decay_rule(model))
    assert {"projector.1.weight", "predictor.1.weight"} <= decay      # BatchNorm weights: decayed
    assert {"encoder.cls_token", "pixel_decoder.mask_token", "feature_decoder.mask_token",
            "encoder.norm.weight", "pixel_decoder.norm.weight", "projector.1.bias"} <= skip
    for model in (can.CAN(can_args("/tmp/unused")), siammae.SiamMAE(siammae_args())):
        decay, skip = _groups(model)                                    # timm add_weight_decay
        assert {"encoder.cls_token", "mask_token"} <= decay and "encoder.norm.weight" in skip
    decay, skip = _groups(msn.MSN(msn_args("/tmp/unused")), msn.no_decay)
    assert {"net.encoder.pos_embed", "net.encoder.cls_token"} <= decay and "prototypes" in skip


# ---------------------------------------------------------------------------------------------
# SiamMAE: MAE-ST convention
# ---------------------------------------------------------------------------------------------
def test_siammae_epochs_count_passes_times_R_and_lr_scales_with_videos(tmp_path):
    a = siammae_args(tmp_path, epochs=4, repeated_sampling=2, steps_per_epoch=2, warmup_epochs=0, blr=0.256,
                     batch_size=4)
    siammae.train(a)
    ckpt = C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "siammae")
    assert ckpt["epoch"] == 2 and ckpt["step"] == 4           # 4 effective epochs = 2 passes of R = 2
    recs = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert math.isclose(recs[0]["lr"], 0.256 * 4 / 256)       # videos per step, not pairs (x R = 8)


# ---------------------------------------------------------------------------------------------
# Heads and decoders, written out from each official module
# ---------------------------------------------------------------------------------------------
def test_msn_head_projects_the_normed_cls_token_and_prototypes_are_uniform():
    """msn_train.py init_model: fc1-bn1-gelu1-fc2-bn2-gelu2-fc3 on deit.py's norm(x)[:, 0]; prototypes
    U(-1/sqrt(d), 1/sqrt(d))."""
    a = msn_args("/tmp/unused", head_dim=64, num_prototypes=1024)
    model = msn.MSN(a).eval()
    head = model.net.head
    assert [type(m) for m in head] == [nn.Linear, nn.BatchNorm1d, nn.GELU] * 2 + [nn.Linear]
    assert all(m.approximate == "none" for m in head if isinstance(m, nn.GELU))
    x = torch.randn(4, 3, 16, 16)
    torch.testing.assert_close(model.net(x), head(model.net.encoder(x)[:, 0]))
    b, P = 64 ** -0.5, model.prototypes
    assert P.abs().max() <= b and P.abs().max() > 0.99 * b and abs(P.std().item() - b / math.sqrt(3)) < 0.02 * b


def test_cmae_decoders_heads_and_feature_branch_written_out():
    """Each decoder: embed, [M] tokens into the masked slots (unshuffled), + sin-cos table, blocks, norm,
    linear; u = predictor(projector(mean of the feature decoder's patch tokens)); the heads are
    Linear-BN-ReLU-Linear(no bias) (NonLinearNeck); the [M] tokens normal(0.02)."""
    model = cmae.CMAE(cmae_args("/tmp/unused")).eval()
    x = torch.randn(4, 3, 16, 16)
    ids_keep, ids_restore, _ = cmae.random_masking(4, 4, 0.5, 2)
    latent = model.encoder(x, ids_keep)
    for dec in (model.pixel_decoder, model.feature_decoder):
        t = cmae.restore_tokens(dec.embed(latent), dec.mask_token, ids_restore) + cmae.sincos_pos_embed(32, 4)
        for blk in dec.blocks:
            t = blk(t)
        torch.testing.assert_close(dec(latent, ids_restore), dec.out(dec.norm(t)))
    pred, u = model(x, ids_keep, ids_restore)
    torch.testing.assert_close(pred, model.pixel_decoder(latent, ids_restore)[:, 1:])
    y_s = model.feature_decoder(latent, ids_restore)[:, 1:].mean(1)
    torch.testing.assert_close(u, model.predictor(model.projector(y_s)))
    for head in (model.projector, model.predictor):
        assert [type(m) for m in head] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
        assert head[0].bias is not None and head[3].bias is None
    tok = cmae.Decoder(32, 4, 2048, 0, 2, 8).mask_token
    assert abs(tok.std().item() - 0.02) < 0.002


def test_can_forward_written_out():
    """u = projector(mean of the visible patch tokens), projector Linear-BN-ReLU-Linear; the decoder input
    is embed + [M] tokens (unshuffled) + sin-cos table + MLP(sinusoid(1000 sigma)) on every token;
    sinusoid = [sin(s w_k), cos(s w_k)], w_k = 10000^(-k / half)."""
    model = can.CAN(can_args("/tmp/unused")).eval()
    assert [type(m) for m in model.projector] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    x, sigma = torch.randn(4, 3, 16, 16), torch.tensor([0.0, 0.1, 0.3, 0.75])
    ids_keep, ids_restore, _ = can.random_masking(4, 4, 0.5)
    latent = model.encoder(x, ids_keep)
    s = 1000 * sigma[:, None] * 10000 ** (-torch.arange(16.0) / 16)
    torch.testing.assert_close(can.sinusoid(1000 * sigma, 32), torch.cat([s.sin(), s.cos()], 1))
    t = can.restore_tokens(model.decoder_embed(latent), model.mask_token, ids_restore) + can.sincos_pos_embed(32, 4)
    t = t + model.noise_embed.mlp(torch.cat([s.sin(), s.cos()], 1))[:, None]
    for blk in model.decoder:
        t = blk(t)
    pred, u = model(x, sigma, ids_keep, ids_restore)
    torch.testing.assert_close(u, model.projector(latent[:, 1:].mean(1)))
    torch.testing.assert_close(pred, model.decoder_pred(model.decoder_norm(t))[:, 1:])


def test_siammae_forward_written_out():
    """f1 whole and f2's visible patches through the shared encoder, each embedded and given the decoder's
    sin-cos table (f2 with [M] tokens, unshuffled); every block: f2 cross-attends to f1, then self, then MLP."""
    model = siammae.SiamMAE(siammae_args()).eval()
    f1, f2 = torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16)
    ids_keep, ids_restore, _ = siammae.random_masking(2, 4, 0.5)
    pe = siammae.sincos_pos_embed(32, 4)
    h1 = model.decoder_embed(model.encoder(f1)) + pe
    x = siammae.restore_tokens(model.decoder_embed(model.encoder(f2, ids_keep)), model.mask_token, ids_restore) + pe
    for blk in model.blocks:
        x = x + blk.cross(blk.norm_x(x), blk.norm_ctx(h1))
        x = x + blk.attn(blk.norm_sa(x))
        x = x + blk.mlp(blk.norm_mlp(x))
    torch.testing.assert_close(model(f1, f2, ids_keep, ids_restore), model.pred(model.norm(x))[:, 1:])
