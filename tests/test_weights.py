"""Your own weights and images: --init (a run starts from existing weights, online network and EMA target alike),
eval_linear.py --mode embed (the features of any image folder) and --export (the encoder alone, for timm)."""
import json
import os

import numpy as np
import pytest
import torch

import can
import cmae
import common as C
import conmim
import eval_linear as E
import weights as W
import msn
import siammae
from helpers import vit_checkpoint
from test_can import tiny_args as can_args
from test_cmae import tiny_args as cmae_args
from test_conmim import tiny_args as conmim_args
from test_msn import tiny_args as msn_args
from test_siammae import tiny_args as siammae_args

# method: (module, tiny args, the online encoder and the EMA target's (or None) of train_step's first two arguments)
CASES = {"msn": (msn, msn_args, lambda a, b: (a.net.encoder, b.encoder)),
         "cmae": (cmae, cmae_args, lambda a, b: (a.encoder, b.encoder)),
         "conmim": (conmim, conmim_args, lambda a, b: (a.encoder, b.encoder)),
         "can": (can, can_args, lambda a, b: (a.encoder, None)),
         "siammae": (siammae, siammae_args, lambda a, b: (a.encoder, None))}


class Started(Exception):
    """Raised by the spy on a run's first train_step: what the networks held at step 0."""


def first_step(mod, args, monkeypatch, encoders):
    """The online and target encoders' state dicts as the run's first step receives them."""
    seen = {}

    def spy(a, b, *rest, **kw):
        online, target = encoders(a, b)
        seen.update(online={k: v.clone() for k, v in online.state_dict().items()},
                    target=target and {k: v.clone() for k, v in target.state_dict().items()})
        raise Started
    monkeypatch.setattr(mod, "train_step", spy)
    with pytest.raises(Started):
        mod.train(args)
    return seen


@pytest.mark.parametrize("method", list(CASES))
def test_init_starts_the_online_network_and_the_ema_target_from_the_checkpoints_encoder(method, tmp_path,
                                                                                         monkeypatch, capsys):
    """--init CKPT (a run of the same method, 3 steps: its EMA target apart from its online network): at step 0 both
    the online encoder and the EMA target's are the checkpoint's evaluated encoder (MSN's and ConMIM's EMA one), and
    the heads come from its online network (`model`); the line says what was loaded."""
    mod, args, encoders = CASES[method]
    mod.train(args(tmp_path / "pre", epochs=2 if method == "siammae" else 1, steps_per_epoch=3, warmup_epochs=0))
    path = str(tmp_path / "pre" / "checkpoint.pth")
    src = C.load_checkpoint(path, method)
    seen = first_step(mod, args(tmp_path / "new", init=path, seed=5), monkeypatch, encoders)
    for which in ("online", "target"):
        if seen[which] is not None:
            assert seen[which].keys() == src["encoder"].keys()
            assert all(torch.equal(v, src["encoder"][k]) for k, v in seen[which].items()), which
    out = capsys.readouterr().out
    assert f"--init {path} (a {method} checkpoint, step 3): loaded encoder (" in out and "fresh: nothing" in out
    fresh = first_step(mod, args(tmp_path / "fresh", seed=5), monkeypatch, encoders)      # without --init: not these
    assert not all(torch.equal(v, src["encoder"][k]) for k, v in fresh["online"].items())


def test_init_takes_the_heads_from_the_online_network_where_names_and_shapes_match(tmp_path, capsys):
    """MSN from an MSN checkpoint of another output width (--head-dim 8, not 16): the encoder and the head's layers of
    the same shape load; its last layer and the prototypes (of the other width) start fresh, and the line says so."""
    msn.train(msn_args(tmp_path / "pre", epochs=1, steps_per_epoch=1, warmup_epochs=0))
    path = str(tmp_path / "pre" / "checkpoint.pth")
    src = C.load_checkpoint(path, "msn")
    model = msn.MSN(msn_args(tmp_path, head_dim=8))
    loaded = W.init_weights(path, model, model.net.encoder, "msn")
    assert torch.equal(model.net.head[0].weight, src["model"]["net.head.0.weight"])
    assert "prototypes" not in loaded and "net.head.6.weight" not in loaded
    out = capsys.readouterr().out
    assert "loaded encoder (30), head (14); fresh: " in out and "head (2)" in out and "prototypes (1)" in out


def _layouts(sd):
    """A ViT state dict as the official MSN file, an MAE-style `model` dict and a plain timm state dict."""
    return {"the official MSN layout": {"target_encoder": {"module." + k: v for k, v in sd.items()}, "epoch": 3},
            "an MAE-style model dict": {"model": sd | {"decoder_embed.weight": torch.randn(4, 4)}},
            "a timm ViT": sd | {"head.weight": torch.randn(10, sd["cls_token"].shape[-1])}}


@pytest.mark.parametrize("method", ["msn", "cmae"])
def test_init_reads_the_released_layouts_and_interpolates_a_learned_position_table(method, tmp_path, capsys):
    """The official MSN file, an MAE-style dict and a timm state dict of a ViT trained at 16 px go into a 32-px run:
    every encoder tensor loaded; MSN's learned position table interpolated to the 8 x 8 grid (eval_linear's
    resize_pos_embed), CMAE's fixed sin-cos table its own; the heads start fresh."""
    torch.manual_seed(3)
    vit = W.ViT(img_size=16, patch_size=4, dim=64, depth=2, heads=2)
    mod, args, _ = CASES[method]
    for what, obj in _layouts(vit.state_dict()).items():
        torch.save(obj, tmp_path / "w.pth")
        model = msn.MSN(args(tmp_path, img_size=32)) if method == "msn" else \
            cmae.CMAE(args(tmp_path, img_size=32, master_size=40))
        enc = model.net.encoder if method == "msn" else model.encoder
        fixed = enc.pos_embed.clone()
        W.init_weights(str(tmp_path / "w.pth"), model, enc, method)
        for k, v in vit.state_dict().items():
            if k == "pos_embed":
                want = W.resize_pos_embed(v, 8, 8) if method == "msn" else fixed
                torch.testing.assert_close(enc.pos_embed, want)
            else:
                assert torch.equal(enc.state_dict()[k], v), (what, k)
        out = capsys.readouterr().out
        assert f"({what}): loaded encoder (" in out
        assert ("interpolated: pos_embed 4^2 -> 8^2" in out) == (method == "msn")


def test_init_refuses_an_encoder_it_cannot_use_naming_the_tensor(tmp_path):
    """Another width, another depth, BEiT's tensors from a plain ViT: one line naming the key (the run would train
    from a half-loaded encoder)."""
    model = can.CAN(can_args(tmp_path))                               # nano: width 64, depth 2
    for vit, match in ((dict(dim=32, heads=2), r"its encoder has cls_token of shape \(1, 1, 32\), this model's "
                                               r"\(1, 1, 64\)"),
                       (dict(dim=64, depth=3, heads=2), "its encoder has blocks.2.attn.proj.bias, which this model "
                                                        "lacks")):
        with pytest.raises(C.UserError, match=match):
            W.init_weights(vit_checkpoint(tmp_path / "v.pth", "cmae", **vit), model, model.encoder, "can")
    student = conmim.Net(conmim_args(tmp_path))
    with pytest.raises(C.UserError, match="its encoder has no rel_pos_bias.relative_position_bias_table"):
        W.init_weights(vit_checkpoint(tmp_path / "v.pth", "cmae", dim=64), student, student.encoder, "conmim")
    bad = torch.load(vit_checkpoint(tmp_path / "nan.pth", "cmae", dim=64, depth=2), weights_only=True)
    bad["encoder"]["norm.weight"][0] = float("nan")
    torch.save(bad, tmp_path / "nan.pth")
    with pytest.raises(C.UserError, match="encoder.norm.weight holds NaN"):
        W.init_weights(str(tmp_path / "nan.pth"), model, model.encoder, "can")


def test_init_is_part_of_the_experiment_and_read_only_when_a_run_starts(tmp_path, capsys):
    """A rerun with another --init is refused like any recipe change; a resumed run does not read the --init file
    (gone by then, it resumes from its checkpoint)."""
    can.train(can_args(tmp_path / "a", epochs=1, steps_per_epoch=1))
    can.train(can_args(tmp_path / "b", epochs=1, steps_per_epoch=1, seed=1))
    for d in "ab":
        os.rename(tmp_path / d / "checkpoint.pth", tmp_path / f"{d}.pth")
    run = lambda **kw: can.train(can_args(tmp_path / "run", epochs=2, steps_per_epoch=1, **kw))  # noqa: E731
    run(init=str(tmp_path / "a.pth"), stop_step=1)
    with pytest.raises(C.UserError, match=r"trained with other settings \(--init .*a.pth -> .*b.pth\)"):
        run(init=str(tmp_path / "b.pth"))
    os.remove(tmp_path / "a.pth")
    capsys.readouterr()
    run(init=str(tmp_path / "a.pth"))
    assert "resumed from" in capsys.readouterr().out
    assert C.load_checkpoint(str(tmp_path / "run" / "checkpoint.pth"), "can")["step"] == 2


# ----------------------------------------------------------------------------------------------
# The features and the encoder out
# ----------------------------------------------------------------------------------------------
def test_embed_writes_the_evaluations_features_of_any_folder_with_its_file_names(tmp_path):
    """--mode embed on a folder of class folders: features.npy equals the rows eval_linear's k-NN computes for the
    same images (encoder, pooling, preprocessing), files.txt names each row; a flat folder works too; --pixels
    writes the normalised images."""
    from test_eval_linear import tiny_folder
    data = tiny_folder(tmp_path / "d")
    ckpt = vit_checkpoint(tmp_path / "c.pth", "msn")
    a = E.Args(ckpt=ckpt, data=os.path.join(data, "val"), mode="embed", output=str(tmp_path / "out"), workers=0)
    res = E.evaluate(a)
    feats = np.load(tmp_path / "out" / "features.npy")
    files = open(tmp_path / "out" / "files.txt").read().split()
    enc, ck = W.load_encoder(ckpt)
    ref, _ = E.features(E.Args(ckpt=ckpt, data=data, cache=False, workers=0), enc, ck, "val",
                        E.splits(data)[1], torch.device("cpu"))
    assert res == {"images": 9, "dim": 32, "output": str(tmp_path / "out")} and feats.dtype == np.float32
    np.testing.assert_array_equal(feats, ref.numpy())
    assert files == [f"c{c}/{i}.png" for c in range(3) for i in range(3)]
    flat = tmp_path / "flat"
    flat.mkdir()
    for i, f in enumerate(files[:4]):
        os.link(os.path.join(data, "val", f), flat / f"img{i}.png")
    E.evaluate(E.Args(pixels=True, img_size=8, data=str(flat), mode="embed", output=str(tmp_path / "px"), workers=0))
    px = np.load(tmp_path / "px" / "features.npy")
    assert px.shape == (4, 3 * 8 * 8) and open(tmp_path / "px" / "files.txt").read().split() == [
        f"img{i}.png" for i in range(4)]
    with pytest.raises(C.UserError, match="--mode embed writes features.npy and files.txt into --output DIR"):
        E.evaluate(E.Args(ckpt=ckpt, data=data, mode="embed", workers=0))


@pytest.mark.parametrize("method,pool", [("cmae", "mean"), ("msn", "cls-prenorm"), ("conmim", "mean")])
def test_export_writes_the_encoder_alone_that_timm_loads_in_two_lines(method, pool, tmp_path):
    """--export OUT: encoder.pth (the evaluated encoder's state dict), config.json (timm's model and kwargs, the
    pooling and how timm gives it, mean / std); where timm is installed, `timm.create_model(**config["timm"])` loads
    it strict and gives the evaluation's features."""
    mod, args, _ = CASES[method]
    mod.train(args(tmp_path / "run", epochs=1, steps_per_epoch=1, warmup_epochs=0))
    ckpt = str(tmp_path / "run" / "checkpoint.pth")
    config = E.evaluate(E.Args(ckpt=ckpt, export=str(tmp_path / "out")))
    sd = torch.load(tmp_path / "out" / "encoder.pth", weights_only=True)
    saved = C.load_checkpoint(ckpt, method)["encoder"]
    assert sd.keys() == saved.keys() and all(torch.equal(v, saved[k]) for k, v in sd.items())
    assert json.load(open(tmp_path / "out" / "config.json")) == json.loads(json.dumps(config))
    assert config["pool"] == pool and config["mean"] == C.IMAGENET_MEAN and config["img_size"] == 16
    timm = pytest.importorskip("timm")
    vit = timm.create_model(**json.load(open(tmp_path / "out" / "config.json"))["timm"])
    vit.load_state_dict(torch.load(tmp_path / "out" / "encoder.pth", weights_only=True))
    enc = W.load_encoder(ckpt)[0]
    vit.eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        if pool == "cls-prenorm":
            vit.norm = torch.nn.Identity()                           # config["features"] says so
        got = vit.forward_features(x)[:, 1:].mean(1) if config["features"].startswith("vit.forward_features") \
            else vit(x)
        torch.testing.assert_close(got, E.features_of(enc, x, pool), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# A picture of what a checkpoint learned
# ----------------------------------------------------------------------------------------------
def _visualize():
    import importlib.util
    spec = importlib.util.spec_from_file_location("visualize", os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "scripts", "visualize.py"))
    vis = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vis)
    return vis


@pytest.mark.parametrize("beit", [False, True])
def test_the_attention_drawn_is_the_one_the_last_block_applies(beit):
    """scripts/visualize.py's weights times the values give the last block's attention output (before its
    projection), for a ViT and for ConMIM's BEiT (q / v biases, the shared relative position bias)."""
    vis = _visualize()
    torch.manual_seed(0)
    kw = dict(pos_embed="none", rel_pos_bias="shared", layer_scale=0.1, qkv_bias="qv", init="beit") if beit else {}
    enc = W.ViT(img_size=16, patch_size=4, dim=32, depth=2, heads=2, **kw).eval()
    if beit:
        torch.nn.init.normal_(enc.rel_pos_bias.relative_position_bias_table)          # a bias that matters
    x = torch.randn(3, 3, 16, 16)
    got = {}
    hook = enc.blocks[-1].attn.proj.register_forward_pre_hook(lambda m, a: got.update(out=a[0]))
    weights = vis.attention_weights(enc, x)                                             # (B, h, T, T)
    hook.remove()
    attn = enc.blocks[-1].attn
    xin = {}
    h2 = attn.register_forward_pre_hook(lambda m, a: xin.update(x=a[0]))
    with torch.no_grad():
        enc(x)
    h2.remove()
    B, T, D = xin["x"].shape
    bias = attn.qkv.bias if attn.qkv.bias is not None else torch.cat((attn.q_bias, torch.zeros_like(attn.v_bias),
                                                                      attn.v_bias))
    v = torch.nn.functional.linear(xin["x"], attn.qkv.weight, bias).view(B, T, 3, 2, D // 2)[:, :, 2].transpose(1, 2)
    torch.testing.assert_close((weights @ v).transpose(1, 2).reshape(B, T, D), got["out"], atol=1e-5, rtol=1e-5)
    cls, mean = vis.last_attention(enc, x, "cls"), vis.last_attention(enc, x, "mean")
    torch.testing.assert_close(cls, weights.mean(1)[:, 0, 1:])
    torch.testing.assert_close(mean, weights.mean(1)[:, 1:, 1:].mean(1))


@pytest.mark.parametrize("method,rows", [("cmae", 4), ("can", 4), ("msn", 2), ("conmim", 2), ("siammae", 5)])
def test_visualize_writes_one_grid_of_input_mask_reconstruction_and_attention(method, rows, tmp_path):
    """A PNG of the input, (CMAE, CAN, SiamMAE) the masked input and the reconstruction, and the attention, one
    labelled row each, on a folder of the user's images (SiamMAE: frame folders; the synthetic clips here)."""
    from PIL import Image
    from test_eval_linear import tiny_folder
    mod, args, _ = CASES[method]
    mod.train(args(tmp_path / "run", epochs=2 if method == "siammae" else 1, steps_per_epoch=1, warmup_epochs=0))
    data = "synthetic" if method == "siammae" else os.path.join(tiny_folder(tmp_path / "d"), "val")
    out = _visualize().main([str(tmp_path / "run" / "checkpoint.pth"), data, "--images", "4"])
    assert out == str(tmp_path / "run" / "visualize.png")
    img = Image.open(out)
    assert img.size[1] == rows * (64 + 2) + 2 and img.size[0] == 200 + 4 * (64 + 2) + 2, img.size


def test_embed_reads_every_image_under_the_folder_whatever_its_sub_folders(tmp_path):
    """--mode embed on a photo folder with one sub-folder: every image, the top level's and the sub-folder's (the
    class-folder rule of training kept only sub/x.png, exit 0)."""
    from test_eval_linear import tiny_folder
    import shutil
    data = tiny_folder(tmp_path / "d")
    flat = tmp_path / "photos"
    os.makedirs(flat / "edited")
    for i in range(3):
        shutil.copy(os.path.join(data, "val", "c0", f"{i}.png"), flat / f"{i}.png")
    shutil.copy(os.path.join(data, "val", "c1", "0.png"), flat / "edited" / "x.png")
    res = E.evaluate(E.Args(ckpt=vit_checkpoint(tmp_path / "c.pth", "msn"), data=str(flat), mode="embed",
                            output=str(tmp_path / "out"), workers=0))
    assert res["images"] == 4
    assert open(tmp_path / "out" / "files.txt").read().split() == ["0.png", "1.png", "2.png", "edited/x.png"]


@pytest.mark.parametrize("method", ["cmae", "can"])
def test_visualizes_reconstruction_row_is_the_decoders_prediction_at_the_masked_patches(method, tmp_path):
    """reconstruct(): the masked input is the input at the visible patches and zero at the masked ones; the
    reconstruction is the input at the visible patches and the decoder's prediction (back in pixels) at the masked
    ones, drawn with the run's mask ratio (a slip drawing the input there passed every test)."""
    vis = _visualize()
    mod, args, _ = CASES[method]
    a = args(tmp_path)
    torch.manual_seed(0)
    net = (mod.CMAE(a) if method == "cmae" else mod.CAN(a)).eval()
    x = torch.randn(2, 3, a.img_size, a.img_size)
    masked, recon = vis.reconstruct(mod, a, net, x, seed=5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        keep, restore, mask = mod.random_masking(len(x), a.img_size // a.patch_size, a.mask_ratio,
                                                 *([a.mask_unit] if method == "cmae" else []))
    with torch.no_grad():
        pred = net(x, keep, restore)[0] if method == "cmae" else net(x, torch.zeros(2), keep, restore)[0]
    px, recon, masked = mod.patchify(x, a.patch_size), mod.patchify(recon, a.patch_size), mod.patchify(masked,
                                                                                                       a.patch_size)
    if method == "cmae" or a.norm_pix:
        pred = mod.unnorm_pix(pred, px)
    m = mask.bool()
    assert m.float().mean() == pytest.approx(a.mask_ratio, abs=0.2) and m.any() and (~m).any()
    assert torch.equal(masked[~m], px[~m]) and not masked[m].any()
    assert torch.equal(recon[~m], px[~m]) and torch.equal(recon[m], pred[m]) and not torch.allclose(recon[m], px[m])
