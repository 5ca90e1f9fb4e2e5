"""MSN: Masked Siamese Networks for Label-Efficient Learning.
Assran, Caron, Misra, Bojanowski, Bordes, Vincent, Joulin, Rabbat, Ballas. ECCV 2022.
arXiv:2204.07141.

Idea. An image gives one unmasked target view and M anchor views (one 224 px view with a random
15% of its patches dropped, and small "focal" crops). The anchor's [CLS] embedding, compared with
learnable prototypes, must predict the prototype assignment of the target view made by an EMA
copy of the network, sharpened and balanced with Sinkhorn. A mean-entropy-maximisation term
(ME-MAX) keeps all prototypes in use. Only the online (anchor) branch receives gradients.

Launch. `--batch-size` is the GLOBAL batch (recipe: 1024 = official 64 x 16 GPUs); each process
takes batch / processes images in micro-batches of --micro-batch (default 512; docs/DESIGN.md
measures the memory) and the step is exact: Sinkhorn and ME-MAX stay over the global batch.
  python msn.py --data synthetic                       # CPU quickstart, ~5 min, ends with k-NN
  python msn.py --data /cifar10 --preset small         # CIFAR-10 folders, 2 CPU cores: stated rules
  python msn.py --data /imagenet                       # ViT-S/16 official recipe on 1 GPU: 2 x 512
  torchrun --nproc_per_node=8 msn.py --data /imagenet  # the same objective on 8 GPUs: 8 x 128
  python msn.py --data /imagenet --grad-ckpt --micro-batch 1024   # 1 GPU, one micro-batch
  python msn.py --data /imagenet --gpu-decode          # few CPU cores: JPEGs decoded on the GPU
  python msn.py --data /my/images --init msn_vits16.pth.tar --eval-every 500   # go on, watch k-NN

Files. This file, common.py (the training kit: schedules, the optimiser step, micro-batches, data,
checkpoints, the log) and harness.py (the command line, launching, resume, preemption) train the
official recipe on an image folder. Beside them, for a flag: recipes.py (--preset, and with
synthetic.py --data synthetic), weights.py (--init), eval_linear.py and weights.py (--knn,
--eval-every), gpu_aug.py (the colour ops on the GPU, default on CUDA; without it they run in the
workers), gpu_decode.py (--gpu-decode).

Paper -> code.
  Views x+ (target), x_1..x_M (anchors), Sec 3.1 .... MultiView (data section)
  Random masking of anchor patches, Sec 3.2 ......... random_masking, ViT.forward(ids_keep)
  Encoders f_theta / EMA f_theta_bar, Sec 3.3 ........ ViT, Net (ViT [CLS] + 3-layer head),
                                                       make_target, ema_update
  p = softmax(<z, q>/tau), Eq. (1) ................... msn_loss: log_p
  p+ = sharpen(softmax(<z+, q>/tau)), tau+ < tau ..... msn_loss: p_plus (softmax at tau_plus)
  Sinkhorn balancing of p+ (official code) ........... sinkhorn
  H(p+, p) averaged over M*B, Eq. (2) ................ msn_loss: ce
  ME-MAX  -lambda H(p_bar), Eq. (2) .................. msn_loss: me_max
  Evaluated network: the target encoder .............. checkpoint["encoder"] = target encoder

Where this file follows the official code (facebookresearch/msn) rather than the paper text, or
differs from both, and why:
  - Sinkhorn-Knopp (3 iterations, sums all-reduced across GPUs) on the sharpened targets, as in
    the official ViT-S/16 config; the paper's equations only sharpen.
  - Sharpening softmax(cos/0.1)^(1/0.25), normalised, is computed as the identical
    softmax(cos/0.025).
  - Schedules (lr warm-up 2e-4 -> 1e-3 then cosine to 1e-6, weight decay cosine 0.04 -> 0.4,
    EMA momentum linear 0.996 -> 1) span 1.25 x the training steps; training stops at 80% of them.
    Step k uses the lr and weight decay at k; official schedulers step before use (k + 1), one
    step ahead of ours; the momentum is official's at k (tests/test_loops.py).
  - The projection head is applied per resolution group (224 px views, then focal views), so its
    BatchNorm statistics are per group, as the official forward does. SyncBN under multi-GPU CUDA;
    with gloo on CPU BN statistics stay per process (SyncBN has no CPU kernel).
  - BatchNorm scope: the head's statistics are over one micro-batch of one resolution group,
    across processes with SyncBN on multi-GPU CUDA (micro-batch x processes images); official
    (SyncBN, 16 GPUs x 64) normalises over the 1024 global images. Equal when one micro-batch per
    process holds the global batch share (e.g. 8 GPUs x 128, or --micro-batch 0 with --grad-ckpt).
  - Focal views are not patch-masked (official: patch_drop applies to the first group only).
  - The target network never applies drop path (official deep-copies the encoder; identical at
    the recipe's drop_path 0), so its targets are deterministic in train mode.
  - Masks are drawn per image (official: one permutation per GPU batch). Same ratio, same count.
  - Weight decay as official: every weight but biases, 1-d tensors and the prototypes (pos-embed
    and cls token are decayed).
  - Initialisation as official (DeiT, src/deit.py): trunc-normal(0.02) Linear (encoder and head),
    kaiming-normal patch embedding, trunc-normal cls token and pos-embed.
  - bf16 autocast on GPU (official: fp32). The loss itself runs in fp32.
  - On CUDA, colour jitter / grey / blur run as batched device ops with per-image parameters
    (gpu_aug.py; `--no-gpu-aug` keeps them in the PIL workers, the official way):
    the same distributions (KS-tested), in float without uint8 rounding between ops. The 12-view
    CPU pipeline is otherwise the bottleneck.
    Blur: PIL's untruncated Gaussian blur, sigma U[0.1, 2] px, on every view (as official); the
    --gpu-aug path uses a 13-tap (+-3 sigma) kernel.
  - --gpu-decode (off by default; gpu_decode.py): JPEGs decoded, cropped and flipped on the device,
    the workers drawing the same boxes and flips; resampled with roi_align's box-averaged bilinear
    instead of PIL's triangle filter (about 1 level of 255), in float (no uint8 rounding).
  - The official extra entropy term (weight 0 in every released config) is omitted.
"""
import contextlib
import copy
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

import common as C
import harness as H


@dataclass
class Args(H.RunArgs):
    """MSN pre-training (defaults: official ViT-S/16 ImageNet recipe)."""
    data: str = H.arg(None, "image folder (uses DIR/train if present) or 'synthetic'", group="data")
    output_dir: str = H.arg(None, "where checkpoint.pth, log.jsonl, args.json and pictures go "
                            "(default runs/msn)", group="data")
    model: str = H.arg("small", "ViT size: nano|micro|tiny|small|base|large", group="model")
    init: str = H.arg(None, "start from these weights at step 0: a checkpoint of this project, the "
                      "official MSN file, an MAE-style 'model' dict or a timm / DeiT state dict "
                      "(read by weights.py)", group="model")
    patch_size: int = H.arg(16, "ViT patch size (px)", group="model", positive=True)
    img_size: int = H.arg(224, "target / random anchor view size", group="data", positive=True)
    epochs: int = H.arg(800, "training epochs (the schedules span them)",
                        group="optimisation", positive=True)
    batch_size: int = H.arg(1024, "GLOBAL batch, all processes (official 64 x 16 GPUs)",
                            group="optimisation", positive=True)
    micro_batch: int = H.arg(512, "images per forward/backward per process (0 = the whole "
                             "per-process batch; memory: docs/DESIGN.md); the step stays exact",
                             group="optimisation", min=0)
    lr: float = H.arg(1e-3, "peak lr (not scaled with batch size)",
                      group="optimisation", positive=True)
    start_lr: float = H.arg(2e-4, "lr at the start of warm-up", group="optimisation", min=0)
    min_lr: float = H.arg(1e-6, "lr at the end of the cosine schedule", group="optimisation", min=0)
    warmup_epochs: float = H.arg(15, "linear lr warm-up epochs", group="optimisation", min=0)
    weight_decay: float = H.arg(0.04, "start of the cosine wd schedule",
                                group="optimisation", min=0)
    final_weight_decay: float = H.arg(0.4, "weight decay at the end (cosine)",
                                      group="optimisation", min=0)
    betas: tuple = H.arg((0.9, 0.999), "AdamW betas", group="optimisation")
    clip_grad: float = H.arg(3.0, "max grad norm of encoder+head (0 = off)",
                             group="optimisation", min=0)
    ema: tuple = H.arg((0.996, 1.0), "EMA momentum start, end (linear)", group="optimisation")
    ema_horizon: float = H.arg(0.0, "cap the EMA horizon 1/(1-m) at this fraction of the run's "
                               "steps by lowering the first momentum (0: official; short-run "
                               "presets: 0.02)", group="optimisation", min=0)
    ipe_scale: float = H.arg(1.25, "schedules span ipe_scale x the steps run",
                             group="optimisation", min=1,
                             why=" (the schedules span ipe-scale x the run: below 1 they would end "
                                 "before it)")
    drop_path: float = H.arg(0.0, "stochastic depth rate of the last block", group="model", min=0)
    # views and masking
    rand_views: int = H.arg(1, "masked anchor views at img-size",
                            group="views and masking", positive=True)
    focal_views: int = H.arg(10, "focal views per image", group="views and masking", min=0)
    focal_size: int = H.arg(96, "focal view size (px)", group="views and masking", positive=True)
    rand_scale: tuple = H.arg((0.3, 1.0), "crop area range of the random anchor views",
                              group="views and masking")
    focal_scale: tuple = H.arg((0.05, 0.3), "crop area range of the focal views",
                               group="views and masking")
    mask_ratio: float = H.arg(0.15, "patch drop ratio of the random anchors",
                              group="views and masking")
    gpu_aug: bool = H.arg(None, "photometric augmentation batched on the device (default: on with "
                          "CUDA; --no-gpu-aug keeps it in the CPU workers)",
                          group="views and masking")
    resident: int = H.arg(0, "decode the training images once into S x S uint8 on the device "
                          "and cut every view there (gpu_data.py; 0 = off; needs --gpu-aug): "
                          "small datasets (CIFAR-10 at 32, Tiny-ImageNet at 64)",
                          group="views and masking", min=0)
    gpu_decode: bool = H.arg(False, "decode JPEGs, crop and flip on the device (gpu_decode.py; "
                             "needs --gpu-aug): the workers only read files, for hosts whose CPUs "
                             "cannot feed the GPU", group="views and masking")
    # head, prototypes, loss
    head_hidden: int = H.arg(2048, "projection hidden width", group="model", positive=True)
    head_dim: int = H.arg(256, "projection output width", group="model", positive=True)
    num_prototypes: int = H.arg(1024, "prototypes K", group="model", min=2,
                                why=" (a softmax over one prototype is constant: nothing to learn)")
    tau: float = H.arg(0.1, "softmax temperature", positive=True)
    tau_plus: float = H.arg(0.025, "target temperature (0.1 x sharpen 0.25)", positive=True)
    me_max_weight: float = H.arg(1.0, "weight of the ME-MAX regulariser", min=0)
    sinkhorn_iters: int = H.arg(3, "Sinkhorn-Knopp iterations", min=0)
    # run plumbing
    knn: bool = H.arg(None, "k-NN of the evaluated encoder at step 0 and at the end (default: on "
                      "for synthetic; eval_linear.py's)", group="run control")
    eval_every: int = H.arg(0, "also the k-NN every N steps (0 = off), against val/ (else test/) "
                            "or the --holdout images", group="run control", min=0)

    # Small recipes: the official one above by recipes.scale_recipe's rules; the values here are the budget's or
    # the held-out sweep's (lr_factor). Each value's reason: docs/RESULTS.md.
    PRESETS = {"small": dict(lr_factor=4, model="micro", patch_size=4, img_size=32, epochs=4,
                             batch_size=256, head_hidden=512, workers=2, log_every=20),
               "gpu": dict(lr_factor=4, model="tiny", patch_size=4, img_size=32, epochs=5,
                           batch_size=512, head_hidden=512, micro_batch=0, resident=32,
                           gpu_aug=True)}
    SYNTHETIC = dict(model="micro", patch_size=4, img_size=32, focal_views=4, epochs=8,
                     batch_size=64, head_hidden=256, head_dim=64, num_prototypes=64, workers=2,
                     log_every=20, steps_per_epoch=40)
    RULES = {"start_lr": "the official start lr, scaled as the lr",
             "num_prototypes": "1,024 for 1,024 images, as official: each one's share of a batch",
             "focal_size": "the official 96 px x img / 224, a multiple of the patch"}

    def preset_rules(cls, preset):
        """recipes.scale_recipe's rules, then MSN's own (RULES): the warm-up's start lr scaled as
        the lr, the prototypes in their official ratio to the batch (1,024 at 1,024: Sinkhorn gives
        every prototype the same share of a batch's target mass), the focal crop x img / 224."""
        recipes = C.optional("recipes")                              # (for a preset only: present)
        d = {f.name: f.default for f in fields(cls)}
        out = recipes.scale_recipe(cls, preset)
        p = preset.get("patch_size", d["patch_size"])
        batch_ratio = preset["batch_size"] / d["batch_size"]
        start_lr = d["start_lr"] * batch_ratio * preset.get("lr_factor", 1.0)
        out.setdefault("start_lr", float(f"{start_lr:.4g}"))
        out.setdefault("num_prototypes", max(2, round(d["num_prototypes"] * batch_ratio)))
        focal = d["focal_size"] * preset["img_size"] / recipes.OFFICIAL_IMG
        out.setdefault("focal_size", max(p, round(focal / p) * p))
        return out

    def check(self):
        """validate()'s rules for MSN's own flags."""
        if self.resident and self.gpu_decode:
            raise C.UserError("--resident and --gpu-decode: choose one (both decode on the device)")
        if self.gpu_decode and self.in_chans != 3:
            raise C.UserError(f"--gpu-decode takes RGB images; with --in-chans {self.in_chans} "
                              "leave it off (the workers read and augment)")
        if self.focal_size % self.patch_size:
            raise C.UserError(f"--focal-size {self.focal_size} is not a multiple of --patch-size "
                              f"{self.patch_size}")
        if self.start_lr > self.lr:
            raise C.UserError(f"--start-lr {self.start_lr:g} is above the peak lr {self.lr:g}: the "
                              "warm-up would fall")


# ----------------------------------------------------------------------------------------------
# Model: MSN's ViT (DeiT-style, official src/deit.py): [CLS], learned position embeddings
# (interpolated for the 96 px focal views), patch drop. timm's key names: the encoder loads into
# timm's VisionTransformer and into every other method's ViT (tests/test_interop.py).
# ----------------------------------------------------------------------------------------------
SIZES = {"nano": (64, 2, 2), "micro": (128, 4, 4), "tiny": (192, 12, 3), "small": (384, 12, 6),
         "base": (768, 12, 12), "large": (1024, 24, 16)}                # width, depth, heads


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):                                            # (B, N, D)
        B, N, D = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D))


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def drop_path(x, p, training):
    """Stochastic depth: zero a sample's residual branch with probability p, rescale the rest."""
    if p == 0.0 or not training:
        return x
    return x * x.new_empty(x.shape[0], 1, 1).bernoulli_(1 - p) / (1 - p)


class Block(nn.Module):
    """Pre-norm block: x + DP(Attn(LN(x))); x + DP(MLP(LN(x)))."""

    def __init__(self, dim, heads, drop_path=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim)
        self.drop_path = drop_path

    def forward(self, x):
        x = x + drop_path(self.attn(self.norm1(x)), self.drop_path, self.training)
        return x + drop_path(self.mlp(self.norm2(x)), self.drop_path, self.training)


class PatchEmbed(nn.Module):
    def __init__(self, patch_size, dim, in_chans=3):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, patch_size, patch_size)

    def forward(self, x):                                            # (B, C, H, W) -> (B, N, D)
        return self.proj(x).flatten(2).transpose(1, 2)


def trunc_init(module):
    """DeiT / MSN init: Linear trunc-normal(0.02) (timm's, cut at +-2 absolute), the patch-embedding
    Conv2d kaiming-normal (fan_in, relu); biases 0; LayerNorm and BatchNorm keep 1 / 0."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)


class ViT(nn.Module):
    """forward(x, ids_keep=None, norm=True) -> (B, 1 + n, D), [CLS] first; ids_keep (B, n): the
    patches kept (MSN's patch drop). Init as official (trunc_init; cls, pos-embed trunc-normal)."""

    def __init__(self, img_size=224, patch_size=16, dim=384, depth=12, heads=6, drop_path=0.0,
                 in_chans=3):
        super().__init__()
        self.config = dict(img_size=img_size, patch_size=patch_size, dim=dim, depth=depth,
                           heads=heads, mlp_ratio=4.0, pos_embed="learned", init="trunc")  # ckpt["vit"]
        self.config |= {"in_chans": in_chans} if in_chans != 3 else {}             # RGB's: unsaid
        self.patch_size = patch_size
        self.dim = dim
        self.grid = img_size // patch_size
        self.patch_embed = PatchEmbed(patch_size, dim, in_chans)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        pos_embed = torch.zeros(1, 1 + self.grid ** 2, dim)
        self.pos_embed = nn.Parameter(nn.init.trunc_normal_(pos_embed, std=0.02))
        rates = torch.linspace(0, drop_path, depth).tolist()         # stochastic depth, rising
        self.blocks = nn.ModuleList(Block(dim, heads, p) for p in rates)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.grad_ckpt = False                                       # C.set_grad_checkpointing
        trunc_init(self)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def patch_pos_embed(self, gh, gw):                               # (1, gh*gw, D), bicubic if resized
        pe = self.pos_embed[:, 1:]
        if (gh, gw) == (self.grid, self.grid):
            return pe
        pe = pe.reshape(1, self.grid, self.grid, self.dim).permute(0, 3, 1, 2)
        pe = F.interpolate(pe.float(), size=(gh, gw), mode="bicubic", align_corners=False)
        return pe.permute(0, 2, 3, 1).reshape(1, gh * gw, self.dim).to(self.pos_embed.dtype)

    def forward(self, x, ids_keep=None, norm=True):
        gh, gw = x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size
        x = self.patch_embed(x) + self.patch_pos_embed(gh, gw)       # (B, N, D)
        if ids_keep is not None:                                     # patch drop: keep a subset
            x = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        cls = self.cls_token + self.pos_embed[:, :1]
        x = torch.cat([cls.expand(x.shape[0], -1, -1), x], dim=1)
        x = C.run_blocks(self.blocks, x, self.grad_ckpt)
        return self.norm(x) if norm else x


def make_vit(a):
    if a.model not in SIZES:
        raise C.UserError(f"--model must be one of {', '.join(SIZES)}, got {a.model!r}")
    dim, depth, heads = SIZES[a.model]
    return ViT(a.img_size, a.patch_size, dim, depth, heads, a.drop_path, a.in_chans)


def random_masking(n, grid, ratio, device=None):
    """MSN's patch drop: each of n anchor views keeps int(N (1 - ratio)) of its N = grid^2
    patches, drawn uniformly (indices ascending); the others never enter the encoder.
    Returns ids_keep (n, n_keep)."""
    N = grid * grid
    shuffled = torch.rand(n, N, device=device).argsort(1)         # a random permutation per view
    kept = shuffled[:, :int(N * (1 - ratio))]                        # its first n_keep patches
    return kept.sort(1).values


def make_target(net):
    """f_theta_bar: a copy of f_theta without gradients and with drop path off in every block, so
    its targets are deterministic in train mode (its BatchNorm keeps batch statistics: official)."""
    target = copy.deepcopy(net).requires_grad_(False)
    for m in target.modules():
        if isinstance(m, Block):
            m.drop_path = 0.0
    return target


@torch.no_grad()
def ema_update(target, online, m):
    """theta_bar <- m theta_bar + (1 - m) theta, every parameter (BatchNorm buffers: its own)."""
    online = [p.detach() for p in online.parameters()]
    torch._foreach_lerp_(list(target.parameters()), online, 1.0 - m)


def ema_start(m, steps, horizon):
    """The first EMA momentum: m, lowered where its horizon 1 / (1 - m) exceeds `horizon` x steps
    (the short-run rule: recipes.scale_recipe; the same lines in each EMA method's file, pinned
    equal by tests/test_common.py)."""
    return min(m, 1 - 1 / max(1.0, horizon * steps)) if horizon else m


def linear_schedule(step, total, start, end):
    """The EMA momentum m: start -> end linearly over `total` steps (the official scheduler)."""
    return start + (end - start) * min(1.0, step / max(1, total))


class Net(nn.Module):
    """f_theta: ViT [CLS] (after the final norm) -> Linear-BN-GELU-Linear-BN-GELU-Linear head."""

    def __init__(self, a):
        super().__init__()
        self.encoder = make_vit(a)
        d = self.encoder.dim
        self.head = nn.Sequential(
            nn.Linear(d, a.head_hidden), nn.BatchNorm1d(a.head_hidden), nn.GELU(),
            nn.Linear(a.head_hidden, a.head_hidden), nn.BatchNorm1d(a.head_hidden), nn.GELU(),
            nn.Linear(a.head_hidden, a.head_dim))
        trunc_init(self.head)

    def forward(self, x, ids_keep=None):                             # (B, 3, H, W) -> (B, d)
        return self.head(self.encoder(x, ids_keep)[:, 0])


class MSN(nn.Module):
    """Online branch: Net + prototypes q (K, d), init U(-1/sqrt(d), 1/sqrt(d)) as official."""

    def __init__(self, a):
        super().__init__()
        self.net = Net(a)
        self.prototypes = nn.Parameter(torch.empty(a.num_prototypes, a.head_dim))
        nn.init.uniform_(self.prototypes, -a.head_dim ** -0.5, a.head_dim ** -0.5)

    def forward(self, rand_views, focal_views, ids_keep):
        """rand_views (R*B, 3, S, S) masked by ids_keep, focal_views (Nf*B, 3, s, s) or None.
        Returns anchor embeddings z (M*B, d), view-major."""
        z = [self.net(rand_views, ids_keep)]                          # head per resolution group
        if focal_views is not None:
            z.append(self.net(focal_views))
        return torch.cat(z)


# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
def no_decay(name, p):
    """Official: no weight decay on biases, 1-d tensors and the prototypes."""
    return C.no_decay_1d(name, p) or name == "prototypes"


@torch.no_grad()
def sinkhorn(P, iters=3):
    """Sinkhorn-Knopp on target probabilities P (B, K) over the GLOBAL batch (sums all-reduced).

    Alternately rescales prototype (column) mass to 1/K and sample (row) mass to 1/B_global;
    returns B_global * Q^T so every row sums to 1 (official msn.src.utils.distributed_sinkhorn).
    """
    Q = P.T.float()                                                  # (K, B)
    K, B = Q.shape[0], Q.shape[1] * C.world_size()
    Q = Q / C.all_reduce_sum_(Q.sum())
    for _ in range(iters):
        Q = Q / C.all_reduce_sum_(Q.sum(dim=1, keepdim=True)) / K   # each prototype: mass 1/K
        Q = Q / Q.sum(dim=0, keepdim=True) / B                       # each sample: mass 1/B
    return (Q * B).T                                                 # (B, K), rows sum to 1


def msn_loss(anchor, target, prototypes, tau=0.1, tau_plus=0.025, me_max_weight=1.0,
             sinkhorn_iters=3):
    """MSN objective, Eq. (2) with the official Sinkhorn targets. Returns (loss, parts).

    anchor (M*B, d): projected anchor views z_{i,m}, view-major (row m*B + i);
    target (B, d): projected target views z+_i (no gradient flows to it);
    prototypes (K, d): q. All cosine similarities (z and q L2-normalised).
      p_{i,m} = softmax(<z_{i,m}, q> / tau)                                          (M*B, K)
      p+_i    = Sinkhorn(softmax(<z+_i, q> / tau_plus))            stop-gradient       (B, K)
      CE      = (1 / MB) sum_{i,m} H(p+_i, p_{i,m}),  H(a, b) = -sum_k a_k log b_k   row mean
      p_bar   = mean of p_{i,m} over all rows of all processes                         (K,)
      ME-MAX  = sum_k p_bar_k log p_bar_k + log K  (= log K - H(p_bar) >= 0)
      loss    = CE + me_max_weight * ME-MAX
    """
    K = prototypes.shape[0]
    q = F.normalize(prototypes, dim=-1)
    log_p = (F.normalize(anchor, dim=-1) @ q.T / tau).log_softmax(dim=-1)              # (M*B, K)
    with torch.no_grad():
        p_plus = (F.normalize(target, dim=-1) @ q.T / tau_plus).softmax(dim=-1)         # (B, K)
        if sinkhorn_iters:
            p_plus = sinkhorn(p_plus, sinkhorn_iters)
        n_proto = torch.zeros(K, device=p_plus.device).scatter_(0, p_plus.argmax(-1), 1.0).sum()
        p_plus = p_plus.repeat(anchor.shape[0] // target.shape[0], 1)                   # (M*B, K)
    ce = -(p_plus * log_p).sum(dim=-1).mean()
    p_bar = C.all_gather(log_p.exp().mean(dim=0)[None]).mean(0)             # (K,): over the global batch
    me_max = (p_bar * torch.log(p_bar)).sum() + math.log(K)
    loss = ce + me_max_weight * me_max
    return loss, {"loss": loss.detach(), "ce": ce.detach(), "me_max": me_max.detach(),
                  "n_proto": n_proto}


# ----------------------------------------------------------------------------------------------
# Data: 1 target + R random anchors at img_size, Nf focal anchors at focal_size
# ----------------------------------------------------------------------------------------------
def view_specs(a):
    """(size, crop scale, count, resampling) of each view group, in view order: the target + R
    random anchors, Nf focal anchors. MultiView makes them in the workers; --resident
    (gpu_data.cut) and --gpu-decode cut the same ones on the device."""
    return [(a.img_size, a.rand_scale, 1 + a.rand_views, "bilinear"),
            (a.focal_size, a.focal_scale, a.focal_views, "bilinear")]


class MultiView:
    """PIL image -> [target, rand_1..rand_R, focal_1..focal_Nf] uint8 tensors (official ops)."""

    def __init__(self, a):
        from torchvision import transforms as T
        def view(size, scale):                                       # --gpu-aug: colour in the loop
            color = [] if a.gpu_aug else [C.color_augment()]
            crop = T.RandomResizedCrop(size, scale=scale)            # bilinear
            return T.Compose([crop, T.RandomHorizontalFlip(), *color, C.to_uint8])
        self.views = []
        for size, scale, n, _ in view_specs(a):
            self.views += [view(size, scale)] * n                    # one transform per group, applied n times

    def __call__(self, img):
        return [t(img) for t in self.views]


# ----------------------------------------------------------------------------------------------
# The training step: views -> networks -> loss, forward and backward
# ----------------------------------------------------------------------------------------------
def train_step(online, target_net, x_target, x_rand, x_focal, ids_keep, a, micro=None,
               autocast=contextlib.nullcontext(), scale=None, ddp=None):
    """One MSN step on this process's B images; gradients are left in the online parameters.

    x_target (B, 3, S, S): the target view, seen ONLY by the target network f_theta_bar
      (target_net), unmasked, without gradient;
    x_rand (R, B, 3, S, S): random anchors, masked by ids_keep (R, B, n_keep) (kept patch indices);
    x_focal (Nf, B, 3, s, s) or None: focal anchors, unmasked. Anchors go to the online f_theta.
    online: MSN (or its DDP / compiled wrapper); target_net: Net. micro: images per forward/backward
    (Sinkhorn and ME-MAX stay over the whole batch: C.gradient_cache). Returns (loss, parts).
    """
    B = x_target.shape[0]
    micro = micro or B
    scale = scale or (lambda t: t)
    q = C.unwrap(online).prototypes.float()                          # prototypes (K, d)
    with torch.no_grad(), autocast:                                  # target view -> f_theta_bar only
        z_plus = torch.cat([target_net(x_target[i:i + micro]) for i in range(0, B, micro)]).float()  # (B, d)

    def anchors(sl):                                                 # anchor views -> f_theta: (M*b, d)
        focal = x_focal[:, sl].flatten(0, 1) if x_focal is not None else None
        with autocast:
            z = online(x_rand[:, sl].flatten(0, 1), focal, ids_keep[:, sl].flatten(0, 1))
        return z.float()                                             # view-major

    def loss_of(z):                                                  # Eq. (2), z view-major (M*B, d)
        return msn_loss(z, z_plus, q, a.tau, a.tau_plus, a.me_max_weight, a.sinkhorn_iters)

    if micro >= B:                                                   # the paper's step, one pass
        loss, parts = loss_of(anchors(slice(None)))
        scale(loss).backward()                                       # loss = CE + ME-MAX
        return loss.detach(), parts
    # Micro-batches: Sinkhorn and ME-MAX couple the whole batch, so the gradient cache computes the
    # same loss and gradient (tests/test_step.py); it takes the anchors image-major (b, M, d).
    M = ids_keep.shape[0] + (x_focal.shape[0] if x_focal is not None else 0)

    def forward(sl, local):
        return None, anchors(sl).view(M, -1, q.shape[-1]).transpose(0, 1), {}

    def coupled(z):                                                  # (B, M, d) -> view-major (M*B, d)
        return loss_of(z.transpose(0, 1).reshape(-1, z.shape[-1]))

    return C.gradient_cache(forward, coupled, B, micro, scale, ddp)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def loader_and_views(args, run, dataset, per):
    """The training loader and views(batch): its batch as the step's views on the device,
    normalised: x_target (B, 3, S, S), x_rand (R, B, 3, S, S), x_focal (Nf, B, 3, s, s) or None.
    The paper's views come from MultiView in the PIL workers; --resident cuts the same view_specs
    on the device from the images decoded there once (gpu_data.py), --gpu-decode from each batch's
    JPEGs decoded there (gpu_decode.py). --gpu-aug runs the colour ops batched on the device, one
    call per view size, compiled on CUDA (else in the workers)."""
    if not (args.resident or args.gpu_decode):                       # the paper's: the PIL workers
        viewed = C.Views(dataset, MultiView(args), args.seed)
        loader = C.make_loader(viewed, per, args.workers, args.seed)
    elif args.resident:
        gpu_data = C.optional("gpu_data", "--resident needs gpu_data.py next to this file")
        loader = gpu_data.loader(dataset, args, run, per, view_specs(args))
    else:
        gpu_decode = C.optional("gpu_decode", "--gpu-decode needs gpu_decode.py next to this file")
        loader = gpu_decode.loader(dataset, args, run, per, view_specs(args))
    color = None
    if args.gpu_aug:
        color = C.optional("gpu_aug").color_augmenter(args.compile or run.device.type == "cuda")

    def prep(v):                                                     # (n B, 3, S, S) -> normalised
        return color(v, normalize=True) if color else C.normalize(v)

    def views(batch):
        v = [t.to(run.device, non_blocking=True) for t in batch]
        R, B = args.rand_views, v[0].shape[0]
        x = prep(torch.cat(v[:1 + R])).unflatten(0, (1 + R, B))     # target and random anchors: one size
        x_focal = prep(torch.cat(v[1 + R:])).unflatten(0, (-1, B)) if args.focal_views else None
        return x[0], x[1:], x_focal
    return loader, views


def train(args):
    run = H.setup(args, "msn")
    dev, R = run.device, args.rand_views
    grid = args.img_size // args.patch_size                          # of a random anchor
    def dropped():
        return grid * grid - random_masking(1, grid, args.mask_ratio).shape[1]
    H.check_mask_ratio(args.mask_ratio, dropped, grid * grid, need_masked=False)   # 0: valid
    weakens = (f"Sinkhorn targets and the ME-MAX mean are statistics of the global batch; with "
               f"{args.batch_size} images against {args.num_prototypes} prototypes the targets "
               "flatten and the prototype marginal is noisier")
    per, micro = H.batch_plan(args, run, 1024, weakens, batchnorm="the projection head's")
    dataset = C.image_dataset(args.data, "train", skip_unreadable=True, holdout=args.holdout)
    loader, views = loader_and_views(args, run, dataset, per)
    ipe = min(len(loader), args.steps_per_epoch or len(loader))
    total = args.epochs * ipe
    sched = int(args.ipe_scale * total)                              # schedules over 1.25x, stop at 80%
    m0 = ema_start(args.ema[0], total, args.ema_horizon)             # short runs: horizon <= a share of the run

    model = MSN(args).to(dev)                                        # seeded in setup: same on all ranks
    if args.init and not run.resuming:                               # --init: start from these weights
        weights = C.optional("weights", "--init needs weights.py next to this file")
        weights.init_weights(args.init, model, model.net.encoder, "msn")
    target_net = make_target(model.net)                              # f_theta_bar: a copy, no drop path
    if run.world > 1 and dev.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        target_net = nn.SyncBatchNorm.convert_sync_batchnorm(target_net)
    C.set_grad_checkpointing(model, args.grad_ckpt)
    opt = C.make_optimizer(model, args.lr, args.weight_decay, args.betas, dev, no_decay)
    start = H.resume_run(run, "msn", args, model, opt, target_net, data={"train": dataset})   # global step
    online, ddp = H.distribute(torch.compile(model) if args.compile else model, run)
    target_fwd = torch.compile(target_net) if args.compile else target_net

    def save(step, **kw):                                            # snapshot=True: the encoder alone
        encoder = target_net.encoder                                 # the evaluated one
        C.save_run(run, "msn", args, step // ipe, step, encoder, model, opt, target_net, **kw)
    log = C.Logger(run, args, total, start, ipe)
    if log.done:                                                     # a finished or stopped run, rerun
        return
    lr_rule = f"--preset {args.preset}: recipes.py" if args.preset else "absolute, as official"
    C.print0(f"{len(dataset)} images, {ipe} steps/epoch, {total} steps ({args.epochs} epochs; "
             f"schedules span {sched}), {1 + R + args.focal_views} views/image; lr "
             f"{args.start_lr:g} -> {args.lr:g} -> {args.min_lr:g} ({lr_rule}); EMA momentum "
             f"{m0:g} -> {args.ema[1]:g}")
    knn = None
    if H.knn_wanted(args):                                           # --knn, --eval-every: eval_linear's k-NN
        eval_linear = C.optional("eval_linear", "--knn / --eval-every need eval_linear.py and "
                                 "weights.py next to this file")
        knn = eval_linear.KNNMonitor(args, run, log, target_net.encoder, "msn", "target encoder")
        if start == 0:
            knn(0)                                                   # the initial encoder

    batches = C.Batches(loader, ipe, args.max_unreadable)          # from the checkpoint's step on

    for epoch in range(start // ipe, args.stop_epoch or args.epochs):
        if epoch * ipe >= start:                                     # a fresh epoch: masks and drop path from
            C.seed_epoch(args.seed, epoch, run.rank)                 # (seed, epoch, rank); resumed: the checkpoint's
        model.train()
        target_net.train()                                           # official: batch BN statistics
        for it, (batch, _) in batches.epoch(epoch, start):
            step = epoch * ipe + it
            warmup = args.warmup_epochs * ipe
            lr = C.cosine_schedule(step, sched, args.lr, args.min_lr, warmup, args.start_lr)
            wd = C.cosine_schedule(step, sched, args.weight_decay, args.final_weight_decay)
            m = linear_schedule(step, sched, m0, args.ema[1])
            C.set_hparams(opt, lr, wd)
            x_target, x_rand, x_focal = views(batch)                 # (B, ...), (R, B, ...), (Nf, B, ...)
            B = x_target.shape[0]
            ids_keep = random_masking(R * B, grid, args.mask_ratio, device=dev).view(R, B, -1)
            opt.zero_grad(set_to_none=True)
            loss, parts = train_step(online, target_fwd, x_target, x_rand, x_focal, ids_keep, args,
                                     micro, run.autocast, run.scaler.scale, ddp)
            parts["grad_norm"] = C.optimizer_step(run, opt, model.net.parameters(), args.clip_grad)
            ema_update(target_net, model.net, m)
            # the log line, the NaN watch, a checkpoint when due
            stop = C.end_step(run, log, save, batches, step + 1, epoch, parts, lr=lr, wd=wd, mom=m)
            if knn and knn.due(step + 1):                            # --eval-every (a --stop-step's too)
                knn(step + 1, save)                                  # its checkpoint first
            if stop:
                return                                               # preempted, --stop-step: saved
        save((epoch + 1) * ipe)

    if knn:                                                          # the final checkpoint is written: a stop
        run.control.trained = run.ckpt                               # signal in this k-NN ends the program at once
        knn(log.end)


if __name__ == "__main__":
    H.main(train, Args)
