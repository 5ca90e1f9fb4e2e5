"""Frozen-feature evaluation of any image checkpoint (msn, cmae, conmim, can): k-NN, linear probe,
low-shot logistic regression.

  python eval_linear.py --ckpt runs/msn/checkpoint.pth --data /imagenet --mode all
  python eval_linear.py --ckpt runs/msn/checkpoint.pth --data /imagenet --mode lowshot \
      --subset-file msn/imagenet_subsets1/5imgs_class.txt          # MSN's official 5-image split
  python eval_linear.py --ckpt runs/msn/checkpoint.pth --data synthetic --mode all
  python eval_linear.py --ckpt runs/msn/checkpoint.pth --data synthetic --random-init   # baseline
  python eval_linear.py --pixels --img-size 32 --data /cifar10 --mode all       # raw pixels

The checkpoint's `encoder` (the network the paper evaluates) is rebuilt from its `vit` config.
Features are computed once (Resize img*256/224, bicubic, + CenterCrop; bf16 on GPU) and cached
under <ckpt dir>/features/, keyed by checkpoint file (path, size, mtime), pooling, image size and
split. Pooling default per method: for MSN the CLS token BEFORE the final LayerNorm, as MSN's
logistic_eval.py and linear_eval.py (deit.forward_blocks with 1 block: the last block's CLS, no
norm); the mean of the (normed) patch tokens for the MAE-style methods (CMAE, ConMIM, CAN).

Modes.
  knn     weighted k-NN (k=20, T=0.07, cosine on L2-normalised features), top-1 / top-5; classes
          that got no vote never count as a top-5 hit (matters when k < 5)
  linear  linear classifier on standardised cached centre-crop features, SGD + momentum 0.9, cosine
          lr, 100 epochs, batch 1024, top-1 / top-5. NOT MAE's protocol (LARS, BatchNorm without
          affine, RandomResizedCrop + flip, 90 epochs, batch 16384) nor MSN's (SGD on the pre-norm
          CLS with random crops): a fast, deterministic frozen-feature probe; compare numbers
          across checkpoints with it, not with the papers' linear-probe tables.
  lowshot MSN's protocol (logistic_eval.py with cyanure): each feature row centred (its own mean
          subtracted) and L2-normalised (cyanure preprocess(normalize=True, columns=False,
          centering=True)); multinomial logistic regression without intercept minimising
          mean CE + (lambd / n) / 2 ||W||^2, n = number of training images (MSN passes --lambd
          0.0025 and divides it by n), solved full-batch by L-BFGS. Training images: --shots per
          class or --percent % of each class over --seeds random subsets (mean +- std), or the
          images listed in --subset-file (MSN's imagenet_subsets*/*.txt format: one file name or
          relative path per line).
  all     all of the above

Baselines. --random-init: the checkpoint's ViT at its initialisation. --pixels (no checkpoint): the
image itself, resized and cropped as above and normalised, flattened to 3 x size^2 numbers and
centred by the train split's mean image, through the same k-NN / linear / low-shot (centring
matters for the cosine k-NN; the linear probe standardises anyway).

Protocol differences from the official evaluations, not fixed: MSN resizes bilinearly to 256,
we resize bicubically to img*256/224 (= 256 at 224) for every method, as MAE's evaluation does.
cyanure's solver (tol 1e-3, at most 300 epochs) is replaced by L-BFGS on the same objective.
"""
import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

import common as C
import harness as H
import weights

POOLS = ("cls", "cls-prenorm", "mean")


@dataclass
class Args:
    """Frozen-feature evaluation (k-NN / linear / low-shot) of a checkpoint's encoder."""
    ckpt: str = H.arg(None, "checkpoint.pth written by one of the method files, the official MSN "
                      "file, an MAE-style ('model') file or a timm/DeiT ViT state dict",
                      group="model")
    data: str = H.arg(None, "image folder with train/ and val/ (or test/), or 'synthetic'",
                      group="data")
    split: str = H.arg(None, "the folder next to train/ that is evaluated (default: val/, else "
                       "test/ where there is no val/, as in CIFAR-10's folders)", group="data")
    pixels: bool = H.arg(False, "the raw-pixel baseline instead of a checkpoint: the normalised "
                         "image, flattened and centred by the train mean (needs --img-size)")
    mode: str = H.arg("knn", "knn | linear | lowshot | all | embed (the features of the images "
                      "under --data, any folder, into --output)")
    output: str = H.arg(None, "--mode embed: the folder for features.npy (N, D) and files.txt "
                        "(paths under --data)", group="run control")
    tokens: bool = H.arg(False, "--mode embed: also tokens.npy (N, h, w, D), each image's "
                         "last-block patch tokens after the final norm (eval_dense.py's)")
    export: str = H.arg(None, "write the encoder alone to this folder (encoder.pth, "
                        "encoder.safetensors where that package is, config.json: timm's model, "
                        "the pooling, mean / std), then exit", group="model")
    pool: str = H.arg(None, "cls | cls-prenorm | mean (default: per method)", group="model")
    img_size: int = H.arg(None, "training image size (px) (default: the checkpoint's training "
                          "size)", group="data", positive=True)
    model: str = H.arg(None, "ViT size (tiny|small|base|large): picks the heads of a foreign "
                       "checkpoint of non-standard width; checked against any checkpoint",
                       group="model")
    patch_size: int = H.arg(None, "checked against the checkpoint's patch size", group="model",
                            positive=True)
    random_init: bool = H.arg(False, "evaluate the same ViT at its default random initialisation "
                              "(run's seed; may differ from the run's exact initial weights)",
                              group="model")
    online: bool = H.arg(False, "evaluate the online network's encoder (the checkpoint's `model`) "
                         "instead of the one the paper evaluates (MSN's EMA target, ConMIM's "
                         "teacher)")
    holdout: int = H.arg(0, "evaluate the N train/ images that a --holdout N run kept out (the "
                         "k-NN bank: the other train/ images): the lr sweep's validation, never "
                         "test/", group="data", min=0)
    k: int = H.arg(20, "neighbours of the k-NN", positive=True)
    temperature: float = H.arg(0.07, "softmax temperature", positive=True)
    linear_epochs: int = H.arg(100, "linear probe epochs", positive=True)
    linear_lr: float = H.arg(0.1, "linear probe peak lr", positive=True)
    linear_batch: int = H.arg(1024, "linear probe batch", positive=True)
    shots: int = H.arg(1, "images per class for lowshot (ignored with --percent)", positive=True)
    percent: float = H.arg(0.0, "use this %% of train images per class for lowshot", min=0)
    seeds: int = H.arg(3, "random subsets for lowshot", positive=True)
    lambd: float = H.arg(0.0025, "L2 penalty of the logistic regression, divided by the number of "
                         "training images (MSN protocol)", min=0)
    subset_file: str = H.arg(None, "lowshot: train only on the images listed here (one file name "
                             "or relative path per line, as MSN's imagenet_subsets)", group="data")
    batch_size: int = H.arg(256, "images per batch", group="optimisation", positive=True)
    workers: int = H.arg(min(8, os.cpu_count() or 1), "DataLoader workers (default: min(8, CPUs))",
                         group="data", min=0)
    device: str = H.arg(None, "cpu | cuda | cuda:N (default: cuda if available)",
                        group="run control")
    cache: bool = H.arg(True, "cache features next to the checkpoint", group="run control")


class Pixels(nn.Module):
    """The raw-pixel baseline (--pixels) in the encoder's place: (B, 3, H, W) -> (B, 3HW), the
    normalised image itself (evaluate() centres it by the train split's mean image)."""
    patch_size = 1

    def forward(self, x, norm=True):
        return x.flatten(1)


def features_of(encoder, x, how, tokens=False):
    """(B, C, H, W) -> (B, D): "cls" the CLS token after the final norm, "cls-prenorm" before it
    (MSN's evaluations), "mean" the mean of the normed patch tokens. tokens (--mode embed
    --tokens, one forward): (B, 1 + N, D), that feature, then the patch tokens after the norm."""
    if how not in POOLS:
        raise C.UserError(f"--pool must be one of {', '.join(POOLS)}, got {how!r}")
    if isinstance(encoder, Pixels):
        return encoder(x)
    if not tokens:
        t = encoder(x, norm=how != "cls-prenorm")
        return t[:, 1:].mean(1) if how == "mean" else t[:, 0]
    pre = encoder(x, norm=False)
    t = encoder.norm(pre)
    f = pre[:, 0] if how == "cls-prenorm" else t[:, 1:].mean(1) if how == "mean" else t[:, 0]
    return torch.cat([f[:, None], t[:, 1:]], 1)


class Progress:
    """A phase that can take long (feature extraction, a probe's epochs, propagation): `what i/total
    (pct), elapsed, eta` at most every `every` seconds (rank 0), and a closing line with its time.
    progress.step(n) after each unit; use as a context manager or call done()."""

    def __init__(self, what, total, every=10.0):
        self.what = what
        self.total = max(1, total)
        self.every = every
        self.i = 0
        self.t0 = self.t = time.time()

    def step(self, n=1):
        self.i += n
        now = time.time()
        if now - self.t >= self.every and self.i < self.total:
            self.t = now
            eta = (now - self.t0) / self.i * (self.total - self.i)
            C.print0(f"{self.what}: {self.i}/{self.total} ({100 * self.i / self.total:.0f}%), "
                   f"{now - self.t0:.0f} s, eta {eta:.0f} s")

    def done(self):
        if time.time() - self.t0 >= self.every:                     # said only for phases that were long
            C.print0(f"{self.what}: done in {time.time() - self.t0:.0f} s")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.done()


# ----------------------------------------------------------------------------------------------
# Features and weighted k-NN (InstDisc / DINO protocol; also the training scripts' k-NN monitor)
# ----------------------------------------------------------------------------------------------
def eval_transform(img_size, synthetic=False):
    """Resize (img*256/224) + centre crop, as uint8; synthetic images are simply resized."""
    from torchvision import transforms as T
    if synthetic:
        return T.Compose([T.Resize(img_size), C.to_uint8])
    resize = T.Resize(int(img_size * 256 / 224), interpolation=T.InterpolationMode.BICUBIC)
    return T.Compose([resize, T.CenterCrop(img_size), C.to_uint8])


@torch.no_grad()
def knn_predict(train_f, train_y, test_f, num_classes, k=20, T=0.07, chunk=1024):
    """Cosine similarity top-k, votes weighted by exp(sim / T); returns (n_test, C) class scores
    (knn_votes)."""
    s, idx = knn_neighbours(train_f, test_f, k, chunk)
    return knn_votes(s, train_y[idx], num_classes, T)


def knn_neighbours(train_f, test_f, k=20, chunk=1024):
    """Each query's min(k, n_train) largest similarities test_f @ train_f.T, sorted, and their train
    rows: (n_test, k) each, computed chunk queries at a time (chunk x n_train similarities in
    memory)."""
    out = [(test_f[i:i + chunk] @ train_f.T).topk(min(k, len(train_f)), dim=1)   # (b, n_train) -> (b, k)
           for i in range(0, len(test_f), chunk)]
    return torch.cat([s for s, _ in out]), torch.cat([i for _, i in out])


def knn_votes(s, labels, num_classes, T=0.07):
    """(n, C) class scores of neighbours with sorted similarities s and labels (n, k): votes
    weighted by exp(sim / T), each query's up to the factor exp(its largest sim / T) (subtracted
    before exp: at T 0.01 exp(1 / T) overflows float32), and -inf for a class that got no vote."""
    weight = ((s - s[:, :1]) / T).exp()                               # (n, k), in (0, 1]
    onehot = F.one_hot(labels, num_classes).float()                   # (n, k, C)
    votes = (onehot * weight.unsqueeze(-1)).sum(1)
    return votes.masked_fill(onehot.sum(1) == 0, float("-inf"))


@torch.no_grad()
def extract_features(encoder, loader, device, features, autocast=contextlib.nullcontext()):
    """(N, D) raw (un-normalised) features features(encoder, x) of a loader's normalised images, and
    the (N,) labels; the encoder in eval mode."""
    encoder.eval()
    feats, labels = [], []
    n = len(getattr(loader, "dataset", loader))
    with Progress(f"features of {n} images", len(loader)) as progress:
        for x, y in loader:
            with autocast:
                x = C.normalize(x.to(device, non_blocking=True))
                feats.append(features(encoder, x).float().cpu())
            labels.append(y)
            progress.step()
    feats = torch.cat(feats)
    if not torch.isfinite(feats).all():
        rows = (~torch.isfinite(feats)).any(1).sum()
        raise C.UserError(f"the encoder gave NaN or infinite features for {rows} of {len(feats)} "
                          "images (its weights are finite: an overflow, e.g. of bf16 activations; "
                          "try --device cpu)")
    return feats, torch.cat(labels)


def check_readable(ds, workers=0, batch_size=256):
    """Read every image of ds once (a DataLoader of `workers`): an unreadable one is its one-line
    error now, at the start (of fine-tuning, of a run's k-NN monitor), not when an evaluation after
    an epoch of training reaches it."""
    every = torch.utils.data.DataLoader(C.Views(ds, lambda img: 0), batch_size, num_workers=workers)
    for _ in every:
        pass


def val_to_train(train, val):
    """(len(val.classes),) the train index of each val class, matched BY NAME (-1: train lacks
    it)."""
    index = {c: i for i, c in enumerate(train.classes)}
    return torch.tensor([index.get(c, -1) for c in val.classes])


@torch.no_grad()
def share_features(encoder, ds, size, pool, device, autocast=contextlib.nullcontext(), workers=0,
                   synthetic=False):
    """extract_features of this process's strided share of ds (images r, r + world, ...; none where
    ds has fewer images than processes): the k-NN monitor's, every process extracting at once.
    Returns (feats, labels) on CPU."""
    mine = range(C.rank(), len(ds), C.world_size())
    viewed = C.Views(ds, eval_transform(size, synthetic))
    share = torch.utils.data.Subset(viewed, mine or range(1))       # none: the first image's width, 0 rows
    loader = torch.utils.data.DataLoader(share, 256, num_workers=workers)
    feats, labels = extract_features(encoder, loader, device, lambda e, x: features_of(e, x, pool),
                                     autocast)
    return feats[:len(mine)], labels[:len(mine)]


def sharded_features(encoder, ds, size, pool, device, autocast=contextlib.nullcontext(), workers=0,
                     synthetic=False):
    """share_features of every process, gathered in ds's order on every rank (the monitor's
    queries)."""
    feats, labels = share_features(encoder, ds, size, pool, device, autocast, workers, synthetic)
    world = C.world_size()
    if world == 1:
        return feats, labels
    rows = -(-len(ds) // world)                                      # the largest share: every rank pads to it
    padded = [torch.cat([t.to(device), t.new_zeros(rows - len(t), *t.shape[1:]).to(device)])
              for t in (feats, labels)]
    gathered = [C.all_gather(t, grad=False).view(world, rows, *t.shape[1:]) for t in padded]
    out = [torch.empty(len(ds), *g.shape[2:], dtype=g.dtype) for g in gathered]
    for r in range(world):
        n = len(range(r, len(ds), world))
        for o, g in zip(out, gathered):
            o[r::world] = g[r, :n].cpu()
    return out[0], out[1]


def sharded_knn(bank_f, bank_y, n_bank, query_f, query_y, num_classes, device, k=20, T=0.07,
                chunk=1024):
    """knn() with the bank split over the processes: each holds its share (bank_f, bank_y: about
    n_bank / world rows) and every query, finds its share's k nearest on `device` (chunk x share
    similarities at a time) and the (n_query, k) candidates of every process are gathered and merged
    to the k nearest of the whole bank: the score of one process, the bank never gathered (ImageNet
    at width 768: 4 GB a rank) and no rank scoring alone while the others wait in a collective.
    Returns knn()'s dict on every rank."""
    bank = F.normalize(bank_f.to(device), dim=1)
    s, idx = knn_neighbours(bank, F.normalize(query_f.to(device), dim=1), k, chunk)     # (n_query, <= k)
    labels = bank_y.to(device)[idx]
    world = C.world_size()
    if world > 1:                                                    # a share of fewer than k images: padded
        pad = k - s.shape[1]                                         # with -inf, never among the k kept
        s = torch.cat([s, s.new_full((len(s), pad), float("-inf"))], 1)
        labels = torch.cat([labels, labels.new_zeros(len(s), pad)], 1)
        n = len(s)
        s, labels = (C.all_gather(t.contiguous(), grad=False).view(world, n, k).transpose(0, 1)
                     .reshape(n, world * k) for t in (s, labels))   # (n_query, world * k)
        s, j = s.topk(min(k, n_bank), dim=1)
        labels = labels.gather(1, j)
    scores = knn_votes(s, labels, num_classes, T).cpu()
    return {"knn_top1": topk(scores, query_y, 1), "knn_top5": topk(scores, query_y, 5)}


class KNNMonitor:
    """--knn / --eval-every N of a training script: the k-NN (this file's: eval transform, the
    method's pooling, k 20, T 0.07) of the encoder the run evaluates, train/ the bank and val/
    (else test/) the queries, or with --holdout the run's training images the bank and its held-out
    ones the queries. The method's loop calls it at step 0 (the initial encoder), every N steps
    (due()) and at the end, each logged as knn_top1 / knn_top5 with its step. Each process extracts
    a share of the bank and of the queries and scores its bank share against every query on its
    device (sharded_knn: n_train / world bank rows and the n_val queries a process, 3 KB each at
    width 768; ImageNet on 8 GPUs: 0.5 + 0.15 GB). Its RNG is its own: the run trains the same
    weights without it."""

    def __init__(self, args, run, log, encoder, method, what):
        self.run = run
        self.log = log
        self.encoder = encoder
        self.what = what
        self.every = args.eval_every
        self.size = args.img_size
        self.pool = weights.DEFAULT_POOL[method]
        self.stop_step = getattr(args, "stop_step", 0)
        self.synthetic = args.data == "synthetic"
        self.workers = args.workers
        skip = getattr(args, "max_unreadable", 0) > 0                # the bank as training reads it
        try:                                                         # the layout, checked before any step
            self.train, self.val, self.to_train = splits(args.data, skip, holdout=args.holdout)
        except C.UserError as e:
            raise C.UserError(f"--knn / --eval-every: {e}") from None
        self.split = eval_split(args.data, holdout=args.holdout)
        check_readable(self.val, args.workers)                      # an unreadable query: now, not at step N
        self.first = None

    def due(self, step):
        """A step the monitor evaluates in the loop, after that step's checkpoint where one is
        written: every N steps but the invocation's last, which the loop evaluates after the final
        checkpoint, unless --stop-step ends the run there (the loop returns first); never once a
        stop signal came (the checkpoint, then the exit)."""
        if not self.every or step % self.every or self.run.control.signal:
            return False
        return step < self.log.end or step == self.stop_step

    def __call__(self, step, save=None):
        """The k-NN of the encoder as it stands at `step`. save (the loop's): the checkpoint of this
        step is written first, so a stop signal during the evaluation ends the program at once,
        losing nothing (it waited for the whole k-NN, minutes on CPU, past a cluster's grace period,
        with nothing saved)."""
        t0 = time.time()
        if save is not None and self.run.guard.saved != step:
            save(step)
        devices = [self.run.device] if self.run.device.type == "cuda" else []
        ctl = self.run.control
        trained = ctl.trained
        ctl.trained = self.run.ckpt if save is not None else trained  # read by the signal handler
        try:
            with torch.random.fork_rng(devices=devices):            # the training draws stay as without it
                was = self.encoder.training
                how = (self.size, self.pool, self.run.device, self.run.autocast, self.workers,
                       self.synthetic)
                ftr, ytr = share_features(self.encoder, self.train, *how)    # this process's share of the bank
                fva, yva = sharded_features(self.encoder, self.val, *how)    # every query
                self.encoder.train(was)
            classes = len(self.train.classes)                        # scored: a signal here ends it too
            res = sharded_knn(ftr, ytr, len(self.train), fva, self.to_train[yva], classes,
                              self.run.device)
        finally:
            ctl.trained = trained
        if not C.is_main():
            return None
        self.log.write({"step": step, **{k: round(v, 3) for k, v in res.items()}})
        if self.first is None:
            self.first = (step, res["knn_top1"])
        C.print0(f"k-NN top-1 on {self.split}/ ({self.what}, {self.pool}): {res['knn_top1']:.1f}% "
                 f"at step {step}"
                 + (f" ({self.first[1]:.1f}% at step {self.first[0]})" if self.first[0] != step
                    else "")
                 + f"; {len(self.train)} + {len(self.val)} images in {time.time() - t0:.0f} s")
        return res


def eval_split(data, split=None, holdout=0):
    """The evaluated folder's name: `split` when given, else val/, else test/ (CIFAR-10's folders);
    "holdout" for --holdout (images of train/)."""
    if holdout:
        return "holdout"
    if split or data == "synthetic":
        return split or "val"
    has = lambda name: os.path.isdir(os.path.join(data, name))      # noqa: E731
    return "test" if not has("val") and has("test") else "val"


def splits(data, skip_unreadable=False, split=None, holdout=0):
    """The train and evaluated (val) datasets, checked before any feature is computed, and val's
    labels mapped to train's class indices BY NAME (a val/ that lacks a class, or orders them
    otherwise, keeps every label right); a val class that train lacks is an error. Returns (train,
    val, val_to_train). split: the evaluated folder (default val/, else test/). skip_unreadable: for
    train (fine-tuning skips bad images as training does). holdout n: val is the n train images
    C.held_out() keeps out of a --holdout n run, train the others (no other folder is read)."""
    if holdout:
        if split:
            raise C.UserError(f"--holdout evaluates images of train/, not --split {split}: give "
                              "one of them")
        train, val = (C.image_dataset(data, s, skip_unreadable, holdout)
                      for s in ("train", "holdout"))
        return train, val, torch.arange(len(train.classes))
    split = eval_split(data, split)
    train = C.image_dataset(data, "train", skip_unreadable)
    synthetic = data == "synthetic"
    has = lambda name: os.path.isdir(os.path.join(data, name))      # noqa: E731
    val = C.image_dataset(data, split) if has(split) or synthetic else None
    if val is None or not has("train") and not synthetic:
        test = "; a test/ folder is used where there is no val/" if split == "val" else ""
        raise C.UserError(f"--data {data}: expected train/ and {split}/ class folders (evaluation "
                          f"needs both{test})")
    mapping = val_to_train(train, val)
    missing = [c for c, i in zip(val.classes, mapping.tolist()) if i < 0]
    if missing:
        some = ", ".join(train.classes[:5]) + (", ..." if len(train.classes) > 5 else "")
        raise C.UserError(f"--data {data}: val/ has {len(missing)} class(es) that train/ lacks, "
                          f"e.g. {missing[0]!r} (train has {len(train.classes)}: {some})")
    return train, val, mapping


def features(a, enc, ckpt, split, ds, device, tokens=False):
    """(N, D) float features and (N,) labels (ds's own class indices) of a split, cached on disk.
    The cache key holds everything they depend on: the checkpoint file (path, size, mtime), how it
    is read (pooling, size, --random-init, --model, --patch-size) and the split's images (class
    names and file list), so a dataset changed in place is never served another's features and
    labels."""
    pool = weights.pool_of(ckpt, a.pool)
    size = a.img_size or ckpt["vit"]["img_size"]
    if a.pixels:
        a = replace(a, cache=False)                  # no checkpoint to cache next to; cheap to redo
    st = os.stat(a.ckpt) if a.ckpt else None
    files = [p for p, _ in getattr(ds, "samples", [])]
    key = st and hashlib.sha1(json.dumps([os.path.abspath(a.ckpt), st.st_size, st.st_mtime_ns, pool,
                                          size, a.data, a.random_init, a.online, a.model,
                                          a.patch_size, len(ds), list(ds.classes), files]).encode())
    path = st and os.path.join(os.path.dirname(os.path.abspath(a.ckpt)), "features",
                               f"{key.hexdigest()[:16]}_{split}.pt")
    if a.cache and os.path.isfile(path):
        return torch.load(path, weights_only=True)
    tf = eval_transform(size, synthetic=a.data == "synthetic")
    dl = torch.utils.data.DataLoader(C.Views(ds, tf), a.batch_size, num_workers=a.workers)
    if device.type == "cuda":
        autocast = torch.autocast("cuda", torch.bfloat16)
    else:
        autocast = torch.autocast("cpu", enabled=False)
    out = extract_features(enc, dl, device, lambda e, x: features_of(e, x, pool, tokens), autocast)
    if a.cache:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        C.save_checkpoint(path, out)
    return out


def topk(scores, y, k):
    """Top-k accuracy (%); entries at -inf (no vote) never count as a hit."""
    val, idx = scores.topk(min(k, scores.shape[1]), dim=1)
    return 100.0 * ((idx == y[:, None]) & (val > float("-inf"))).any(1).float().mean().item()


def knn(train_f, train_y, val_f, val_y, num_classes, k=20, T=0.07):
    s = knn_predict(F.normalize(train_f, dim=1), train_y, F.normalize(val_f, dim=1), num_classes, k,
                    T)
    return {"knn_top1": topk(s, val_y, 1), "knn_top5": topk(s, val_y, 5)}


def linear_probe(train_f, train_y, val_f, val_y, num_classes, epochs=100, lr=0.1, batch=1024,
                 seed=0):
    """Both splits standardised with the TRAIN mean and std, a linear head trained on train, top-1/5
    on val."""
    mean = train_f.mean(0)
    std = train_f.std(0) + 1e-6
    head = linear_head((train_f - mean) / std, train_y, num_classes, epochs, lr, batch, seed)
    with torch.no_grad():
        s = head((val_f - mean) / std)
    return {"linear_top1": topk(s, val_y, 1), "linear_top5": topk(s, val_y, 5)}


def linear_head(xt, train_y, num_classes, epochs=100, lr=0.1, batch=1024, seed=0):
    """nn.Linear from zeros, mean CE, SGD momentum 0.9, lr cosine from lr to 0 per step over epochs
    x ceil(n / batch) steps, a fresh shuffle (generator seeded by seed) each epoch, the last batch
    partial."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(xt.shape[1], num_classes)
    torch.nn.init.zeros_(head.weight), torch.nn.init.zeros_(head.bias)
    opt = torch.optim.SGD(head.parameters(), lr=lr, momentum=0.9)
    steps = epochs * max(1, (len(xt) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    progress = Progress("linear probe epochs", epochs)
    for _ in range(epochs):
        progress.step()
        perm = torch.randperm(len(xt), generator=g)
        for i in range(0, len(xt), batch):
            idx = perm[i:i + batch]
            loss = F.cross_entropy(head(xt[idx]), train_y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    progress.done()
    return head


def msn_preprocess(x):
    """cyanure preprocess(normalize=True, columns=False, centering=True): per row, subtract the
    row's own mean, then scale to unit L2 norm."""
    return F.normalize(x - x.mean(dim=1, keepdim=True), dim=1)


def logistic_regression(x, y, num_classes, lambd=0.0025, iters=500):
    """MSN's low-shot classifier: W (D, C) minimising mean_i CE(x_i W, y_i) + (lambd / n) / 2
    ||W||^2, no intercept, n = len(x) (logistic_eval.py divides --lambd by the number of training
    images). Full-batch L-BFGS in float64. Returns W."""
    x = x.double()
    W = torch.zeros(x.shape[1], num_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([W], lr=1, max_iter=iters, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")
    reg = lambd / len(x)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(x @ W, y) + 0.5 * reg * (W ** 2).sum()
        loss.backward()
        return loss
    opt.step(closure)
    return W.detach()


def lowshot_subset(labels, num_classes, shots=1, percent=0.0, seed=0):
    """Indices of `shots` images per class (or percent% of each class, >= 1), drawn with `seed`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for c in range(num_classes):
        idx = (labels == c).nonzero().flatten()
        n = max(1, round(len(idx) * percent / 100)) if percent else shots
        if len(idx) < n:
            raise C.UserError(f"class {c} has {len(idx)} train images, fewer than the {n} asked "
                              "for")
        out.append(idx[torch.randperm(len(idx), generator=g)[:n]])
    return torch.cat(out)


def subset_from_file(path, data):
    """Indices into the train split of the images listed in `path` (MSN's imagenet_subsets format):
    each line a file name or a path relative to the train root; a line matches a relative path
    exactly, else a unique file name."""
    if not os.path.isfile(path):
        raise C.UserError(f"--subset-file {path} does not exist")
    ds = C.image_dataset(data, "train")
    if not isinstance(ds, C.ImageFiles):
        raise C.UserError("--subset-file needs an image folder as --data (the synthetic set has "
                          "no file names)")
    root = os.path.join(data, "train") if os.path.isdir(os.path.join(data, "train")) else data
    rel = {os.path.relpath(p, root).replace(os.sep, "/"): i for i, (p, _) in enumerate(ds.samples)}
    base = {}
    for r, i in rel.items():
        base.setdefault(os.path.basename(r), []).append(i)
    names = [ln.strip() for ln in open(path) if ln.strip()]
    idx, missing = [], []
    for n in names:
        hit = rel.get(n.replace(os.sep, "/"))
        if hit is None and len(base.get(os.path.basename(n), [])) == 1:
            hit = base[os.path.basename(n)][0]
        (missing if hit is None else idx).append(n if hit is None else hit)
    if missing:
        raise C.UserError(f"--subset-file {path}: {len(missing)} of {len(names)} images not found "
                          f"(or ambiguous) under {root}, e.g. {missing[0]!r}")
    return torch.tensor(idx)


def lowshot(train_f, train_y, val_f, val_y, num_classes, shots=1, percent=0.0, seeds=3,
            lambd=0.0025, subset=None):
    """MSN protocol on `subset` (indices) or on `seeds` random subsets; mean +- std top-1 (%)."""
    subsets = [subset] if subset is not None else [
        lowshot_subset(train_y, num_classes, shots, percent, s) for s in range(seeds)]
    accs = []
    for idx in subsets:
        W = logistic_regression(msn_preprocess(train_f[idx]), train_y[idx], num_classes, lambd)
        accs.append(topk(msn_preprocess(val_f).double() @ W, val_y, 1))
    t = torch.tensor(accs)
    name = f"lowshot_{percent:g}pct" if percent else f"lowshot_{shots}shot"
    name = "lowshot_file" if subset is not None else name
    std = t.std().item() if len(accs) > 1 else 0.0
    return {f"{name}_mean": t.mean().item(), f"{name}_std": std}


def embed(a, enc, ckpt, device):
    """--mode embed: features.npy (N, D) float32 and files.txt (each row's path under --data) of
    every image under --data (a flat folder or class folders, unreadable images an error), with the
    evaluation's encoder, pooling and preprocessing (features(): the same rows as the k-NN's on the
    same images; --pixels: the normalised image itself, not centred)."""
    import numpy as np
    if not a.output:
        raise C.UserError("--mode embed writes features.npy and files.txt into --output DIR: give "
                          "it")
    _lock = H.claim_dir(a.output, "--output")                       # held while this evaluation writes
    if a.data == "synthetic":
        ds = C.image_dataset(a.data, "train")
    else:
        ds = C.ImageFiles(a.data, every=True)
    feats, _ = features(replace(a, cache=False), enc.to(device), ckpt, "embed", ds, device,
                        a.tokens)
    if a.tokens:                                                     # the square crop's grid, row-major
        feats, tok = feats[:, 0], feats[:, 1:]
        g = round(tok.shape[1] ** 0.5)
        np.save(os.path.join(a.output, "tokens.npy"),
                tok.reshape(len(tok), g, g, -1).numpy().astype(np.float32))
    np.save(os.path.join(a.output, "features.npy"), feats.numpy().astype(np.float32))
    names = [os.path.relpath(p, a.data) for p, _ in getattr(ds, "samples", [])]
    names = names or [str(i) for i in range(len(ds))]
    with open(os.path.join(a.output, "files.txt"), "w") as f:
        f.writelines(n + "\n" for n in names)
    C.print0(f"features of {len(ds)} images ({tuple(feats.shape)}, pooling "
             f"{weights.pool_of(ckpt, a.pool)}) -> {a.output}/features.npy, files.txt")
    return {"images": len(ds), "dim": feats.shape[1], "output": a.output}


def evaluate(a):
    H.validate(a)                                                    # ranges, finite numbers: one line each
    if a.pixels and (a.ckpt or a.random_init or not a.img_size):
        raise C.UserError("--pixels evaluates the images themselves: give --img-size, and no "
                          "--ckpt / --random-init")
    if not a.ckpt and not a.pixels:
        raise C.UserError("--ckpt is required (a checkpoint.pth written by "
                          "msn/cmae/conmim/can.py), or --pixels")
    if a.export and (a.pixels or a.random_init):
        raise C.UserError("--export writes a checkpoint's trained encoder: not with --pixels or "
                          "--random-init")
    if not a.data and not a.export:
        raise C.UserError("--data is required: an image folder with train/ and val/, or "
                          "'synthetic'")
    if a.mode not in ("knn", "linear", "lowshot", "all", "embed"):
        raise C.UserError(f"--mode must be knn, linear, lowshot, all or embed, got {a.mode!r}")
    if a.percent > 100:
        raise C.UserError(f"--percent must be in [0, 100], got {a.percent}")
    if a.online and (a.random_init or a.pixels):
        raise C.UserError("--online reads a checkpoint's trained online network: not with "
                          "--random-init or --pixels")
    device = H.resolve_device(a.device)
    if a.pixels:
        enc, ckpt = Pixels(), {"method": "pixels", "vit": {"img_size": a.img_size}}
    else:
        enc, ckpt = weights.load_encoder(a.ckpt, a.random_init, a.model, a.patch_size,
                                         online=a.online)
    trained = a.holdout
    if "encoder" in ckpt and not a.random_init:
        trained = ckpt.get("args", {}).get("holdout", 0)
    if a.holdout and trained != a.holdout:           # the held-out images must be ones it never trained on
        raise C.UserError(f"--holdout {a.holdout}: {a.ckpt} was trained with --holdout {trained}"
                          f"{' (on every train/ image)' if not trained else ''}: its held-out "
                          "images are not these")
    if a.img_size is not None and (a.img_size <= 0 or a.img_size % enc.patch_size):
        raise C.UserError(f"--img-size {a.img_size} is not a positive multiple of the checkpoint's "
                          f"patch size {enc.patch_size}")
    if a.subset_file and a.mode not in ("lowshot", "all"):
        raise C.UserError(f"--subset-file is read by --mode lowshot or all, not {a.mode}")
    if a.export:
        return weights.export(a.export, enc, ckpt, weights.pool_of(ckpt, a.pool), a.ckpt)
    if a.tokens and (a.mode != "embed" or a.pixels):
        raise C.UserError("--tokens writes a checkpoint's patch tokens with --mode embed")
    if a.mode == "embed":
        return embed(a, enc, ckpt, device)
    train, val, val_to_train = splits(a.data, split=a.split, holdout=a.holdout)   # layout checked before any extraction
    subset = subset_from_file(a.subset_file, a.data) if a.subset_file else None           # so is the subset
    C.print0(f"train: {len(train)} images in {len(train.classes)} classes; "
             f"{eval_split(a.data, a.split, a.holdout)}: {len(val)} images in {len(val.classes)} "
             "classes (labels matched by class name)")
    enc = enc.to(device)
    ftr, ytr = features(a, enc, ckpt, "train", train, device)
    fva, yva = features(a, enc, ckpt, "val", val, device)
    yva = val_to_train[yva]
    if a.pixels:                                                   # centred by the train mean image
        mean = ftr.mean(0)
        ftr, fva = ftr - mean, fva - mean
    nc = len(train.classes)
    res = {"method": ckpt["method"], "ckpt": a.ckpt, "random_init": a.random_init,
           "online": a.online, "split": eval_split(a.data, a.split, a.holdout),
           "pool": weights.pool_of(ckpt, a.pool),
           "train_classes": len(train.classes), "val_classes": len(val.classes)}
    if a.mode in ("knn", "all"):
        res.update(knn(ftr, ytr, fva, yva, nc, a.k, a.temperature))
    if a.mode in ("linear", "all"):
        res.update(linear_probe(ftr, ytr, fva, yva, nc, a.linear_epochs, a.linear_lr,
                                a.linear_batch))
    if a.mode in ("lowshot", "all"):
        res.update(lowshot(ftr, ytr, fva, yva, nc, a.shots, a.percent, a.seeds, a.lambd, subset))
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}))
    return res


if __name__ == "__main__":
    H.main(evaluate, Args)
