"""Frozen-feature evaluation of any image checkpoint (msn, cmae, conmim, can): k-NN, linear probe,
low-shot logistic regression.

  python eval_linear.py --ckpt runs/msn/checkpoint.pth --data /imagenet --mode all
  python eval_linear.py --ckpt runs/msn/checkpoint.pth --data synthetic --mode all
  python eval_linear.py --ckpt runs/msn/checkpoint.pth --data synthetic --random-init   # baseline

The checkpoint's `encoder` (the network the paper evaluates) is rebuilt from its `vit` config.
Features are computed once (Resize img*256/224 + CenterCrop, bf16 on GPU) and cached under
<ckpt dir>/features/, keyed by checkpoint file (path, size, mtime), pooling, image size and split.
Pooling default per method: CLS for MSN (as its paper), mean of patch tokens for the MAE-style
methods (CMAE, ConMIM, CAN).

Modes.
  knn     weighted k-NN (k=20, T=0.07, cosine on L2-normalised features), top-1 / top-5
  linear  linear classifier on standardised features, SGD + momentum, cosine lr, top-1 / top-5
  lowshot MSN protocol: features centred (train mean) and L2-normalised, multinomial logistic
          regression with an L2 penalty (full-batch L-BFGS), on --shots images per class or
          --percent % of the train set, over --seeds random subsets: mean +- std top-1
  all     all of the above
"""
import hashlib
import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import common as C

DEFAULT_POOL = {"msn": "cls", "cmae": "mean", "conmim": "mean", "can": "mean", "siammae": "mean"}


@dataclass
class Args:
    """Frozen-feature evaluation (k-NN / linear / low-shot) of a checkpoint's encoder."""
    ckpt: str = field(default=None, metadata={"help": "checkpoint.pth written by one of the method files"})
    data: str = field(default=None, metadata={"help": "image folder with train/ and val/, or 'synthetic'"})
    mode: str = field(default="knn", metadata={"help": "knn | linear | lowshot | all"})
    pool: str = field(default=None, metadata={"help": "cls | mean (default: per method)"})
    img_size: int = field(default=None, metadata={"help": "default: the checkpoint's training size"})
    random_init: bool = field(default=False, metadata={"help": "evaluate the same ViT at its default random "
                              "initialisation (run's seed; may differ from the run's exact initial weights)"})
    k: int = 20
    temperature: float = 0.07
    linear_epochs: int = 100
    linear_lr: float = 0.1
    linear_batch: int = 1024
    shots: int = field(default=1, metadata={"help": "images per class for lowshot (ignored with --percent)"})
    percent: float = field(default=0.0, metadata={"help": "use this %% of train images per class for lowshot"})
    seeds: int = field(default=3, metadata={"help": "random subsets for lowshot"})
    lambd: float = field(default=0.0025, metadata={"help": "L2 penalty of the logistic regression"})
    batch_size: int = 256
    workers: int = field(default=min(8, os.cpu_count() or 1), metadata={"help": "DataLoader workers (default: min(8, CPUs))"})
    device: str = None
    cache: bool = field(default=True, metadata={"help": "cache features next to the checkpoint"})


def features(a, enc, ckpt, split, device):
    """(N, D) float features and (N,) labels of a split, cached on disk."""
    pool = a.pool or DEFAULT_POOL.get(ckpt["method"], "cls")
    size = a.img_size or ckpt["vit"]["img_size"]
    st = os.stat(a.ckpt)
    key = hashlib.sha1(json.dumps([os.path.abspath(a.ckpt), st.st_size, st.st_mtime_ns, pool, size, a.data,
                                   a.random_init]).encode()).hexdigest()[:16]
    path = os.path.join(os.path.dirname(os.path.abspath(a.ckpt)), "features", f"{key}_{split}.pt")
    if a.cache and os.path.isfile(path):
        return torch.load(path, weights_only=True)
    ds = C.image_dataset(a.data, split)
    if ds is None:
        raise C.UserError(f"--data {a.data}: no {split}/ folder (evaluation needs train/ and val/)")
    tf = C.eval_transform(size, synthetic=a.data == "synthetic")
    dl = torch.utils.data.DataLoader(C.Views(ds, tf), a.batch_size, num_workers=a.workers)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    out = C.extract_features(enc, dl, device, pool, autocast)
    if a.cache:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        C.save_checkpoint(path, out)
    return out


def topk(scores, y, k):
    return 100.0 * (scores.topk(min(k, scores.shape[1]), dim=1).indices == y[:, None]).any(1).float().mean().item()


def knn(train_f, train_y, val_f, val_y, num_classes, k=20, T=0.07):
    s = C.knn_predict(F.normalize(train_f, dim=1), train_y, F.normalize(val_f, dim=1), num_classes, k, T)
    return {"knn_top1": topk(s, val_y, 1), "knn_top5": topk(s, val_y, 5)}


def linear_probe(train_f, train_y, val_f, val_y, num_classes, epochs=100, lr=0.1, batch=1024, seed=0):
    mean, std = train_f.mean(0), train_f.std(0) + 1e-6
    xt, xv = (train_f - mean) / std, (val_f - mean) / std
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(xt.shape[1], num_classes)
    torch.nn.init.zeros_(head.weight), torch.nn.init.zeros_(head.bias)
    opt = torch.optim.SGD(head.parameters(), lr=lr, momentum=0.9)
    steps = epochs * max(1, (len(xt) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(epochs):
        perm = torch.randperm(len(xt), generator=g)
        for i in range(0, len(xt), batch):
            idx = perm[i:i + batch]
            loss = F.cross_entropy(head(xt[idx]), train_y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    with torch.no_grad():
        s = head(xv)
    return {"linear_top1": topk(s, val_y, 1), "linear_top5": topk(s, val_y, 5)}


def logistic_regression(x, y, num_classes, lambd=0.0025, iters=300):
    """Multinomial logistic regression, mean CE + lambd/2 ||W||^2 (bias unpenalised), full-batch L-BFGS."""
    W = torch.zeros(x.shape[1], num_classes, requires_grad=True)
    b = torch.zeros(num_classes, requires_grad=True)
    opt = torch.optim.LBFGS([W, b], lr=1, max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(x @ W + b, y) + 0.5 * lambd * (W ** 2).sum()
        loss.backward()
        return loss
    opt.step(closure)
    return lambda z: z @ W.detach() + b.detach()


def lowshot_subset(labels, num_classes, shots=1, percent=0.0, seed=0):
    """Indices of `shots` images per class (or percent% of each class, >= 1), drawn with `seed`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for c in range(num_classes):
        idx = (labels == c).nonzero().flatten()
        n = max(1, round(len(idx) * percent / 100)) if percent else shots
        if len(idx) < n:
            raise C.UserError(f"class {c} has {len(idx)} train images, fewer than the {n} asked for")
        out.append(idx[torch.randperm(len(idx), generator=g)[:n]])
    return torch.cat(out)


def lowshot(train_f, train_y, val_f, val_y, num_classes, shots=1, percent=0.0, seeds=3, lambd=0.0025):
    accs = []
    for s in range(seeds):
        idx = lowshot_subset(train_y, num_classes, shots, percent, s)
        mean = train_f[idx].mean(0)
        xt, xv = F.normalize(train_f[idx] - mean, dim=1), F.normalize(val_f - mean, dim=1)
        clf = logistic_regression(xt, train_y[idx], num_classes, lambd)
        accs.append(topk(clf(xv), val_y, 1))
    t = torch.tensor(accs)
    name = f"lowshot_{percent:g}pct" if percent else f"lowshot_{shots}shot"
    return {f"{name}_mean": t.mean().item(), f"{name}_std": t.std().item() if seeds > 1 else 0.0}


def evaluate(a):
    if not a.ckpt:
        raise C.UserError("--ckpt is required (a checkpoint.pth written by msn/cmae/conmim/can.py)")
    if not a.data:
        raise C.UserError("--data is required: an image folder with train/ and val/, or 'synthetic'")
    if a.mode not in ("knn", "linear", "lowshot", "all"):
        raise C.UserError(f"--mode must be knn, linear, lowshot or all, got {a.mode!r}")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    enc, ckpt = C.load_encoder(a.ckpt, a.random_init)
    enc = enc.to(device)
    (ftr, ytr), (fva, yva) = (features(a, enc, ckpt, s, device) for s in ("train", "val"))
    nc = int(max(ytr.max(), yva.max())) + 1
    res = {"method": ckpt["method"], "ckpt": a.ckpt, "random_init": a.random_init,
           "pool": a.pool or DEFAULT_POOL.get(ckpt["method"], "cls")}
    if a.mode in ("knn", "all"):
        res.update(knn(ftr, ytr, fva, yva, nc, a.k, a.temperature))
    if a.mode in ("linear", "all"):
        res.update(linear_probe(ftr, ytr, fva, yva, nc, a.linear_epochs, a.linear_lr, a.linear_batch))
    if a.mode in ("lowshot", "all"):
        res.update(lowshot(ftr, ytr, fva, yva, nc, a.shots, a.percent, a.seeds, a.lambd))
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}))
    return res


if __name__ == "__main__":
    C.main(evaluate, Args)
