"""Frozen-feature evaluation of any image checkpoint (msn, cmae, conmim, can): k-NN, linear probe,
low-shot logistic regression.

  python eval_linear.py --ckpt runs/msn/checkpoint.pth --data /imagenet --mode all
  python eval_linear.py --ckpt runs/msn/checkpoint.pth --data /imagenet --mode lowshot \
      --subset-file msn/imagenet_subsets1/5imgs_class.txt          # MSN's official 5-image split
  python eval_linear.py --ckpt runs/msn/checkpoint.pth --data synthetic --mode all
  python eval_linear.py --ckpt runs/msn/checkpoint.pth --data synthetic --random-init   # baseline
  python eval_linear.py --pixels --img-size 32 --data /cifar10 --mode all   # raw-pixel baseline (val/ or test/)

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
import math
import os
import re
import time
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

import common as C
import harness as H

DEFAULT_POOL = {"msn": "cls-prenorm", "cmae": "mean", "conmim": "mean", "can": "mean", "siammae": "mean",
                "finetune": "mean"}                              # eval_finetune's head reads the mean patch token


@dataclass
class Args:
    """Frozen-feature evaluation (k-NN / linear / low-shot) of a checkpoint's encoder."""
    ckpt: str = H.arg(None, "checkpoint.pth written by one of the method files, the official MSN file, an MAE-style "
                      "('model') file or a timm/DeiT ViT state dict", group="model")
    data: str = H.arg(None, "image folder with train/ and val/ (or test/), or 'synthetic'", group="data")
    split: str = H.arg(None, "the folder next to train/ that is evaluated (default: val/, else test/ where there is no "
                       "val/, as in CIFAR-10's folders)", group="data")
    pixels: bool = H.arg(False, "the raw-pixel baseline instead of a checkpoint: the normalised image, flattened and "
                         "centred by the train mean (needs --img-size)")
    mode: str = H.arg("knn", "knn | linear | lowshot | all | embed (the features of the images under --data, any "
                      "folder, into --output)")
    output: str = H.arg(None, "--mode embed: the folder for features.npy (N, D) and files.txt (paths under --data)",
                        group="run control")
    export: str = H.arg(None, "write the encoder alone to this folder (encoder.pth, encoder.safetensors where that "
                        "package is, config.json: timm's model, the pooling, mean / std), then exit", group="model")
    pool: str = H.arg(None, "cls | cls-prenorm | mean (default: per method)", group="model")
    img_size: int = H.arg(None, "training image size (px) (default: the checkpoint's training size)", group="data",
                          positive=True)
    model: str = H.arg(None, "ViT size (tiny|small|base|large): picks the heads of a foreign checkpoint of "
                       "non-standard width; checked against any checkpoint", group="model")
    patch_size: int = H.arg(None, "checked against the checkpoint's patch size", group="model", positive=True)
    random_init: bool = H.arg(False, "evaluate the same ViT at its default random initialisation (run's seed; may "
                              "differ from the run's exact initial weights)", group="model")
    online: bool = H.arg(False, "evaluate the online network's encoder (the checkpoint's `model`) instead of the one "
                         "the paper evaluates (MSN's EMA target, ConMIM's teacher)")
    holdout: int = H.arg(0, "evaluate the N train/ images that a --holdout N run kept out (the k-NN bank: the other "
                         "train/ images): the lr sweep's validation, never test/", group="data", min=0)
    k: int = H.arg(20, "neighbours of the k-NN", positive=True)
    temperature: float = H.arg(0.07, "softmax temperature", positive=True)
    linear_epochs: int = H.arg(100, "linear probe epochs", positive=True)
    linear_lr: float = H.arg(0.1, "linear probe peak lr", positive=True)
    linear_batch: int = H.arg(1024, "linear probe batch", positive=True)
    shots: int = H.arg(1, "images per class for lowshot (ignored with --percent)", positive=True)
    percent: float = H.arg(0.0, "use this %% of train images per class for lowshot", min=0)
    seeds: int = H.arg(3, "random subsets for lowshot", positive=True)
    lambd: float = H.arg(0.0025, "L2 penalty of the logistic regression, divided by the number of training images (MSN "
                         "protocol)", min=0)
    subset_file: str = H.arg(None, "lowshot: train only on the images listed here (one file name or relative path per "
                             "line, as MSN's imagenet_subsets)", group="data")
    batch_size: int = H.arg(256, "images per batch", group="optimisation", positive=True)
    workers: int = H.arg(min(8, os.cpu_count() or 1), "DataLoader workers (default: min(8, CPUs))", group="data", min=0)
    device: str = H.arg(None, "cpu | cuda | cuda:N (default: cuda if available)", group="run control")
    cache: bool = H.arg(True, "cache features next to the checkpoint", group="run control")


# ----------------------------------------------------------------------------------------------
# The evaluated encoder: a plain ViT with timm's key names, rebuilt from any checkpoint's `vit`
# config (each method file has its own training ViT; tests/test_interop.py pins that they agree)
# ----------------------------------------------------------------------------------------------
SIZES = {"nano": (64, 2, 2), "micro": (128, 4, 4), "tiny": (192, 12, 3), "small": (384, 12, 6),
         "base": (768, 12, 12), "large": (1024, 24, 16)}                # width, depth, heads
HEADS = {192: 3, 384: 6, 768: 12, 1024: 16}                            # timm's ViT-Ti/S/B/L
POOLS = ("cls", "cls-prenorm", "mean")


class Attention(nn.Module):
    """qkv_bias "qkv": one qkv bias (timm ViT); "qv": BEiT's learned q and v biases, k bias 0.
    rel_pos: this block's own BEiT relative position bias table (fine-tuning expands the shared one)."""

    def __init__(self, dim, heads, qkv_bias="qkv", rel_pos=None):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim, bias=qkv_bias == "qkv"), nn.Linear(dim, dim)
        if qkv_bias == "qv":
            self.q_bias, self.v_bias = nn.Parameter(torch.zeros(dim)), nn.Parameter(torch.zeros(dim))
        if rel_pos is not None:                                      # timm Beit's per-block names
            self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * rel_pos - 1) ** 2 + 3, heads))
            self.register_buffer("relative_position_index", relative_position_index(rel_pos), persistent=False)

    def forward(self, x, bias=None):                                 # (B, T, D), bias (heads, T, T)
        B, T, D = x.shape
        b = self.qkv.bias if self.qkv.bias is not None else torch.cat((self.q_bias, torch.zeros_like(self.v_bias),
                                                                       self.v_bias))
        q, k, v = F.linear(x, self.qkv.weight, b).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        if hasattr(self, "relative_position_bias_table"):
            bias = relative_bias(self.relative_position_bias_table, self.relative_position_index)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if bias is None else bias.to(q.dtype).unsqueeze(0))
        return self.proj(out.transpose(1, 2).reshape(B, T, D))


def relative_position_index(grid):
    """BEiT's index (1 + N, 1 + N) into the ((2g - 1)^2 + 3)-row table (same as conmim.py's)."""
    yx = torch.stack(torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")).flatten(1)
    rel = (yx[:, :, None] - yx[:, None, :]).permute(1, 2, 0) + (grid - 1)
    n_rel = (2 * grid - 1) ** 2 + 3
    index = torch.zeros(grid * grid + 1, grid * grid + 1, dtype=torch.long)
    index[1:, 1:] = rel[..., 0] * (2 * grid - 1) + rel[..., 1]
    index[0, :], index[:, 0], index[0, 0] = n_rel - 3, n_rel - 2, n_rel - 1
    return index


def relative_bias(table, index):
    """(heads, 1 + N, 1 + N) attention bias: the table's row for each token pair's relative offset."""
    n = index.shape[0]
    return table[index.view(-1)].view(n, n, -1).permute(2, 0, 1)


class RelativePositionBias(nn.Module):
    def __init__(self, grid, heads):
        super().__init__()
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * grid - 1) ** 2 + 3, heads))
        self.register_buffer("relative_position_index", relative_position_index(grid), persistent=False)

    def forward(self):                                               # (heads, 1 + N, 1 + N)
        return relative_bias(self.relative_position_bias_table, self.relative_position_index)


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def drop_path(x, p, training):
    """Stochastic depth: zero a sample's residual branch with probability p, rescale the rest."""
    if p == 0.0 or not training:
        return x
    return x * x.new_empty(x.shape[0], 1, 1).bernoulli_(1 - p) / (1 - p)


class Block(nn.Module):
    """Pre-norm block; drop_path: stochastic depth (used by eval_finetune.py only); layer_scale: BEiT's
    gamma_1 / gamma_2 (None: none); qkv_bias / rel_pos: see Attention."""

    def __init__(self, dim, heads, mlp_ratio=4.0, drop_path=0.0, layer_scale=None, qkv_bias="qkv", rel_pos=None):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim, eps=1e-6), Attention(dim, heads, qkv_bias, rel_pos)
        self.norm2, self.mlp = nn.LayerNorm(dim, eps=1e-6), Mlp(dim, int(dim * mlp_ratio))
        if layer_scale is not None:
            self.gamma_1 = nn.Parameter(torch.full((dim,), float(layer_scale)))
            self.gamma_2 = nn.Parameter(torch.full((dim,), float(layer_scale)))
        self.drop_path = drop_path

    def forward(self, x, bias=None):
        a = self.attn(self.norm1(x), bias)
        if hasattr(self, "gamma_1"):
            a = self.gamma_1 * a
        x = x + drop_path(a, self.drop_path, self.training)
        m = self.mlp(self.norm2(x))
        if hasattr(self, "gamma_2"):
            m = self.gamma_2 * m
        return x + drop_path(m, self.drop_path, self.training)


class PatchEmbed(nn.Module):
    def __init__(self, patch_size, dim):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch_size, patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


def sincos_pos_embed(dim, grid):
    """MAE's fixed 2-D sin-cos table (grid*grid, dim): [x sin, x cos, y sin, y cos]."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4.0))
    ys, xs = torch.meshgrid(torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64),
                            indexing="ij")
    return torch.cat([f(p.flatten()[:, None] * omega[None]) for p in (xs, ys) for f in (torch.sin, torch.cos)],
                     1).float()


class ViT(nn.Module):
    """forward(x, norm=True) -> (B, 1+N, D), [CLS] first. The position table is a parameter here
    (a checkpoint's fixed sin-cos buffer loads into it), interpolated bicubically at other sizes.
    BEiT (ConMIM): pos_embed "none", rel_pos_bias "shared" (one table, pre-training's layout, key
    rel_pos_bias.*) or "block" (one per block, fine-tuning's: load_encoder(per_block_rel_pos=True)
    copies the shared table into every block, as BEiT's run_class_finetuning), layer_scale, qkv_bias
    "qv"; such an encoder takes only its training image size (the bias is tied to the patch grid).
    --random-init draws the weights as the method's own ViT does (init "trunc": DeiT / MSN,
    "xavier": MAE / CMAE / CAN / SiamMAE, "beit": ConMIM), in the same order, for the run's seed: the
    run's own initial encoder for MSN, CMAE and ConMIM; CAN's and SiamMAE's training models draw the
    whole model at once (MAE's initialize_weights), so there it is another draw of the same
    initialisation (a run's first checkpoint, --stop-step 1 at lr 0, holds its own start)."""

    def __init__(self, img_size=224, patch_size=16, dim=384, depth=12, heads=6, mlp_ratio=4.0,
                 pos_embed="learned", init="trunc", drop_path=0.0, rel_pos_bias=None, layer_scale=None,
                 qkv_bias="qkv", **_):
        super().__init__()
        self.config = dict(img_size=img_size, patch_size=patch_size, dim=dim, depth=depth, heads=heads,
                           mlp_ratio=mlp_ratio, pos_embed="none" if pos_embed == "none" else "learned", init=init)
        if pos_embed == "none":
            self.config.update(rel_pos_bias=rel_pos_bias, layer_scale=layer_scale, qkv_bias=qkv_bias)
        self.patch_size, self.dim, self.grid = patch_size, dim, img_size // patch_size
        self.patch_embed = PatchEmbed(patch_size, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        if pos_embed != "none":
            self.pos_embed = nn.Parameter(torch.zeros(1, 1 + self.grid ** 2, dim))
            if pos_embed == "sincos":
                self.pos_embed.data[0, 1:] = sincos_pos_embed(dim, self.grid)
            else:
                self.init_token(self.pos_embed, init)
        if rel_pos_bias == "shared":
            self.rel_pos_bias = RelativePositionBias(self.grid, heads)
        block_rel = self.grid if rel_pos_bias == "block" else None
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio, p, layer_scale, qkv_bias, block_rel)
                                    for p in torch.linspace(0, drop_path, depth).tolist())
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                conv = isinstance(m, nn.Conv2d)
                if init == "beit":
                    nn.init.trunc_normal_(m.weight, std=0.02, a=-0.02, b=0.02)
                elif init == "xavier":
                    nn.init.xavier_uniform_(m.weight.view(m.weight.shape[0], -1) if conv else m.weight)
                elif conv:
                    nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
                else:
                    nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None and not (conv and init == "xavier"):
                    nn.init.zeros_(m.bias)
        self.init_token(self.cls_token, init)
        if init == "beit":                                           # BEiT's fix_init_weight
            for layer, blk in enumerate(self.blocks, start=1):
                blk.attn.proj.weight.data.div_(math.sqrt(2.0 * layer))
                blk.mlp.fc2.weight.data.div_(math.sqrt(2.0 * layer))

    def check_grid(self, gh, gw):
        """A one-line error where a BEiT encoder gets another patch grid than its training one (its relative
        position bias is tied to it; BEiT would interpolate the tables, this code does not)."""
        if not hasattr(self, "pos_embed") and (gh, gw) != (self.grid, self.grid):
            raise C.UserError(f"this BEiT encoder takes {self.grid * self.patch_size}px images only (its relative "
                              f"position bias is tied to the {self.grid}x{self.grid} patch grid), got "
                              f"{gh * self.patch_size}x{gw * self.patch_size}; leave --img-size at the checkpoint's")

    @staticmethod
    def init_token(t, init):
        if init == "xavier":
            nn.init.normal_(t, std=0.02)
        else:
            nn.init.trunc_normal_(t, std=0.02, **(dict(a=-0.02, b=0.02) if init == "beit" else {}))

    def forward(self, x, norm=True):
        gh, gw = x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size
        x = self.patch_embed(x)
        if not hasattr(self, "pos_embed"):                           # BEiT: no position added to any token
            self.check_grid(gh, gw)
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
            bias = self.rel_pos_bias() if hasattr(self, "rel_pos_bias") else None
            x = C.run_blocks(self.blocks, x, getattr(self, "grad_ckpt", False), bias)
            return self.norm(x) if norm else x
        x = x + resize_pos_embed(self.pos_embed, gh, gw)[:, 1:].to(x.dtype)
        x = torch.cat([(self.cls_token + self.pos_embed[:, :1]).expand(x.shape[0], -1, -1), x], dim=1)
        x = C.run_blocks(self.blocks, x, getattr(self, "grad_ckpt", False))
        return self.norm(x) if norm else x


def resize_pos_embed(pe, gh, gw):
    """A position table (1, 1 + g * g, D) (the [CLS] row first) for a gh x gw patch grid: the patch rows interpolated
    bicubically when the grid differs (timm's resample_abs_pos_embed; also --init's), the [CLS] row as it is."""
    g = math.isqrt(pe.shape[1] - 1)
    if (gh, gw) == (g, g):
        return pe
    grid = pe[:, 1:].reshape(1, g, g, -1).permute(0, 3, 1, 2).float()
    grid = F.interpolate(grid, size=(gh, gw), mode="bicubic", align_corners=False)
    return torch.cat([pe[:, :1], grid.permute(0, 2, 3, 1).reshape(1, gh * gw, -1).to(pe.dtype)], dim=1)


def check_size(encoder, size):
    """size, or at start the one-line error the encoder's forward would give (BEiT: its training size only)."""
    encoder.check_grid(size // encoder.patch_size, size // encoder.patch_size)
    return size


class Pixels(nn.Module):
    """The raw-pixel baseline (--pixels) in the encoder's place: (B, 3, H, W) -> (B, 3HW), the normalised
    image itself (evaluate() centres it by the train split's mean image)."""
    patch_size = 1

    def check_grid(self, gh, gw):
        pass

    def forward(self, x, norm=True):
        return x.flatten(1)


def features_of(encoder, x, how):
    """(B, 3, H, W) -> (B, D): "cls" the CLS token after the final norm, "cls-prenorm" before it
    (MSN's evaluations), "mean" the mean of the normed patch tokens."""
    if how not in POOLS:
        raise C.UserError(f"--pool must be one of {', '.join(POOLS)}, got {how!r}")
    if isinstance(encoder, Pixels):
        return encoder(x)
    tokens = encoder(x, norm=how != "cls-prenorm")
    return tokens[:, 1:].mean(1) if how == "mean" else tokens[:, 0]


# A ViT's own tensors in timm / DeiT / MAE / MSN naming (heads, decoders, prototypes are not).
VIT_KEY = re.compile(r"cls_token|pos_embed|patch_embed\.proj\.(weight|bias)|norm\.(weight|bias)|"
                     r"blocks\.\d+\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)")


def foreign_vit(obj, path):
    """(layout, ViT state dict in timm's names) of a checkpoint not written here: the official MSN file
    (`target_encoder`, `module.` prefix), an MAE-style file (`model`: MAE, CAN, DeiT and many MAE
    derivatives) or a plain timm / DeiT state dict; heads, decoders and optimiser state left out."""
    if not isinstance(obj, dict):
        raise C.UserError(f"{path}: not a dict of tensors")
    layout, sd = next(((k, obj[k]) for k in ("target_encoder", "model") if isinstance(obj.get(k), dict)), ("timm", obj))
    sd = {k.removeprefix("module."): v for k, v in sd.items() if torch.is_tensor(v)}
    vit = {k: v for k, v in sd.items() if VIT_KEY.fullmatch(k)}
    if "cls_token" not in vit or "patch_embed.proj.weight" not in vit or "blocks.0.attn.qkv.weight" not in vit:
        keys = ", ".join(list(obj)[:6]) + (", ..." if len(obj) > 6 else "")
        raise C.UserError(f"{path}: unknown checkpoint layout (keys: {keys}); expected this project's format, MSN's "
                          "target_encoder, an MAE-style 'model' or a timm ViT state dict")
    return {"target_encoder": "msn", "model": "mae-style"}.get(layout, "timm"), vit


def foreign_encoder(obj, path, model=None):
    """(layout, ViT config, ViT state dict) of a checkpoint not written here (foreign_vit). The architecture comes
    from the tensor shapes; the heads from --model (else timm's default for the width)."""
    layout, vit = foreign_vit(obj, path)
    dim, p = vit["cls_token"].shape[-1], vit["patch_embed.proj.weight"].shape[-1]
    depth = 1 + max(int(k.split(".")[1]) for k in vit if k.startswith("blocks."))
    grid = math.isqrt(vit["pos_embed"].shape[1] - 1)
    if model is not None:
        if model not in SIZES or SIZES[model][0] != dim:
            raise C.UserError(f"--model {model} does not match {path} (width {dim})")
    heads = SIZES[model][2] if model else HEADS.get(dim)
    if heads is None:
        raise C.UserError(f"{path}: width {dim} is not a standard ViT size; give --model")
    config = dict(img_size=grid * p, patch_size=p, dim=dim, depth=depth, heads=heads,
                  mlp_ratio=vit["blocks.0.mlp.fc1.weight"].shape[0] / dim, pos_embed="learned")
    return layout, config, vit


def load_encoder(path, random_init=False, model=None, patch_size=None, drop_path=0.0, per_block_rel_pos=False,
                 online=False):
    """(encoder, checkpoint) of a checkpoint file: this project's format, or (see foreign_encoder)
    the official MSN layout, an MAE-style `model` dict or a timm/DeiT state dict, whose `method` is
    then "msn", "mae-style" or "timm". random_init: the same ViT at its default initialisation drawn
    with the run's seed (weights not loaded). per_block_rel_pos: a BEiT encoder's shared relative
    position bias becomes one table per block, each a copy (fine-tuning, as BEiT / ConMIM's
    run_class_finetuning). online: the online network's encoder (online_encoder). In eval mode."""
    obj = C.load_checkpoint(path, ours=False)
    if online and not (isinstance(obj, dict) and "method" in obj and "model" in obj):
        raise C.UserError(f"--online: {path} is not a checkpoint of this project's training scripts (no `model`)")
    if isinstance(obj, dict) and "method" in obj and "encoder" in obj:
        ckpt = C.load_checkpoint(path)
        if online:
            ckpt["encoder"] = online_encoder(ckpt, path)
        v = ckpt["vit"]                                              # --model: checked here too
        if model is not None and SIZES.get(model, ())[:3] != (v["dim"], v["depth"], v["heads"]):
            raise C.UserError(f"--model {model} does not match {path} (width {v['dim']}, depth {v['depth']})")
    else:
        method, config, sd = foreign_encoder(obj, path, model)
        ckpt = {"method": method, "vit": config, "encoder": sd, "args": {"seed": 0}}
    if patch_size is not None and patch_size != ckpt["vit"]["patch_size"]:      # any checkpoint
        raise C.UserError(f"--patch-size {patch_size} does not match {path} (patch {ckpt['vit']['patch_size']})")
    if ckpt["method"] == "conmim" and ckpt["vit"].get("pos_embed") != "none":
        print(f"{path}: a ConMIM checkpoint from before its BEiT backbone (learned absolute position "
              "embeddings, which let its objective be solved by position alone): evaluated as the plain ViT it is")
    vit, sd = dict(ckpt["vit"]), ckpt["encoder"]
    if per_block_rel_pos and vit.get("rel_pos_bias") == "shared":
        vit["rel_pos_bias"] = "block"
        sd = dict(sd)
        table = sd.pop("rel_pos_bias.relative_position_bias_table", None)
        if table is not None:
            sd |= {f"blocks.{i}.attn.relative_position_bias_table": table.clone() for i in range(vit["depth"])}
    torch.manual_seed(ckpt["args"].get("seed", 0))
    enc = ViT(**vit, drop_path=drop_path)
    if not random_init:
        bad = next((k for k, v in sd.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
        if bad:                                                      # it would score 0 on every metric
            raise C.UserError(f"{path}: the encoder's {bad} holds NaN or infinite values (a corrupted file, or a "
                              "diverged run's weights)")
        try:
            enc.load_state_dict(sd)
        except RuntimeError as e:
            raise C.UserError(f"{path}: the encoder does not fit a ViT ({' '.join(str(e).split())[:300]})") from None
    return enc.eval(), ckpt


def init_weights(path, model, encoder, method):
    """--init PATH of a training script: the weights its online network starts from at step 0 (before its EMA target
    is copied from it, so both start there). The encoder (`encoder`, a module of `model`) from any file load_encoder
    reads: a checkpoint of this project (its evaluated `encoder`; one of the same method also gives the heads,
    decoders, prototypes of its `model`), the official MSN file, an MAE-style `model` dict, a timm / DeiT state dict.
    Every encoder tensor must be found with its shape, but a learned position table, interpolated to this patch grid
    (resize_pos_embed), and a fixed sin-cos one, which stays this model's own; anything else loads where a name and a
    shape match and starts fresh otherwise. Prints what was loaded, started fresh and was interpolated; an encoder
    tensor that cannot be used is a one-line error naming its key."""
    obj = C.load_checkpoint(path, ours=False)
    at = next(n for n, m in model.named_modules() if m is encoder) + "."     # the encoder's prefix in model
    if isinstance(obj, dict) and "method" in obj and "encoder" in obj:
        ckpt = C.load_checkpoint(path)
        source = dict(ckpt.get("model") or {}) if ckpt["method"] == method else {}
        source |= {at + k: v for k, v in ckpt["encoder"].items()}    # the evaluated encoder (MSN's, ConMIM's EMA)
        what = f"a {ckpt['method']} checkpoint, step {ckpt.get('step')}"
    else:
        layout, sd = foreign_vit(obj, path)
        source = {at + k: v for k, v in sd.items()}
        what = {"msn": "the official MSN layout", "mae-style": "an MAE-style model dict"}.get(layout, "a timm ViT")
    fixed = {n for n, _ in model.named_buffers()}                    # e.g. a sin-cos table: never learned
    own, load, fresh, resized = model.state_dict(), {}, [], []
    for k, v in own.items():
        src, name = source.get(k), k.removeprefix(at)
        if src is not None and src.shape != v.shape and k == at + "pos_embed" and k not in fixed:
            src = resize_pos_embed(src, encoder.grid, encoder.grid)
            resized.append(f"{name} {math.isqrt(source[k].shape[1] - 1)}^2 -> {encoder.grid}^2")
        if src is not None and src.shape == v.shape:
            load[k] = src
        elif k in fixed:                                             # a fixed table of another grid: this one's own
            continue
        elif k.startswith(at):                                       # the encoder must come whole
            why = f"no {name}" if src is None else f"{name} of shape {tuple(src.shape)}, this model's {tuple(v.shape)}"
            raise C.UserError(f"--init {path}: its encoder has {why} (another size or architecture)")
        else:
            fresh.append(k)
    extra = sorted(k.removeprefix(at) for k in source if k.startswith(at) and k not in own)
    if extra:
        raise C.UserError(f"--init {path}: its encoder has {extra[0]}, which this model lacks ({len(extra)} such "
                          "tensors: another depth or architecture)")
    bad = next((k for k, v in load.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
    if bad:
        raise C.UserError(f"--init {path}: {bad} holds NaN or infinite values")
    model.load_state_dict(load, strict=False)
    path_to_encoder = at.split(".")[:-1]                            # e.g. ["net", "encoder"]

    def count(keys):                                                 # "encoder (42), head (9), prototypes (1)"
        groups = {"encoder": 0} if any(k.startswith(at) for k in keys) else {}    # the encoder first
        for k in keys:
            part = "encoder" if k.startswith(at) else next(p for p in k.split(".") if p not in path_to_encoder)
            groups[part] = groups.get(part, 0) + 1
        return ", ".join(f"{g} ({n})" for g, n in groups.items()) or "nothing"
    C.print0(f"--init {path} ({what}): loaded {count(load)}; fresh: {count(fresh)}"
             + (f"; interpolated: {', '.join(resized)}" if resized else ""))
    return load


def online_encoder(ckpt, path):
    """The online network's encoder in a checkpoint's `model` (MSN: net.encoder.*; CMAE, ConMIM, CAN,
    SiamMAE: encoder.*): the keys under the prefix whose names are exactly those of the evaluated
    `encoder` (for CMAE, CAN and SiamMAE the same weights: they evaluate the online encoder)."""
    model, names = ckpt.get("model") or {}, set(ckpt["encoder"])
    for prefix in sorted({k[:k.index("encoder.") + 8] for k in model if "encoder." in k}):
        sd = {k[len(prefix):]: v for k, v in model.items() if k.startswith(prefix)}
        if set(sd) == names:
            return sd
    raise C.UserError(f"--online: {path}'s `model` holds no encoder with the evaluated encoder's weights' names")


class Progress:
    """A phase that can take long (feature extraction, a probe's epochs, propagation): `what i/total
    (pct), elapsed, eta` at most every `every` seconds (rank 0), and a closing line with its time.
    progress.step(n) after each unit; use as a context manager or call done()."""

    def __init__(self, what, total, every=10.0):
        self.what, self.total, self.every, self.i = what, max(1, total), every, 0
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
    return T.Compose([T.Resize(int(img_size * 256 / 224), interpolation=T.InterpolationMode.BICUBIC),
                      T.CenterCrop(img_size), C.to_uint8])


@torch.no_grad()
def knn_predict(train_f, train_y, test_f, num_classes, k=20, T=0.07, chunk=1024):
    """Cosine similarity top-k, votes weighted by exp(sim / T); returns (n_test, C) class scores, each query's up to
    the factor exp(its largest sim / T) (subtracted before exp: at T 0.01 exp(1 / T) overflows float32), and -inf for
    a class that got no vote."""
    out = []
    for i in range(0, len(test_f), chunk):
        sim = test_f[i:i + chunk] @ train_f.T                        # (b, n_train)
        s, idx = sim.topk(min(k, train_f.shape[0]), dim=1)           # sorted: s[:, :1] is each query's largest
        weight = ((s - s[:, :1]) / T).exp()                          # (b, k), in (0, 1]
        onehot = F.one_hot(train_y[idx], num_classes).float()        # (b, k, C)
        votes = (onehot * weight.unsqueeze(-1)).sum(1)
        out.append(votes.masked_fill(onehot.sum(1) == 0, float("-inf")))
    return torch.cat(out)


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
                feats.append(features(encoder, C.normalize(x.to(device, non_blocking=True))).float().cpu())
            labels.append(y)
            progress.step()
    feats = torch.cat(feats)
    if not torch.isfinite(feats).all():
        rows = (~torch.isfinite(feats)).any(1).sum()
        raise C.UserError(f"the encoder gave NaN or infinite features for {rows} of {len(feats)} images (its weights "
                          "are finite: an overflow, e.g. of bf16 activations; try --device cpu)")
    return feats, torch.cat(labels)


def check_readable(ds, workers=0, batch_size=256):
    """Read every image of ds once (a DataLoader of `workers`): an unreadable one is its one-line error now, at the
    start (of fine-tuning, of a run's k-NN monitor), not when an evaluation after an epoch of training reaches it."""
    for _ in torch.utils.data.DataLoader(C.Views(ds, lambda img: 0), batch_size, num_workers=workers):
        pass


def val_to_train(train, val):
    """(len(val.classes),) the train index of each val class, matched BY NAME (-1: train lacks it)."""
    index = {c: i for i, c in enumerate(train.classes)}
    return torch.tensor([index.get(c, -1) for c in val.classes])


@torch.no_grad()
def sharded_features(encoder, ds, size, pool, device, autocast=contextlib.nullcontext(), workers=0, synthetic=False):
    """extract_features of ds with every process taking a strided share (ranks r, r + world, ...), gathered in ds's
    order on every rank: the k-NN monitor's, whose other processes would otherwise wait at the next collective."""
    world, rank = C.world_size(), C.rank()
    share = torch.utils.data.Subset(C.Views(ds, eval_transform(size, synthetic)), range(rank, len(ds), world))
    feats, labels = extract_features(encoder, torch.utils.data.DataLoader(share, 256, num_workers=workers), device,
                                     lambda e, x: features_of(e, x, pool), autocast)
    if world == 1:
        return feats, labels
    rows = -(-len(ds) // world)                                      # the largest share: every rank pads to it
    padded = [torch.cat([t.to(device), t.new_zeros(rows - len(t), *t.shape[1:]).to(device)]) for t in (feats, labels)]
    gathered = [C.all_gather(t, grad=False).view(world, rows, *t.shape[1:]) for t in padded]
    out = [torch.empty(len(ds), *g.shape[2:], dtype=g.dtype) for g in gathered]
    for r in range(world):
        n = len(range(r, len(ds), world))
        for o, g in zip(out, gathered):
            o[r::world] = g[r, :n].cpu()
    return out[0], out[1]


class KNNMonitor:
    """--knn / --eval-every N of a training script: the k-NN (this file's: eval transform, the method's pooling,
    k 20, T 0.07) of the encoder the run evaluates, train/ the bank and val/ (else test/) the queries, or with
    --holdout the run's training images the bank and its held-out ones the queries. At step 0 (the initial encoder),
    every N steps and at the end of the run (called by the method's loop), each logged as knn_top1 / knn_top5 with
    its step. All processes extract, rank 0 scores. Its RNG is its own: the run trains the same weights without it."""

    def __init__(self, args, run, log, encoder, method, what):
        self.run, self.log, self.encoder, self.what = run, log, encoder, what
        self.every, self.size, self.pool = args.eval_every, args.img_size, DEFAULT_POOL[method]
        self.synthetic, self.workers = args.data == "synthetic", args.workers
        try:                                                         # the layout, checked before any step
            self.train, self.val, self.to_train = splits(args.data, holdout=args.holdout)
        except C.UserError as e:
            raise C.UserError(f"--knn / --eval-every: {e}") from None
        self.split = eval_split(args.data, holdout=args.holdout)
        check_readable(self.val, args.workers)                      # an unreadable query: now, not at step N
        self.first = None
        if log.first == 1:                                           # a new run: its initial encoder
            self(0)

    def due(self, step):
        """A step the monitor evaluates in the loop (the run's end is evaluated after its final checkpoint)."""
        return bool(self.every) and step % self.every == 0 and step < self.log.end

    def final(self, step):
        """The k-NN of the final encoder, after the final checkpoint: a stop signal now ends the program at once."""
        self.run.control.trained = self.run.ckpt
        return self(step)

    def __call__(self, step):
        t0 = time.time()
        devices = [self.run.device] if self.run.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):                # the training draws stay as without it
            was = self.encoder.training
            feats = [sharded_features(self.encoder, ds, self.size, self.pool, self.run.device, self.run.autocast,
                                      self.workers, self.synthetic) for ds in (self.train, self.val)]
            self.encoder.train(was)
        if not C.is_main():
            return None
        (ftr, ytr), (fva, yva) = feats
        res = knn(ftr, ytr, fva, self.to_train[yva], len(self.train.classes))
        self.log.write({"step": step, **{k: round(v, 3) for k, v in res.items()}})
        if self.first is None:
            self.first = (step, res["knn_top1"])
        C.print0(f"k-NN top-1 on {self.split}/ ({self.what}, {self.pool}): {res['knn_top1']:.1f}% at step {step}"
                 + (f" ({self.first[1]:.1f}% at step {self.first[0]})" if self.first[0] != step else "")
                 + f"; {len(self.train)} + {len(self.val)} images in {time.time() - t0:.0f} s")
        return res


def eval_split(data, split=None, holdout=0):
    """The evaluated folder's name: `split` when given, else val/, else test/ (CIFAR-10's folders);
    "holdout" for --holdout (images of train/)."""
    if holdout:
        return "holdout"
    if split or data == "synthetic":
        return split or "val"
    return "test" if not os.path.isdir(os.path.join(data, "val")) and os.path.isdir(os.path.join(data,
                                                                                                 "test")) else "val"


def splits(data, skip_unreadable=False, split=None, holdout=0):
    """The train and evaluated (val) datasets, checked before any feature is computed, and val's labels
    mapped to train's class indices BY NAME (a val/ that lacks a class, or orders them otherwise, keeps
    every label right); a val class that train lacks is an error. Returns (train, val, val_to_train).
    split: the evaluated folder (default val/, else test/). skip_unreadable: for train (fine-tuning
    skips bad images as training does). holdout n: val is the n train images C.held_out() keeps out of
    a --holdout n run, train the others (no other folder is read)."""
    if holdout:
        if split:
            raise C.UserError(f"--holdout evaluates images of train/, not --split {split}: give one of them")
        train, val = (C.image_dataset(data, s, skip_unreadable, holdout) for s in ("train", "holdout"))
        return train, val, torch.arange(len(train.classes))
    split = eval_split(data, split)
    train = C.image_dataset(data, "train", skip_unreadable)
    val = C.image_dataset(data, split) if os.path.isdir(os.path.join(data, split)) or data == "synthetic" else None
    if val is None or not os.path.isdir(os.path.join(data, "train")) and data != "synthetic":
        raise C.UserError(f"--data {data}: expected train/ and {split}/ class folders (evaluation needs both"
                          f"{'' if split != 'val' else '; a test/ folder is used where there is no val/'})")
    mapping = val_to_train(train, val)
    missing = [c for c, i in zip(val.classes, mapping.tolist()) if i < 0]
    if missing:
        raise C.UserError(f"--data {data}: val/ has {len(missing)} class(es) that train/ lacks, e.g. {missing[0]!r} "
                          f"(train has {len(train.classes)}: "
                          f"{', '.join(train.classes[:5])}{', ...' if len(train.classes) > 5 else ''})")
    return train, val, mapping


def features(a, enc, ckpt, split, ds, device):
    """(N, D) float features and (N,) labels (ds's own class indices) of a split, cached on disk. The
    cache key holds everything they depend on: the checkpoint file (path, size, mtime), how it is read
    (pooling, size, --random-init, --model, --patch-size) and the split's images (class names and
    file list), so a dataset changed in place is never served another's features and labels."""
    pool = a.pool or DEFAULT_POOL.get(ckpt["method"], "cls")
    size = check_size(enc, a.img_size or ckpt["vit"]["img_size"])
    if a.pixels:
        a = replace(a, cache=False)                  # no checkpoint to cache next to; cheap to redo
    st = os.stat(a.ckpt) if a.ckpt else None
    files = [p for p, _ in getattr(ds, "samples", [])]
    key = st and hashlib.sha1(json.dumps([os.path.abspath(a.ckpt), st.st_size, st.st_mtime_ns, pool, size, a.data,
                                          a.random_init, a.online, a.model, a.patch_size, len(ds), list(ds.classes),
                                          files]).encode()).hexdigest()[:16]
    path = st and os.path.join(os.path.dirname(os.path.abspath(a.ckpt)), "features", f"{key}_{split}.pt")
    if a.cache and os.path.isfile(path):
        return torch.load(path, weights_only=True)
    tf = eval_transform(size, synthetic=a.data == "synthetic")
    dl = torch.utils.data.DataLoader(C.Views(ds, tf), a.batch_size, num_workers=a.workers)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    out = extract_features(enc, dl, device, lambda e, x: features_of(e, x, pool), autocast)
    if a.cache:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        C.save_checkpoint(path, out)
    return out


def topk(scores, y, k):
    """Top-k accuracy (%); entries at -inf (no vote) never count as a hit."""
    val, idx = scores.topk(min(k, scores.shape[1]), dim=1)
    return 100.0 * ((idx == y[:, None]) & (val > float("-inf"))).any(1).float().mean().item()


def knn(train_f, train_y, val_f, val_y, num_classes, k=20, T=0.07):
    s = knn_predict(F.normalize(train_f, dim=1), train_y, F.normalize(val_f, dim=1), num_classes, k, T)
    return {"knn_top1": topk(s, val_y, 1), "knn_top5": topk(s, val_y, 5)}


def linear_probe(train_f, train_y, val_f, val_y, num_classes, epochs=100, lr=0.1, batch=1024, seed=0):
    """Both splits standardised with the TRAIN mean and std, a linear head trained on train, top-1/5 on val."""
    mean, std = train_f.mean(0), train_f.std(0) + 1e-6
    head = linear_head((train_f - mean) / std, train_y, num_classes, epochs, lr, batch, seed)
    with torch.no_grad():
        s = head((val_f - mean) / std)
    return {"linear_top1": topk(s, val_y, 1), "linear_top5": topk(s, val_y, 5)}


def linear_head(xt, train_y, num_classes, epochs=100, lr=0.1, batch=1024, seed=0):
    """nn.Linear from zeros, mean CE, SGD momentum 0.9, lr cosine from lr to 0 per step over epochs x
    ceil(n / batch) steps, a fresh shuffle (generator seeded by seed) each epoch, the last batch partial."""
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
    """cyanure preprocess(normalize=True, columns=False, centering=True): per row, subtract the row's
    own mean, then scale to unit L2 norm."""
    return F.normalize(x - x.mean(dim=1, keepdim=True), dim=1)


def logistic_regression(x, y, num_classes, lambd=0.0025, iters=500):
    """MSN's low-shot classifier: W (D, C) minimising mean_i CE(x_i W, y_i) + (lambd / n) / 2 ||W||^2,
    no intercept, n = len(x) (logistic_eval.py divides --lambd by the number of training images).
    Full-batch L-BFGS in float64. Returns W."""
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
            raise C.UserError(f"class {c} has {len(idx)} train images, fewer than the {n} asked for")
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
        raise C.UserError("--subset-file needs an image folder as --data (the synthetic set has no file names)")
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
        raise C.UserError(f"--subset-file {path}: {len(missing)} of {len(names)} images not found (or "
                          f"ambiguous) under {root}, e.g. {missing[0]!r}")
    return torch.tensor(idx)


def lowshot(train_f, train_y, val_f, val_y, num_classes, shots=1, percent=0.0, seeds=3, lambd=0.0025, subset=None):
    """MSN protocol on `subset` (indices) or on `seeds` random subsets; mean +- std top-1 (%)."""
    subsets = [subset] if subset is not None else [lowshot_subset(train_y, num_classes, shots, percent, s)
                                                    for s in range(seeds)]
    accs = []
    for idx in subsets:
        W = logistic_regression(msn_preprocess(train_f[idx]), train_y[idx], num_classes, lambd)
        accs.append(topk(msn_preprocess(val_f).double() @ W, val_y, 1))
    t = torch.tensor(accs)
    name = "lowshot_file" if subset is not None else f"lowshot_{percent:g}pct" if percent else f"lowshot_{shots}shot"
    return {f"{name}_mean": t.mean().item(), f"{name}_std": t.std().item() if len(accs) > 1 else 0.0}


def embed(a, enc, ckpt, device):
    """--mode embed: features.npy (N, D) float32 and files.txt (each row's path under --data) of every image under
    --data (a flat folder or class folders, unreadable images an error), with the evaluation's encoder, pooling and
    preprocessing (features(): the same rows as the k-NN's on the same images; --pixels: the normalised image
    itself, not centred)."""
    import numpy as np
    if not a.output:
        raise C.UserError("--mode embed writes features.npy and files.txt into --output DIR: give it")
    _lock = H.claim_dir(a.output, "--output")                       # held while this evaluation writes
    ds = C.image_dataset(a.data, "train") if a.data == "synthetic" else C.ImageFiles(a.data)
    feats, _ = features(replace(a, cache=False), enc.to(device), ckpt, "embed", ds, device)
    np.save(os.path.join(a.output, "features.npy"), feats.numpy().astype(np.float32))
    names = [os.path.relpath(p, a.data) for p, _ in getattr(ds, "samples", [])] or [str(i) for i in range(len(ds))]
    with open(os.path.join(a.output, "files.txt"), "w") as f:
        f.writelines(n + "\n" for n in names)
    C.print0(f"features of {len(ds)} images ({tuple(feats.shape)}, pooling {a.pool or DEFAULT_POOL.get(ckpt['method'])}"
             f") -> {a.output}/features.npy, files.txt")
    return {"images": len(ds), "dim": feats.shape[1], "output": a.output}


TIMM_NAMES = {192: "tiny", 384: "small", 768: "base", 1024: "large"}


def export(a, enc, ckpt):
    """--export OUT: the evaluated encoder alone, as encoder.pth (and encoder.safetensors where the safetensors package
    is installed), and config.json: how to rebuild it in timm (`timm.create_model(**config["timm"])`, then
    load_state_dict), its pooling and the preprocessing (mean / std, size)."""
    _lock = H.claim_dir(a.export, "--export")                       # held while the export writes
    v, pool = ckpt["vit"], a.pool or DEFAULT_POOL.get(ckpt["method"], "cls")
    beit = v.get("pos_embed") == "none"
    name = "beit_base_patch16_224" if beit else f"vit_{TIMM_NAMES.get(v['dim'], 'small')}_patch16_224"  # resized
    timm = dict(model_name=name, pretrained=False, num_classes=0, img_size=v["img_size"], patch_size=v["patch_size"],
                embed_dim=v["dim"], depth=v["depth"], num_heads=v["heads"], mlp_ratio=v["mlp_ratio"])
    if beit:                                                         # ConMIM's: BEiT's shared relative bias
        timm |= dict(use_abs_pos_emb=False, use_rel_pos_bias=False, use_shared_rel_pos_bias=True,
                     init_values=v["layer_scale"], global_pool="token")
        how = "vit.forward_features(x)[:, 1:].mean(1)" if pool == "mean" else "vit(x)"
    else:                                                            # timm's "avg" without fc_norm: our "mean"
        timm |= dict(global_pool="avg" if pool == "mean" else "token", fc_norm=False)
        how = "vit(x) with vit.norm = torch.nn.Identity()" if pool == "cls-prenorm" else "vit(x)"
    sd = {k: t.contiguous() for k, t in enc.state_dict().items()}
    C.save_checkpoint(os.path.join(a.export, "encoder.pth"), sd)
    try:
        from safetensors.torch import save_file
        save_file(sd, os.path.join(a.export, "encoder.safetensors"))
    except ImportError:                                              # optional: never required
        pass
    config = {"method": ckpt["method"], "step": ckpt.get("step"), "ckpt": os.path.abspath(a.ckpt), "pool": pool,
              "features": how, "timm": timm, "img_size": v["img_size"], "mean": C.IMAGENET_MEAN, "std": C.IMAGENET_STD,
              "resize": "bicubic to img_size * 256 / 224, centre crop img_size (eval_linear.eval_transform)",
              "vit": v}
    with open(os.path.join(a.export, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    C.print0(f"the {ckpt['method']} encoder -> {a.export}: encoder.pth, config.json (timm: {name}, pooling {pool})")
    return config


def evaluate(a):
    H.validate(a)                                                    # ranges, finite numbers: one line each
    if a.pixels and (a.ckpt or a.random_init or not a.img_size):
        raise C.UserError("--pixels evaluates the images themselves: give --img-size, and no --ckpt / --random-init")
    if not a.ckpt and not a.pixels:
        raise C.UserError("--ckpt is required (a checkpoint.pth written by msn/cmae/conmim/can.py), or --pixels")
    if a.export and (a.pixels or a.random_init):
        raise C.UserError("--export writes a checkpoint's trained encoder: not with --pixels or --random-init")
    if not a.data and not a.export:
        raise C.UserError("--data is required: an image folder with train/ and val/, or 'synthetic'")
    if a.mode not in ("knn", "linear", "lowshot", "all", "embed"):
        raise C.UserError(f"--mode must be knn, linear, lowshot, all or embed, got {a.mode!r}")
    if a.percent > 100:
        raise C.UserError(f"--percent must be in [0, 100], got {a.percent}")
    if a.online and (a.random_init or a.pixels):
        raise C.UserError("--online reads a checkpoint's trained online network: not with --random-init or --pixels")
    device = H.resolve_device(a.device)
    enc, ckpt = (Pixels(), {"method": "pixels", "vit": {"img_size": a.img_size}}) if a.pixels else \
        load_encoder(a.ckpt, a.random_init, a.model, a.patch_size, online=a.online)
    trained = ckpt.get("args", {}).get("holdout", 0) if "encoder" in ckpt and not a.random_init else a.holdout
    if a.holdout and trained != a.holdout:           # the held-out images must be ones it never trained on
        raise C.UserError(f"--holdout {a.holdout}: {a.ckpt} was trained with --holdout {trained}"
                          f"{' (on every train/ image)' if not trained else ''}: its held-out images are not these")
    if a.img_size is not None and (a.img_size <= 0 or a.img_size % enc.patch_size):
        raise C.UserError(f"--img-size {a.img_size} is not a positive multiple of the checkpoint's patch size "
                          f"{enc.patch_size}")
    if a.subset_file and a.mode not in ("lowshot", "all"):
        raise C.UserError(f"--subset-file is read by --mode lowshot or all, not {a.mode}")
    if a.export:
        return export(a, enc, ckpt)
    if a.mode == "embed":
        return embed(a, enc, ckpt, device)
    train, val, val_to_train = splits(a.data, split=a.split, holdout=a.holdout)   # layout checked before any extraction
    subset = subset_from_file(a.subset_file, a.data) if a.subset_file else None           # so is the subset
    C.print0(f"train: {len(train)} images in {len(train.classes)} classes; {eval_split(a.data, a.split, a.holdout)}: "
             f"{len(val)} images in {len(val.classes)} classes (labels matched by class name)")
    enc = enc.to(device)
    ftr, ytr = features(a, enc, ckpt, "train", train, device)
    fva, yva = features(a, enc, ckpt, "val", val, device)
    yva = val_to_train[yva]
    if a.pixels:                                                   # centred by the train mean image
        mean = ftr.mean(0)
        ftr, fva = ftr - mean, fva - mean
    nc = len(train.classes)
    res = {"method": ckpt["method"], "ckpt": a.ckpt, "random_init": a.random_init, "online": a.online,
           "split": eval_split(a.data, a.split, a.holdout),
           "pool": a.pool or DEFAULT_POOL.get(ckpt["method"], "cls"),
           "train_classes": len(train.classes), "val_classes": len(val.classes)}
    if a.mode in ("knn", "all"):
        res.update(knn(ftr, ytr, fva, yva, nc, a.k, a.temperature))
    if a.mode in ("linear", "all"):
        res.update(linear_probe(ftr, ytr, fva, yva, nc, a.linear_epochs, a.linear_lr, a.linear_batch))
    if a.mode in ("lowshot", "all"):
        res.update(lowshot(ftr, ytr, fva, yva, nc, a.shots, a.percent, a.seeds, a.lambd, subset))
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}))
    return res


if __name__ == "__main__":
    H.main(evaluate, Args)
