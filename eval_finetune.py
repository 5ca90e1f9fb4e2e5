"""End-to-end fine-tuning of a pre-trained encoder with a linear head: the ImageNet-1k top-1 that
CMAE, ConMIM and CAN report as their headline result, with each official fine-tuning recipe.

  python eval_finetune.py --ckpt runs/cmae/checkpoint.pth --data /imagenet     # MAE's ViT-B recipe
  python eval_finetune.py --ckpt runs/conmim/checkpoint.pth --data /imagenet   # BEiT-style recipe
  torchrun --nproc_per_node=8 eval_finetune.py --ckpt runs/can/checkpoint.pth --data /imagenet
  python eval_finetune.py --ckpt runs/cmae/checkpoint.pth --data synthetic [--random-init]
  python eval_finetune.py --linear --ckpt runs/can/checkpoint.pth --data /imagenet   # linear probe

Reads every checkpoint eval_linear.py reads (this project's image methods, the official MSN file,
MAE-style and timm/DeiT files). The model (MAE `models_vit` with global_pool, BEiT with
use_mean_pooling): the encoder's patch tokens, WITHOUT its final norm, averaged, then a fresh
LayerNorm (fc_norm) and a linear head initialised trunc-normal(std 2e-5) (MAE; BEiT's 0.02 x
init_scale 0.001 is the same scale). The encoder's pre-trained `norm` is kept in the checkpoint
but frozen (unused). Drop path 0.1. Every value below is a flag; the default recipe follows the
checkpoint's method:

  "mae" (CMAE: configs/fine-tuning/cmae/*_8x128_100e; CAN, MSN and foreign files: MAE's
  FINETUNE.md / main_finetune.py, ViT-B): global batch 1024, AdamW (0.9, 0.999), lr = blr 5e-4 x
  batch / 256, layer-wise lr decay 0.65, weight decay 0.05 (none on biases, norms, pos_embed,
  cls_token), 100 epochs, 5 warm-up epochs from 0, then cosine to min lr 1e-6 (per step),
  RandomResizedCrop(0.08-1, bicubic) + flip + RandAugment(2 ops, magnitude 9), random erasing
  0.25, MixUp 0.8 / CutMix 1.0 (one of the two per batch), label smoothing 0.1, no clipping.
  (CMAE's config warms up from 1e-4 x lr, 2e-7 at batch 1024, not 0; evaluates every 10 epochs.)
  "beit" (ConMIM: README command, run_class_finetuning.py): the same but lr 4e-3 ABSOLUTE for the
  global batch 1024, 20 warm-up epochs from 0 (BEiT's cosine_scheduler starts its warm-up at
  start_warmup_value=0; the --warmup_lr 1e-6 it parses is never used).
Layer ids (MAE's lr_decay.py = BEiT's get_num_layer_for_vit): cls_token, pos_embed, patch_embed
-> 0; blocks.i -> i + 1; fc_norm, head -> depth + 1; lr scale = decay^(depth + 1 - id).

Where torchvision's operations differ from the official timm ones (listed, not fixed):
  - RandAugment: torchvision's (14 ops, fixed magnitude 9 of 31 bins, each op always applied) vs
    timm's rand-m9-mstd0.5-inc1 (15 ops of the "increasing" family, magnitude 9 of 10 with Gaussian
    noise std 0.5, each op applied with probability 0.5). Fill: torchvision 0, timm the mean.
  - Random erasing: torchvision RandomErasing(value="random") after normalisation = timm's
    mode "pixel", count 1 (same area 0.02-1/3 and aspect 0.3-3.3).
  - MixUp / CutMix: torchvision v2, one lambda per process batch, switching with probability 0.5
    (timm: mode "batch", switch_prob 0.5, same), pairing image i with i - 1 (timm: with B - 1 - i,
    the flipped batch); label smoothing applied to the mixed one-hot
    target (equal to timm's mixing of smoothed targets, mixing being linear).
ConMIM's BEiT encoder (no absolute position embedding, layer scale, q / v biases) is fine-tuned as
BEiT's run_class_finetuning does it: the pre-trained shared relative position bias table is copied
into every block (blocks.i.attn.relative_position_bias_table, layer id i + 1, weight-decayed like
any 2-d tensor: --disable_weight_decay_on_rel_pos_bias is off by default); gammas and q / v biases
are 1-d (no decay). At another --img-size the tables stay at the pre-training grid's size and are
resized bicubically in each forward, as the absolute position tables are (weights.grid_bias; BEiT
resizes them once at load, its offsets spaced geometrically).
  - Evaluation each epoch on val/ (Resize img*256/224 bicubic + CenterCrop), top-1 / top-5.

The papers' linear probe (`--linear`): the encoder frozen (no gradient, eval mode, no drop path),
its features through a fresh head, trained with the protocol of the checkpoint's method:

  "mae" (CMAE, CAN, ConMIM and foreign files: MAE's main_linprobe.py and FINETUNE.md, which CAN's
  repository runs unchanged; ConMIM's has no linear-probe script): the CLS token after the final
  norm (--cls_token) -> BatchNorm1d(D, affine=False, eps 1e-6) -> Linear (trunc-normal std 0.01),
  LARS (momentum 0.9, trust coefficient 0.001, weight decay 0; MoCo v3's, below), lr = blr 0.1 x
  batch / 256, global batch 16384, 90 epochs, 10 warm-up epochs from 0, cosine to 0,
  RandomResizedCrop(0.08-1, bicubic) + flip, cross-entropy.
  "msn" (MSN: linear_eval.py, configs/eval/lineval_msn_vits16.yaml): the last block's CLS token
  before the final norm -> LayerNorm(D) -> L2 normalisation -> Linear (normal std 0.01), SGD with
  Nesterov momentum 0.9, weight decay 0, lr 6.4 ABSOLUTE for the global batch 8192 (32 x 256),
  100 epochs, no warm-up, cosine to 0, RandomResizedCrop(0.08-1, bilinear) + flip.
Differences: the evaluation's resize is Resize(img*256/224, bicubic) for both (MSN's: bilinear);
torch's SGD keeps the gradient in its momentum buffer where MSN's src/sgd.py keeps lr x gradient
(equal at a constant lr; the cosine lowers it slowly); MAE's crop is util/crop.py's
RandomResizedCrop (torchvision's, a fallback for extreme aspect ratios aside). BatchNorm's
statistics are per micro-batch and per process (MAE: per GPU's 512; no SyncBN in either).

Output: <output-dir>/checkpoint.pth (resumable, method "finetune", the fine-tuned encoder under
`encoder`), log.jsonl (val_top1, val_top5 and val_loss, the cross-entropy without smoothing, after
each epoch; a run stopped at an epoch's last step, by --stop-step or a signal, evaluates that epoch
when resumed), and a final JSON line with best_top1, last_top1, last_top5 and last_val_loss.
"""
import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import common as C
import harness as H
import eval_linear
import weights

RECIPES = {  # per-method defaults of the fields left at None
    "mae": dict(blr=5e-4, lr=None, warmup_epochs=5, warmup_lr=0.0, layer_decay=0.65),
    "beit": dict(blr=None, lr=4e-3, warmup_epochs=20, warmup_lr=0.0, layer_decay=0.65),
}
SMALL_LAYER_DECAY = {"beit": 0.45}  # --preset small: chosen on held-out images (docs/RESULTS.md; CAN: 0.65 better)
METHOD_RECIPE = {"conmim": "beit"}                       # every other checkpoint: "mae"
OFFICIAL_BATCH, OFFICIAL_EPOCHS = 1024, 100                # both recipes' (ViT-B)
LINEAR = {  # --linear: the protocols' values (the docstring), each filling what was not given
    "mae": dict(batch_size=16384, epochs=90, blr=0.1, lr=None, warmup_epochs=10, pool="cls"),
    "msn": dict(batch_size=8192, epochs=100, blr=None, lr=6.4, warmup_epochs=0, pool="cls-prenorm"),
}
METHOD_LINEAR = {"msn": "msn"}                             # every other checkpoint: "mae"


def identity_rules(cls, preset):
    """recipes.presets' hook: a fine-tuning preset's values are final; its lr and warm-up follow the
    checkpoint's recipe at run time (finetune: per image, and the same share of the run)."""
    return dict(preset)


@dataclass
class Args(H.RunArgs):
    """End-to-end fine-tuning of a checkpoint's encoder with a linear head (official recipes)."""
    ckpt: str = H.arg(None, "pre-trained checkpoint (any that eval_linear.py reads)", group="model")
    data: str = H.arg(None, "image folder with train/ and val/ class folders, or 'synthetic'",
                      group="data")
    output_dir: str = H.arg(None, "where checkpoint.pth, log.jsonl, args.json and pictures go "
                            "(default runs/finetune)", group="data")
    recipe: str = H.arg(None, "mae | beit (default: from the checkpoint's method)")
    random_init: bool = H.arg(False, "the same run from the ViT's initialisation", group="model")
    model: str = H.arg(None, "ViT size, checked (eval_linear.py)", group="model")
    patch_size: int = H.arg(None, "checked against the checkpoint's", group="model", positive=True)
    img_size: int = H.arg(None, "training image size (px) (default: the checkpoint's training "
                          "size)", group="data", positive=True)
    epochs: int = H.arg(100, "training epochs (the schedules span them)", group="optimisation",
                        positive=True)
    batch_size: int = H.arg(1024, "GLOBAL batch, all processes (official 1024)",
                            group="optimisation", positive=True)
    micro_batch: int = H.arg(256, "images per forward/backward per process", group="optimisation",
                             min=0)
    lr: float = H.arg(None, "absolute peak lr (default: the recipe's)", group="optimisation",
                      positive=True)
    blr: float = H.arg(None, "lr = blr x global batch / 256 when --lr is not given",
                       group="optimisation", positive=True)
    warmup_lr: float = H.arg(None, "lr at the start of warm-up (both recipes: 0)",
                             group="optimisation", min=0)
    min_lr: float = H.arg(1e-6, "lr at the end of the cosine schedule", group="optimisation", min=0)
    warmup_epochs: int = H.arg(None, "linear lr warm-up epochs", group="optimisation", min=0)
    layer_decay: float = H.arg(None, "layer-wise lr decay (default: the recipe's, 0.65)",
                               group="optimisation")
    weight_decay: float = H.arg(0.05, "AdamW weight decay", group="optimisation", min=0)
    betas: tuple = H.arg((0.9, 0.999), "AdamW betas", group="optimisation")
    clip_grad: float = H.arg(0.0, "max grad norm (0 = off, as both recipes)", group="optimisation",
                             min=0)
    drop_path: float = H.arg(0.1, "stochastic depth rate of the last block", group="model", min=0)
    smoothing: float = H.arg(0.1, "label smoothing")
    mixup: float = H.arg(0.8, "MixUp alpha (0 = off)")
    cutmix: float = H.arg(1.0, "CutMix alpha (0 = off)")
    reprob: float = H.arg(0.25, "random erasing probability")
    randaug_magnitude: int = H.arg(9, "RandAugment magnitude (2 ops; -1 = off)")
    crop_scale: tuple = H.arg((0.08, 1.0), "RandomResizedCrop area range", group="data")
    eval_batch: int = H.arg(256, "images per evaluation batch")
    lr_factor: float = H.arg(1.0, "the recipe's lr times this (a preset's: chosen on held-out "
                             "training images, never on the evaluated split)", positive=True)
    split: str = H.arg(None, "the evaluated folder (default val/, else test/)", group="data")
    eval_every: int = H.arg(1, "epochs between evaluations (0: the run's last epoch only, which is "
                            "always evaluated)", group="run control", min=0)
    labels_per_class: int = H.arg(0, "fine-tune on this many labelled images of each class, a "
                                  "fixed draw (not --seed); 0 = all", min=0)
    linear: bool = H.arg(False, "the papers' linear probe of the frozen encoder instead (MAE's or "
                         "MSN's protocol; its own defaults: --linear --help)", group="model")
    pool: str = H.arg(None, "--linear: cls | cls-prenorm | mean (default: the protocol's)",
                      group="model")

    # --data synthetic: a CPU-sized run (150 steps of 64, about 2 min on 2 cores). The recipe's heavy
    # regularisation (MixUp, CutMix, RandAugment, erasing) is off: at 150 steps it kept both the
    # pre-trained and the random-init run near chance (CMAE checkpoint: 13.9 vs 12.8% top-1).
    SYNTHETIC = dict(epochs=5, batch_size=64, micro_batch=0, warmup_epochs=1, workers=2,
                     log_every=20, steps_per_epoch=30, blr=4e-3, layer_decay=0.75,
                     crop_scale=(0.3, 1.0), mixup=0.0, cutmix=0.0, reprob=0.0, randaug_magnitude=-1)
    # --preset small: 32-px images (CIFAR-10) on 2 CPU cores, ~9 min a run of 50,000 images. The recipe's lr per
    # image at batch 256 (MAE: blr as it is; BEiT: 4e-3 x 256 / 1024) times lr_factor, warm-up its share of the run
    # (finetune), every other value the recipe's but BEiT's layer decay (SMALL_LAYER_DECAY). Chosen on 5,000
    # held-out training images (docs/RESULTS.md, "Fine-tuning on CIFAR-10"): all labels (the highest top-1 for both
    # encoders, a gap as large as with 100 or 500 a class), lr_factor 1 (x4 lowered both); 3 epochs: the time.
    PRESETS = {"small": dict(batch_size=256, micro_batch=0, labels_per_class=0, epochs=3,
                             eval_every=1, lr_factor=1.0, workers=2, log_every=20)}
    preset_rules = identity_rules                                    # recipes.presets: no pre-training rules here


@dataclass
class LinearArgs(Args):
    """The papers' linear probe of a checkpoint's frozen encoder (MAE's or MSN's protocol)."""
    linear: bool = H.arg(True, "the papers' linear probe of the frozen encoder", group="model")
    recipe: str = H.arg(None, "mae | msn: the protocol (default: from the checkpoint's method)")
    epochs: int = H.arg(None, "training epochs (default: the protocol's: MAE 90, MSN 100)",
                        group="optimisation", positive=True)
    batch_size: int = H.arg(None, "GLOBAL batch, all processes (default: the protocol's: MAE "
                            "16384, MSN 8192)", group="optimisation", positive=True)
    warmup_lr: float = H.arg(0.0, "lr at the start of warm-up", group="optimisation", min=0)
    min_lr: float = H.arg(0.0, "lr at the end of the cosine schedule", group="optimisation", min=0)
    weight_decay: float = H.arg(0.0, "weight decay (LARS / SGD; both protocols: 0)",
                                group="optimisation", min=0)
    drop_path: float = H.arg(0.0, "stochastic depth: none in a frozen encoder", group="model",
                             min=0)
    smoothing: float = H.arg(0.0, "label smoothing (none: the protocols' cross-entropy)")
    mixup: float = H.arg(0.0, "MixUp alpha (0 = off, as both protocols)")
    cutmix: float = H.arg(0.0, "CutMix alpha (0 = off, as both protocols)")
    reprob: float = H.arg(0.0, "random erasing probability (0 = off, as both protocols)")
    randaug_magnitude: int = H.arg(-1, "RandAugment magnitude (-1 = off, as both protocols)")

    # --data synthetic: a CPU-sized probe (150 steps of 64).
    SYNTHETIC = dict(epochs=5, batch_size=64, micro_batch=0, workers=2, log_every=20,
                     steps_per_epoch=30, crop_scale=(0.3, 1.0))
    # --preset small: 32-px CIFAR-10 on 2 CPU cores, batch 256, warm-up the protocol's share of the run, 10
    # epochs (the time). lr: MSN's SGD its lr per image (6.4 x 256 / 8192); MAE's LARS its lr per step, 6.4
    # (= 0.1 x 16384 / 256): a LARS step moves a weight by lr x 0.001 x its norm whatever the batch.
    PRESETS = {"small": dict(batch_size=256, micro_batch=0, epochs=10, eval_every=5, workers=2,
                             log_every=50)}


# ----------------------------------------------------------------------------------------------
# Model: encoder -> mean of patch tokens (no final norm) -> fc_norm -> head
# ----------------------------------------------------------------------------------------------
class Classifier(nn.Module):
    def __init__(self, encoder, num_classes):
        super().__init__()
        self.encoder, D = encoder, encoder.dim
        self.encoder.norm.requires_grad_(False)                      # unused (MAE deletes it, BEiT: Identity)
        self.fc_norm, self.head = nn.LayerNorm(D, eps=1e-6), nn.Linear(D, num_classes)
        nn.init.trunc_normal_(self.head.weight, std=2e-5)
        nn.init.zeros_(self.head.bias)

    def forward(self, x):                                            # (B, 3, H, W) -> (B, classes)
        return self.head(self.fc_norm(self.encoder(x, norm=False)[:, 1:].mean(1)))


class LinearProbe(nn.Module):
    """--linear: the frozen encoder's features (`pool`) -> MAE's head (protocol "mae": BatchNorm1d
    without affine, Linear trunc-normal std 0.01) or MSN's LinearClassifier ("msn": LayerNorm, L2
    normalisation, Linear normal std 0.01). Only the head has parameters that train."""

    def __init__(self, encoder, num_classes, protocol, pool):
        super().__init__()
        self.encoder = encoder.requires_grad_(False)
        self.pool = pool
        self.l2 = protocol == "msn"
        D = encoder.dim
        self.norm = nn.LayerNorm(D) if self.l2 else nn.BatchNorm1d(D, affine=False, eps=1e-6)
        self.head = nn.Linear(D, num_classes)
        init = nn.init.normal_ if self.l2 else nn.init.trunc_normal_
        init(self.head.weight, std=0.01)
        nn.init.zeros_(self.head.bias)

    def train(self, mode=True):                                      # the encoder stays in eval mode
        super().train(mode)
        self.encoder.eval()
        return self

    def forward(self, x):                                            # (B, 3, H, W) -> (B, classes)
        with torch.no_grad():
            f = eval_linear.features_of(self.encoder, x, self.pool)  # (B, D)
        z = self.norm(f.float())
        return self.head(F.normalize(z, dim=-1) if self.l2 else z)


class LARS(torch.optim.Optimizer):
    """MAE's util/lars.py (MoCo v3's LARS): a tensor of more than one dimension takes the update
    u = g + wd p scaled by trust x ||p|| / ||u|| (by 1 where either norm is 0); biases and other
    1-d tensors the plain gradient (no decay, no scaling); then mu <- momentum mu + u,
    p <- p - lr mu."""

    def __init__(self, params, lr=0.0, weight_decay=0.0, momentum=0.9, trust_coefficient=0.001):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                      trust_coefficient=trust_coefficient))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                u = p.grad
                if p.ndim > 1:
                    u = u.add(p, alpha=g["weight_decay"])
                    p_norm = torch.norm(p)
                    u_norm = torch.norm(u)
                    trust = g["trust_coefficient"] * p_norm / u_norm
                    u = u.mul(torch.where((p_norm > 0) & (u_norm > 0), trust, 1.0))
                mu = self.state[p].setdefault("mu", torch.zeros_like(p))
                mu.mul_(g["momentum"]).add_(u)
                p.add_(mu, alpha=-g["lr"])


def layer_id(name, depth):
    """MAE's get_layer_id_for_vit / BEiT's get_num_layer_for_vit for a Classifier parameter name."""
    name = name.removeprefix("encoder.")
    if name in ("cls_token", "pos_embed") or name.startswith("patch_embed"):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1                                                 # fc_norm, head


def param_groups(model, weight_decay, layer_decay):
    """AdamW groups by (layer id, decay): lr_scale = layer_decay^(depth + 1 - id); no weight decay
    on 1-d tensors, biases, pos_embed and cls_token (MAE's param_groups_lrd, BEiT's
    get_parameter_groups)."""
    depth = len(model.encoder.blocks)
    groups = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        lid = layer_id(n, depth)
        table = n.removeprefix("encoder.") in ("pos_embed", "cls_token")
        decay = not (p.ndim == 1 or n.endswith(".bias") or table)
        g = groups.setdefault((lid, decay), {"params": [],
                                             "weight_decay": weight_decay if decay else 0.0,
                                             "lr_scale": layer_decay ** (depth + 1 - lid)})
        g["params"].append(p)
    return [groups[k] for k in sorted(groups)]


# ----------------------------------------------------------------------------------------------
# Loss and batch mixing
# ----------------------------------------------------------------------------------------------
def soft_target_ce(logits, target):
    """Cross-entropy with a distribution target (B, C): mean_i -sum_c target_ic log
    softmax(logits_i)_c."""
    return -(target * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


def smooth(target, eps):
    """Label smoothing of a (mixed) one-hot target: (1 - eps) t + eps / C."""
    return target * (1 - eps) + eps / target.shape[-1]


class Mix:
    """MixUp(alpha) or CutMix(alpha), one chosen per batch with probability 0.5 (torchvision v2, one
    lambda per batch), then label smoothing: (x, y) -> (x mixed, target (B, C), a distribution)."""

    def __init__(self, a, num_classes):
        from torchvision.transforms import v2
        ops = ([v2.MixUp(alpha=a.mixup, num_classes=num_classes)] if a.mixup > 0 else []) + \
              ([v2.CutMix(alpha=a.cutmix, num_classes=num_classes)] if a.cutmix > 0 else [])
        self.op = v2.RandomChoice(ops) if len(ops) == 2 else (ops[0] if ops else None)
        self.C, self.eps = num_classes, a.smoothing

    def __call__(self, x, y):
        if self.op is None:
            return x, smooth(F.one_hot(y, self.C).float(), self.eps)
        x, t = self.op(x, y)
        return x, smooth(t.float(), self.eps)


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def labelled(train, n):
    """--labels-per-class n: keep n images of each class of `train` (an image folder), a draw fixed
    by the file list alone (not --seed), so that every run of a comparison fine-tunes on the same
    images."""
    if not hasattr(train, "samples"):
        raise C.UserError("--labels-per-class needs an image folder (--data synthetic has no "
                          "files to draw from)")
    order = torch.randperm(len(train.samples), generator=torch.Generator().manual_seed(0)).tolist()
    taken, keep = [0] * len(train.classes), []
    for i in order:
        c = train.samples[i][1]
        if taken[c] < n:
            taken[c] += 1
            keep.append(i)
    if min(taken) < n:
        raise C.UserError(f"--labels-per-class {n}: class "
                          f"{train.classes[taken.index(min(taken))]!r} has {min(taken)} training "
                          "images")
    train.samples = [train.samples[i] for i in sorted(keep)]
    train.count_unreadable_of(len(train.samples))


def train_transform(a, size, bicubic=True):
    """RandomResizedCrop(bicubic, else bilinear) + flip + RandAugment(2, m) -> normalised float,
    random erasing."""
    from torchvision import transforms as T
    how = T.InterpolationMode.BICUBIC if bicubic else T.InterpolationMode.BILINEAR
    ops = [T.RandomResizedCrop(size, scale=a.crop_scale, interpolation=how),
           T.RandomHorizontalFlip()]
    if a.randaug_magnitude >= 0:
        ops.append(T.RandAugment(2, a.randaug_magnitude, interpolation=T.InterpolationMode.BICUBIC))
    ops += [C.to_uint8, C.normalize]
    if a.reprob > 0:
        ops.append(T.RandomErasing(a.reprob, value="random"))
    return T.Compose(ops)


@torch.no_grad()
def evaluate(model, val, size, a, run):
    """Top-1 / top-5 (%) and the mean cross-entropy (no smoothing, as MAE's evaluate) on val/, each
    process a strided share, sums over processes."""
    model.eval()
    viewed = C.Views(val, eval_linear.eval_transform(size, a.data == "synthetic"))
    share = torch.utils.data.Subset(viewed, range(run.rank, len(val), run.world))
    hits = torch.zeros(4, device=run.device)                       # top-1, top-5, count, summed loss
    for x, y in torch.utils.data.DataLoader(share, a.eval_batch, num_workers=a.workers):
        x, y = C.normalize(x.to(run.device)), y.to(run.device)
        with run.autocast:
            logits = model(x).float()
        top = logits.topk(min(5, len(val.classes)), dim=1).indices
        hits += torch.stack([(top[:, 0] == y).sum(), (top == y[:, None]).any(1).sum(),
                             torch.tensor(len(y), device=run.device),
                             F.cross_entropy(logits, y, reduction="sum")])
    hits = C.all_reduce_sum_(hits)
    model.train()
    n = hits[2]
    return (100 * hits[0] / n).item(), (100 * hits[1] / n).item(), (hits[3] / n).item()


# ----------------------------------------------------------------------------------------------
# Fine-tuning
# ----------------------------------------------------------------------------------------------
def finetune_recipe(args, method):
    """The fine-tuning recipe's name; its values fill the flags left at None (a preset: the lr per
    image and the warm-up's share of the run)."""
    recipe = args.recipe or METHOD_RECIPE.get(method, "mae")
    if recipe not in RECIPES:
        raise C.UserError(f"--recipe must be mae or beit, got {recipe!r}")
    rec = RECIPES[recipe]
    small = args.preset not in (None, "synthetic")                   # a short run: preset_rules
    if args.lr is None and args.blr is None:
        args.lr, args.blr = rec["lr"], rec["blr"]
        if small and args.lr:                                        # BEiT's lr for 1024 images -> per image
            args.lr = float(f"{args.lr * args.batch_size / OFFICIAL_BATCH:.4g}")
    if args.warmup_epochs is None:                                   # a preset: the same share of its run
        args.warmup_epochs = rec["warmup_epochs"]
        if small:
            args.warmup_epochs = rec["warmup_epochs"] * args.epochs / OFFICIAL_EPOCHS
    if args.warmup_lr is None:
        args.warmup_lr = rec["warmup_lr"]
    if args.layer_decay is None:
        args.layer_decay = rec["layer_decay"]
        if small:
            args.layer_decay = SMALL_LAYER_DECAY.get(recipe, rec["layer_decay"])
    if not 0 <= args.layer_decay <= 1:
        raise C.UserError(f"--layer-decay must be in [0, 1], got {args.layer_decay}")
    return recipe


def linear_recipe(args, method):
    """--linear: the protocol's name; its values fill the flags left at None (a preset, and --data
    synthetic: the lr per image and the warm-up's share of the run)."""
    protocol = args.recipe or METHOD_LINEAR.get(method, "mae")
    if protocol not in LINEAR:
        raise C.UserError(f"--linear: --recipe must be mae or msn, got {protocol!r}")
    if args.layer_decay is not None:
        raise C.UserError("--layer-decay: a linear probe trains no layer of the encoder")
    rec = LINEAR[protocol]
    short = args.preset is not None
    args.batch_size = args.batch_size or rec["batch_size"]
    args.epochs = args.epochs or rec["epochs"]
    if args.lr is None and args.blr is None:
        args.lr, args.blr = rec["lr"], rec["blr"]
        if short and args.lr:                                        # SGD (MSN): the lr per image
            args.lr = float(f"{args.lr * args.batch_size / rec['batch_size']:.4g}")
        elif short:                     # LARS (MAE): its step is lr x 0.001 x |p| at any batch: the lr per step
            args.lr, args.blr = float(f"{args.blr * rec['batch_size'] / 256:.4g}"), None
    if args.warmup_epochs is None:
        share = args.epochs / rec["epochs"] if short else 1
        args.warmup_epochs = rec["warmup_epochs"] * share
    args.pool = args.pool or rec["pool"]
    if args.pool not in eval_linear.POOLS:
        raise C.UserError(f"--pool must be one of {', '.join(eval_linear.POOLS)}, got "
                          f"{args.pool!r}")
    return protocol


def finetune(args):
    if not args.ckpt:
        raise C.UserError("--ckpt is required (a pre-trained checkpoint)")
    if args.linear and not isinstance(args, LinearArgs):             # Args' defaults are fine-tuning's
        raise C.UserError("finetune(Args(linear=True)): give LinearArgs(...), whose defaults are "
                          "the linear protocol's (no MixUp, RandAugment, label smoothing, ...)")
    for k in ("smoothing", "reprob"):
        if not 0 <= getattr(args, k) <= 1:
            raise C.UserError(f"--{k.replace('_', '-')} must be in [0, 1], got {getattr(args, k)}")
    if args.mixup < 0 or args.cutmix < 0 or args.eval_batch <= 0:
        raise C.UserError("--mixup and --cutmix must be >= 0 and --eval-batch positive")
    if not -1 <= args.randaug_magnitude <= 30:
        raise C.UserError("--randaug-magnitude must be in 0..30 (RandAugment's 31 bins) or -1 "
                          f"(off), got {args.randaug_magnitude}")
    enc, ckpt = weights.load_encoder(args.ckpt, args.random_init, args.model, args.patch_size,
                                     args.drop_path, per_block_rel_pos=True)
    recipe = (linear_recipe if args.linear else finetune_recipe)(args, ckpt["method"])
    args.in_chans = ckpt["vit"].get("in_chans", 3)                  # the images the encoder takes
    mean, std = weights.mean_std(ckpt)                             # not given: the checkpoint's
    args.mean, args.std = args.mean or mean, args.std or std        # (H.setup sets them)
    if args.in_chans != 3 and args.randaug_magnitude >= 0:
        raise C.UserError(f"RandAugment's operations (colour, posterize, equalize, ...) are RGB "
                          f"images'; {args.ckpt} takes {args.in_chans} channel(s): give "
                          "--randaug-magnitude -1")
    size = args.img_size or ckpt["vit"]["img_size"]
    if size % enc.patch_size:
        raise C.UserError(f"--img-size {size} is not a multiple of the checkpoint's patch size "
                          f"{enc.patch_size}")
    if not args.holdout:            # the folder evaluated, as resolved (naming the default --split val is the same)
        args.split = eval_linear.eval_split(args.data, args.split)
    run = H.setup(args, "finetune")
    if args.linear:
        official = LINEAR[recipe]["batch_size"]
        per, micro = H.batch_plan(args, run, official, "the protocol's lr and its head's batch "
                                  f"statistics were set at {official}")
    else:
        per, micro = H.batch_plan(args, run, 1024, "the recipe's lr and its batch statistics "
                                  "(MixUp per process batch) were tuned at 1024")
    train, val, _ = eval_linear.splits(args.data, True, args.split, args.holdout)
    if len(val.classes) != len(train.classes):      # names sorted, val's within train's: same count = same classes
        raise C.UserError(f"--data {args.data}: val/ must have the same classes as train/ for "
                          f"top-1 (train {len(train.classes)}, val {len(val.classes)})")
    eval_linear.check_readable(val, args.workers)                  # an unreadable val/ image: now, not after an epoch
    if args.labels_per_class:
        labelled(train, args.labels_per_class)
    bicubic = not (args.linear and recipe == "msn")                 # MSN's linear crop: bilinear
    viewed = C.Views(train, train_transform(args, size, bicubic), args.seed)
    loader = C.make_loader(viewed, per, args.workers, args.seed)
    ipe = min(len(loader), args.steps_per_epoch or len(loader))
    total = args.epochs * ipe
    lr = (args.lr or args.blr * args.batch_size / 256) * args.lr_factor

    if args.linear:                                                  # the head: seeded in setup
        model = LinearProbe(enc, len(train.classes), recipe, args.pool).to(run.device).train()
        head = [p for p in model.parameters() if p.requires_grad]
        opt = LARS(head, lr, args.weight_decay) if recipe == "mae" else \
            torch.optim.SGD(head, lr, momentum=0.9, nesterov=True, weight_decay=args.weight_decay)
    else:
        model = Classifier(enc, len(train.classes)).to(run.device).train()
        C.set_grad_checkpointing(model, args.grad_ckpt)
        groups = param_groups(model, args.weight_decay, args.layer_decay)
        opt = torch.optim.AdamW(groups, lr=lr, betas=args.betas, fused=run.device.type == "cuda")
    start = H.resume_run(run, "finetune", args, model, opt, data={"train": train, "val": val})
    net, ddp = H.distribute(torch.compile(model) if args.compile else model, run)
    mix = Mix(args, len(train.classes))
    log = C.Logger(run, args, total, start, ipe)
    def save(step, **kw):                                            # the checkpoint (snapshot=True: the encoder)
        C.save_run(run, "finetune", args, step // ipe, step, model.encoder, model, opt, **kw)
    where = eval_linear.eval_split(args.data, args.split, args.holdout)
    why = ([f"{args.lr:g}"] if args.lr else [f"blr {args.blr:g}", f"{args.batch_size} / 256"]) \
        + ([f"lr-factor {args.lr_factor:g}"] if args.lr_factor != 1 else [])      # what the printed lr is
    source = "random init" if args.random_init else args.ckpt
    few = f" ({args.labels_per_class} a class)" if args.labels_per_class else ""
    what = f"linear probe of {ckpt['method']} ({source}, {args.pool}), protocol {recipe}" \
        if args.linear else f"fine-tuning {ckpt['method']} ({source}), recipe {recipe}"
    how = f"{type(opt).__name__}" if args.linear else f"layer decay {args.layer_decay}"
    C.print0(f"{what}: {len(train)} images{few}, {len(train.classes)} classes, {ipe} steps/epoch, "
             f"{total} steps, lr {lr:.3g}" + (f" (= {' x '.join(why)})" if len(why) > 1 else "")
             + f", {how}, warm-up {args.warmup_epochs:g} epochs; evaluated on {where}/ "
             f"({len(val)} images)")
    vals = {}                                                        # epoch -> (top1, top5, val loss)
    if start and os.path.isfile(os.path.join(run.out, "log.jsonl")):     # resumed: the epochs already evaluated
        for rec in map(json.loads, open(os.path.join(run.out, "log.jsonl"))):
            if "val_top1" in rec and rec["epoch"] < start // ipe:
                vals[rec["epoch"]] = rec["val_top1"], rec["val_top5"], rec.get("val_loss")

    def evaluate_epoch(epoch):                                       # its step: a resume drops it with those after
        top1, top5, vloss = vals[epoch] = evaluate(model, val, size, args, run)
        log.write({"epoch": epoch, "step": (epoch + 1) * ipe, "val_top1": round(top1, 3),
                   "val_top5": round(top5, 3), "val_loss": round(vloss, 4)})
    last = (args.stop_epoch or args.epochs) - 1                      # this invocation's last epoch: always evaluated
    due = lambda e: bool(args.eval_every) and (e + 1) % args.eval_every == 0 or e == last      # noqa: E731
    ended = start // ipe - 1                                         # the checkpoint's last whole epoch
    pending = bool(start) and start % ipe == 0 and ended not in vals and due(ended)
    pending = torch.tensor(float(pending), device=run.device)
    if C.all_reduce_sum_(pending) > 0:             # stopped at an epoch's last step (--stop-step, a signal) before its
        evaluate_epoch(start // ipe - 1)           # evaluation: evaluate it now (agreed: evaluate() is collective)
    batches = C.Batches(loader, ipe, args.max_unreadable)          # from the checkpoint's step on
    for epoch in range(start // ipe, 0 if log.done else args.stop_epoch or args.epochs):   # done: nothing to train
        if epoch * ipe >= start:                                     # a fresh epoch: mixup, drop path from
            C.seed_epoch(args.seed, epoch, run.rank)                 # (seed, epoch, rank); resumed: the checkpoint's
        for it, (x, y) in batches.epoch(epoch, start):
            step = epoch * ipe + it
            lr_now = C.cosine_schedule(step, total, lr, args.min_lr, args.warmup_epochs * ipe,
                                       args.warmup_lr)
            C.set_hparams(opt, lr_now)                                 # x each group's layer-decay lr_scale
            x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
            x, target = mix(x, y)                                     # MixUp / CutMix + smoothing
            opt.zero_grad(set_to_none=True)
            loss = 0.0
            for sl in C.micro_batches(len(x), micro, ddp):            # one slice, or exact accumulation
                with run.autocast:
                    logits = net(x[sl])
                part = soft_target_ce(logits, target[sl]) * (len(logits) / len(x))   # share of the mean
                run.scaler.scale(part).backward()
                loss = loss + part.detach()
            norm = C.optimizer_step(run, opt, [p for g in opt.param_groups for p in g["params"]],
                                    args.clip_grad)
            parts = {"loss": loss, "grad_norm": norm}
            if C.end_step(run, log, save, batches, step + 1, epoch, parts, lr=lr_now):
                return None
        save((epoch + 1) * ipe)
        if due(epoch):
            evaluate_epoch(epoch)
    top1, top5, vloss = vals[max(vals)] if vals else evaluate(model, val, size, args, run)   # else: as it stands
    best = max([v[0] for v in vals.values()] + [top1])
    res = {"method": ckpt["method"], "random_init": args.random_init, "recipe": recipe,
           **({"linear": True, "pool": args.pool} if args.linear else {}),
           "split": where, "train_images": len(train),
           "best_top1": round(best, 2), "last_top1": round(top1, 2), "last_top5": round(top5, 2),
           "last_val_loss": None if vloss is None else round(vloss, 4)}
    log.write({"step": start if log.done else (args.stop_epoch or args.epochs) * ipe, **res})
    return res


if __name__ == "__main__":
    H.main(finetune, LinearArgs if "--linear" in sys.argv[1:] else Args)
