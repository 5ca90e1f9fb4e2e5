"""eval_linear.py: k-NN vs naive, logistic regression on separable data, exact low-shot subsets,
every image method's checkpoint evaluates, feature cache, bad checkpoints."""
import importlib
import math
import os

import pytest
import torch

import common as C
import synthetic as S
import eval_linear as E
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


def test_msn_features_are_the_cls_token_before_the_final_norm():
    enc = E.ViT(16, 4, 32, 2, 2).eval()
    x = torch.randn(3, 3, 16, 16)
    assert E.DEFAULT_POOL["msn"] == "cls-prenorm"
    torch.testing.assert_close(E.features_of(enc, x, "cls-prenorm"), enc(x, norm=False)[:, 0])
    torch.testing.assert_close(E.features_of(enc, x, "cls"), enc.norm(enc(x, norm=False))[:, 0])


@pytest.mark.parametrize("shots,percent", [(1, 0), (2, 0), (5, 0), (0, 10)])
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
                       epochs=1, steps_per_epoch=1, batch_size=4, workers=0, knn=False, warmup_epochs=0, **TINY[method]))
    ckpt = str(tmp_path / "run" / "checkpoint.pth")
    res = E.evaluate(E.Args(ckpt=ckpt, data=data, mode="all", workers=0, k=3, linear_epochs=2, seeds=2))
    assert res["method"] == method and res["pool"] == E.DEFAULT_POOL[method]
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


def test_bad_checkpoints(tmp_path):
    one_line_error(run_cli("eval_linear.py", "--ckpt", str(tmp_path / "missing.pth"), "--data", "synthetic"), "does not exist")
    (tmp_path / "junk.pth").write_bytes(b"junk")
    one_line_error(run_cli("eval_linear.py", "--ckpt", str(tmp_path / "junk.pth"), "--data", "synthetic"), "not a readable checkpoint")
    torch.save({"state_dict": {}}, tmp_path / "foreign.pth")
    one_line_error(run_cli("eval_linear.py", "--ckpt", str(tmp_path / "foreign.pth"), "--data", "synthetic"), "unknown checkpoint layout")


def test_knn_predict_matches_naive():
    g = torch.Generator().manual_seed(0)
    tr = torch.nn.functional.normalize(torch.randn(30, 5, generator=g), dim=1)
    ytr = torch.randint(0, 3, (30,), generator=g)
    te = torch.nn.functional.normalize(torch.randn(7, 5, generator=g), dim=1)
    scores = E.knn_predict(tr, ytr, te, 3, k=4, T=0.5)
    for i in range(7):
        sims = [(float(te[i] @ tr[j]), j) for j in range(30)]
        top = sorted(sims, reverse=True)[:4]
        naive = [sum(math.exp(s / 0.5) for s, j in top if ytr[j] == c) for c in range(3)]
        assert torch.allclose(scores[i], torch.tensor(naive), rtol=1e-4)


def test_linear_probe_standardises_val_with_the_train_statistics():
    """Val features are standardised with train's mean and std (a val split of one class must not be
    re-centred onto the decision boundary)."""
    g = torch.Generator().manual_seed(0)
    y = torch.arange(200) % 2
    train_f = torch.randn(200, 4, generator=g) * 0.1 + 5.0
    train_f[:, 0] += torch.where(y == 1, 1.0, -1.0)                 # the class is the sign of dim 0 - 5
    val_f = train_f[y == 1][:50]                                      # class 1 only
    res = E.linear_probe(train_f, y, val_f, torch.ones(50, dtype=torch.long), 2, epochs=20, lr=0.1, batch=50)
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
