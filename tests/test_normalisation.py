"""--mean / --std: a run normalises its pixels with them, keeps them in its checkpoint and in --export's
config.json, and every evaluation reads them back from the file (ImageNet's for files that do not say);
scripts/mean_std.py measures a folder's."""
import json
import os

import numpy as np
import torch
from PIL import Image

import can
import common as C
import eval_finetune as FT
import eval_linear as E
import harness as H
import weights as W
from helpers import run_cli

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)


def test_normalize_uses_the_mean_and_std_in_force():
    x = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    C.set_mean_std(MEAN, STD)
    want = (x.float() / 255 - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)
    torch.testing.assert_close(C.normalize(x), want)
    import gpu_aug
    torch.testing.assert_close(gpu_aug._normalize(x.float() / 255), want)       # the batched colour path's
    C.set_mean_std()
    want = (x.float() / 255 - torch.tensor(C.IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(C.IMAGENET_STD).view(3, 1, 1)
    torch.testing.assert_close(C.normalize(x), want)


def test_a_runs_mean_and_std_reach_its_network_its_checkpoint_its_export_and_every_evaluation(tmp_path, monkeypatch):
    """Trained with --mean / --std: the encoder's input is (x - mean) / std in training; the checkpoint's args
    and the export's config.json hold them; an evaluation that reads either file gives the encoder's features of
    the images normalised with them (not ImageNet's), even after another file set other values."""
    seen = []
    real = C.normalize
    monkeypatch.setattr(C, "normalize", lambda x: (seen.append(tuple(C.MEAN_STD[0])), real(x))[1])
    out = tmp_path / "run"
    can.train(H.parse_args(can.Args, [
        "--data", "synthetic", "--output-dir", str(out), "--model", "nano", "--patch-size", "4", "--img-size", "16",
        "--epochs", "1", "--steps-per-epoch", "1", "--batch-size", "8", "--decoder-dim", "16", "--decoder-depth", "1",
        "--decoder-heads", "2", "--proj-hidden", "16", "--proj-dim", "8", "--workers", "0", "--no-knn",
        "--device", "cpu", "--mean", *map(str, MEAN), "--std", *map(str, STD)]))
    assert seen and set(seen) == {MEAN}                                 # every normalisation of the run
    ckpt = str(out / "checkpoint.pth")
    c = C.load_checkpoint(ckpt)
    assert (tuple(c["args"]["mean"]), tuple(c["args"]["std"])) == (MEAN, STD)
    E.evaluate(E.Args(ckpt=ckpt, export=str(tmp_path / "export")))
    config = json.load(open(tmp_path / "export" / "config.json"))
    assert (tuple(config["mean"]), tuple(config["std"])) == (MEAN, STD)
    folder = tmp_path / "imgs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    x = torch.stack([E.eval_transform(16)(Image.open(folder / f"{i}.png")) for i in range(2)])   # its preprocessing
    for path in (ckpt, str(tmp_path / "export")):
        C.set_mean_std()                                                 # another file's (ImageNet) in force
        res = E.evaluate(E.Args(ckpt=path, data=str(folder), mode="embed", output=str(tmp_path / "f"), workers=0,
                                device="cpu"))
        assert res["images"] == 2
        enc, rec = W.load_encoder(path)
        C.set_mean_std()
        xn = (x.float() / 255 - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)
        with torch.no_grad():
            want = E.features_of(enc, xn, W.pool_of(rec))
        np.testing.assert_allclose(np.load(tmp_path / "f" / "features.npy"), want.numpy(), atol=1e-5)
    assert W.mean_std({"args": {"seed": 0}}) == (C.IMAGENET_MEAN, C.IMAGENET_STD)   # a foreign file: ImageNet's
    C.set_mean_std()
    seen.clear()
    FT.finetune(FT.Args(ckpt=ckpt, data="synthetic", output_dir=str(tmp_path / "ft"), epochs=1, steps_per_epoch=1,
                        batch_size=8, warmup_epochs=0, blr=1e-3, workers=0, eval_batch=500, device="cpu"))
    assert set(seen) == {MEAN}                                          # fine-tuning normalises as it pre-trained
    assert tuple(C.load_checkpoint(str(tmp_path / "ft" / "checkpoint.pth"))["args"]["mean"]) == MEAN
    seen.clear()                                                        # values given win, ImageNet's too
    FT.finetune(FT.Args(ckpt=ckpt, data="synthetic", output_dir=str(tmp_path / "ft2"), epochs=1, steps_per_epoch=1,
                        batch_size=8, warmup_epochs=0, blr=1e-3, workers=0, eval_batch=500, device="cpu",
                        mean=C.IMAGENET_MEAN, std=C.IMAGENET_STD))
    assert set(seen) == {C.IMAGENET_MEAN}


def test_bad_mean_or_std_is_one_line(tmp_path):
    for flags, needle in [(["--std", "0.2", "0", "0.2"], "std > 0"), (["--mean", "0.5", "0.5"], "--mean")]:
        r = run_cli("can.py", "--data", "synthetic", "--output-dir", str(tmp_path / "o"), "--stop-step", "1",
                    "--device", "cpu", *flags)
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and needle in r.stderr, r.stderr


def test_mean_std_script_measures_a_folders_pixels(tmp_path):
    """scripts/mean_std.py: every pixel of the images pooled, per channel, printed as the flags."""
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (8, 6, 3), dtype=np.uint8) for _ in range(3)]
    os.makedirs(tmp_path / "a" / "cls")
    for i, a in enumerate(arrays):
        Image.fromarray(a).save(tmp_path / "a" / "cls" / f"{i}.png")
    px = np.concatenate([a.reshape(-1, 3) for a in arrays]) / 255
    r = run_cli("scripts/mean_std.py", str(tmp_path / "a"))
    got = r.stdout.split()
    assert got[0] == "--mean" and got[4] == "--std"
    np.testing.assert_allclose([float(v) for v in got[1:4]], px.mean(0), atol=1e-4)
    np.testing.assert_allclose([float(v) for v in got[5:8]], px.std(0), atol=1e-4)
