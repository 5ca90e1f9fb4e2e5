"""Interoperability: the checkpoint's encoder uses timm's key names (and loads into timm when it is
installed), older checkpoints still load, and the evaluations read the official MSN layout, MAE-style
`model` files and plain timm / DeiT state dicts, ignoring heads and decoders."""
import importlib
import os
import sys

import pytest
import torch

import common as C
import synthetic as S
import eval_linear as E
import weights as W
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


def beit_keys(depth, shared=True):
    """timm Beit(use_abs_pos_emb=False, init_values>0, global_pool="token", num_classes=0) keys, written
    out: shared (use_shared_rel_pos_bias, pre-training) or per-block (use_rel_pos_bias, fine-tuning) table."""
    keys = {"cls_token", "patch_embed.proj.weight", "patch_embed.proj.bias", "norm.weight", "norm.bias"}
    keys |= {"rel_pos_bias.relative_position_bias_table"} if shared else set()
    for i in range(depth):
        keys |= {f"blocks.{i}.{k}" for k in ("norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.q_bias",
                                             "attn.v_bias", "attn.proj.weight", "attn.proj.bias", "norm2.weight",
                                             "norm2.bias",
                                             "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias",
                                             "gamma_1", "gamma_2")}
        keys |= set() if shared else {f"blocks.{i}.attn.relative_position_bias_table"}
    return keys


def timm_beit(shared=True, layer_scale=0.1, img_size=16):
    from timm.models.beit import Beit
    return Beit(img_size=img_size, patch_size=4, embed_dim=64, depth=2, num_heads=2, num_classes=0, global_pool="token",
                use_abs_pos_emb=False, use_shared_rel_pos_bias=shared, use_rel_pos_bias=not shared,
                init_values=layer_scale).eval()


@pytest.mark.parametrize("method", ["msn", "cmae", "conmim", "can"])
def test_every_checkpoint_encoder_has_timm_keys_only(method, tmp_path):
    mod = importlib.import_module(method)
    mod.train(mod.Args(data="synthetic", output_dir=str(tmp_path), model="nano", patch_size=4, img_size=16,
                       epochs=1, steps_per_epoch=1, batch_size=4, workers=0, knn=False, warmup_epochs=0,
                       **TINY[method]))
    ckpt = C.load_checkpoint(str(tmp_path / "checkpoint.pth"), method)
    beit = method == "conmim"                                       # ConMIM's backbone is BEiT's
    assert set(ckpt["encoder"]) == (beit_keys(2) if beit else timm_keys(2))     # no mask token, no head
    pytest.importorskip("timm")
    from timm.models.vision_transformer import VisionTransformer
    enc = W.ViT(**ckpt["vit"]).eval()
    enc.load_state_dict(ckpt["encoder"])
    tm = (timm_beit() if beit else
          VisionTransformer(img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=2, num_classes=0).eval())
    tm.load_state_dict(ckpt["encoder"], strict=True)
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(tm(x), enc(x)[:, 0], atol=1e-5, rtol=1e-5)


def test_conmim_encoder_is_timm_beit_shared_and_per_block(tmp_path):
    """ConMIM's BEiT (trained-looking weights: random bias table, q / v biases, gammas) gives the same
    tokens as eval_linear's ViT built from its config, as timm's Beit with the shared table, and, with
    the table copied into every block (fine-tuning's load_encoder(per_block_rel_pos=True)), as timm's
    per-block Beit; the per-block state dict has timm's per-block keys."""
    import conmim
    torch.manual_seed(0)
    enc = conmim.ViT(16, 4, 64, 2, 2, layer_scale=0.1).eval()
    enc.load_state_dict({k: v + 0.05 * torch.randn_like(v) for k, v in enc.state_dict().items()})
    C.save_checkpoint(str(tmp_path / "c.pth"), {"method": "conmim", "vit": enc.config, "encoder": enc.state_dict(),
                                                "args": {"seed": 0}, "epoch": 1, "step": 1})
    x = torch.randn(2, 3, 16, 16)
    shared, _ = W.load_encoder(str(tmp_path / "c.pth"))
    block, _ = W.load_encoder(str(tmp_path / "c.pth"), per_block_rel_pos=True)
    assert set(block.state_dict()) == beit_keys(2, shared=False)
    with torch.no_grad():
        ref = enc(x)
        torch.testing.assert_close(shared(x), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(block(x), ref, atol=1e-5, rtol=1e-5)
        pytest.importorskip("timm")
        for sd, tm in ((enc.state_dict(), timm_beit(True)), (block.state_dict(), timm_beit(False))):
            tm.load_state_dict(sd, strict=True)
            torch.testing.assert_close(tm.forward_features(x), ref, atol=1e-5, rtol=1e-5)
        # another patch grid (a non-square video frame, eval_dense.py): each table resized by timm's own
        # resize_rel_pos_bias_table_simple into timm's Beit built for that grid gives the same tokens
        from timm.layers import resize_rel_pos_bias_table_simple
        x = torch.randn(2, 3, 16, 24)                               # 4 x 6 patches; trained on 4 x 4
        for enc_, sd, shared_ in ((shared, enc.state_dict(), True), (block, block.state_dict(), False)):
            tm = timm_beit(shared_, img_size=(16, 24))
            sd = {k: resize_rel_pos_bias_table_simple(v, (4, 6), tm.state_dict()[k].shape)
                  if k.endswith("relative_position_bias_table") else v for k, v in sd.items()}
            tm.load_state_dict(sd, strict=True)
            torch.testing.assert_close(tm.forward_features(x), enc_(x), atol=1e-5, rtol=1e-5)


VITS = ["msn", "cmae", "can", "siammae", "weights"]          # the ViT family (ConMIM's BEiT: above)


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


def test_conmim_checkpoints_from_before_the_beit_backbone_still_load_for_evaluation(tmp_path, capsys):
    """ConMIM checkpoints written before its BEiT backbone (a plain ViT with learned absolute position
    embeddings and the mask token in the encoder) evaluate as the plain ViT they are, with a line saying they
    predate the fix; resuming one with today's conmim.py is a one-line error (the backbones differ)."""
    import conmim
    from test_conmim import tiny_args
    torch.manual_seed(0)
    plain = W.ViT(16, 4, 64, 2, 2, init="beit").eval()              # the old ConMIM encoder
    vit = {k: v for k, v in plain.config.items() if k != "init"} | {"mask_token": True}
    mask_token = torch.randn(1, 1, 64)
    old = {"method": "conmim", "vit": vit, "args": {"seed": 0}, "epoch": 1, "step": 1,
           "encoder": plain.state_dict() | {"mask_token": mask_token},
           "model": {"encoder." + k: v for k, v in plain.state_dict().items()} | {"encoder.mask_token": mask_token}}
    torch.save(old, tmp_path / "old.pth")
    enc, _ = W.load_encoder(str(tmp_path / "old.pth"))
    assert "from before its BEiT backbone" in capsys.readouterr().out
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(enc(x), plain(x))
    os.makedirs(tmp_path / "run")
    torch.save(old, tmp_path / "run" / "checkpoint.pth")
    with pytest.raises(C.UserError, match="does not fit this model"):
        conmim.train(tiny_args(tmp_path / "run"))


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
    enc = W.ViT(16, 4, 192, 2, 3).eval()                            # width 192: timm's ViT-Ti heads (3)
    torch.save(_layouts(enc)[layout], tmp_path / "w.pth")
    loaded, ckpt = W.load_encoder(str(tmp_path / "w.pth"))
    assert ckpt["method"] == layout and ckpt["vit"]["img_size"] == 16 and ckpt["vit"]["patch_size"] == 4
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(loaded(x), enc(x))
    with pytest.raises(C.UserError, match="--model small does not match"):
        W.load_encoder(str(tmp_path / "w.pth"), model="small")
    with pytest.raises(C.UserError, match="--patch-size 16 does not match"):
        W.load_encoder(str(tmp_path / "w.pth"), patch_size=16)


def test_nonstandard_width_needs_model_flag(tmp_path):
    enc = W.ViT(16, 4, 64, 2, 2).eval()
    torch.save(enc.state_dict(), tmp_path / "w.pth")
    with pytest.raises(C.UserError, match="give --model"):
        W.load_encoder(str(tmp_path / "w.pth"))
    loaded, _ = W.load_encoder(str(tmp_path / "w.pth"), model="nano")
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(loaded(x), enc(x))


def test_eval_linear_and_eval_video_read_foreign_checkpoints(tmp_path, monkeypatch):
    torch.manual_seed(2)
    enc = W.ViT(16, 4, 192, 1, 3).eval()
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
    clips = V.synthetic_videos                                      # two of the 20 clips: it reads the file
    monkeypatch.setattr(V, "synthetic_videos", lambda task: clips(task, n=2))
    res = V.evaluate(V.Args(ckpt=str(tmp_path / "timm.pth"), data="synthetic", n_context=2, device="cpu"))
    assert res["method"] == "timm" and res["videos"] == 2 and 0 < res["JF_mean"] <= 100


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
            W.read_foreign({k: v for k, v in sd.items() if k != missing}, "f.pth")
    with pytest.raises(C.UserError, match="not a dict of tensors"):
        W.read_foreign([torch.zeros(1)], "f.pth")


def top_level_imports(path):
    """The repository's modules that `path` imports at its top level, and theirs (what a copy must take along);
    the optional ones (gpu_aug, synthetic, eval_linear) are imported inside functions, for their flags."""
    import ast
    todo, found = [path], set()
    while todo:
        body = ast.parse(open(os.path.join(ROOT, todo.pop())).read()).body
        for node in body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for n in names:
                f = n.split(".")[0] + ".py"
                if os.path.isfile(os.path.join(ROOT, f)) and f not in found:
                    found.add(f)
                    todo.append(f)
    return found


def test_an_optional_sibling_is_the_file_beside_common_not_a_package_first_on_the_path(tmp_path, monkeypatch):
    """A project's regular package `recipes` (an __init__.py), imported and first on sys.path, is not the optional
    recipes.py: common.optional reads the file beside common.py whatever the path holds (a lookup by name took the
    package, whose missing attributes made --preset and --help a bare AttributeError, or ignored the file)."""
    import can
    import harness as H
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "__init__.py").write_text("NAMESAKE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "recipes", raising=False)
    monkeypatch.setattr(C, "_OPTIONAL", {})
    import recipes
    assert recipes.NAMESAKE and sys.modules["recipes"] is recipes
    mod = C.optional("recipes")
    assert os.path.realpath(mod.__file__) == os.path.join(ROOT, "recipes.py") and hasattr(mod, "scale_recipe")
    assert sys.modules["recipes"] is recipes                           # the project's package keeps its name
    assert H.parse_args(can.Args, ["--data", "d", "--preset", "small"]).epochs == can.Args.PRESETS["small"]["epochs"]


def test_a_method_file_and_common_train_on_an_image_folder_without_the_rest(tmp_path):
    """Copy-paste use: can.py and the modules it imports (common.py, harness.py: found from its imports, not
    listed here) alone in a new project (no synthetic.py, no other file) train on an image folder and write a
    checkpoint; given --knn or --init, which are eval_linear.py's, it asks for that file in one line, and given a
    preset for recipes.py (the small recipes), a project's recipes/ folder not taken for it; --tensorboard needs only
    its package (the writer is common.py's), an srun step nothing (harness.py maps SLURM's variables)."""
    import shutil
    proj = tmp_path / "proj"
    proj.mkdir()
    copied = {"can.py"} | top_level_imports("can.py")
    assert copied == {"can.py", "common.py", "harness.py"}, copied     # what the README tells a reader to copy
    for f in copied:
        shutil.copy(os.path.join(ROOT, f), proj / f)
    for i in range(8):
        os.makedirs(tmp_path / "imgs" / f"c{i % 2}", exist_ok=True)
        S.synthetic_image(i)[0].save(tmp_path / "imgs" / f"c{i % 2}" / f"{i}.png")
    tiny = ["--model", "nano", "--patch-size", "4", "--img-size", "16", "--batch-size", "4", "--epochs", "1",
            "--warmup-epochs", "0", "--decoder-dim", "16", "--decoder-depth", "1", "--decoder-heads", "2",
            "--proj-hidden", "16", "--proj-dim", "8", "--workers", "0"]
    r = run_cli("can.py", "--data", str(tmp_path / "imgs"), *tiny, "--output-dir", str(tmp_path / "out"), cwd=str(proj))
    assert r.returncode == 0, r.stderr[-2000:]
    assert set(os.listdir(proj)) - {"__pycache__"} == copied
    assert C.load_checkpoint(str(tmp_path / "out" / "checkpoint.pth"), "can")["step"] == 2
    (proj / "recipes").mkdir()                                       # a project's folder of that name is not it
    for flag, needs in ((["--knn"], "--knn / --eval-every need eval_linear.py and"),
                        (["--init", "x.pth"], "--init needs")):
        r = run_cli("can.py", "--data", str(tmp_path / "imgs"), *tiny, *flag, "--output-dir", str(tmp_path / flag[0]),
                    cwd=str(proj))
        assert r.returncode == 2 and r.stderr.strip() == f"error: {needs} weights.py next to this file", r.stderr
    shutil.copy(os.path.join(ROOT, "eval_linear.py"), proj / "eval_linear.py")     # one of the two: the other named
    r = run_cli("can.py", "--data", str(tmp_path / "imgs"), *tiny, "--knn", "--output-dir", str(tmp_path / "k"),
                cwd=str(proj))
    assert r.returncode == 2 and r.stderr.strip() == "error: eval_linear.py needs weights.py next to it", r.stderr
    r = run_cli("can.py", "--data", str(tmp_path / "imgs"), "--preset", "small", cwd=str(proj))
    assert r.returncode == 2 and "(--preset, --data synthetic) need recipes.py next to this file" in r.stderr
    r = run_cli("can.py", "--data", str(tmp_path / "imgs"), *tiny, "--tensorboard", "--output-dir",
                str(tmp_path / "tb"), cwd=str(proj))                  # common.py's: no file to ask for
    assert r.returncode == 0 or "--tensorboard needs the tensorboard package" in r.stderr, r.stderr[-2000:]
