"""eval_linear.py: k-NN vs naive, logistic regression on separable data, exact low-shot subsets,
every image method's checkpoint evaluates, feature cache, bad checkpoints."""
import importlib
import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

import common as C
import synthetic as S
import eval_linear as E
import weights as W
from helpers import one_line_error, run_cli, vit_checkpoint


def test_knn_matches_naive_weighted_vote():
    g = torch.Generator().manual_seed(0)
    tr, te = torch.randn(40, 6, generator=g), torch.randn(9, 6, generator=g)
    ytr, yte = torch.randint(0, 4, (40,), generator=g), torch.randint(0, 4, (9,), generator=g)
    res = E.knn(tr, ytr, te, yte, 4, k=5, T=0.1)
    trn, ten = torch.nn.functional.normalize(tr, dim=1), torch.nn.functional.normalize(te, dim=1)
    correct = 0
    for i in range(9):
        sims = sorted(((float(ten[i] @ trn[j]), j) for j in range(40)), reverse=True)[:5]
        votes = [sum(math.exp(s / 0.1) for s, j in sims if ytr[j] == c) for c in range(4)]
        correct += max(range(4), key=lambda c: votes[c]) == yte[i]
    assert res["knn_top1"] == pytest.approx(100 * correct / 9)


def test_logistic_regression_separates_separable_data():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(5, 16, generator=g) * 4
    y = torch.arange(5).repeat(20)
    x = centres[y] + torch.randn(100, 16, generator=g) * 0.3
    W = E.logistic_regression(E.msn_preprocess(x), y, 5, lambd=1e-4)
    assert ((E.msn_preprocess(x).double() @ W).argmax(1) == y).float().mean() == 1.0
    res = E.linear_probe(x, y, x, y, 5, epochs=20, batch=32)
    assert res["linear_top1"] == 100.0


def test_knn_normalises_each_row_whatever_its_norm():
    """Cosine similarity: rows of very different norms (0.1 .. 10) against the vote on the unit rows
    (normalising the feature columns instead passed the small test above by chance)."""
    g = torch.Generator().manual_seed(1)
    tr, te = torch.randn(300, 8, generator=g), torch.randn(200, 8, generator=g)
    tr, te = tr * torch.logspace(-1, 1, 300)[torch.randperm(300, generator=g), None], te * torch.logspace(-1, 1,
                                                                                                          200)[:, None]
    ytr, yte = torch.randint(0, 6, (300,), generator=g), torch.randint(0, 6, (200,), generator=g)
    votes = E.knn_predict(F.normalize(tr, dim=1), ytr, F.normalize(te, dim=1), 6, k=10, T=0.07)   # naive-checked below
    res = E.knn(tr, ytr, te, yte, 6, k=10, T=0.07)
    assert res["knn_top1"] == pytest.approx(100 * (votes.argmax(1) == yte).float().mean().item())


def test_knn_counts_a_vote_below_one():
    """A neighbour at negative cosine similarity votes exp(sim / T) < 1: still a vote (only classes with no
    neighbour at all are left out of the top-5)."""
    res = E.knn(torch.tensor([[-1.0, 0.2]]), torch.tensor([0]), torch.tensor([[1.0, 0.0]]), torch.tensor([0]), 3, k=1)
    assert res["knn_top1"] == 100.0 and res["knn_top5"] == 100.0


def test_knn_top5_never_counts_a_class_without_votes():
    """k = 1: one class gets a vote; the other four of the top 5 would be arbitrary zero-score classes."""
    tr = torch.eye(6)[:3]                                      # 3 train points, classes 0, 1, 2
    ytr = torch.tensor([0, 1, 2])
    te = torch.eye(6)[:2] + 0.01                               # nearest: train 0 and train 1
    yte = torch.tensor([3, 4])                                  # classes nobody voted for
    res = E.knn(tr, ytr, te, yte, 6, k=1)
    assert res["knn_top1"] == 0 and res["knn_top5"] == 0


def test_msn_preprocess_centres_each_row_and_normalises():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=g) + torch.arange(7.0)[:, None]    # rows with different offsets
    z = E.msn_preprocess(x)
    torch.testing.assert_close(z.mean(1), torch.zeros(7), atol=1e-6, rtol=0)
    torch.testing.assert_close(z.norm(dim=1), torch.ones(7))
    torch.testing.assert_close(E.msn_preprocess(x + 3.0), z)          # a per-row shift is removed


@pytest.mark.parametrize("n", [10, 80])
def test_lowshot_penalty_is_lambd_over_n(n):
    """Independent reference: the solution must satisfy the optimality condition of
    mean CE + (lambd / n) / 2 ||W||^2 (no intercept), written out here with explicit softmax sums;
    a penalty of lambd (not divided by n, n times too strong) does not."""
    g = torch.Generator().manual_seed(n)
    C_, D, lambd = 4, 6, 0.25
    y = torch.arange(C_).repeat(n // C_ + 1)[:n]
    x = E.msn_preprocess(torch.randn(C_, D, generator=g)[y] + 0.8 * torch.randn(n, D, generator=g)).double()
    W = E.logistic_regression(x, y, C_, lambd)

    def grad(W, reg):                                           # d/dW [ mean_i CE_i + reg/2 |W|^2 ]
        logits = x @ W
        p = torch.exp(logits - logits.max(1, keepdim=True).values)
        p = p / p.sum(1, keepdim=True)
        onehot = torch.zeros(n, C_, dtype=torch.float64)
        onehot[torch.arange(n), y] = 1
        return x.T @ (p - onehot) / n + reg * W
    assert grad(W, lambd / n).abs().max() < 1e-6
    assert grad(W, lambd).abs().max() > 1e-3
    assert not hasattr(W, "bias") and W.shape == (D, C_)        # no intercept


def test_subset_file_selects_the_listed_images(tmp_path):
    data = tiny_folder(tmp_path / "data")
    (tmp_path / "subset.txt").write_text("c0/1.png\nc1/0.png\n2.png\n")   # relative path or file name
    with pytest.raises(C.UserError, match="ambiguous"):                      # 2.png exists in every class
        E.subset_from_file(str(tmp_path / "subset.txt"), data)
    (tmp_path / "subset.txt").write_text("c0/1.png\nc1/0.png\nc2/2.png\n")
    idx = E.subset_from_file(str(tmp_path / "subset.txt"), data)
    ds = C.image_dataset(data, "train")
    assert [os.path.relpath(ds.samples[i][0], os.path.join(data, "train")) for i in idx] == \
        ["c0/1.png", "c1/0.png", "c2/2.png"]
    (tmp_path / "subset.txt").write_text("c0/1.png\nnope.png\n")
    with pytest.raises(C.UserError, match="1 of 2 images not found"):
        E.subset_from_file(str(tmp_path / "subset.txt"), data)
    shutil.copy(os.path.join(data, "train", "c1", "0.png"), os.path.join(data, "train", "c1", "only.png"))
    (tmp_path / "subset.txt").write_text("c0/1.png\nonly.png\n")                   # a unique file name
    ds = C.image_dataset(data, "train")
    assert [ds.samples[i][0] for i in E.subset_from_file(str(tmp_path / "subset.txt"), data)] == \
        [os.path.join(data, "train", "c0", "1.png"), os.path.join(data, "train", "c1", "only.png")]


def test_lowshot_reports_the_mean_and_std_of_each_seeds_top1_under_its_protocols_name(monkeypatch):
    """Per subset: top-1 (not top-k) of the MSN-preprocessed val rows times that subset's W; reported as the
    mean and the sample std over the seeds (std 0 for one subset), keyed by the protocol."""
    g = torch.Generator().manual_seed(0)
    ytr, yva = torch.arange(4).repeat(6), torch.arange(4).repeat(5)
    tr, va = torch.randn(24, 8, generator=g), torch.randn(20, 8, generator=g)
    Ws = [torch.randn(8, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    calls = []

    def fixed_w(x, y, nc, lambd):                    # the i-th subset's classifier is Ws[i]
        calls.append(1)
        return Ws[len(calls) - 1]
    monkeypatch.setattr(E, "logistic_regression", fixed_w)
    accs = torch.tensor([100 * ((E.msn_preprocess(va).double() @ W).argmax(1) == yva).double().mean().item()
                         for W in Ws])
    assert len(set(accs.tolist())) > 1
    res = E.lowshot(tr, ytr, va, yva, 4, shots=2, seeds=3)
    assert res.keys() == {"lowshot_2shot_mean", "lowshot_2shot_std"}
    assert res["lowshot_2shot_mean"] == pytest.approx(accs.mean().item())
    assert res["lowshot_2shot_std"] == pytest.approx(accs.std().item())
    calls.clear()
    assert E.lowshot(tr, ytr, va, yva, 4, shots=1, seeds=2)["lowshot_1shot_std"] == pytest.approx(accs[:2].std().item())
    calls.clear()
    assert E.lowshot(tr, ytr, va, yva, 4, percent=50, seeds=1) == {"lowshot_50pct_mean": pytest.approx(accs[0].item()),
                                                                   "lowshot_50pct_std": 0.0}
    calls.clear()
    assert E.lowshot(tr, ytr, va, yva, 4, subset=torch.arange(8)).keys() == {"lowshot_file_mean", "lowshot_file_std"}


def test_a_bad_subset_file_stops_before_any_feature_is_extracted(tmp_path, monkeypatch):
    """--mode all read the subset file after the k-NN and the linear probe (hours of features on
    ImageNet) and --mode knn ignored it: both are now one-line errors at start."""
    data = tiny_folder(tmp_path / "data")
    ckpt = vit_checkpoint(tmp_path / "c.pth", "cmae")
    (tmp_path / "subset.txt").write_text("c0/1.png\nnope.png\n")
    monkeypatch.setattr(E, "features", lambda *a, **k: pytest.fail("features extracted before the subset was read"))
    with pytest.raises(C.UserError, match="1 of 2 images not found"):
        E.evaluate(E.Args(ckpt=ckpt, data=data, mode="all", workers=0, subset_file=str(tmp_path / "subset.txt")))
    with pytest.raises(C.UserError, match="--subset-file is read by --mode lowshot or all, not knn"):
        E.evaluate(E.Args(ckpt=ckpt, data=data, mode="knn", workers=0, subset_file=str(tmp_path / "subset.txt")))


def test_msn_features_are_the_cls_token_before_the_final_norm():
    enc = W.ViT(16, 4, 32, 2, 2).eval()
    x = torch.randn(3, 3, 16, 16)
    assert W.DEFAULT_POOL["msn"] == "cls-prenorm"
    torch.testing.assert_close(E.features_of(enc, x, "cls-prenorm"), enc(x, norm=False)[:, 0])
    torch.testing.assert_close(E.features_of(enc, x, "cls"), enc.norm(enc(x, norm=False))[:, 0])


@pytest.mark.parametrize("shots,percent", [(1, 0), (2, 0), (5, 0), (10, 0), (0, 10)])   # 10: all of class 0
def test_lowshot_subset_exact_counts(shots, percent):
    labels = torch.arange(4).repeat_interleave(torch.tensor([10, 20, 30, 50]))
    idx = E.lowshot_subset(labels, 4, shots, percent, seed=1)
    counts = torch.bincount(labels[idx], minlength=4).tolist()
    assert counts == ([shots] * 4 if not percent else [1, 2, 3, 5])
    assert len(set(idx.tolist())) == len(idx)
    assert not torch.equal(idx, E.lowshot_subset(labels, 4, shots, percent, seed=2))    # seeds differ


def tiny_folder(root):
    for split, n in (("train", 6), ("val", 3)):
        for c in range(3):
            os.makedirs(root / split / f"c{c}", exist_ok=True)
            for i in range(n):
                img, _ = S.synthetic_image(c + 10 * i, split=split)        # class c shapes
                img.save(root / split / f"c{c}" / f"{i}.png")
    return str(root)


TINY = {"msn": dict(focal_size=8, focal_views=1, head_hidden=16, head_dim=8, num_prototypes=8),
        "cmae": dict(master_size=20, decoder_dim=16, decoder_depth=1, decoder_heads=2, proj_hidden=16, proj_dim=8),
        "conmim": dict(proj_hidden=16, proj_dim=8),
        "can": dict(decoder_dim=16, decoder_depth=1, decoder_heads=2, proj_hidden=16, proj_dim=8)}


@pytest.mark.parametrize("method", ["msn", "cmae", "conmim", "can"])
def test_each_method_checkpoint_evaluates(method, tmp_path):
    mod = importlib.import_module(method)
    data = tiny_folder(tmp_path / "data")
    mod.train(mod.Args(data=data, output_dir=str(tmp_path / "run"), model="nano", patch_size=4, img_size=16,
                       epochs=1, steps_per_epoch=1, batch_size=4, workers=0, knn=False, warmup_epochs=0,
                       **TINY[method]))
    ckpt = str(tmp_path / "run" / "checkpoint.pth")
    res = E.evaluate(E.Args(ckpt=ckpt, data=data, mode="all", workers=0, k=3, linear_epochs=2, seeds=2))
    assert res["method"] == method and res["pool"] == W.DEFAULT_POOL[method]
    for k in ("knn_top1", "linear_top1", "lowshot_1shot_mean"):
        assert 0 <= res[k] <= 100
    (tmp_path / "subset.txt").write_text("c0/0.png\nc1/0.png\nc2/0.png\nc0/1.png\nc1/1.png\nc2/1.png\n")
    sub = E.evaluate(E.Args(ckpt=ckpt, data=data, mode="lowshot", workers=0, subset_file=str(tmp_path / "subset.txt")))
    assert 0 <= sub["lowshot_file_mean"] <= 100
    cached = os.listdir(tmp_path / "run" / "features")
    assert len(cached) == 2                                             # train + val, reused next time
    res2 = E.evaluate(E.Args(ckpt=ckpt, data=data, mode="knn", workers=0, k=3))
    assert res2["knn_top1"] == res["knn_top1"] and len(os.listdir(tmp_path / "run" / "features")) == 2
    rnd = E.evaluate(E.Args(ckpt=ckpt, data=data, mode="knn", workers=0, k=3, random_init=True))
    assert rnd["random_init"] and len(os.listdir(tmp_path / "run" / "features")) == 4


def test_the_sweeps_validation_is_train_images_held_out_of_training_never_val(tmp_path, monkeypatch):
    """--holdout n: a fixed draw of n train/ images (whatever --seed), which a --holdout n training run never
    reads and eval_linear --holdout n scores against the other train/ images as its k-NN bank; no val/ or
    test/ image is read. A checkpoint trained on them (no --holdout, or another n) is refused."""
    data = tiny_folder(tmp_path / "data")                                 # 18 train/, 9 val/ images
    every = [p for p, _ in C.image_dataset(data, "train").samples]
    held = [p for p, _ in C.image_dataset(data, "holdout", holdout=5).samples]
    torch.manual_seed(123)
    rest = [p for p, _ in C.image_dataset(data, "train", holdout=5).samples]
    assert len(held) == 5 and not set(held) & set(rest) and sorted(held + rest) == sorted(every)
    assert len({p.split(os.sep)[-2] for p in held}) > 1                    # a draw, not the first files
    read = []
    real = C.read_image
    monkeypatch.setattr(C, "read_image", lambda p: (read.append(p), real(p))[1])
    mod = importlib.import_module("msn")
    mod.train(mod.Args(data=data, output_dir=str(tmp_path / "run"), model="nano", patch_size=4, img_size=16, epochs=1,
                       batch_size=4, workers=0, knn=False, warmup_epochs=0, holdout=5, **TINY["msn"]))
    assert len(read) == 12 and not set(read) & set(held)                   # 3 steps of 4 of the 13 others
    read.clear()
    shapes = []
    real_knn = E.knn
    monkeypatch.setattr(E, "knn", lambda tr, ytr, va, yva, *a: (shapes.append((len(tr), len(va))), real_knn(tr, ytr,
                                                                                                            va, yva,
                                                                                                            *a))[1])
    ckpt = str(tmp_path / "run" / "checkpoint.pth")
    res = E.evaluate(E.Args(ckpt=ckpt, data=data, holdout=5, workers=0, k=3))
    assert res["split"] == "holdout" and shapes == [(13, 5)] and sorted(read) == sorted(every)
    for bad, match in ((dict(holdout=4), "trained with --holdout 5"), (dict(holdout=5, split="val"), "not --split "
                                                                                                     "val")):
        with pytest.raises(C.UserError, match=match):
            E.evaluate(E.Args(ckpt=ckpt, data=data, workers=0, k=3, **bad))
    with pytest.raises(C.UserError, match="trained with --holdout 0 .on every train/ image"):
        E.evaluate(E.Args(ckpt=vit_checkpoint(tmp_path / "c.pth", "cmae"), data=data, holdout=5, workers=0, k=3))
    assert E.evaluate(E.Args(ckpt=ckpt, data=data, holdout=5, workers=0, k=3, random_init=True))["split"] == "holdout"


@pytest.mark.parametrize("method,prefix", [("msn", "net.encoder."), ("conmim", "encoder."), ("cmae", "encoder.")])
def test_online_reads_the_online_networks_encoder(method, prefix, tmp_path):
    """--online: the encoder inside the checkpoint's `model` (a hand-built copy of it loads the same weights);
    for MSN and ConMIM not the evaluated EMA network, for CMAE the same weights; cached apart."""
    mod = importlib.import_module(method)
    data = tiny_folder(tmp_path / "data")
    mod.train(mod.Args(data=data, output_dir=str(tmp_path / "run"), model="nano", patch_size=4, img_size=16, epochs=1,
                       batch_size=4, workers=0, knn=False, warmup_epochs=0, **TINY[method]))
    path = str(tmp_path / "run" / "checkpoint.pth")
    ckpt = C.load_checkpoint(path)
    online, _ = W.load_encoder(path, online=True)
    hand = W.ViT(**ckpt["vit"])
    hand.load_state_dict({k[len(prefix):]: v for k, v in ckpt["model"].items() if k.startswith(prefix)})
    for k, v in hand.state_dict().items():
        assert torch.equal(online.state_dict()[k], v), k
    evaluated, _ = W.load_encoder(path)
    same = all(torch.equal(evaluated.state_dict()[k], v) for k, v in hand.state_dict().items())
    assert same == (method == "cmae")
    a = E.evaluate(E.Args(ckpt=path, data=data, workers=0, k=3, online=True))
    b = E.evaluate(E.Args(ckpt=path, data=data, workers=0, k=3))
    assert a["online"] and not b["online"] and len(os.listdir(tmp_path / "run" / "features")) == 4
    for bad in (dict(random_init=True), dict(ckpt=None, pixels=True, img_size=16)):
        with pytest.raises(C.UserError, match="--online reads"):
            E.evaluate(E.Args(**{**dict(ckpt=path, data=data, workers=0, online=True), **bad}))
    with pytest.raises(C.UserError, match="--online: .* is not a checkpoint of this project's training scripts"):
        W.load_encoder(vit_checkpoint(tmp_path / "c.pth", "cmae"), online=True)


def test_bad_checkpoints(tmp_path):
    one_line_error(run_cli("eval_linear.py", "--ckpt", str(tmp_path / "missing.pth"), "--data", "synthetic"),
                   "does not exist")
    (tmp_path / "junk.pth").write_bytes(b"junk")
    one_line_error(run_cli("eval_linear.py", "--ckpt", str(tmp_path / "junk.pth"), "--data", "synthetic"),
                   "not a readable checkpoint")
    torch.save({"state_dict": {}}, tmp_path / "foreign.pth")
    one_line_error(run_cli("eval_linear.py", "--ckpt", str(tmp_path / "foreign.pth"), "--data", "synthetic"),
                   "unknown checkpoint layout")


def test_an_unreadable_image_is_an_error_in_evaluation_not_skipped(tmp_path):
    """Training skips unreadable images (--max-unreadable); an evaluation must not: the scores would be
    of another set than the one named."""
    data = tiny_folder(tmp_path / "data")
    (tmp_path / "data" / "train" / "c1" / "2.png").write_bytes(b"not a png")
    ckpt = vit_checkpoint(tmp_path / "c.pth", "cmae")
    with pytest.raises(C.UserError, match="cannot read image .*2.png"):
        E.evaluate(E.Args(ckpt=ckpt, data=data, mode="knn", workers=0, cache=False))


def test_a_folder_without_train_or_val_is_an_error_before_any_feature(tmp_path):
    """Only val/ (the image folder would have been read whole, val/ included, as the train split) or only
    train/: evaluation needs both."""
    data = tiny_folder(tmp_path / "data")
    shutil.move(os.path.join(data, "train"), tmp_path / "train")
    with pytest.raises(C.UserError, match="expected train/ and val/"):
        E.splits(data)
    shutil.move(tmp_path / "train", os.path.join(data, "train"))
    shutil.rmtree(os.path.join(data, "val"))
    with pytest.raises(C.UserError, match="expected train/ and val/"):
        E.splits(data)


def test_model_and_patch_size_flags_are_checked_against_this_projects_checkpoints_too(tmp_path):
    """--model / --patch-size were checked for foreign checkpoints only and silently ignored for ours."""
    ckpt = vit_checkpoint(tmp_path / "c.pth", "cmae", dim=64, depth=2, heads=2)     # the 'nano' size
    assert W.load_encoder(ckpt, model="nano", patch_size=4)[1]["vit"]["dim"] == 64
    with pytest.raises(C.UserError, match="--model tiny does not match"):
        W.load_encoder(ckpt, model="tiny")
    with pytest.raises(C.UserError, match="--patch-size 8 does not match"):
        W.load_encoder(ckpt, patch_size=8)


def test_knn_predict_matches_naive():
    g = torch.Generator().manual_seed(0)
    tr = torch.nn.functional.normalize(torch.randn(30, 5, generator=g), dim=1)
    ytr = torch.randint(0, 3, (30,), generator=g)
    te = torch.nn.functional.normalize(torch.randn(7, 5, generator=g), dim=1)
    scores = E.knn_predict(tr, ytr, te, 3, k=6, T=0.5)                # k above the feature width 5
    for i in range(7):
        sims = [(float(te[i] @ tr[j]), j) for j in range(30)]
        top = sorted(sims, reverse=True)[:6]
        naive = [sum(math.exp(s / 0.5) for s, j in top if ytr[j] == c) for c in range(3)]
        naive = [v / math.exp(top[0][0] / 0.5) if v else -math.inf for v in naive]   # up to the query's factor
        assert torch.allclose(scores[i], torch.tensor(naive), rtol=1e-4)
    torch.testing.assert_close(E.knn_predict(tr, ytr, te, 3, k=6, T=0.5, chunk=3), scores)   # queries in chunks of 3


@pytest.mark.parametrize("T", [0.07, 0.01, 0.002])
def test_knn_at_a_low_temperature_votes_as_in_float64(T):
    """exp(sim / T) overflows float32 from T ~ 0.0113 (sim 1: exp(88.7)); the votes are taken up to each query's
    largest similarity, so a low temperature gives float64's top-1 (it gave 4 of 100 where float64 gave 79)."""
    g = torch.Generator().manual_seed(0)
    centres = F.normalize(torch.randn(5, 16, generator=g), dim=1)
    ytr, yte = torch.randint(0, 5, (400,), generator=g), torch.randint(0, 5, (100,), generator=g)
    tr, te = (F.normalize(centres[y] + 0.3 * torch.randn(len(y), 16, generator=g), dim=1) for y in (ytr, yte))
    sim, idx = (te.double() @ tr.double().T).topk(20, dim=1)
    ref = (F.one_hot(ytr[idx], 5).double() * (sim / T).exp().unsqueeze(-1)).sum(1)   # float64: no overflow here
    res = E.knn(tr, ytr, te, yte, 5, k=20, T=T)
    assert res["knn_top1"] == pytest.approx(100 * (ref.argmax(1) == yte).double().mean().item())
    assert res["knn_top1"] > 40                                   # chance: 20


@pytest.mark.parametrize("method,how", [("msn", "cls-prenorm"), ("cmae", "mean")])
def test_knn_monitor_is_the_evaluations_knn_on_the_folder(method, how, tmp_path, monkeypatch):
    """The training scripts' k-NN monitor against the same k-NN computed here image by image: eval transform, the
    method's pooling, val classes matched to train BY NAME (val lacks c0, so positions differ); logged with its
    step."""
    from PIL import Image
    from helpers import knn_monitor
    data = tiny_folder(tmp_path / "d")
    shutil.rmtree(tmp_path / "d" / "val" / "c0")
    torch.manual_seed(0)
    enc = W.ViT(img_size=16, patch_size=4, dim=32, depth=1, heads=2).eval()
    tf = E.eval_transform(16)

    def feats(split):
        rows = [(p, int(p.parent.name[1])) for p in sorted((tmp_path / "d" / split).glob("*/*.png"))]
        with torch.no_grad():
            f = torch.cat([E.features_of(enc, C.normalize(tf(Image.open(p).convert("RGB"))[None]), how) for p,
                           _ in rows])
        return f, torch.tensor([c for _, c in rows])
    (ftr, ytr), (fva, yva) = feats("train"), feats("val")
    ref = E.knn(ftr, ytr, fva, yva, 3)
    seen = []
    real = E.sharded_knn
    monkeypatch.setattr(E, "sharded_knn", lambda *a, **kw: (seen.append(a), real(*a, **kw))[1])
    monitor, records = knn_monitor(enc, data, 16, method)
    assert monitor(7) == pytest.approx(ref) and records == [{"step": 7, **{k: round(v, 3) for k, v in ref.items()}}]
    [(gtr, gytr, n, gva, gyva, nc, _)] = seen                       # the very features, not only the top-1
    torch.testing.assert_close((gtr, gva), (ftr, fva))
    assert gytr.tolist() == ytr.tolist() and gyva.tolist() == yva.tolist() and nc == 3 and n == len(ytr)


def test_linear_probe_feeds_the_head_standardised_features_and_scores_top1_top5(monkeypatch):
    """The head trains on (train - mean) / std and scores (val - mean) / std, both with train's mean and std
    (per feature); top-1 / top-5 are read from its scores (a fake head with known scores)."""
    g = torch.Generator().manual_seed(0)
    train_f, val_f = torch.randn(40, 3, generator=g) * torch.tensor([0.5, 2.0, 7.0]) + 3, torch.randn(4, 3, generator=g)
    mean, std = train_f.mean(0), train_f.std(0) + 1e-6
    scores = torch.tensor([[9., 1, 2, 3, 4, 5], [0, 9, 1, 2, 3, 4], [9, 0, 8, 1, 2, 3], [9, 8, 7, 0, 6, 5]])
    seen = {}

    def fake_head(xt, y, nc, *a):
        seen["train"] = xt

        def head(v):
            seen["val"] = v
            return scores
        return head
    monkeypatch.setattr(E, "linear_head", fake_head)
    res = E.linear_probe(train_f, torch.zeros(40, dtype=torch.long), val_f, torch.tensor([0, 1, 2, 3]), 6)
    torch.testing.assert_close(seen["train"], (train_f - mean) / std)
    torch.testing.assert_close(seen["val"], (val_f - mean) / std)
    assert res == {"linear_top1": 50.0, "linear_top5": 75.0}      # sample 2 second, sample 3 last of 6


def test_linear_probe_standardises_val_with_the_train_statistics():
    """Val features are standardised with train's mean and std (a val split of one class must not be
    re-centred onto the decision boundary, nor a val split left unstandardised)."""
    g = torch.Generator().manual_seed(0)
    y = torch.arange(200) % 2
    train_f = torch.randn(200, 4, generator=g) * 0.1 + 5.0
    train_f[:, 0] += torch.where(y == 1, 1.0, -1.0)                 # the class is the sign of dim 0 - 5
    val_f = train_f[y == 1][:50]                                      # class 1 only
    res = E.linear_probe(train_f, y, val_f, torch.ones(50, dtype=torch.long), 2, epochs=20, lr=0.1, batch=50)
    assert res["linear_top1"] == 100.0
    res = E.linear_probe(train_f, y, train_f, y, 2, epochs=20, lr=0.1, batch=50)     # both classes (raw val: 50)
    assert res["linear_top1"] == 100.0


def test_flags_reach_the_protocols_and_each_pooling_has_its_own_cached_features(tmp_path, monkeypatch):
    data = tiny_folder(tmp_path / "data")
    ckpt = vit_checkpoint(tmp_path / "c.pth", "can")
    calls = {}
    for name in ("knn", "linear_probe", "lowshot"):
        real = getattr(E, name)
        monkeypatch.setattr(E, name, lambda *a, _n=name, _r=real: (calls.__setitem__(_n, a[5:]), _r(*a))[1])
    E.evaluate(E.Args(ckpt=ckpt, data=data, mode="all", workers=0, pool="mean", k=3, temperature=0.5,
                      linear_epochs=2, linear_lr=0.05, linear_batch=7, shots=2, seeds=2, lambd=0.01))
    assert calls == {"knn": (3, 0.5), "linear_probe": (2, 0.05, 7), "lowshot": (2, 0.0, 2, 0.01, None)}
    feats = tmp_path / "features"
    assert len(os.listdir(feats)) == 2                                # train + val of --pool mean
    cls = E.evaluate(E.Args(ckpt=ckpt, data=data, mode="knn", workers=0, pool="cls", k=3))
    assert len(os.listdir(feats)) == 4                                # --pool cls: its own features
    fresh = E.evaluate(E.Args(ckpt=ckpt, data=data, mode="knn", workers=0, pool="cls", k=3, cache=False))
    assert cls["knn_top1"] == fresh["knn_top1"]


# ----------------------------------------------------------------------------------------------
# What the mutation audit of eval_linear.py found unpinned (each test fails with its line broken)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["msn", "cmae", "conmim", "can"])
def test_the_default_pooling_of_each_method_reaches_the_features(method, tmp_path):
    """README: MSN the [CLS] token before the final norm, the MAE-style methods the mean of the normed
    PATCH tokens ([CLS] left out); evaluate() without --pool extracts exactly that."""
    data = tiny_folder(tmp_path / "data")
    ckpt = vit_checkpoint(tmp_path / "c.pth", method)
    enc, ck = W.load_encoder(ckpt)
    val = C.image_dataset(data, "val")
    f, _ = E.features(E.Args(ckpt=ckpt, data=data, workers=0, cache=False), enc, ck, "val", val, torch.device("cpu"))
    x = torch.stack([C.normalize(E.eval_transform(16)(val.load(i)[0])) for i in range(len(val))])
    with torch.no_grad():
        tok = enc(x, norm=method != "msn")
    torch.testing.assert_close(f, tok[:, 0] if method == "msn" else tok[:, 1:].mean(1))


def test_eval_transform_is_resize_256_over_224_bicubic_then_centre_crop():
    """MAE's evaluation transform (Resize(img * 256 / 224, bicubic) + CenterCrop(img)); the square
    synthetic images are resized whole."""
    from PIL import Image
    from torchvision.transforms import InterpolationMode, functional as TF
    img = Image.fromarray(torch.randint(0, 256, (100, 150, 3), dtype=torch.uint8).numpy())
    for size, resize in ((112, 128), (224, 256)):                                   # 112 * 256 / 224 = 128
        ref = TF.center_crop(TF.resize(img, resize, InterpolationMode.BICUBIC), size)
        assert torch.equal(E.eval_transform(size)(img), TF.pil_to_tensor(ref))
    sq = img.crop((0, 0, 64, 64))
    assert torch.equal(E.eval_transform(32, synthetic=True)(sq), TF.pil_to_tensor(TF.resize(sq, 32)))


def test_features_are_extracted_in_eval_mode_without_drop_path():
    enc = W.ViT(16, 4, 32, 2, 2, drop_path=0.5).train()
    batch = [(torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8), torch.arange(3))]
    pool = lambda e, x: E.features_of(e, x, "cls")                                     # noqa: E731
    f1, y = E.extract_features(enc, batch, torch.device("cpu"), pool)
    f2, _ = E.extract_features(enc.train(), batch, torch.device("cpu"), pool)
    assert torch.equal(f1, f2) and torch.equal(y, torch.arange(3))
    with torch.no_grad():
        torch.testing.assert_close(f1, enc.eval()(C.normalize(batch[0][0]))[:, 0])


def test_the_evaluation_vit_interpolates_its_position_table_bicubically():
    """At another image size the learned table's patch part is resized bicubically (timm / DeiT's
    resample_abs_pos_embed, MSN's interpolate_pos_encoding); [CLS]'s entry is kept."""
    torch.manual_seed(0)
    vit = W.ViT(16, 4, 32, 1, 2).eval()
    big = W.ViT(24, 4, 32, 1, 2).eval()
    sd = vit.state_dict()
    pe = sd["pos_embed"][:, 1:].reshape(1, 4, 4, 32).permute(0, 3, 1, 2)
    pe = F.interpolate(pe, size=(6, 6), mode="bicubic", align_corners=False).permute(0, 2, 3, 1).reshape(1, 36, 32)
    big.load_state_dict({**sd, "pos_embed": torch.cat([sd["pos_embed"][:, :1], pe], 1)})
    x = torch.randn(2, 3, 24, 24)
    with torch.no_grad():
        torch.testing.assert_close(vit(x), big(x))


def test_model_flag_sets_the_heads_of_a_foreign_checkpoint(tmp_path):
    """--model picks timm's heads for the size (ViT-Ti: 3), as does the width alone; the features equal
    the saved ViT's."""
    torch.manual_seed(0)
    enc = W.ViT(16, 4, 192, 1, 3).eval()
    torch.save(enc.state_dict(), tmp_path / "w.pth")
    x = torch.randn(2, 3, 16, 16)
    for model in (None, "tiny"):
        loaded, ck = W.load_encoder(str(tmp_path / "w.pth"), model=model)
        assert ck["vit"]["heads"] == 3
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), enc(x))


def test_random_init_is_drawn_with_the_runs_seed_whatever_the_global_rng(tmp_path):
    ckpt = vit_checkpoint(tmp_path / "c.pth", "cmae")
    ck = torch.load(ckpt, weights_only=True)
    ck["args"]["seed"] = 5
    torch.save(ck, ckpt)
    torch.manual_seed(123)
    a, _ = W.load_encoder(ckpt, random_init=True)
    torch.manual_seed(0)
    ref = W.ViT(**ck["vit"])
    assert not all(torch.equal(v, ref.state_dict()[k]) for k, v in a.state_dict().items())   # not seed 0 (or 123)
    torch.manual_seed(5)
    ref = W.ViT(**ck["vit"])
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in a.state_dict().items())


def test_a_rewritten_checkpoint_of_the_same_size_gets_fresh_features(tmp_path):
    """The cache key holds the checkpoint's mtime: training on writes a file of the same size, whose
    features must not be served from the old file's cache."""
    data = tiny_folder(tmp_path / "data")
    ckpt = vit_checkpoint(tmp_path / "c.pth", "can")
    raw = torch.load(ckpt, weights_only=True)
    C.save_checkpoint(ckpt, raw)
    a = E.Args(ckpt=ckpt, data=data, workers=0)
    val = C.image_dataset(data, "val")
    enc, ck = W.load_encoder(ckpt)
    f1, _ = E.features(a, enc, ck, "val", val, torch.device("cpu"))
    size = os.path.getsize(ckpt)
    for v in raw["encoder"].values():
        v.add_(0.1)                                                  # same tensors, new values
    C.save_checkpoint(ckpt, raw)
    os.utime(ckpt, ns=(os.stat(ckpt).st_atime_ns, os.stat(ckpt).st_mtime_ns + 10**9))
    assert os.path.getsize(ckpt) == size
    enc, ck = W.load_encoder(ckpt)
    f2, _ = E.features(a, enc, ck, "val", val, torch.device("cpu"))
    assert not torch.allclose(f1, f2)



def test_a_dataset_changed_in_place_gets_fresh_features_and_labels(tmp_path):
    """The cache key holds the split's class names and files: an image added to a class, or a class
    renamed, under the same --data path must not be served the old split's features and labels."""
    data = tiny_folder(tmp_path / "data")
    ckpt = vit_checkpoint(tmp_path / "c.pth", "can")
    a = E.Args(ckpt=ckpt, data=data, workers=0)
    enc, ck = W.load_encoder(ckpt)
    def feats():
        return E.features(a, enc, ck, "val", C.image_dataset(data, "val"), torch.device("cpu"))
    f1, y1 = feats()
    shutil.copy(os.path.join(data, "val", "c0", "0.png"), os.path.join(data, "val", "c1", "9.png"))
    f2, y2 = feats()
    assert len(f2) == len(y2) == len(f1) + 1 and y2.tolist() == sorted(y1.tolist() + [1])
    os.rename(os.path.join(data, "val", "c2"), os.path.join(data, "val", "b2"))      # now sorts first: label 0
    f3, y3 = feats()
    assert y3.tolist() == [0] * 3 + [1] * 3 + [2] * 4
    assert len(os.listdir(tmp_path / "features")) == 3

@pytest.mark.parametrize("n", [23, 20, 7])                # batch 10: a partial last batch, none, one batch only
def test_linear_head_is_sgd_momentum_with_a_per_step_cosine_from_zeros(n):
    """The probe's head against a plain re-implementation of its protocol: W, b from 0, mean CE,
    v <- 0.9 v + g, p <- p - lr_t v, lr_t = lr (1 + cos(pi t / steps)) / 2 over steps = epochs x
    ceil(n / batch), reshuffled each epoch."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)
    head = E.linear_head(x, y, 3, epochs=3, lr=0.5, batch=10, seed=4)
    W, b = torch.zeros(3, 5, requires_grad=True), torch.zeros(3, requires_grad=True)
    vel = [torch.zeros(3, 5), torch.zeros(3)]
    gen, t, steps = torch.Generator().manual_seed(4), 0, 3 * math.ceil(n / 10)
    for _ in range(3):
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, 10):
            idx = perm[i:i + 10]
            gW, gb = torch.autograd.grad(F.cross_entropy(x[idx] @ W.T + b, y[idx]), (W, b))
            lr_t = 0.5 * (1 + math.cos(math.pi * t / steps)) / 2
            with torch.no_grad():
                for p, v, gr in zip((W, b), vel, (gW, gb)):
                    v.mul_(0.9).add_(gr)
                    p -= lr_t * v
            t += 1
    torch.testing.assert_close(head.weight.detach(), W.detach())
    torch.testing.assert_close(head.bias.detach(), b.detach())


def test_lowshot_preprocesses_val_as_train_and_draws_one_subset_per_seed(monkeypatch):
    """A per-row shift and positive scale of val changes no prediction (MSN's per-row centring + L2
    normalisation; W is orthogonal to the all-ones direction since the train rows are centred, so even
    raw val rows would give the same argmax). --seeds N: the subsets of seeds 0 .. N-1."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(3, 8, generator=g)
    ytr, yva = torch.arange(3).repeat(5), torch.arange(3).repeat(4)
    tr, va = centres[ytr] + 0.3 * torch.randn(15, 8, generator=g), centres[yva] + 0.3 * torch.randn(12, 8, generator=g)
    res = E.lowshot(tr, ytr, va, yva, 3, shots=2, seeds=2)
    moved = va * torch.linspace(0.5, 3, 12)[:, None] + torch.linspace(-4, 4, 12)[:, None]
    assert E.lowshot(tr, ytr, moved, yva, 3, shots=2, seeds=2) == res
    seeds, real = [], E.lowshot_subset
    monkeypatch.setattr(E, "lowshot_subset", lambda *a: (seeds.append(a[-1]), real(*a))[1])
    E.lowshot(tr, ytr, va, yva, 3, shots=2, seeds=3)
    assert seeds == [0, 1, 2]


def test_a_test_folder_is_evaluated_where_there_is_no_val(tmp_path, monkeypatch):
    """CIFAR-10's folders are train/ and test/: test/ is evaluated where val/ is absent (or by --split),
    by eval_linear and by the training scripts' k-NN monitor, and the error names both when neither is
    there."""
    data = tiny_folder(tmp_path / "data")
    shutil.move(os.path.join(data, "val"), os.path.join(data, "test"))
    train, test, _ = E.splits(data)
    assert len(test) == 9 and all("/test/" in p for p, _ in test.samples)
    ckpt = vit_checkpoint(tmp_path / "c.pth", "cmae")
    res = E.evaluate(E.Args(ckpt=ckpt, data=data, mode="knn", workers=0, k=3, cache=False))
    assert res["split"] == "test"
    queries, real = [], E.knn_neighbours                          # the evaluation's k-NN and the monitor's
    monkeypatch.setattr(E, "knn_neighbours", lambda *a, **kw: (queries.append(len(a[1])), real(*a, **kw))[1])
    from helpers import knn_monitor
    knn_monitor(W.ViT(img_size=16, patch_size=4, dim=32, depth=1, heads=2), data, 16)[0](1)
    assert queries == [9]                                         # the monitor queries test/'s 9 images
    shutil.copytree(os.path.join(data, "test"), os.path.join(data, "val"))
    assert E.eval_split(data) == "val" and E.eval_split(data, "test") == "test"
    for name in ("1.png", "2.png"):                                 # val/ (7 images) and test/ (9) now differ
        os.remove(os.path.join(data, "val", "c0", name))
    for split, n in (("test", 9), (None, 7)):                       # --split test reads test/, the default val/
        queries.clear()
        res = E.evaluate(E.Args(ckpt=ckpt, data=data, split=split, mode="knn", workers=0, k=3, cache=False))
        assert res["split"] == (split or "val") and queries == [n]
    shutil.rmtree(os.path.join(data, "val")), shutil.rmtree(os.path.join(data, "test"))
    with pytest.raises(C.UserError, match="expected train/ and val/ class folders .*test/ folder is used"):
        E.splits(data)
    with pytest.raises(C.UserError, match="expected train/ and test/"):
        E.splits(data, split="test")


def test_pixels_baseline_is_the_centred_normalised_image_through_the_same_knn_and_probe(tmp_path, monkeypatch):
    """--pixels: features = the eval transform's image, normalised, flattened (3 x size^2), minus the train
    mean image; the same k-NN / linear code receives exactly those."""
    data = tiny_folder(tmp_path / "data")
    seen = {}
    knn = E.knn
    monkeypatch.setattr(E, "knn", lambda *a, **kw: seen.update(args=a) or knn(*a, **kw))
    res = E.evaluate(E.Args(pixels=True, img_size=16, data=data, mode="all", workers=0, k=3, linear_epochs=2, seeds=2))
    assert res["method"] == "pixels" and 0 <= res["linear_top1"] <= 100 and 0 <= res["knn_top1"] <= 100
    tf = E.eval_transform(16)
    train, val, mapping = E.splits(data)
    flat = lambda ds: torch.stack([C.normalize(tf(ds.load(i)[0]))[None].flatten() for i in range(len(ds))])  # noqa: E731
    ftr, fva = flat(train), flat(val)
    assert ftr.shape == (18, 3 * 16 * 16)
    mean = ftr.mean(0)
    torch.testing.assert_close(seen["args"][0], ftr - mean)
    torch.testing.assert_close(seen["args"][2], fva - mean)
    assert seen["args"][1].tolist() == [y for _, y in train.samples]
    assert seen["args"][3].tolist() == mapping[torch.tensor([y for _, y in val.samples])].tolist()
    for bad in (dict(pixels=True, data=data), dict(pixels=True, img_size=16, data=data, ckpt="x.pth"),
                dict(pixels=True, img_size=16, data=data, random_init=True)):
        with pytest.raises(C.UserError, match="--pixels evaluates the images themselves"):
            E.evaluate(E.Args(workers=0, **bad))


@pytest.mark.parametrize("method", ["msn", "cmae", "conmim", "can", "siammae"])
def test_random_init_is_the_runs_own_initial_encoder_except_can_and_siammae(method, tmp_path):
    """--random-init (the bare ViT drawn with the run's seed) is the run's own initial encoder, as the
    first checkpoint of a run shows (--stop-step 1: at lr 0 in an MAE-style warm-up; MSN's and ConMIM's
    evaluated networks are EMA targets); CAN's and SiamMAE's training models draw the whole model at
    once, so there it is another draw, as docs/RESULTS.md and eval_video's docstring say."""
    import importlib
    mod, tiny = importlib.import_module(method), importlib.import_module(f"test_{method}").tiny_args
    mod.train(tiny(tmp_path, stop_step=1))
    path = str(tmp_path / "checkpoint.pth")
    start, (enc, _) = C.load_checkpoint(path)["encoder"], W.load_encoder(path, random_init=True)
    diff = max((enc.state_dict()[k] - v.float()).abs().max().item() for k, v in start.items())
    assert (diff < 1e-6) == (method not in ("can", "siammae")), diff


def test_a_rank_left_without_an_image_still_takes_part_in_the_monitors_gather(tmp_path, monkeypatch):
    """Fewer val (or --holdout) images than processes: the rank whose strided share is empty extracts nothing, pads
    and joins the gather (it crashed on torch.cat([]) and took the run down: 2 processes, 1 val image). Rank 1 of 2
    here, the gather standing in for the collective."""
    import shutil
    data = tiny_folder(tmp_path / "d")
    os.makedirs(tmp_path / "one" / "c0")
    shutil.copy(os.path.join(data, "val", "c0", "0.png"), tmp_path / "one" / "c0")
    one = C.ImageFiles(str(tmp_path / "one"))                           # 1 image, 2 ranks
    enc = W.ViT(16, 4, 32, 1, 2).eval()
    monkeypatch.setattr(C, "world_size", lambda: 2)
    monkeypatch.setattr(C, "rank", lambda: 1)
    gathered = []
    monkeypatch.setattr(C, "all_gather", lambda t, grad=False: gathered.append(t) or torch.cat([t, t]))
    feats, labels = E.sharded_features(enc, one, 16, "mean", torch.device("cpu"))
    assert feats.shape == (1, 32) and labels.shape == (1,) and gathered[0].shape == (1, 32)


def _monitor_score(rank, world, data, state):
    from helpers import knn_monitor
    enc = W.ViT(img_size=16, patch_size=4, dim=32, depth=1, heads=2)
    enc.load_state_dict(state)
    gathered = []
    real = C.all_gather
    C.all_gather = lambda t, grad=True: gathered.append(tuple(t.shape)) or real(t, grad)
    return knn_monitor(enc, data, 16)[0](3), gathered


def test_the_monitors_score_in_two_processes_is_the_one_process_score_and_the_bank_is_never_gathered(tmp_path):
    """The k-NN monitor in 2 gloo processes: each scores its half of the bank (9 of 18 train images, fewer than k 20:
    padded) against every query and the candidates are merged: the same top-1 / top-5 as one process and as
    eval_linear's k-NN; what crosses between processes is the queries and (n_val, k) candidates, never the bank
    (ImageNet at width 768 gathered to every rank: 4 GB each)."""
    from ddp import spawn
    from helpers import knn_monitor
    data = tiny_folder(tmp_path / "d")                              # 18 train, 9 val images, 3 classes
    torch.manual_seed(0)
    enc = W.ViT(img_size=16, patch_size=4, dim=32, depth=1, heads=2)
    one = knn_monitor(enc, data, 16)[0](3)
    (r0, g0), (r1, g1) = spawn(_monitor_score, data, enc.state_dict())
    assert r0 == pytest.approx(one) and r1 is None and 0 < one["knn_top1"] < 100
    assert g0 == g1 == [(5, 32), (5,), (9, 20), (9, 20)]         # val's share (5 of 9), then 9 x k candidates


def _sharded_votes(rank, world, bank, labels, queries):
    votes = []
    real = E.knn_votes
    E.knn_votes = lambda *a, **kw: votes.append(real(*a, **kw)) or votes[-1]
    E.sharded_knn(bank[rank::world], labels[rank::world], len(bank), queries, torch.zeros(len(queries), dtype=int), 6,
                  torch.device("cpu"))
    return votes[0]


@pytest.mark.parametrize("n_bank", [60, 30, 7])
def test_sharded_knn_votes_equal_one_process_votes(n_bank):
    """sharded_knn's class scores in 2 processes, each with its strided half of the bank, equal knn_predict's on the
    whole bank: a share of 30 (above k 20), of 15 (below: padded, the padding never kept) and a bank of 7 (below k)."""
    from ddp import spawn
    g = torch.Generator().manual_seed(n_bank)
    bank, queries = torch.randn(n_bank, 8, generator=g), torch.randn(40, 8, generator=g)
    labels = torch.randint(0, 6, (n_bank,), generator=g)
    one = E.knn_predict(F.normalize(bank, dim=1), labels, F.normalize(queries, dim=1), 6)
    v0, v1 = spawn(_sharded_votes, bank, labels, queries)
    torch.testing.assert_close(v0, one), torch.testing.assert_close(v1, one)
