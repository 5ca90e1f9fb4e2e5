"""Interoperability: the checkpoint's encoder uses timm's key names (and loads into timm when it is
installed), older checkpoints still load, and the evaluations read the official MSN layout, MAE-style
`model` files and plain timm / DeiT state dicts, ignoring heads and decoders."""
import importlib
import os

import pytest
import torch

import common as C
import synthetic as S
import eval_linear as E
import eval_video as V
import msn
from helpers import ROOT, one_line_error, run_cli
from test_eval_linear import TINY, tiny_folder


def timm_keys(depth):
    """timm VisionTransformer(num_classes=0) state-dict keys, written out."""
    keys = {"cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias", "norm.weight", "norm.bias"}
    for i in range(depth):
        for m in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"):
            keys |= {f"blocks.{i}.{m}.weight", f"blocks.{i}.{m}.bias"}
    return keys


@pytest.mark.parametrize("method", ["msn", "cmae", "conmim", "can"])
def test_every_checkpoint_encoder_has_timm_keys_only(method, tmp_path):
    mod = importlib.import_module(method)
    mod.train(mod.Args(data="synthetic", output_dir=str(tmp_path), model="nano", patch_size=4, img_size=16,
                       epochs=1, steps_per_epoch=1, batch_size=4, workers=0, knn=False, warmup_epochs=0, **TINY[method]))
    ckpt = C.load_checkpoint(str(tmp_path / "checkpoint.pth"), method)
    assert set(ckpt["encoder"]) == timm_keys(2)                     # no mask token, no head
    pytest.importorskip("timm")
    from timm.models.vision_transformer import VisionTransformer
    enc = E.ViT(**ckpt["vit"]).eval()
    enc.load_state_dict(ckpt["encoder"])
    tm = VisionTransformer(img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=2, num_classes=0).eval()
    tm.load_state_dict(ckpt["encoder"], strict=True)
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(tm(x), enc(x)[:, 0], atol=1e-5, rtol=1e-5)


VITS = ["msn", "cmae", "conmim", "can", "siammae", "eval_linear"]


@pytest.mark.parametrize("src", VITS)
def test_every_methods_encoder_loads_into_every_other_vit_with_equal_features(src):
    """Each method file defines its own ViT (deliberate repetition); the copies must agree where it
    matters: timm's key names and the same function of the same weights. Each one's state dict loads
    with strict=True into every other (and into timm's where installed) and gives equal tokens."""
    torch.manual_seed(0)
    make = lambda m: importlib.import_module(m).ViT(16, 4, 64, 2, 2).eval()       # noqa: E731
    enc = make(src)
    sd = enc.state_dict()
    if src in ("cmae", "can", "siammae"):                       # a fixed sin-cos table: make it non-trivial
        sd["pos_embed"] = sd["pos_embed"] + 0.1 * torch.randn_like(sd["pos_embed"])
        enc.load_state_dict(sd)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = enc(x)
        assert set(sd) == timm_keys(2)
        for dst in VITS:
            other = make(dst)
            other.load_state_dict(sd, strict=True)
            torch.testing.assert_close(other(x), ref, atol=1e-5, rtol=1e-5, msg=f"{src} -> {dst}")
        timm = pytest.importorskip("timm")
        tm = timm.models.vision_transformer.VisionTransformer(img_size=16, patch_size=4, embed_dim=64, depth=2,
                                                              num_heads=2, num_classes=0).eval()
        tm.load_state_dict(sd, strict=True)
        torch.testing.assert_close(tm(x), ref[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("size", ["tiny", "small", "base", "large"])
def test_encoder_loads_into_timm_named_models(size):
    timm = pytest.importorskip("timm")
    enc = msn.ViT(32, 16, *msn.SIZES[size]).eval()                  # img/patch size via timm's kwargs
    tm = timm.create_model(f"vit_{size}_patch16_224", pretrained=False, num_classes=0, img_size=32).eval()
    tm.load_state_dict(enc.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(tm(x), enc(x)[:, 0], atol=1e-4, rtol=1e-4)


def _old_format(sd):
    """This project's key names before timm naming: Sequential MLP."""
    return {k.replace(".mlp.fc1.", ".mlp.0.").replace(".mlp.fc2.", ".mlp.2."): v for k, v in sd.items()}


def test_checkpoints_written_before_the_renaming_still_load(tmp_path):
    import conmim
    from test_conmim import tiny_args
    conmim.train(tiny_args(tmp_path, epochs=1, steps_per_epoch=1))
    new = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    old = dict(new)                                                 # old configs: mask_token, no init
    old["vit"] = {k: v for k, v in new["vit"].items() if k != "init"} | {"mask_token": True}
    old["encoder"] = _old_format(new["encoder"]) | {"mask_token": new["model"]["mask_token"]}
    for key in ("model", "target"):
        sd = _old_format(new[key])
        sd["encoder.mask_token"] = sd.pop("mask_token")
        old[key] = sd
    torch.save(old, tmp_path / "old.pth")
    enc, _ = E.load_encoder(str(tmp_path / "old.pth"))
    ref, _ = E.load_encoder(str(tmp_path / "checkpoint.pth"))
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(enc(x), ref(x))
    ck = C.load_checkpoint(str(tmp_path / "old.pth"), "conmim")     # resume path: model / target keys
    model = conmim.Net(tiny_args(tmp_path))
    model.load_state_dict(ck["model"])
    model.load_state_dict(ck["target"])


def _layouts(enc):
    """The encoder's state dict as the official MSN file, an MAE-style file and a timm state dict
    name it, each with extra heads / decoders / optimiser state that must be ignored."""
    sd = enc.state_dict()
    D = enc.dim
    msn = {"target_encoder": {"module." + k: v for k, v in sd.items()} |
           {"module.fc.fc1.weight": torch.randn(8, D), "module.fc.bn1.running_mean": torch.zeros(8)},
           "encoder": {"module." + k: torch.zeros_like(v) for k, v in sd.items()},   # the online copy: not it
           "prototypes": torch.randn(4, 8), "epoch": 3, "lr": 1e-3}
    mae = {"model": sd | {"mask_token": torch.randn(1, 1, 16), "decoder_embed.weight": torch.randn(16, D),
                          "decoder_blocks.0.norm1.weight": torch.ones(16), "decoder_norm.weight": torch.ones(16),
                          "decoder_pos_embed": torch.randn(1, 17, 16)}, "epoch": 3}
    timm = sd | {"head.weight": torch.randn(10, D), "head.bias": torch.zeros(10)}
    return {"msn": msn, "mae-style": mae, "timm": timm}


@pytest.mark.parametrize("layout", ["msn", "mae-style", "timm"])
def test_foreign_layouts_load_with_the_same_features(layout, tmp_path):
    torch.manual_seed(1)
    enc = E.ViT(16, 4, 192, 2, 3).eval()                            # width 192: timm's ViT-Ti heads (3)
    torch.save(_layouts(enc)[layout], tmp_path / "w.pth")
    loaded, ckpt = E.load_encoder(str(tmp_path / "w.pth"))
    assert ckpt["method"] == layout and ckpt["vit"]["img_size"] == 16 and ckpt["vit"]["patch_size"] == 4
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(loaded(x), enc(x))
    with pytest.raises(C.UserError, match="--model small does not match"):
        E.load_encoder(str(tmp_path / "w.pth"), model="small")
    with pytest.raises(C.UserError, match="--patch-size 16 does not match"):
        E.load_encoder(str(tmp_path / "w.pth"), patch_size=16)


def test_nonstandard_width_needs_model_flag(tmp_path):
    enc = E.ViT(16, 4, 64, 2, 2).eval()
    torch.save(enc.state_dict(), tmp_path / "w.pth")
    with pytest.raises(C.UserError, match="give --model"):
        E.load_encoder(str(tmp_path / "w.pth"))
    loaded, _ = E.load_encoder(str(tmp_path / "w.pth"), model="nano")
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(loaded(x), enc(x))


def test_eval_linear_and_eval_video_read_foreign_checkpoints(tmp_path):
    torch.manual_seed(2)
    enc = E.ViT(16, 4, 192, 1, 3).eval()
    lay = _layouts(enc)
    torch.save(lay["msn"], tmp_path / "msn.pth")
    data = tiny_folder(tmp_path / "data")
    res = E.evaluate(E.Args(ckpt=str(tmp_path / "msn.pth"), data=data, mode="knn", workers=0, k=3, device="cpu"))
    assert res["method"] == "msn" and res["pool"] == "cls-prenorm"  # MSN's own evaluation features
    train = C.image_dataset(data, "train")
    tf = E.eval_transform(16)
    x = torch.stack([C.normalize(tf(train.load(i)[0])) for i in range(2)])
    feats = torch.load(next((tmp_path / "features").glob("*_train.pt")), weights_only=True)[0]
    torch.testing.assert_close(feats[:2], enc(x, norm=False)[:, 0], atol=1e-5, rtol=1e-5)
    torch.save(lay["timm"], tmp_path / "timm.pth")
    res = V.evaluate(V.Args(ckpt=str(tmp_path / "timm.pth"), data="synthetic", n_context=2, device="cpu"))
    assert res["method"] == "timm" and res["videos"] == 20


def test_unknown_layout_is_a_one_line_error_listing_keys(tmp_path):
    torch.save({"state_dict": {"backbone.x": torch.zeros(1)}, "meta": 1}, tmp_path / "odd.pth")
    r = run_cli("eval_linear.py", "--ckpt", str(tmp_path / "odd.pth"), "--data", "synthetic")
    one_line_error(r, "unknown checkpoint layout", "state_dict, meta")


def test_a_foreign_file_missing_a_vit_tensor_or_not_a_dict_is_a_one_line_error():
    """Each of the tensors the architecture is read from must be there (a global-pool ViT without a
    [CLS] token has the blocks but no cls_token: an error, not a KeyError); a file holding a list is not
    a state dict."""
    sd = msn.ViT(16, 4, 32, 2, 2).state_dict()
    for missing in ("cls_token", "patch_embed.proj.weight", "blocks.0.attn.qkv.weight"):
        with pytest.raises(C.UserError, match="unknown checkpoint layout"):
            E.foreign_encoder({k: v for k, v in sd.items() if k != missing}, "f.pth")
    with pytest.raises(C.UserError, match="not a dict of tensors"):
        E.foreign_encoder([torch.zeros(1)], "f.pth")


def test_a_method_file_and_common_train_on_an_image_folder_without_the_rest(tmp_path):
    """Copy-paste use: can.py + common.py alone in a new project (no synthetic.py, no other file)
    train on an image folder and write a checkpoint; the end-of-run k-NN report, which is
    eval_linear.py's, is skipped with a line saying so."""
    import shutil
    proj = tmp_path / "proj"
    proj.mkdir()
    for f in ("can.py", "common.py"):
        shutil.copy(os.path.join(ROOT, f), proj / f)
    for i in range(8):
        os.makedirs(tmp_path / "imgs" / f"c{i % 2}", exist_ok=True)
        S.synthetic_image(i)[0].save(tmp_path / "imgs" / f"c{i % 2}" / f"{i}.png")
    r = run_cli("can.py", "--data", str(tmp_path / "imgs"), "--model", "nano", "--patch-size", "4", "--img-size", "16",
                "--batch-size", "4", "--epochs", "1", "--warmup-epochs", "0", "--decoder-dim", "16", "--decoder-depth", "1",
                "--decoder-heads", "2", "--proj-hidden", "16", "--proj-dim", "8", "--workers", "0", "--knn", "--output-dir",
                str(tmp_path / "out"), cwd=str(proj))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "k-NN monitor skipped: it is eval_linear.py's" in r.stdout
    assert sorted(os.listdir(proj)) == ["can.py", "common.py"] or "__pycache__" in os.listdir(proj)
    assert C.load_checkpoint(str(tmp_path / "out" / "checkpoint.pth"), "can")["step"] == 2
