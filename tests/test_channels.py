"""Images that are not RGB photos: --in-chans 1 (grey images trained as one channel) and N (.npy arrays, TIFF
stacks, N-band images), read by common.read_image, augmented by geometry and per-channel intensity only, trained by
every image method, their checkpoints and exports read back by the evaluations, visualize.py and timm; --init
adapting an RGB patch embedding by timm's adapt_input_conv rule; what is RGB's alone refused by name."""
import importlib
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import common as C
import eval_finetune as FT
import eval_linear as E
import harness as H
import weights as W
from helpers import one_line_error, run_cli
from test_eval_linear import TINY

MEAN4, STD4 = (0.5, 0.4, 0.3, 0.2), (0.25, 0.2, 0.3, 0.1)


def array_folder(root, chans=4, n=3, size=20):
    """train/ and val/ of 2 classes of uint8 (chans, size, size) .npy arrays; class c darkens its channel c."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(2):
            (root / split / f"c{c}").mkdir(parents=True)
            for i in range(n):
                a = rng.integers(0, 256, (chans, size, size), dtype=np.uint8)
                a[c] //= 4
                np.save(root / split / f"c{c}" / f"{i}.npy", a)
    return str(root)


def test_read_image_reads_the_channels_in_force(tmp_path):
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    assert C.read_image(str(tmp_path / "rgb.png")).mode == "RGB"          # 3 channels: the RGB path, as before
    C.set_mean_std(chans=1)                                                # grey: ImageNet's values averaged
    assert C.MEAN_STD == [(0.449,), (0.226,)]
    grey = C.read_image(str(tmp_path / "rgb.png"))                         # a colour image converted
    assert grey.dtype == torch.uint8 and grey.shape == (1, 6, 5)
    np.testing.assert_array_equal(grey[0].numpy(), np.asarray(Image.open(tmp_path / "rgb.png").convert("L")))
    deep = rng.integers(0, 65536, (6, 5), dtype=np.uint16)
    Image.fromarray(deep).save(tmp_path / "deep.png")                      # 16-bit grey keeps its depth
    torch.testing.assert_close(C.read_image(str(tmp_path / "deep.png")), torch.from_numpy(deep / 65535).float()[None])

    C.set_mean_std(MEAN4, STD4)                                            # 4 channels, from len(mean)
    a = rng.integers(0, 256, (4, 6, 5), dtype=np.uint8)
    np.save(tmp_path / "chw.npy", a)
    np.save(tmp_path / "hwc16.npy", (a.transpose(1, 2, 0).astype(np.uint16) * 257))
    np.save(tmp_path / "float.npy", a.astype(np.float32) / 255)
    pages = [Image.fromarray(p) for p in a]
    pages[0].save(tmp_path / "stack.tif", save_all=True, append_images=pages[1:])
    Image.fromarray(a.transpose(1, 2, 0), "RGBA").save(tmp_path / "rgba.png")
    want = torch.from_numpy(a)
    for name in ("chw.npy", "stack.tif", "rgba.png"):
        got = C.read_image(str(tmp_path / name))
        assert got.dtype == torch.uint8 and torch.equal(got, want), name
    for name in ("hwc16.npy", "float.npy"):
        torch.testing.assert_close(C.read_image(str(tmp_path / name)), want.float() / 255)
    np.save(tmp_path / "three.npy", a[:3])
    np.save(tmp_path / "hot.npy", a.astype(np.float32))
    for name, needle in [("three.npy", "--in-chans 4"), ("rgb.png", "--in-chans 4"), ("hot.npy", "[0, 1]")]:
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            C.read_image(str(tmp_path / name))


def test_the_augmentation_of_other_channel_counts_is_geometry_and_per_channel_intensity():
    """With 4 channels a method's colour augmentation holds no RGB operation; brightness scales each channel by
    its own factor and contrast scales each channel's spread about its own mean; solarisation inverts the top
    half of the range, uint8 or float."""
    C.set_mean_std(MEAN4, STD4)
    aug = C.color_augment(p_solarize=0.2)
    kinds = {type(t).__name__ for t in aug.transforms} | {type(t).__name__ for r in aug.transforms
                                                           for t in getattr(r, "transforms", [])}
    assert "ChannelJitter" in kinds and not kinds & {"ColorJitter", "RandomGrayscale"}
    x = (40 + torch.arange(64, dtype=torch.float32).view(8, 8)).expand(4, 8, 8) / 255   # float, in [0, 1]
    y = C.ChannelJitter(0.4, 0.0)(x)
    ratio = (y / x).flatten(1)                                              # (4, 64): one factor a channel
    torch.testing.assert_close(ratio, ratio[:, :1].expand(-1, 64))
    assert ratio[:, 0].unique().numel() == 4 and ((ratio > 0.6 - 1e-6) & (ratio < 1.4 + 1e-6)).all()
    y = C.ChannelJitter(0.0, 0.4)(x)
    torch.testing.assert_close(y.mean((1, 2)), x.mean((1, 2)))              # each channel keeps its mean
    spread = y.std((1, 2)) / x.std((1, 2))
    assert spread.unique().numel() == 4 and ((spread > 0.6 - 1e-6) & (spread < 1.4 + 1e-6)).all()
    u8 = torch.tensor([[[0, 127, 128, 255]]], dtype=torch.uint8)
    assert C.solarize(u8).tolist() == [[[0, 127, 127, 0]]]
    assert C.ChannelJitter(0.4, 0.4)(u8.expand(4, 1, 4)).dtype == torch.uint8


def encoder_input(path, size):
    """An array file as an evaluation feeds it: eval_transform then normalize with the values in force."""
    return C.normalize(E.eval_transform(size)(C.read_image(path)))[None]


@pytest.mark.parametrize("method", ["msn", "cmae", "conmim", "can"])
def test_each_image_method_trains_on_4_channel_arrays_and_every_reader_takes_its_files(method, tmp_path, monkeypatch):
    """--in-chans 4 with its --mean / --std: every normalised batch has 4 channels and those values; the patch
    embedding (and the pixel decoder's output, CMAE / CAN) is 4-channel; an evaluation of the checkpoint, of its
    --export and timm's model of the export give the encoder's features of the arrays; visualize.py draws it."""
    data = array_folder(tmp_path / "data")
    seen = []
    real = C.normalize
    monkeypatch.setattr(C, "normalize", lambda x: (seen.append((x.shape[-3], C.MEAN_STD[0])), real(x))[1])
    mod = importlib.import_module(method)
    mod.train(mod.Args(data=data, output_dir=str(tmp_path / "run"), model="nano", patch_size=4, img_size=16,
                       epochs=1, steps_per_epoch=1, batch_size=4, workers=0, knn=False, warmup_epochs=0,
                       in_chans=4, mean=MEAN4, std=STD4, **TINY[method]))
    assert seen and set(seen) == {(4, MEAN4)}
    monkeypatch.setattr(C, "normalize", real)
    path = str(tmp_path / "run" / "checkpoint.pth")
    ckpt = C.load_checkpoint(path)
    assert ckpt["vit"]["in_chans"] == 4 and ckpt["encoder"]["patch_embed.proj.weight"].shape[1] == 4
    out = {"cmae": "pixel_decoder.out.weight", "can": "decoder_pred.weight"}.get(method)
    if out:                                                                 # p p C pixels a patch
        assert ckpt["model"][out].shape[0] == 4 * 4 * 4
    E.evaluate(E.Args(ckpt=path, export=str(tmp_path / "export")))
    config = json.load(open(tmp_path / "export" / "config.json"))
    assert config["timm"]["in_chans"] == 4 and tuple(config["mean"]) == MEAN4
    files = sorted((tmp_path / "data" / "val").rglob("*.npy"))
    for source in (path, str(tmp_path / "export")):
        C.set_mean_std()                                                    # another file's (RGB) in force
        res = E.evaluate(E.Args(ckpt=source, data=str(tmp_path / "data" / "val"), mode="embed",
                                output=str(tmp_path / "f"), workers=0, device="cpu"))
        assert res["images"] == len(files)
        enc, rec = W.load_encoder(source)
        with torch.no_grad():
            want = torch.cat([E.features_of(enc, encoder_input(str(f), 16), W.pool_of(rec)) for f in files])
        np.testing.assert_allclose(np.load(tmp_path / "f" / "features.npy"), want.numpy(), atol=1e-5)
    res = E.evaluate(E.Args(ckpt=str(tmp_path / "export"), data=data, mode="knn", workers=0, k=3))
    assert 0 <= res["knn_top1"] <= 100
    timm = pytest.importorskip("timm")
    tm = timm.create_model(**config["timm"]).eval()
    tm.load_state_dict(torch.load(tmp_path / "export" / "encoder.pth"), strict=True)
    if rec["pool"] == "cls-prenorm":
        tm.norm = torch.nn.Identity()
    x = encoder_input(str(files[0]), 16)
    with torch.no_grad():
        got = tm.forward_features(x)[:, 1:].mean(1) if method == "conmim" else tm(x)
        torch.testing.assert_close(got, E.features_of(enc, x, rec["pool"]), atol=1e-5, rtol=1e-5)
    if method == "cmae":                                                    # the picture: its first 3 channels
        import visualize
        visualize.main([path, str(tmp_path / "data" / "val"), "--images", "2", "--out", str(tmp_path / "v.png")])
        assert Image.open(tmp_path / "v.png").mode == "RGB"


def test_grey_images_train_as_one_channel_and_evaluate_as_grey(tmp_path, monkeypatch):
    """CMAE on colour PNGs with --in-chans 1: the network sees one channel, the grey conversion of each image,
    normalised with ImageNet's values averaged (kept in the checkpoint); the linear probe and the k-NN read the
    folder as grey; fine-tuning refuses RandAugment by name; the RGB-only evaluations refuse the file in one line."""
    data = str(tmp_path / "data")
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(2):
            (tmp_path / "data" / split / f"c{c}").mkdir(parents=True)
            for i in range(3):                                               # colour: R, G and B differ
                Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(
                    tmp_path / "data" / split / f"c{c}" / f"{i}.png")
    seen = []
    real = C.normalize
    monkeypatch.setattr(C, "normalize", lambda x: (seen.append(x.shape[-3]), real(x))[1])
    import cmae
    cmae.train(cmae.Args(data=data, output_dir=str(tmp_path / "run"), model="nano", patch_size=4, img_size=16,
                         epochs=1, steps_per_epoch=1, batch_size=4, workers=0, knn=False, warmup_epochs=0,
                         in_chans=1, **TINY["cmae"]))
    assert seen and set(seen) == {1}
    monkeypatch.setattr(C, "normalize", real)
    path = str(tmp_path / "run" / "checkpoint.pth")
    assert tuple(C.load_checkpoint(path)["args"]["mean"]) == (0.449,)
    C.set_mean_std()
    files = sorted((tmp_path / "data" / "val").rglob("*.png"))
    E.evaluate(E.Args(ckpt=path, data=str(tmp_path / "data" / "val"), mode="embed", output=str(tmp_path / "f"),
                      workers=0))
    enc, rec = W.load_encoder(path)
    grey = torch.stack([E.eval_transform(16)(torch.from_numpy(np.asarray(Image.open(f).convert("L")).copy())[None])
                        for f in files])
    with torch.no_grad():
        want = E.features_of(enc, (grey.float() / 255 - 0.449) / 0.226, W.pool_of(rec))
    np.testing.assert_allclose(np.load(tmp_path / "f" / "features.npy"), want.numpy(), atol=1e-5)
    FT.finetune(H.parse_args(FT.LinearArgs, ["--linear", "--ckpt", path, "--data", data, "--output-dir",
                                             str(tmp_path / "lin"), "--epochs", "1", "--steps-per-epoch", "1",
                                             "--batch-size", "4", "--warmup-epochs", "0", "--workers", "0",
                                             "--device", "cpu"]))
    assert C.load_checkpoint(str(tmp_path / "lin" / "checkpoint.pth"))["vit"]["in_chans"] == 1
    with pytest.raises(C.UserError, match="RandAugment"):
        FT.finetune(FT.Args(ckpt=path, data=data, output_dir=str(tmp_path / "ft"), workers=0))
    for script in ("eval_dense.py", "eval_video.py"):
        one_line_error(run_cli(script, "--ckpt", path, "--data", "synthetic"), "1 channel(s)")


def test_what_is_rgb_alone_is_refused_by_name(tmp_path):
    data = array_folder(tmp_path / "data", n=1)
    base = ("--data", data, "--output-dir", str(tmp_path / "o"), "--device", "cpu", "--in-chans", "4")
    one_line_error(run_cli("can.py", *base), "--mean / --std take 4 numbers", "mean_std.py")
    one_line_error(run_cli("cmae.py", *base, "--mean", *["0.5"] * 4, "--std", *["0.2"] * 4, "--gpu-aug"),
                   "--gpu-aug takes RGB images")
    one_line_error(run_cli("siammae.py", "--data", "synthetic", "--in-chans", "4"), "SiamMAE reads the RGB frames")


@pytest.mark.parametrize("chans", [1, 4, 6])
def test_init_adapts_an_rgb_patch_embedding_as_timm_does(chans, tmp_path, capsys):
    """--init of an RGB file into a --in-chans run: the patch embedding is timm's adapt_input_conv of the file's,
    which keeps the response to a grey image (1 channel) or to an image equal in every channel (N a multiple of
    3; N = 4 repeats R); the rest of the encoder loads as it is."""
    import can
    rgb = can.ViT(16, 4, 64, 2, 2)
    torch.save(rgb.state_dict(), tmp_path / "mae.pth")                       # a plain (timm-named) ViT file
    a = H.parse_args(can.Args, ["--data", "synthetic", "--model", "nano", "--patch-size", "4", "--img-size", "16",
                                "--decoder-dim", "16", "--decoder-heads", "2", "--in-chans", str(chans)])
    model = can.CAN(a)
    W.init_weights(str(tmp_path / "mae.pth"), model, model.encoder, "can")
    assert f"patch_embed.proj.weight 3 -> {chans} channels" in capsys.readouterr().out
    w, w3 = model.encoder.patch_embed.proj.weight, rgb.patch_embed.proj.weight
    pytest.importorskip("timm")
    from timm.models._manipulate import adapt_input_conv
    torch.testing.assert_close(w, adapt_input_conv(chans, w3))
    torch.testing.assert_close(model.encoder.blocks[0].attn.qkv.weight, rgb.blocks[0].attn.qkv.weight)
    x = torch.rand(2, 1, 16, 16)
    if chans % 3 == 0 or chans == 1:
        torch.testing.assert_close(F.conv2d(x.expand(-1, chans, -1, -1), w, stride=4),
                                   F.conv2d(x.expand(-1, 3, -1, -1), w3, stride=4), atol=1e-5, rtol=1e-5)


def test_arrays_are_images_only_where_the_channels_are_not_rgb_and_mean_std_measures_them(tmp_path):
    """A stray .npy in an RGB folder is no image (the RGB readers and a run's file list stay as they were);
    with --in-chans 4 the folder's images are its arrays, and scripts/mean_std.py --in-chans 4 pools their
    pixels per channel."""
    data = tmp_path / "d"
    data.mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(data / "a.png")
    np.save(data / "b.npy", np.zeros((4, 8, 8), np.uint8))
    assert [p for p, _ in C.ImageFiles(str(data), every=True).samples] == [str(data / "a.png")]
    C.set_mean_std(MEAN4, STD4)
    assert len(C.ImageFiles(str(data), every=True).samples) == 2
    C.set_mean_std()
    array_folder(tmp_path / "arr")
    arrays = [np.load(f) for f in sorted((tmp_path / "arr").rglob("*.npy"))]
    px = np.concatenate([a.reshape(4, -1) for a in arrays], 1) / 255
    r = run_cli("scripts/mean_std.py", str(tmp_path / "arr"), "--in-chans", "4")
    got = r.stdout.split()
    assert got[:3] == ["--in-chans", "4", "--mean"] and got[7] == "--std", r.stdout + r.stderr
    np.testing.assert_allclose([float(v) for v in got[3:7]], px.mean(1), atol=1e-4)
    np.testing.assert_allclose([float(v) for v in got[8:12]], px.std(1), atol=1e-4)
