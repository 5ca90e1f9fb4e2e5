"""Every file the project writes, read back by every tool that takes one: for each method, each artifact (the
run's checkpoint, a --keep-every snapshot, an --export folder and its encoder files, a fine-tuned checkpoint and
its export) into each consumer (eval_linear's k-NN, eval_finetune, eval_video for SiamMAE, scripts/visualize.py,
--init of the same method and of another, timm strict) loads and gives the features of the file it came from, or is
refused in one line that says why. Then the foreign layouts weights.py reads or refuses, tensor by tensor."""
import json
import os

import pytest
import torch

import common as C
import eval_finetune as FT
import eval_linear as E
import eval_video as V
import weights as W
from test_can import tiny_args as can_args
from test_cmae import tiny_args as cmae_args
from test_conmim import tiny_args as conmim_args
from test_eval_linear import tiny_folder
from test_msn import tiny_args as msn_args
from test_siammae import tiny_args as siammae_args
from test_weights import CASES, _visualize

ARGS = {"msn": msn_args, "cmae": cmae_args, "conmim": conmim_args, "can": can_args, "siammae": siammae_args}
X = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))


def reference(path):
    """The features of a file of this project, computed from its own tensors (not through any reader):
    the ViT its config names, its encoder loaded, pooled by the method's rule."""
    c = torch.load(path, weights_only=True)
    enc = W.ViT(**c["vit"]).eval()
    enc.load_state_dict({k: v for k, v in c["encoder"].items() if k != "mask_token"})
    with torch.no_grad():
        return E.features_of(enc, X, W.DEFAULT_POOL[c["method"]])


def through(path, **kw):
    """The features of any file through the readers the evaluations use (weights.load_encoder)."""
    enc, rec = W.load_encoder(path, **kw)
    with torch.no_grad():
        return E.features_of(enc, X, W.pool_of(rec))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """For each method, a one-step run (checkpoint.pth and its --keep-every 1 snapshot, every encoder tensor but the
    position table moved off its value so a wrong table or gamma shows) and its --export; for the image methods, a
    one-step fine-tuning FROM THAT EXPORT FOLDER (eval_finetune reads it) and the fine-tuned checkpoint's --export."""
    root = tmp_path_factory.mktemp("roundtrip")
    data = tiny_folder(root / "data")
    out = {"data": data}
    for method, args in ARGS.items():
        mod, d = CASES[method][0], root / method
        mod.train(args(d / "run", epochs=2 if method == "siammae" else 1, steps_per_epoch=1, warmup_epochs=0,
                       keep_every=1))
        ckpt = str(d / "run" / "checkpoint.pth")
        c = torch.load(ckpt, weights_only=True)
        g = torch.Generator().manual_seed(1)
        c["encoder"] = {k: v + 0.05 * torch.randn(v.shape, generator=g) if k != "pos_embed" else v
                        for k, v in c["encoder"].items()}          # (MAE's sin-cos table is fixed)
        C.save_checkpoint(ckpt, c)
        snap = sorted(p for p in os.listdir(d / "run") if p.startswith("encoder_step"))[-1]
        E.evaluate(E.Args(ckpt=ckpt, export=str(d / "export")))
        arts = {"checkpoint": ckpt, "snapshot": str(d / "run" / snap), "export": str(d / "export"),
                "export/encoder.pth": str(d / "export" / "encoder.pth"),
                "export/encoder.safetensors": str(d / "export" / "encoder.safetensors")}
        refs = {k: reference(ckpt) for k in arts}
        refs["snapshot"] = reference(arts["snapshot"])
        if method != "siammae":
            FT.finetune(FT.Args(ckpt=str(d / "export"), data="synthetic", output_dir=str(d / "ft"), epochs=1,
                                steps_per_epoch=1, batch_size=8, warmup_epochs=0, blr=1e-3, workers=0,
                                eval_batch=500, device="cpu"))
            arts["finetuned"] = str(d / "ft" / "checkpoint.pth")
            E.evaluate(E.Args(ckpt=arts["finetuned"], export=str(d / "ft-export")))
            arts["finetuned/export"] = str(d / "ft-export")
            refs["finetuned"] = refs["finetuned/export"] = reference(arts["finetuned"])
        out[method] = (arts, refs)
    return out


@pytest.mark.parametrize("method", list(ARGS))
def test_every_artifact_gives_its_sources_features_in_eval_linear_and_eval_finetune(method, made):
    """eval_linear (k-NN, its features and score) and eval_finetune's reader (per-block tables for BEiT) give each
    artifact the features of the file it came from; an export keeps its pooling, and its folder holds only what
    it publishes (no lock file), its config.json no path of this machine."""
    arts, refs = made[method]
    knn = {}
    for name, path in arts.items():
        torch.testing.assert_close(through(path), refs[name], atol=1e-5, rtol=1e-5, msg=name)
        enc, _ = W.load_encoder(path, per_block_rel_pos=True)             # eval_finetune's reader
        with torch.no_grad():
            torch.testing.assert_close(E.features_of(enc, X, "mean"), E.features_of(
                W.load_encoder(path)[0], X, "mean"), atol=1e-5, rtol=1e-5, msg=name)
        res = E.evaluate(E.Args(ckpt=path, data=made["data"], mode="knn", workers=0, k=3, cache=False))
        knn.setdefault(name.split("/")[0], set()).add((res["pool"], res["knn_top1"], res["knn_top5"]))
    assert all(len(v) == 1 for v in knn.values()), knn                 # an export scores as its checkpoint
    for folder in [p for n, p in arts.items() if n.endswith("export")]:
        assert sorted(os.listdir(folder)) == ["config.json", "encoder.pth", "encoder.safetensors"]
        config = json.load(open(os.path.join(folder, "config.json")))
        assert (config["mean"], config["std"]) == (list(C.IMAGENET_MEAN), list(C.IMAGENET_STD))
        assert os.path.dirname(made["data"]) not in open(os.path.join(folder, "config.json")).read()


@pytest.mark.parametrize("method", list(ARGS))
def test_every_export_loads_strict_into_timm_with_the_evaluations_features(method, made):
    """config.json's timm model loads encoder.pth and encoder.safetensors strict (ConMIM's BEiT: the shared table;
    fine-tuned: one per block) and gives, as config["features"] says, the checkpoint's features."""
    timm = pytest.importorskip("timm")
    from safetensors.torch import load_file
    arts, refs = made[method]
    for name in [n for n in arts if n.endswith("export")]:
        config = json.load(open(os.path.join(arts[name], "config.json")))
        for sd in (torch.load(os.path.join(arts[name], "encoder.pth"), weights_only=True),
                   load_file(os.path.join(arts[name], "encoder.safetensors"))):
            vit = timm.create_model(**config["timm"]).eval()
            vit.load_state_dict(sd, strict=True)
            if config["pool"] == "cls-prenorm":
                vit.norm = torch.nn.Identity()
            with torch.no_grad():
                got = vit.forward_features(X)[:, 1:].mean(1) if config["features"].startswith(
                    "vit.forward_features") else vit(X)
            torch.testing.assert_close(got, refs[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("method", list(ARGS))
def test_every_artifact_starts_a_run_of_its_method_and_a_vit_one_of_another(method, made, capsys):
    """--init of the same method from each artifact: its encoder gives the artifact's features. --init of another
    method: the ViT family's encoders load across (MSN from CAN's and the others from MSN's), ConMIM's BEiT into a
    ViT and a ViT into ConMIM are refused in one line naming the tensor; another method's heads never load."""
    arts, refs = made[method]
    mod, args, _ = CASES[method]
    for name, path in arts.items():
        if name.startswith("finetuned") and method == "conmim":       # one table per block: not ConMIM's shared one
            model = mod.Net(args("/tmp/unused"))
            with pytest.raises(C.UserError, match=r"^--init .*: its encoder has no rel_pos_bias"):
                W.init_weights(path, model, model.encoder, method)
            continue
        model = {"msn": lambda a: mod.MSN(a), "cmae": lambda a: mod.CMAE(a), "conmim": lambda a: mod.Net(a),
                 "can": lambda a: mod.CAN(a), "siammae": lambda a: mod.SiamMAE(a)}[method](args("/tmp/unused"))
        enc = model.net.encoder if method == "msn" else model.encoder
        capsys.readouterr()
        W.init_weights(path, model, enc, method)
        rec = W.read_weights(path)[1]
        if name.startswith("finetuned") and method in ("cmae", "can"):  # fine-tuning learned the table: their
            assert "pos_embed (the file's; this model's is fixed)" in capsys.readouterr().out   # own stays, said
            assert all(torch.equal(v, enc.state_dict()[k]) for k, v in rec["encoder"].items() if k != "pos_embed")
            continue
        probe = W.ViT(**rec["vit"]).eval()
        probe.load_state_dict(enc.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(E.features_of(probe, X, W.pool_of(rec)), refs[name], atol=1e-5, rtol=1e-5,
                                       msg=name)
    other = "cmae" if method == "msn" else "msn"
    omod, oargs, _ = CASES[other]
    omodel = omod.MSN(oargs("/tmp/unused")) if other == "msn" else omod.CMAE(oargs("/tmp/unused"))
    before = {k: v.clone() for k, v in omodel.state_dict().items() if "encoder" not in k}
    capsys.readouterr()
    if method == "conmim":
        with pytest.raises(C.UserError, match=r"^--init .*: its encoder has no pos_embed"):
            W.init_weights(arts["checkpoint"], omodel, omodel.net.encoder, other)
        return
    W.init_weights(arts["checkpoint"], omodel, (omodel.net.encoder if other == "msn" else omodel.encoder), other)
    line = capsys.readouterr().out
    assert f"(a {method} checkpoint" in line and "another method's" in line, line
    assert all(torch.equal(v, omodel.state_dict()[k]) for k, v in before.items())   # no head taken across


@pytest.mark.parametrize("method", list(ARGS))
def test_every_artifact_draws_in_visualize_and_siammaes_propagate_in_eval_video(method, made, tmp_path, monkeypatch):
    """visualize.py on each artifact: the input and attention rows (and SiamMAE's f1 row) for every one, the masked
    input and reconstruction where the file has the decoder (the run's checkpoint of CMAE, CAN, SiamMAE). eval_video
    scores a SiamMAE export as its checkpoint, and reads its snapshot."""
    from PIL import Image
    arts, _ = made[method]
    data = "synthetic" if method == "siammae" else os.path.join(made["data"], "val")
    for name, path in arts.items():
        out = _visualize().main([path, data, "--images", "2", "--out", str(tmp_path / "v.png")])
        rows = 2 + (method == "siammae") + 2 * (name == "checkpoint" and method in ("cmae", "can", "siammae"))
        assert Image.open(out).size[1] == rows * (64 + 2) + 2, (name, Image.open(out).size)
    if method == "siammae":
        clips = V.synthetic_videos
        monkeypatch.setattr(V, "synthetic_videos", lambda task: clips(task, n=2))
        scores = {name: V.evaluate(V.Args(ckpt=path, data="synthetic", n_context=2, device="cpu"))["JF_mean"]
                  for name, path in arts.items() if name in ("checkpoint", "snapshot", "export", "export/encoder.pth")}
        assert scores["checkpoint"] == scores["export"] == scores["export/encoder.pth"], scores
        assert 0 <= scores["snapshot"] <= 100                         # the step-1 encoder, before the test moved it


# ----------------------------------------------------------------------------------------------
# Foreign files: what weights.py reads, what it refuses, and never a tensor dropped unsaid
# ----------------------------------------------------------------------------------------------
def timm_vit(**kw):
    from timm.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    vit = VisionTransformer(img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=2, num_classes=0, **kw)
    with torch.no_grad():
        for p in vit.parameters():
            p.add_(0.05 * torch.randn_like(p))                       # gammas, tables off their initial values
    return vit.eval()


@pytest.mark.parametrize("kw", [dict(init_values=0.1), dict(no_embed_class=True), dict(qkv_bias=False)])
def test_a_timm_vit_with_layer_scale_no_cls_position_or_no_qkv_bias_loads_with_timms_features(kw, tmp_path, capsys):
    """Layer scale (DeiT III, DINOv2: blocks.N.ls1.gamma) is read as the evaluated ViT's gammas, a position table
    without a [CLS] row (no_embed_class) gets the zero row it means, a ViT without qkv biases has none: each gives
    timm's own features ([CLS] and mean token); its --export loads back into timm strict; --init of MSN takes the
    no-[CLS] table interpolated, and refuses the gammas, which MSN's ViT has no place for, naming them."""
    pytest.importorskip("timm")
    import msn
    vit = timm_vit(**kw)
    torch.save(vit.state_dict(), tmp_path / "t.pth")
    enc, rec = W.load_encoder(str(tmp_path / "t.pth"), model="nano")
    with torch.no_grad():
        torch.testing.assert_close(E.features_of(enc, X, "cls"), vit(X), atol=1e-5, rtol=1e-5)
        tokens = vit.forward_features(X)
    torch.testing.assert_close(E.features_of(enc, X, "mean"), tokens[:, vit.num_prefix_tokens:].mean(1),
                               atol=1e-5, rtol=1e-5)
    E.evaluate(E.Args(ckpt=str(tmp_path / "t.pth"), export=str(tmp_path / "x"), pool="cls", model="nano"))
    import timm
    back = timm.create_model(**json.load(open(tmp_path / "x" / "config.json"))["timm"]).eval()
    back.load_state_dict(torch.load(tmp_path / "x" / "encoder.pth", weights_only=True), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(back(X), vit(X), atol=1e-5, rtol=1e-5)
    model = msn.MSN(msn_args("/tmp/unused", img_size=32))
    if "init_values" in kw:
        with pytest.raises(C.UserError, match=r"its encoder has blocks\.0\.gamma_1, which this model lacks"):
            W.init_weights(str(tmp_path / "t.pth"), model, model.net.encoder, "msn")
        return
    if "qkv_bias" in kw:
        with pytest.raises(C.UserError, match=r"its encoder has no blocks\.0\.attn\.qkv\.bias"):
            W.init_weights(str(tmp_path / "t.pth"), model, model.net.encoder, "msn")
        return
    W.init_weights(str(tmp_path / "t.pth"), model, model.net.encoder, "msn")
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "interpolated: pos_embed 4^2 -> 8^2" in line and "no [CLS] row" in line, line


@pytest.mark.parametrize("kw,named", [(dict(reg_tokens=2), "reg_token"), (dict(pre_norm=True), "norm_pre.weight"),
                                      (dict(class_token=False, global_pool="avg"), "unknown checkpoint layout")])
def test_a_timm_vit_with_tensors_this_vit_has_no_place_for_is_refused_naming_them(kw, named, tmp_path):
    """Register tokens, a pre-norm, a ViT without [CLS]: one line naming the tensor, from every reader (eval_linear,
    --init): nothing loads with a tensor dropped."""
    pytest.importorskip("timm")
    import cmae
    torch.save(timm_vit(**kw).state_dict(), tmp_path / "t.pth")
    with pytest.raises(C.UserError, match=named):
        W.load_encoder(str(tmp_path / "t.pth"), model="nano")
    model = cmae.CMAE(cmae_args("/tmp/unused"))
    with pytest.raises(C.UserError, match=named):
        W.init_weights(str(tmp_path / "t.pth"), model, model.encoder, "cmae")


def test_heads_and_decoders_of_a_foreign_file_are_left_out_by_name_and_a_learned_table_is_not_put_in_a_fixed_one(
        tmp_path, capsys):
    """An MAE-style file (encoder, decoder, mask token, a classifier head): the evaluation reads its encoder and
    says what it left out; --init of CMAE (a fixed sin-cos table) keeps its own table and says the file's was left
    out (it was loaded into the buffer when the grids matched, dropped when they did not, both without a word)."""
    import cmae
    torch.manual_seed(0)
    enc = W.ViT(16, 4, 64, 2, 2)
    sd = {**enc.state_dict(), "decoder_embed.weight": torch.zeros(8, 64), "mask_token": torch.zeros(1, 1, 8),
          "head.weight": torch.zeros(10, 64), "head.bias": torch.zeros(10)}
    torch.save({"model": sd, "epoch": 3}, tmp_path / "mae.pth")
    _, rec = W.load_encoder(str(tmp_path / "mae.pth"), model="nano")
    assert rec["left_out"] == {"decoder_embed": 1, "mask_token": 1, "head": 2}
    assert "left out decoder_embed (1), mask_token (1), head (2)" in capsys.readouterr().out
    model = cmae.CMAE(cmae_args("/tmp/unused"))
    own = model.encoder.pos_embed.clone()
    W.init_weights(str(tmp_path / "mae.pth"), model, model.encoder, "cmae")
    line = capsys.readouterr().out
    assert torch.equal(model.encoder.pos_embed, own) and "pos_embed (the file's; this model's is fixed)" in line
    assert "head (2)" in line and "decoder_embed (1)" in line, line


def test_a_safetensors_file_of_any_layout_reads_as_its_pth(tmp_path):
    """A foreign state dict saved as .safetensors (timm's hub format) reads as the same dict in a .pth."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file
    torch.manual_seed(0)
    sd = W.ViT(16, 4, 192, 1, 3).state_dict()
    torch.save(sd, tmp_path / "a.pth")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "a.safetensors"))
    torch.testing.assert_close(through(str(tmp_path / "a.safetensors")), through(str(tmp_path / "a.pth")))
    (tmp_path / "bad.safetensors").write_bytes(b"not one")
    with pytest.raises(C.UserError, match="is not a readable safetensors file"):
        W.load_encoder(str(tmp_path / "bad.safetensors"))


def test_a_siammae_checkpoint_from_before_weight_init_resumes(tmp_path, capsys):
    """--init was the initialisation scheme before it named a file (now --weight-init): such a checkpoint's args
    read as today's, so the run resumes instead of being refused as "--init xavier -> None"."""
    import siammae
    siammae.train(siammae_args(tmp_path, epochs=4, stop_epoch=1, steps_per_epoch=1))
    c = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    c["args"]["init"] = c["args"].pop("weight_init")                  # as the older version wrote it
    C.save_checkpoint(str(tmp_path / "checkpoint.pth"), c)
    siammae.train(siammae_args(tmp_path, epochs=4, steps_per_epoch=1))
    assert "resumed from" in capsys.readouterr().out
    assert C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "siammae")["step"] == 2
