"""scripts/eval_correspondence.py and the synthetic clips' ground-truth motion: oracles with known answers
(a translated textured frame: its raw pixels find every source, noise finds ~chance, "no motion" none),
the truth itself (f1 warped by it reproduces f2), and a run on a tiny SiamMAE checkpoint."""
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import common as C
import harness as H
import eval_correspondence as EC
import synthetic as S


def test_warping_f1_by_the_true_motion_reproduces_f2():
    """SyntheticClip.source is the motion the clip renders: f1 sampled at each f2 pixel's source equals
    f2 except at occlusion boundaries (median |error| < 0.01 of the grey range, vs ~0.05-0.1 for 'no
    motion' on moving pixels)."""
    for i in range(4):
        clip = S.SyntheticClip(i, "val")
        f1, f2 = (np.asarray(clip.load(t))[..., 0] / 255.0 for t in (3, 11))
        src, ids = clip.source(3, 11)
        grid = torch.tensor(src / ((clip.size - 1) / 2) - 1, dtype=torch.float32)[None]
        warped = F.grid_sample(torch.tensor(f1, dtype=torch.float32)[None, None], grid, align_corners=True)[0,
                                                                                                            0].numpy()
        inside = ((src >= 0) & (src <= clip.size - 1)).all(-1)
        assert np.median(np.abs(warped - f2)[inside]) < 0.01
        moved = np.hypot(*(src - np.stack(np.meshgrid(np.arange(64), np.arange(64)), -1)).transpose(2, 0, 1)) > 2
        assert np.median(np.abs(f1 - f2)[inside & moved]) > 3 * np.median(np.abs(warped - f2)[inside & moved])
    assert ids.max() >= 1 and (src[ids == 0] != src[ids == 1].mean(0)).any()


def test_background_moves_with_the_drift_and_objects_with_their_centre():
    clip = S.SyntheticClip(0, "val")
    src, ids = clip.source(0, 5)
    px = np.stack(np.meshgrid(np.arange(64.0), np.arange(64.0)), -1)
    drift = np.array(clip.bg[3]) * 5 * 63 / 2                          # 5 frames of drift, in pixels
    np.testing.assert_allclose((src - px)[ids == 0], np.broadcast_to(drift, (int((ids == 0).sum()), 2)), atol=1e-9)
    o = clip.objs[0]
    c = [np.clip(o["p0"] + o["vel"] * t, -0.8, 0.8) for t in (0, 5)]
    if o["w"] == 0 or not (ids == 1).any():
        return
    centre = (np.array(c[1]) + 1) * 63 / 2                             # the centre's source is the old centre
    near = np.linalg.norm(px - centre, axis=-1) < 1.0
    if (near & (ids == 1)).any():
        np.testing.assert_allclose(src[near & (ids == 1)].mean(0), (np.array(c[0]) + 1) * 63 / 2, atol=1.0)


def shifted_pair(shift=(2, 1), p=4, g=8, seed=0):
    """A random texture and the same texture translated by `shift` patches (x, y), with its truth."""
    rng = np.random.default_rng(seed)
    big = rng.random((3, (g + 4) * p, (g + 4) * p)).astype(np.float32)
    dx, dy = shift
    f1 = big[:, 2 * p:(g + 2) * p, 2 * p:(g + 2) * p]
    f2 = big[:, (2 - dy) * p:(g + 2 - dy) * p, (2 - dx) * p:(g + 2 - dx) * p]   # f2 at x = f1 at x - shift
    px = np.stack(np.meshgrid(np.arange(g * p, dtype=float), np.arange(g * p, dtype=float)), -1)
    src = px - np.array([dx, dy]) * p
    truth, obj = EC.patch_truth(src, np.zeros((g * p, g * p), int), p)
    return torch.tensor(f1), torch.tensor(f2), truth, obj


def raw_patches(f, p):
    C_, H, W = f.shape
    return f.view(C_, H // p, p, W // p, p).permute(1, 3, 0, 2, 4).reshape((H // p) * (W // p), -1)


def test_oracle_features_find_every_source_noise_finds_chance_and_no_motion_none():
    p, g = 4, 8
    f1, f2, truth, obj = shifted_pair((2, 1), p, g)
    assert not obj.any()
    own = np.arange(g * g)
    np.testing.assert_allclose(truth, np.stack([own % g, own // g], 1) - np.array([2, 1]))
    inside = (truth > -0.5).all(1) & (truth < g - 0.5).all(1)
    assert inside.sum() == (g - 2) * (g - 1)
    choice = EC.nearest(raw_patches(f1, p), raw_patches(f2, p)).numpy()
    assert EC.accuracy(choice, truth, (g, g), inside) == 1.0                    # raw pixels: exact matches
    assert EC.accuracy(own, truth, (g, g), inside) == 0.0                       # "no motion": 2 patches off
    torch.manual_seed(0)
    accs = [EC.accuracy(EC.nearest(torch.randn(g * g, 32), torch.randn(g * g, 32)).numpy(), truth, (g, g), inside)
            for _ in range(50)]
    assert abs(np.mean(accs) - 9 / 64) < 0.03                                   # ~3x3 of 64 cells (fewer at borders)


def test_accuracy_counts_one_patch_either_way():
    truth = np.array([[3.0, 3.0], [3.4, 2.6]])
    for c, ok in ((3 * 8 + 3, 1.0), (4 * 8 + 4, 1.0), (5 * 8 + 3, 0.0), (3 * 8 + 5, 0.0)):
        assert EC.accuracy(np.array([c]), truth[:1], (8, 8), np.array([True])) == ok
    assert EC.accuracy(np.array([1 * 8 + 3]), truth[1:], (8, 8), np.array([True])) == 0.0   # 1.6 rows off


@pytest.fixture(scope="module")
def tiny_siammae(tmp_path_factory):
    import siammae
    out = tmp_path_factory.mktemp("sm")
    siammae.train(siammae.Args(data="synthetic", output_dir=str(out), model="nano", patch_size=8, img_size=64,
                               epochs=2, steps_per_epoch=1, batch_size=4, warmup_epochs=0, decoder_dim=16,
                               decoder_depth=1, decoder_heads=2, workers=0))
    return str(out / "checkpoint.pth")


def test_cross_attention_hook_leaves_the_forward_unchanged(tiny_siammae):
    import siammae
    model, a = EC.load_model(tiny_siammae)
    f1, f2 = torch.randn(2, 3, 64, 64), torch.randn(2, 3, 64, 64)
    ids_keep, ids_restore, _ = siammae.random_masking(2, 8, a.mask_ratio)
    pred, attn = EC.cross_attention(model, f1, f2, ids_keep, ids_restore)
    with torch.no_grad():
        torch.testing.assert_close(pred, model(f1, f2, ids_keep, ids_restore))
    assert attn.shape == (2, 65, 65)
    torch.testing.assert_close(attn.sum(-1), torch.ones(2, 65))
    assert not model.blocks[0].cross._forward_hooks                             # removed


def test_evaluate_reports_every_measure_for_trained_and_random_init(tiny_siammae, tmp_path):
    rows = EC.evaluate(EC.Args(ckpt=tiny_siammae, gaps=(4,), videos=2, pairs=1, device="cpu",
                               output=str(tmp_path / "c.jsonl")))
    r = rows[0]
    for k in ("acc_enc_obj", "acc_enc_bg", "acc_attn_obj", "acc_attn_bg", "acc_zero_obj", "acc_zero_bg",
              "loss_model_obj", "loss_other_f1_obj", "loss_blank_f1_obj", "loss_mean_obj", "loss_const_obj",
              "loss_copy_obj", "loss_oracle_obj"):
        assert r[k] is not None and not (isinstance(r[k], float) and math.isnan(r[k])), k
    assert r["loss_oracle_bg"] < r["loss_copy_bg"]                              # the true motion explains f2
    assert json.loads(open(tmp_path / "c.jsonl").readline()) == r
    rand = EC.evaluate(EC.Args(ckpt=tiny_siammae, gaps=(4,), videos=2, pairs=1, device="cpu", random_init=True))[0]
    assert rand["acc_zero_bg"] == r["acc_zero_bg"] and rand["loss_copy_obj"] == r["loss_copy_obj"]
    assert rand["loss_model_obj"] != r["loss_model_obj"]


def test_gaps_takes_one_or_more_values():
    """--gaps 8 16 24 (a fixed two-value tuple refused a third gap)."""
    assert H.parse_args(EC.Args, ["--ckpt", "x", "--gaps", "8", "16", "24"]).gaps == (8, 16, 24)
    assert H.parse_args(EC.Args, ["--ckpt", "x", "--gaps", "6"]).gaps == (6,)
    assert H.parse_args(EC.Args, ["--ckpt", "x"]).gaps == (4, 8)


def test_the_constant_baseline_is_the_mean_training_target_and_colour_clips_defeat_it():
    """"const" predicts the mean norm-pix target of training clips everywhere: the MSE-optimal constant on
    them. On grey clips every flat patch had one target (a constant matched the trained loss); the
    clips are coloured now, so flat patches of two objects have different targets."""
    import siammae
    x = torch.stack([C.to_uint8(S.SyntheticClip(i, "train").load(t)) for i in range(2) for t in (0, 8, 16, 24)])
    targets = siammae.norm_pix(siammae.patchify(C.normalize(x), 4)).flatten(0, 1)          # (N, 48)
    c = EC.mean_target(4, clips=2)
    torch.testing.assert_close(c, targets.mean(0))
    mse = lambda v: ((targets - v) ** 2).mean().item()                                     # noqa: E731
    assert all(mse(c) < mse(c + 0.05 * torch.eye(48)[j]) for j in range(0, 48, 7))
    clip = next(S.SyntheticClip(i) for i in range(50) if len(S.SyntheticClip(i).objs) >= 2)
    img, ids = clip._render(0)
    assert img.ndim == 3 and not np.allclose(img[..., 0], img[..., 1])                     # colour frames
    flat = [siammae.norm_pix(siammae.patchify(C.normalize(torch.tensor(np.tile(o["rgb"], (4, 4, 1)).T[None]).float()),
                                              4))
            for o in clip.objs[:2]]
    assert not torch.allclose(flat[0], flat[1], atol=1e-2)
