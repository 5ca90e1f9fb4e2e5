"""cmae.py: both losses against naive transcriptions, pixel-shift geometry, gradients and
stop-gradients, block masks, DDP equivalence with gathered negatives, end to end + resume."""
import math

import pytest
import torch

import cmae
import common as C
import synthetic as S
from ddp import spawn
from helpers import exact_resume, one_line_error, run_cli


def naive_contrastive(u, v, tau):
    """L_c = 2 tau * (1/B) sum_i -log( exp(cos(u_i, v_i)/tau) / sum_j exp(cos(u_i, v_j)/tau) )."""
    B = u.shape[0]
    total = 0.0
    for i in range(B):
        cos = [torch.dot(u[i], v[j]) / (u[i].norm() * v[j].norm()) for j in range(v.shape[0])]
        den = sum(torch.exp(c / tau) for c in cos)
        total = total - torch.log(torch.exp(cos[i] / tau) / den)
    return 2 * tau * total / B


def naive_reconstruction(pred, target, mask):
    num, den = 0.0, 0.0
    for b in range(pred.shape[0]):
        for n in range(pred.shape[1]):
            if mask[b, n] == 1:
                num = num + sum((pred[b, n, k] - target[b, n, k]) ** 2 for k in range(pred.shape[2])) / pred.shape[2]
                den += 1
    return num / den


@pytest.mark.parametrize("B,d,tau", [(4, 3, 0.07), (6, 8, 0.2), (2, 5, 1.0)])
def test_contrastive_loss_matches_naive(B, d, tau):
    g = torch.Generator().manual_seed(B)
    u = torch.randn(B, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, d, generator=g, dtype=torch.float64, requires_grad=True)
    loss = cmae.cmae_contrastive_loss(u, v, tau)
    ref = naive_contrastive(u, v.detach(), tau)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss, u, retain_graph=True)[0], torch.autograd.grad(ref, u)[0])
    loss.backward()
    assert v.grad is None                                          # targets are stop-gradient


@pytest.mark.parametrize("B,N,P", [(2, 4, 3), (3, 9, 12)])
def test_reconstruction_loss_matches_naive(B, N, P):
    pred, target = torch.randn(B, N, P, dtype=torch.float64), torch.randn(B, N, P, dtype=torch.float64)
    _, _, mask = cmae.random_masking(B, int(math.sqrt(N)), 0.5)
    torch.testing.assert_close(cmae.reconstruction_loss(pred, target, mask.double()), naive_reconstruction(pred,
                                                                                                           target,
                                                                                                           mask))
    # visible patches do not matter
    pred2 = pred + (1 - mask.double())[..., None] * 100
    torch.testing.assert_close(cmae.reconstruction_loss(pred2, target, mask.double()),
                               cmae.reconstruction_loss(pred, target, mask.double()))


def test_pixel_shift_views_overlap_where_the_shift_says():
    a = cmae.Args(data="synthetic", img_size=32, master_size=40)
    views = cmae.PixelShiftViews(a, color=False)
    img = S.SyntheticImages().load(3)[0]
    seen = set()
    for i in range(200):
        torch.manual_seed(i)
        src, tgt, (dh, dw) = views(img)
        seen.add((int(dh), int(dw)))
        assert src.shape == tgt.shape == (3, 32, 32) and 0 <= dh < 8 and 0 <= dw < 8
        # target pixel (y, x) is master pixel (y + dh, x + dw) = source pixel (y + dh, x + dw)
        assert torch.equal(src[:, dh:, dw:], tgt[:, :32 - dh, :32 - dw])
    assert {d for d, _ in seen} == {d for _, d in seen} == set(range(8))   # U{0 .. master - img - 1}, each axis
    recoloured = 0
    for i in range(5):
        torch.manual_seed(i)
        s2, t2, _ = cmae.PixelShiftViews(a)(img)                    # colour augmentation (the default) ...
        torch.manual_seed(i)
        s3, t3, _ = views(img)
        assert torch.equal(s2, s3)                                  # ... never on the source
        recoloured += not torch.equal(t2, t3)                       # ... on the target (p 0.8 jitter, 0.2 grey)
    assert recoloured >= 3
    torch.manual_seed(0)
    src, tgt, shift = cmae.PixelShiftViews(cmae.Args(data="synthetic", img_size=32, master_size=32), color=False)(img)
    assert torch.equal(src, tgt) and shift.tolist() == [0, 0]       # --master-size = --img-size: no shift


def tiny_args(tmp, **kw):
    base = dict(data="synthetic", output_dir=str(tmp), model="nano", patch_size=4, img_size=16, master_size=20,
                epochs=2, steps_per_epoch=2, batch_size=8, warmup_epochs=1, decoder_dim=32, decoder_depth=1,
                decoder_heads=2, feature_decoder_depth=1, proj_hidden=32, proj_dim=16, workers=0, log_every=1,
                knn=False)
    base.update(kw)
    return cmae.Args(**base)


def test_gradients_reach_both_decoders_and_heads_not_target():
    a = tiny_args("/tmp/unused")
    model = cmae.CMAE(a)
    target = cmae.Target(model)
    x_s, x_t = torch.randn(8, 3, 16, 16), torch.randn(8, 3, 16, 16)
    ids_keep, ids_restore, mask = cmae.random_masking(8, 4, 0.5, 2)
    pred, u = model(x_s, ids_keep, ids_restore)
    assert pred.shape == (8, 16, 48) and u.shape == (8, 16)
    v = target(x_t)
    loss = cmae.reconstruction_loss(pred, cmae.norm_pix(cmae.patchify(x_s, 4)), mask) + cmae.cmae_contrastive_loss(u, v)
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
    assert all(p.grad is None for p in target.parameters())
    before = [p.clone() for p in target.parameters()]
    cmae.ema_update(target, target.online_params(model), 0.9)
    for b, t, o in zip(before, target.parameters(), target.online_params(model).parameters()):
        torch.testing.assert_close(t, 0.9 * b + 0.1 * o)


def test_target_uses_no_final_norm_and_mean_patch_token():
    a = tiny_args("/tmp/unused")
    model = cmae.CMAE(a)
    target = cmae.Target(model).eval()
    x = torch.randn(3, 3, 16, 16)
    z = target.encoder(x, norm=False)[:, 1:].mean(1)
    torch.testing.assert_close(target(x), target.projector(z))
    assert not torch.allclose(target.encoder(x)[:, 1:].mean(1), z)


def _ddp_worker(rank, world, u, v):
    b = u.shape[0] // world
    u_loc = u[rank * b:(rank + 1) * b].clone().requires_grad_()
    loss = cmae.cmae_contrastive_loss(u_loc, v[rank * b:(rank + 1) * b])
    loss.backward()
    return loss.detach(), u_loc.grad


def test_ddp_two_processes_equal_one_process():
    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 6, generator=g, dtype=torch.float64)
    u1 = u.clone().requires_grad_()
    loss1 = cmae.cmae_contrastive_loss(u1, v)
    loss1.backward()
    (l0, g0), (l1, g1) = spawn(_ddp_worker, u, v)
    torch.testing.assert_close((l0 + l1) / 2, loss1.detach())
    torch.testing.assert_close(torch.cat([g0, g1]) / 2, u1.grad)
    # negatives really come from the other rank: a local-only loss differs
    assert not torch.allclose(cmae.cmae_contrastive_loss(u[:4], v[:4]), l0)


def test_end_to_end_resume_png_and_checkpoint(tmp_path):
    full, _ = exact_resume(cmae.train, tiny_args, tmp_path, "cmae", ("model", "target", "encoder"))
    for k, v in full["encoder"].items():                         # online encoder is evaluated
        assert torch.equal(v, full["model"]["encoder." + k])
    assert (tmp_path / "full" / "recon_ep0001_step000004.png").exists()              # the log's ep 1, step 4
    torch.load(tmp_path / "full" / "checkpoint.pth", weights_only=True)


def test_bad_input(tmp_path):
    tiny = ["--model", "nano", "--patch-size", "4", "--img-size", "16", "--master-size", "20", "--batch-size", "4",
            "--epochs", "1", "--warmup-epochs", "0", "--steps-per-epoch", "1", "--no-knn"]
    one_line_error(run_cli("cmae.py", "--data", str(tmp_path / "nope"), *tiny), "no such directory")
    C.save_checkpoint(str(tmp_path / "checkpoint.pth"), {"method": "msn", "encoder": {}})
    one_line_error(run_cli("cmae.py", "--data", "synthetic", *tiny, "--output-dir", str(tmp_path)), "msn checkpoint")
