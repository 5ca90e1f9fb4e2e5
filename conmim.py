"""ConMIM: Masked Image Modeling with Denoising Contrast.
Yi, Ge, Li, Yang, Li, Wu, Shan, Qie. ICLR 2023. arXiv:2205.09616.

Idea. Masked image modelling without a tokenizer: the student ViT sees a corrupted image (75% of
its patches replaced by a learned [MASK] embedding) and, at every masked position j, its patch
feature must pick out the momentum teacher's feature of the same patch of the full image among
all the teacher's patch features of that image (a per-image, patch-level InfoNCE "dictionary").
The teacher gets a strongly augmented view, the student a weakly augmented one.

Launch. `--batch-size` is the GLOBAL batch (recipe: 2048, official); each process takes
batch / processes images in micro-batches of --micro-batch (default 512; docs/DESIGN.md measures the
memory). The loss is per image, so accumulation is exact by construction.
  python conmim.py --data synthetic                       # CPU quickstart, ~5 min, ends with k-NN
  python conmim.py --data /cifar10 --preset small         # CIFAR-10 folders, 2 CPU cores
  python conmim.py --data /imagenet                       # ViT-B/16 recipe on 1 GPU: 4 x 512
  torchrun --nproc_per_node=8 conmim.py --data /imagenet  # the same objective on 8 GPUs: 8 x 256

Files. This file, common.py (the training kit: schedules, the optimiser step, micro-batches, data,
checkpoints, the log) and harness.py (the command line, launching, resume, preemption) train the
official recipe on an image folder. Beside them, for a flag: recipes.py (--preset, and with
synthetic.py --data synthetic), weights.py (--init), eval_linear.py and weights.py (--knn,
--eval-every), gpu_aug.py (the strong view's colour ops on the GPU, default on CUDA; without it
they run in the workers).

Paper -> code (the paper's terms).
  Corrupted input x^: masked patches -> [MASK] ...... random_masking, Net.mask_token,
                                                      ViT.forward(mask=, mask_token=)
  Backbone f (student): BEiT's ViT, as official ...... ViT: no absolute position, one relative
                                                      position bias for all blocks, layer scale
                                                      (Block.gamma_1/2), q / v biases
  Slowly progressing momentum encoder f' (teacher) .. make_teacher (EMA copy), ema_update
  Full input x -> momentum encoder, no mask ......... train_step: teacher(x_strong)
  Patch-level dynamic dictionary, Eq. (2) ........... conmim_loss (keys: the image's own patches)
  Asymmetric augmentation (strong full input) ........ WeakStrongViews
  Evaluated network: the momentum encoder ............ checkpoint["encoder"] = teacher encoder

Where this file follows the official code (TencentARC/ConMIM) rather than the paper, or differs:
  - Random 75% masking in 2x2-patch units (the README recipe), not the code's default blockwise
    BEiT masking. `--mask-unit 1` masks single patches.
  - Projector as official: Linear(D,4096)-BN-ReLU-Linear(4096,4096)-BN-ReLU-Linear(4096,256)-
    BN(affine=False), no bias in any Linear, applied to every token, the CLS token included (the
    loss reads the patch tokens only); its BatchNorm normalises over all B*(1+N) tokens of the
    process. Official training uses plain (per-GPU) BatchNorm here too, so under DDP the statistics
    are per process in both; the DDP equivalence test therefore checks the loss, which has no
    cross-rank term.
  - BatchNorm scope under --micro-batch: statistics over one micro-batch of one process (micro x
    (1+N) tokens); official: one GPU's 128 images. Equal at the official 16 GPUs x 128; on 8 GPUs
    with the default micro-batch 256 they span 256 images.
  - Teacher: an EMA copy of encoder + projector with drop path switched off whatever --drop-path
    says (DINO / iBOT teachers), so its targets are deterministic in train mode. Official
    deep-copies the student; with its pre-training drop_path 0 (our default too) the two agree.
  - Backbone as official (modeling_pretrain.py with run_conmim_pretraining.py's defaults): no
    absolute position embedding (the [CLS] gets none either), so identical [MASK] inputs carry no
    position and the patch dictionary cannot be solved by position alone (tests/test_shortcuts.py);
    one relative position bias table ((2g-1)^2 + 3 rows per head) shared by all blocks,
    zero-initialised; layer scale --layer-scale 0.1 (1e-5 for ViT-L, the README command); qkv
    without bias plus q / v biases. Attention through F.scaled_dot_product_attention with the bias
    as attn_mask (same function).
  - Initialisation as official (BEiT): trunc-normal(0.02) cut at +-1 std for every Linear, the
    patch embedding, cls / mask tokens, then each block's attn.proj and mlp.fc2 divided by
    sqrt(2 * layer). Weight decay as official: all but biases, 1-d tensors (q / v biases, gammas,
    norms) and cls_token; the mask token and the relative position bias table are decayed.
  - Default lr 7.5e-4 (absolute, for a 2048 global batch) and clip 1.0 are the official ViT-L
    recipe; we use them for the default ViT-B as well. Warm-up 0 -> lr as lr k / W at step k
    (official np.linspace: k / (W - 1), the peak one step earlier); cosine after it and the
    teacher's cosine momentum as official (tests/test_loops.py).
  - Short-run presets only (--preset small / gpu): the relative position bias table's lr is 300 x
    the others' (--rel-pos-lr; official: one lr). The table starts at zero (official), so every
    masked query is alike and Eq. (2) sits at chance (ln N) until the table has moved; at the
    official lr that took ~500 of the small preset's 1,170 steps, at x300 ~40 (docs/RESULTS.md). The
    run logs the symmetry: `sym` (mean pairwise cosine of an image's masked outputs, 1 = alike),
    `rpb` (max |b|).
  - bf16 autocast on GPU (official: fp16 AMP, `--precision fp16` is available); the loss runs in
    fp32.
  - On CUDA the strong view's photometric ops (STRONG) run batched on the GPU (same distribution);
    `--no-gpu-aug` keeps them in the workers.
"""
import contextlib
import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import common as C
import harness as H


@dataclass
class Args(H.RunArgs):
    """ConMIM pre-training (defaults: official recipe, ViT-B/16)."""
    data: str = H.arg(None, "image folder (uses DIR/train if present) or 'synthetic'", group="data")
    output_dir: str = H.arg(None, "where checkpoint.pth, log.jsonl, args.json and pictures go "
                            "(default runs/conmim)", group="data")
    model: str = H.arg("base", "ViT size: nano|micro|tiny|small|base|large", group="model")
    init: str = H.arg(None, "start from these weights at step 0: a checkpoint of this project, the "
                      "official MSN file, an MAE-style 'model' dict or a timm / DeiT state dict "
                      "(read by weights.py)", group="model")
    patch_size: int = H.arg(16, "ViT patch size (px)", group="model", positive=True)
    img_size: int = H.arg(224, "training image size (px)", group="data", positive=True)
    epochs: int = H.arg(800, "training epochs (the schedules span them)",
                        group="optimisation", positive=True)
    batch_size: int = H.arg(2048, "GLOBAL batch, all processes (official 2048)",
                            group="optimisation", positive=True)
    micro_batch: int = H.arg(512, "images per forward/backward per process (0 = the whole "
                             "per-process batch; memory: docs/DESIGN.md); the step stays exact",
                             group="optimisation", min=0)
    lr: float = H.arg(7.5e-4, "absolute peak lr (not scaled with batch)",
                      group="optimisation", positive=True)
    min_lr: float = H.arg(1e-5, "lr at the end of the cosine schedule", group="optimisation", min=0)
    warmup_epochs: float = H.arg(10, "linear lr warm-up epochs", group="optimisation", min=0)
    weight_decay: float = H.arg(0.05, "AdamW weight decay", group="optimisation", min=0)
    betas: tuple = H.arg((0.9, 0.98), "AdamW betas", group="optimisation")
    clip_grad: float = H.arg(1.0, "max gradient norm (0 = off)", group="optimisation", min=0)
    ema: tuple = H.arg((0.996, 1.0), "teacher momentum start, end (cosine)", group="optimisation")
    ema_horizon: float = H.arg(0.0, "cap the EMA horizon 1/(1-m) at this fraction of the run's "
                               "steps by lowering the first momentum (0: official; short-run "
                               "presets: 0.02)", group="optimisation", min=0)
    mask_ratio: float = H.arg(0.75, "share of patches masked", group="views and masking")
    mask_unit: int = H.arg(2, "mask in unit x unit patch blocks (1 = per patch)",
                           group="views and masking", positive=True)
    proj_hidden: int = H.arg(4096, "projector hidden width", group="model", positive=True)
    proj_dim: int = H.arg(256, "projector output width", group="model", positive=True)
    tau: float = H.arg(0.1, "softmax temperature", positive=True)
    rel_pos_lr: float = H.arg(1.0, "the relative position bias table's lr as a multiple of the "
                              "others' (official 1; short-run presets 300: the symmetric start, "
                              "docs/RESULTS.md)", group="optimisation", positive=True)
    crop_scale: tuple = H.arg((0.08, 1.0), "RandomResizedCrop area range", group="data")
    drop_path: float = H.arg(0.0, "student only (official pre-training: 0; 0.1 is fine-tuning's)",
                             group="model", min=0)
    layer_scale: float = H.arg(None, "layer scale init of gamma_1 / gamma_2 (default: official "
                               "0.1, 1e-5 for --model large)", group="model")
    gpu_aug: bool = H.arg(None, "photometric augmentation batched on the device (default: on with "
                          "CUDA; --no-gpu-aug keeps it in the CPU workers)",
                          group="views and masking")
    resident: int = H.arg(0, "decode the training images once into S x S uint8 on the device "
                          "and cut every view there (gpu_data.py; 0 = off; needs --gpu-aug): "
                          "small datasets (CIFAR-10 at 32, Tiny-ImageNet at 64)",
                          group="views and masking", min=0)
    knn: bool = H.arg(None, "k-NN of the evaluated encoder at step 0 and at the end (default: on "
                      "for synthetic; eval_linear.py's)", group="run control")
    eval_every: int = H.arg(0, "also the k-NN every N steps (0 = off), against val/ (else test/) "
                            "or the --holdout images", group="run control", min=0)

    # --data synthetic: batch 32 x 800 steps (k-NN 23.1% vs 16.7% at init) learned more than 64 x 400
    # (19.1%) in the same ~4.5 min; at EMA 0.996 the teacher would stay near its init in so few steps.
    # Small recipes: the official one above by recipes.scale_recipe's rules; the values here are the budget's or
    # the held-out sweep's (lr_factor). Each value's reason: docs/RESULTS.md.
    PRESETS = {"small": dict(lr_factor=1, rel_pos_lr=300, model="micro", patch_size=4, img_size=32,
                             epochs=6, batch_size=256, proj_hidden=512, workers=2, log_every=20),
               "gpu": dict(lr_factor=1, rel_pos_lr=300, model="tiny", patch_size=4, img_size=32,
                           epochs=16, batch_size=512, proj_hidden=512, micro_batch=0, resident=32,
                           gpu_aug=True)}
    SYNTHETIC = dict(model="micro", patch_size=4, img_size=32, epochs=8, batch_size=32,
                     proj_hidden=256, proj_dim=64, drop_path=0.0, crop_scale=(0.3, 1.0), workers=2,
                     log_every=20, steps_per_epoch=100)
    RULES = {"rel_pos_lr": "the symmetric start's rule: at x300 the masked queries part within ~40 "
                           "steps (docs/RESULTS.md)"}


# ----------------------------------------------------------------------------------------------
# Model: BEiT's ViT, as ConMIM's official pre-training builds it: NO absolute position embedding
# (identical [MASK] inputs carry no position, so the dictionary cannot be solved by position alone:
# tests/test_shortcuts.py), one relative position bias table shared by all blocks, layer scale,
# q / v biases (no k bias). timm's `Beit` key names: the encoder loads strict into
# timm.models.beit.Beit(use_abs_pos_emb=False, use_shared_rel_pos_bias=True, init_values=...).
# ----------------------------------------------------------------------------------------------
SIZES = {"nano": (64, 2, 2), "micro": (128, 4, 4), "tiny": (192, 12, 3), "small": (384, 12, 6),
         "base": (768, 12, 12), "large": (1024, 24, 16)}                # width, depth, heads


def relative_position_index(grid):
    """BEiT's index (1 + N, 1 + N) into the ((2g - 1)^2 + 3)-row table: token i -> token j reads the
    row of their offset (dy, dx); the last three rows: CLS -> token, token -> CLS, CLS -> CLS."""
    ys, xs = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    yx = torch.stack([ys, xs]).flatten(1)                                               # (2, N)
    rel = (yx[:, :, None] - yx[:, None, :]).permute(1, 2, 0) + (grid - 1)              # (N, N, 2)
    n_rel = (2 * grid - 1) ** 2 + 3
    index = torch.zeros(grid * grid + 1, grid * grid + 1, dtype=torch.long)
    index[1:, 1:] = rel[..., 0] * (2 * grid - 1) + rel[..., 1]
    index[0, :], index[:, 0], index[0, 0] = n_rel - 3, n_rel - 2, n_rel - 1
    return index


class RelativePositionBias(nn.Module):
    """One learned bias per head and relative offset, zero-initialised (official); forward() -> the
    (heads, 1 + N, 1 + N) attention bias every block adds to q k^T / sqrt(d)."""

    def __init__(self, grid, heads):
        super().__init__()
        rows = (2 * grid - 1) ** 2 + 3
        self.relative_position_bias_table = nn.Parameter(torch.zeros(rows, heads))
        index = relative_position_index(grid)
        self.register_buffer("relative_position_index", index, persistent=False)

    def forward(self):
        n = self.relative_position_index.shape[0]
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]     # (n n, heads)
        return bias.view(n, n, -1).permute(2, 0, 1)


class Attention(nn.Module):
    """BEiT attention: qkv without bias plus learned q and v biases (k bias fixed at 0)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x, bias=None):                                 # (B, T, D), bias (heads, T, T)
        B, T, D = x.shape
        qkv_bias = torch.cat((self.q_bias, torch.zeros_like(self.v_bias), self.v_bias))
        qkv = F.linear(x, self.qkv.weight, qkv_bias).view(B, T, 3, self.heads, D // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)                         # (B, heads, T, D / heads) each
        mask = None if bias is None else bias.to(q.dtype).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(B, T, D))


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
    """Pre-norm block with layer scale: x + DP(gamma_1 Attn(LN(x), bias)); then
    x + DP(gamma_2 MLP(LN(x)))."""

    def __init__(self, dim, heads, layer_scale, drop_path=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim)
        self.gamma_1 = nn.Parameter(torch.full((dim,), float(layer_scale)))
        self.gamma_2 = nn.Parameter(torch.full((dim,), float(layer_scale)))
        self.drop_path = drop_path

    def forward(self, x, bias=None):
        a = self.gamma_1 * self.attn(self.norm1(x), bias)
        x = x + drop_path(a, self.drop_path, self.training)
        m = self.gamma_2 * self.mlp(self.norm2(x))
        return x + drop_path(m, self.drop_path, self.training)


class PatchEmbed(nn.Module):
    def __init__(self, patch_size, dim, in_chans=3):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, patch_size, patch_size)

    def forward(self, x):                                            # (B, C, H, W) -> (B, N, D)
        return self.proj(x).flatten(2).transpose(1, 2)


def beit_init(module):
    """BEiT / ConMIM init: Linear and the patch-embedding Conv2d trunc-normal(0.02) cut at +-1 std
    (a = -0.02, b = 0.02), biases 0; LayerNorm and BatchNorm keep 1 / 0."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.trunc_normal_(m.weight, std=0.02, a=-0.02, b=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def beit_token(t):
    return nn.init.trunc_normal_(t, std=0.02, a=-0.02, b=0.02)


class ViT(nn.Module):
    """forward(x, mask=None, mask_token=None, norm=True) -> (B, 1 + N, D), [CLS] first; mask (B,
    N), 1 = masked: those patch embeddings are replaced by mask_token (1, 1, D), and nothing is
    added to any token (no absolute position embedding: position enters only through the shared
    relative position bias inside attention). The [MASK] parameter lives in Net, so the
    checkpoint's encoder is a plain BEiT. Init: beit_init, cls token trunc-normal, then each
    block's attn.proj and mlp.fc2 divided by sqrt(2 layer) (BEiT's fix_init_weight); the bias
    table starts at 0, gammas at layer_scale. The input must be img_size (the bias table is tied
    to the patch grid)."""

    def __init__(self, img_size=224, patch_size=16, dim=768, depth=12, heads=12, drop_path=0.0,
                 layer_scale=0.1, in_chans=3):
        super().__init__()
        self.config = dict(img_size=img_size, patch_size=patch_size, dim=dim, depth=depth,
                           heads=heads, mlp_ratio=4.0, pos_embed="none", rel_pos_bias="shared",
                           layer_scale=layer_scale, qkv_bias="qv", init="beit")   # ckpt["vit"]
        self.config |= {"in_chans": in_chans} if in_chans != 3 else {}             # RGB's: unsaid
        self.patch_size = patch_size
        self.dim = dim
        self.grid = img_size // patch_size
        self.patch_embed = PatchEmbed(patch_size, dim, in_chans)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.rel_pos_bias = RelativePositionBias(self.grid, heads)
        self.blocks = nn.ModuleList(Block(dim, heads, layer_scale, p)
                                    for p in torch.linspace(0, drop_path, depth).tolist())
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.grad_ckpt = False                                       # C.set_grad_checkpointing
        beit_init(self)
        beit_token(self.cls_token)
        with torch.no_grad():
            for layer, blk in enumerate(self.blocks, start=1):
                blk.attn.proj.weight.div_(math.sqrt(2.0 * layer))
                blk.mlp.fc2.weight.div_(math.sqrt(2.0 * layer))

    def forward(self, x, mask=None, mask_token=None, norm=True):
        if x.shape[-2:] != (self.grid * self.patch_size,) * 2:
            raise C.UserError(f"ConMIM's ViT takes {self.grid * self.patch_size}px images (its "
                              f"relative position bias is tied to the {self.grid}x{self.grid} "
                              f"patch grid), got {tuple(x.shape[-2:])}")
        x = self.patch_embed(x)                                      # (B, N, D)
        if mask is not None:                                         # corrupt: masked -> [MASK]
            w = mask.unsqueeze(-1).to(x.dtype)
            x = x * (1 - w) + mask_token.to(x.dtype) * w
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)   # no position added
        x = C.run_blocks(self.blocks, x, self.grad_ckpt, self.rel_pos_bias())
        return self.norm(x) if norm else x


def make_vit(a):
    if a.model not in SIZES:
        raise C.UserError(f"--model must be one of {', '.join(SIZES)}, got {a.model!r}")
    dim, depth, heads = SIZES[a.model]
    return ViT(a.img_size, a.patch_size, dim, depth, heads, a.drop_path, layer_scale(a),
               a.in_chans)


def layer_scale(a):
    """--layer-scale, or the official value: 1e-5 for ViT-L (the README's command), else 0.1."""
    return a.layer_scale if a.layer_scale is not None else (1e-5 if a.model == "large" else 0.1)


def random_masking(batch, grid, ratio, unit=2, device=None):
    """Random masking in unit x unit blocks of patches, per image: exactly int(n_blocks (1 - ratio))
    blocks stay visible. Returns mask (B, N) float, 1 = masked."""
    if grid % unit:
        raise C.UserError(f"patch grid {grid} is not divisible by the mask unit {unit}")
    g = grid // unit
    order = torch.rand(batch, g * g, device=device).argsort(1)      # a random permutation of blocks
    rank = order.argsort(1)                                          # each block's place in it
    masked = rank >= int(g * g * (1 - ratio))                        # all but the first n_keep places
    blocks = masked.view(batch, g, 1, g, 1).expand(-1, -1, unit, -1, unit)   # each unit x unit
    return blocks.reshape(batch, -1).float()


def make_teacher(student):
    """The momentum encoder f' (EMA teacher): a copy of the student without gradients and with drop
    path off in every block: its targets are deterministic in train mode (DINO / iBOT teachers)."""
    teacher = copy.deepcopy(student).requires_grad_(False)
    for m in teacher.modules():
        if isinstance(m, Block):
            m.drop_path = 0.0
    return teacher


@torch.no_grad()
def ema_update(teacher, student, m):
    """theta' <- m theta' + (1 - m) theta, every parameter (BatchNorm buffers: the teacher's)."""
    student = [p.detach() for p in student.parameters()]
    torch._foreach_lerp_(list(teacher.parameters()), student, 1.0 - m)


def ema_start(m, steps, horizon):
    """The first EMA momentum: m, lowered where its horizon 1 / (1 - m) exceeds `horizon` x steps
    (the short-run rule: recipes.scale_recipe; the same lines in each EMA method's file, pinned
    equal by tests/test_common.py)."""
    return min(m, 1 - 1 / max(1.0, horizon * steps)) if horizon else m


# ----------------------------------------------------------------------------------------------
# Heads: the per-token projector and the student / teacher network
# ----------------------------------------------------------------------------------------------
class Projector(nn.Module):
    """Per-token 3-layer MLP with BN, no Linear bias (the official head): (B, T, D) -> (B, T, d)."""

    def __init__(self, D, hidden, d):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(D, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, d, bias=False), nn.BatchNorm1d(d, affine=False))

    def forward(self, x):
        B, N, D = x.shape
        return self.mlp(x.reshape(B * N, D)).view(B, N, -1)


class Net(nn.Module):
    """Student f (and, as an EMA copy, the teacher): ViT with a [MASK] token -> per-token
    projector. The [MASK] embedding lives here, not in the encoder, so the checkpoint's encoder
    is a plain BEiT."""

    def __init__(self, a):
        super().__init__()
        self.encoder = make_vit(a)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, self.encoder.dim))
        self.projector = Projector(self.encoder.dim, a.proj_hidden, a.proj_dim)
        beit_token(self.mask_token)
        beit_init(self.projector)

    def forward(self, x, mask=None):                                    # -> (B, N, d) patch features
        tokens = self.encoder(x, mask=mask, mask_token=self.mask_token)  # (B, 1+N, D)
        return self.projector(tokens)[:, 1:]                            # CLS projected too (official)


def no_decay(name, p):
    """Official (BEiT get_parameter_groups): biases, 1-d tensors (q / v biases, gammas, norms) and
    no_weight_decay() = {pos_embed (absent here), cls_token}; the mask token and the shared relative
    position bias table (2-d) are decayed."""
    return C.no_decay_1d(name, p) or name == "encoder.cls_token"


def make_optimizer(model, a, device):
    """AdamW over the official groups (no_decay); with --rel-pos-lr k != 1 the relative position
    bias table moves to a group of its own (decayed, as official) whose lr is k x the schedule's
    (C.set_hparams reads its lr_scale)."""
    opt = C.make_optimizer(model, a.lr, a.weight_decay, a.betas, device, no_decay)
    if a.rel_pos_lr != 1:
        table = model.encoder.rel_pos_bias.relative_position_bias_table
        g = opt.param_groups[0]
        g["params"] = [p for p in g["params"] if p is not table]
        opt.add_param_group({**{k: v for k, v in g.items() if k != "params"}, "params": [table],
                             "lr": g["lr"] * a.rel_pos_lr,
                             "lr_scale": a.rel_pos_lr})
    return opt


# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
def conmim_loss(student, teacher, mask, tau=0.1):
    """Denoising patch-level contrast, Eq. (2).

    student (B, N, d): f(x^)_j;  teacher (B, N, d): sg f'(x)_i;  mask (B, N), 1 = masked.
      logits_{b,j,i} = <s_bj/|s_bj|, t_bi/|t_bi|> / tau                    (B, N, N)
      L = (1 / #masked) sum_{b, j masked} -log softmax_i(logits_{b,j,:})_{i=j}
    Keys are the N patches of the same image only (no other images, no all-gather). Mean over all
    masked patches of the local batch.
    """
    s = F.normalize(student, dim=-1)
    t = F.normalize(teacher.detach(), dim=-1)
    logits = s @ t.transpose(1, 2) / tau                                  # (B, N, N)
    B, N, _ = logits.shape
    labels = torch.arange(N, device=logits.device).expand(B, N)
    ce = F.cross_entropy(logits.reshape(B * N, N), labels.reshape(-1), reduction="none").view(B, N)
    return (ce * mask).sum() / mask.sum()


@torch.no_grad()
def masked_symmetry(student, mask):
    """The symmetric start's measure (logged as `sym`): the mean pairwise cosine of an image's
    student outputs at its masked positions, averaged over images. 1 = every masked query alike;
    then Eq. (2) cannot go below ln N. student (B, N, d), mask (B, N)."""
    s = F.normalize(student.float(), dim=-1)
    others = 1 - torch.eye(mask.shape[1], device=mask.device)       # pairs of two positions
    pair = mask.unsqueeze(2) * mask.unsqueeze(1) * others           # (B, N, N): both masked
    return ((s @ s.transpose(1, 2)) * pair).sum() / pair.sum().clamp(min=1)


# ----------------------------------------------------------------------------------------------
# Data: one crop, weak (student) and strong (teacher) photometric views of it
# ----------------------------------------------------------------------------------------------
STRONG = dict(jitter=(0.4, 0.4, 0.2, 0.1), p_blur=0.1, p_solarize=0.2)   # the teacher view's photometric ops


def view_specs(a):
    """The views' geometry: one RandomResizedCrop (bicubic) + flip, both views cut from it
    (gpu_data.cut's (size, scale, count, resampling)): what WeakStrongViews makes in the workers and
    --resident cuts on the device."""
    return [(a.img_size, a.crop_scale, 1, "bicubic")]


class WeakStrongViews:
    """One flip + RandomResizedCrop(bicubic); (weak, strong) uint8 views of it. gpu_aug: the strong
    view gets STRONG batched on the device (train loop), so the worker sends the crop once."""

    def __init__(self, a):
        from torchvision import transforms as T
        [(size, scale, _, _)] = view_specs(a)
        self.crop = T.Compose([T.RandomHorizontalFlip(), T.RandomResizedCrop(
            size, scale=scale, interpolation=T.InterpolationMode.BICUBIC)])
        self.strong = None if a.gpu_aug else C.color_augment(**STRONG)   # None: STRONG on the device

    def __call__(self, img):
        img = self.crop(img)
        if self.strong is None:
            return (C.to_uint8(img),)                                # the crop: both views, on the device
        return C.to_uint8(img), C.to_uint8(self.strong(img))         # (student, teacher)


# ----------------------------------------------------------------------------------------------
# The training step: views -> networks -> loss, forward and backward
# ----------------------------------------------------------------------------------------------
def train_step(student, teacher, x_weak, x_strong, mask, a, micro=None,
               autocast=contextlib.nullcontext(), scale=None, ddp=None, diagnose=False):
    """One ConMIM step on this process's B images; gradients are left in the student f.

    x_weak (B, 3, H, W): the weak view, the corrupted input x^ -> student f, its patches at mask
      (B, N) (1 = masked) replaced by [MASK];
    x_strong (B, 3, H, W): the strong view of the same crop, the full input x -> momentum encoder f'
      (teacher) only, unmasked, no grad.
    The loss reads the student's features at the masked positions. Per image, so micro-batches
    accumulate directly (BatchNorm statistics of the projectors are per micro-batch). diagnose (a
    log step): also the symmetric start's measures, `sym` (masked_symmetry of the first
    micro-batch) and `rpb` (the relative position bias table's max |b|).
    """
    B = x_weak.shape[0]
    scale = scale or (lambda t: t)
    total, sym = 0.0, None
    for sl in C.micro_batches(B, micro or B, ddp):                   # one slice, or exact accumulation
        with autocast:
            s = student(x_weak[sl], mask[sl])                        # f(x^): (b, N, d)
            with torch.no_grad():
                t = teacher(x_strong[sl])                            # sg f'(x): (b, N, d)
        loss = conmim_loss(s.float(), t.float(), mask[sl], a.tau) * (len(s) / B)   # share of the mean
        scale(loss).backward()                                       # Eq. (2)
        total = total + loss.detach()
        if diagnose and sym is None:                                 # the first micro-batch's
            sym = masked_symmetry(s, mask[sl])
    parts = {"loss": total}
    if diagnose:
        table = C.unwrap(student).encoder.rel_pos_bias.relative_position_bias_table
        parts |= {"sym": sym, "rpb": table.detach().abs().max()}
    return total, parts


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def loader_and_views(args, run, dataset, per):
    """The training loader and views(batch): its batch as (x_weak, x_strong), each (B, 3, H, W) on
    the device, normalised, the strong view after its photometric ops (STRONG): batched on the
    device with --gpu-aug (compiled on CUDA), else in the PIL workers. The paper's views come from
    WeakStrongViews in the workers; --resident cuts the same view_specs on the device from the
    images decoded there once (gpu_data.py), no workers. With --gpu-aug a batch holds the crop once
    (both views are it before STRONG)."""
    if not args.resident:                                            # the paper's: the PIL workers
        viewed = C.Views(dataset, WeakStrongViews(args), args.seed)
        loader = C.make_loader(viewed, per, args.workers, args.seed)
    else:
        gpu_data = C.optional("gpu_data", "--resident needs gpu_data.py next to this file")
        loader = gpu_data.loader(dataset, args, run, per, view_specs(args))
    color = None
    if args.gpu_aug:
        color = C.optional("gpu_aug").color_augmenter(args.compile or run.device.type == "cuda")

    def views(batch):
        x = [v.to(run.device, non_blocking=True) for v in batch]
        x_weak, x_strong = x[0], x[-1]                               # one crop: the same tensor
        x_strong = color(x_strong, **STRONG, normalize=True) if color else C.normalize(x_strong)
        return C.normalize(x_weak), x_strong
    return loader, views


def train(args):
    run = H.setup(args, "conmim")
    dev = run.device
    grid = args.img_size // args.patch_size

    def masked():
        return random_masking(1, grid, args.mask_ratio, args.mask_unit).sum()
    H.check_mask_ratio(args.mask_ratio, masked, grid * grid)
    per, micro = H.batch_plan(args, run, 2048, "the loss is per image, so only the gradient noise "
                              "and the lr / batch pairing of the recipe change")
    dataset = C.image_dataset(args.data, "train", skip_unreadable=True, holdout=args.holdout)
    loader, views = loader_and_views(args, run, dataset, per)
    ipe = min(len(loader), args.steps_per_epoch or len(loader))
    total = args.epochs * ipe
    m0 = ema_start(args.ema[0], total, args.ema_horizon)             # short runs: horizon <= a share

    student = Net(args).to(dev)                                      # f; seeded in setup: all ranks
    if args.init and not run.resuming:                               # --init: start from these weights
        weights = C.optional("weights", "--init needs weights.py next to this file")
        weights.init_weights(args.init, student, student.encoder, "conmim")
    teacher = make_teacher(student)                                  # f': an EMA copy, no drop path
    C.set_grad_checkpointing(student, args.grad_ckpt)
    opt = make_optimizer(student, args, dev)
    start = H.resume_run(run, "conmim", args, student, opt, teacher, data={"train": dataset})
    student_fwd, ddp = H.distribute(torch.compile(student) if args.compile else student, run)
    teacher_fwd = torch.compile(teacher) if args.compile else teacher

    def save(step, **kw):                                            # snapshot=True: the encoder alone
        encoder = teacher.encoder                                    # the evaluated one
        C.save_run(run, "conmim", args, step // ipe, step, encoder, student, opt, teacher, **kw)
    log = C.Logger(run, args, total, start, ipe)
    if log.done:                                                     # a finished or stopped run, rerun
        return
    lr_rule = f"--preset {args.preset}: recipes.py" if args.preset else "the official batch's"
    C.print0(f"{len(dataset)} images, {ipe} steps/epoch, {total} steps, lr {args.lr:g} (absolute, "
             f"{lr_rule}); teacher momentum {m0:g} -> {args.ema[1]:g}")
    knn = None
    if H.knn_wanted(args):                                           # --knn, --eval-every: eval_linear's k-NN
        eval_linear = C.optional("eval_linear", "--knn / --eval-every need eval_linear.py and "
                                 "weights.py next to this file")
        knn = eval_linear.KNNMonitor(args, run, log, teacher.encoder, "conmim", "teacher encoder")
        if start == 0:
            knn(0)                                                   # the initial encoder

    batches = C.Batches(loader, ipe, args.max_unreadable)          # from the checkpoint's step on

    for epoch in range(start // ipe, args.stop_epoch or args.epochs):
        if epoch * ipe >= start:                                     # a fresh epoch: masks and drop path from
            C.seed_epoch(args.seed, epoch, run.rank)                 # (seed, epoch, rank); resumed: the checkpoint's
        student.train()
        teacher.train()                                              # BatchNorm: batch statistics
        for it, (batch, _) in batches.epoch(epoch, start):
            step = epoch * ipe + it
            lr = C.cosine_schedule(step, total, args.lr, args.min_lr, args.warmup_epochs * ipe)
            m = C.cosine_schedule(step, total, m0, args.ema[1])      # 0.996 -> 1, cosine
            C.set_hparams(opt, lr)
            x_weak, x_strong = views(batch)                          # (B, 3, H, W) each
            mask = random_masking(x_weak.shape[0], grid, args.mask_ratio, args.mask_unit, dev)
            opt.zero_grad(set_to_none=True)
            diagnose = log.due(step + 1)                             # sym, rpb on log steps only
            loss, parts = train_step(student_fwd, teacher_fwd, x_weak, x_strong, mask, args, micro,
                                     run.autocast, run.scaler.scale, ddp, diagnose)
            parts["grad_norm"] = C.optimizer_step(run, opt, student.parameters(), args.clip_grad)
            ema_update(teacher, student, m)
            diag = {k: parts.pop(k, None) for k in ("sym", "rpb")}   # logged, not watched (log steps only)
            scalars = dict(lr=lr, mom=m, **diag)
            stop = C.end_step(run, log, save, batches, step + 1, epoch, parts, **scalars)
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
