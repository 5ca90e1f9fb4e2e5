"""eval_dense.py, the frozen dense probe (linear segmentation on patch tokens, mIoU): exact oracles on generated
folders (a feature that knows each patch's class scores mIoU 100, a constant one predicts the background
everywhere, its pixel accuracy the background rate), the token grid of a non-square image in its own height and
width, DAVIS-2016's masks as object / background, a checkpoint's last-block tokens, bad input in one line."""
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

import common as C
import eval_dense as D
import eval_linear as E
import weights as W
from helpers import run_cli, vit_checkpoint
from test_eval_video import davis2016_folder


def seg_folder(root, n_train=24, n_val=8, h=16, w=24, p=4, seed=0):
    """images/<split>/*.png and masks/<split>/*.png: a red rectangle on whole patches (label 1) over blue noise
    (label 0), non-square (h x w), its place and size drawn per image; returns the val background rate (%)."""
    rng = np.random.default_rng(seed)
    bg = []
    for split, n in (("train", n_train), ("val", n_val)):
        for d in ("images", "masks"):
            os.makedirs(root / d / split)
        for i in range(n):
            gh, gw = h // p, w // p
            y0, x0 = rng.integers(0, gh - 1), rng.integers(0, gw - 1)
            y1, x1 = rng.integers(y0 + 1, gh + 1), rng.integers(x0 + 1, gw + 1)
            lab = np.zeros((h, w), np.uint8)
            lab[y0 * p:y1 * p, x0 * p:x1 * p] = 1
            img = np.stack([lab * 200 + 20, np.full((h, w), 30), (1 - lab) * 180 + 40], -1).astype(np.float64)
            img = np.clip(img + rng.normal(0, 8, img.shape), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(root / "images" / split / f"{i:03d}.png")
            Image.fromarray(lab).save(root / "masks" / split / f"{i:03d}.png")
            if split == "val":
                bg.append((lab == 0).mean())
    return 100 * float(np.mean(bg))


def test_a_feature_that_knows_each_patch_errs_only_at_boundaries_in_a_non_square_grid(tmp_path):
    """Each patch's pixels (colour: the class) as its token, 16 x 24 images, labels on whole patches: every val
    pixel right but those within half a patch of the object's outline (where the bilinear upsampling of patch
    logits decides), so mIoU > 95; only if the tokens are laid out in the image's own height and width (a
    transposed grid misplaces logits far from any outline)."""
    seg_folder(tmp_path / "seg")
    res = D.evaluate(D.Args(pixels=True, patch_size=4, img_size=16, data=str(tmp_path / "seg"), device="cpu",
                            epochs=300, output=str(tmp_path / "pred")))
    assert res["classes"] == 2 and res["train_images"] == 24 and res["val_images"] == 8
    assert res["miou"] > 95 and res["pixel_acc"] > 98
    for i in range(8):
        pred = np.asarray(Image.open(tmp_path / "pred" / f"{i:03d}.png"))
        lab = np.asarray(Image.open(tmp_path / "seg" / "masks" / "val" / f"{i:03d}.png"))
        assert pred.shape == lab.shape == (16, 24)
        edge = np.zeros_like(lab, bool)                               # pixels within 2 px (half a patch) of the outline
        for dy in range(-2, 3):
            for dx in range(-2, 3):
                edge |= np.roll(lab, (dy, dx), (0, 1)) != lab
        assert ((pred != lab) <= edge).all(), i


def test_a_constant_feature_predicts_the_background_everywhere(tmp_path, monkeypatch):
    """Tokens that carry nothing: the head can only learn the majority class, so the pixel accuracy is the val
    background rate and the mIoU that rate over the two classes (the object's IoU 0)."""
    bg = seg_folder(tmp_path / "seg")
    monkeypatch.setattr(D, "patch_tokens", lambda enc, x, p: torch.zeros(x.shape[-2] // p, x.shape[-1] // p, 8))
    res = D.evaluate(D.Args(pixels=True, patch_size=4, img_size=16, data=str(tmp_path / "seg"), device="cpu"))
    assert res["pixel_acc"] == pytest.approx(bg, abs=0.01)
    assert res["miou"] == pytest.approx(bg / 2, abs=0.01) and res["iou"][1] == 0.0


def test_a_checkpoint_is_probed_on_its_last_blocks_normed_patch_tokens_and_davis_2016_is_object_or_background(
        tmp_path):
    """A checkpoint's tokens are its encoder's output after the final norm, [CLS] dropped, row-major (h, w); a
    DAVIS-2016 root fits on train.txt and scores val.txt, its masks' 255 the object (class 1); --img-size
    defaults to the checkpoint's size (frames of 32 px -> 16 on the short side)."""
    ckpt = vit_checkpoint(tmp_path / "c.pth", "cmae")
    enc, _ = W.load_encoder(ckpt)
    x = torch.randint(0, 256, (1, 3, 8, 12), dtype=torch.uint8)
    with torch.no_grad():
        want = enc(C.normalize(x))[0, 1:].view(2, 3, -1)
    assert torch.equal(D.patch_tokens(enc, x, 4), want)
    _, root = davis2016_folder(tmp_path / "d", frames=4, videos=("a", "b"))
    (root / "ImageSets/480p/train.txt").write_text((root / "ImageSets/480p/val.txt").read_text())
    res = D.evaluate(D.Args(ckpt=ckpt, data=str(root), device="cpu", epochs=2))
    assert (res["classes"], res["img_size"], res["train_images"], res["val_images"]) == (2, 16, 8, 8)
    assert 0 <= res["miou"] <= 100
    beit = vit_checkpoint(tmp_path / "b.pth", "conmim", pos_embed="none", rel_pos_bias="shared", qkv_bias="qv",
                          layer_scale=0.1, init="beit")              # ConMIM's BEiT: its bias table resized
    res = D.evaluate(D.Args(ckpt=beit, data=str(root), device="cpu", epochs=2))   # to the frames' 4 x 6 grid
    assert (res["method"], res["img_size"], res["val_images"]) == ("conmim", 16, 8) and 0 <= res["miou"] <= 100


@pytest.mark.parametrize("pool", ["mean", "cls", "cls-prenorm"])
def test_embed_tokens_writes_each_images_patch_tokens(pool, tmp_path, monkeypatch):
    """eval_linear.py --mode embed --tokens: tokens.npy (N, h, w, D), the tokens eval_dense.py probes, beside
    features.npy, the same features as without --tokens, from one pass of the encoder over the images."""
    ckpt = vit_checkpoint(tmp_path / "c.pth", "cmae")
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(3):
        Image.fromarray(np.full((16, 16, 3), 40 * i, np.uint8)).save(folder / f"{i}.png")
    E.evaluate(E.Args(ckpt=ckpt, data=str(folder), mode="embed", pool=pool, output=str(tmp_path / "f"), workers=0,
                      device="cpu"))
    calls = []
    real = W.ViT.forward
    monkeypatch.setattr(W.ViT, "forward", lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1])
    E.evaluate(E.Args(ckpt=ckpt, data=str(folder), mode="embed", pool=pool, tokens=True, output=str(tmp_path / "o"),
                      workers=0, device="cpu"))
    assert len(calls) == 1                                               # 3 images, one batch, one forward
    tok = np.load(tmp_path / "o" / "tokens.npy")
    assert tok.shape == (3, 4, 4, 32)
    np.testing.assert_allclose(np.load(tmp_path / "o" / "features.npy"), np.load(tmp_path / "f" / "features.npy"),
                               atol=1e-6)
    enc, _ = W.load_encoder(ckpt)
    x = C.to_uint8(Image.open(folder / "2.png"))[None]
    np.testing.assert_allclose(tok[2], D.patch_tokens(enc, x, 4).numpy(), atol=1e-5)


def test_bad_dense_input_is_one_line(tmp_path):
    seg_folder(tmp_path / "seg", n_train=2, n_val=1)
    os.remove(tmp_path / "seg" / "masks" / "train" / "001.png")
    r = run_cli("eval_dense.py", "--pixels", "--patch-size", "4", "--img-size", "16", "--data",
                str(tmp_path / "seg"), "--device", "cpu")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "has no label map" in r.stderr
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "seg" / "masks" / "train" / "001.png")
    r = run_cli("eval_dense.py", "--pixels", "--patch-size", "4", "--img-size", "16", "--data",
                str(tmp_path / "seg"), "--device", "cpu")
    assert r.returncode == 2 and "is 8x8 px but its image is 24x16" in r.stderr
    r = run_cli("eval_dense.py", "--data", str(tmp_path / "seg"))
    assert r.returncode == 2 and "--ckpt" in r.stderr
    json.dumps({})
