"""CMAE: Contrastive Masked Autoencoders are Stronger Vision Learners.
Huang, Jin, Lu, Hou, Cheng, Fu, Shen, Feng. TPAMI 2023. arXiv:2207.13532.

Idea. An MAE (encoder on the visible 35% of patches, pixel decoder reconstructing the masked
ones) gets a second, contrastive task: a shallow feature decoder turns the same visible latents +
mask tokens into a pooled image feature that, after a projector and predictor, must identify the
EMA target encoder's embedding of a slightly shifted, colour-augmented view of the same image
among the other images of the global batch (InfoNCE).

Launch. `--batch-size` is the GLOBAL batch (recipe: 4096 = official 256 x 16 GPUs); each process
takes batch / processes images in micro-batches of --micro-batch (default 512; docs/DESIGN.md
measures the memory) and the step is exact: InfoNCE stays over the global batch.
  python cmae.py --data synthetic                        # CPU quickstart, ~5 min, ends with k-NN
  python cmae.py --data /cifar10 --preset small          # CIFAR-10 folders, 2 CPU cores
  python cmae.py --data /imagenet                        # ViT-B/16 official recipe, 1 GPU: 8 x 512
  torchrun --nproc_per_node=8 cmae.py --data /imagenet   # the same objective on 8 GPUs: 8 x 512

Files. This file, common.py (the training kit: schedules, the optimiser step, micro-batches, data,
checkpoints, the log) and harness.py (the command line, launching, resume, preemption) train the
official recipe on an image folder. Beside them, for a flag: recipes.py (--preset, and with
synthetic.py --data synthetic), weights.py (--init), eval_linear.py and weights.py (--knn,
--eval-every), gpu_aug.py (the target view's colour ops on the GPU, default on CUDA; without it
they run in the workers).

Paper -> code.
  Pixel-shifted view pair, Sec 3.3 ......... PixelShiftViews
  Masked online encoder F_s, Sec 3.1 ....... CMAE.forward: encoder(x_s, ids_keep), 2x2-block mask
  Pixel decoder G_p, L_r (Eq. 1) ........... CMAE.pixel_decoder (depth 8) + reconstruction_loss
                                             (norm-pix MSE)
  Feature decoder G_f, y_s ................. CMAE.feature_decoder (depth 2, own parameters), mean
                                             of the patch tokens
  Projection + prediction heads ............ CMAE.projector / CMAE.predictor
  Momentum target encoder F_t, z_t ......... Target (frozen_copy + ema_update of encoder and
                                             projector), mean patch token
  L_c InfoNCE (Eq. 3), L = L_r + l_c L_c ... cmae_contrastive_loss, train()

Where this file follows the official code (ZhichengHuang/CMAE) rather than the paper, or differs:
  - InfoNCE is scaled by 2 * tau (official), one direction, targets all-gathered as negatives.
  - Target encoder features are taken before the final LayerNorm, mean of patch tokens (official).
  - Two decoders with non-shared parameters, as official (two MAEPretrainDecoder) and the paper:
    each has its own input embedding, [M] token, blocks, norm and output layer; the fixed sin-cos
    position table is the same function for both (a buffer each, no parameter).
  - The feature decoder's output width equals the encoder width (official: p*p*3 = 768, the pixel
    width, which equals the projector's input only for ViT-B/16); identical for ViT-B/16.
  - Initialisation as official: encoder and decoders MAE-style (xavier-uniform Linear and patch
    embedding, normal(0.02) cls / mask tokens); projector and predictor keep PyTorch's default
    Linear init, BatchNorm eps 1e-6. Weight decay as official (paramwise custom_keys): none on
    biases, LayerNorms, pos_embed, mask and cls tokens; the heads' BatchNorm weights ARE decayed.
  - BatchNorm scope: projector / predictor (and the target projector) normalise over one
    micro-batch, across processes with SyncBN on multi-GPU CUDA; official SyncBN spans the 4096
    global images. Equal when micro-batch x processes = the global batch (8 GPUs x 512).
  - Masks are per image in 2x2-patch units (`--mask-unit 1` for per-patch MAE masking).
  - The EMA target never applies drop path (official builds it with the backbone's settings;
    identical at the recipe's drop_path 0), so its embeddings are deterministic in train mode.
  - bf16 autocast on GPU (official fp16 AMP; `--precision fp16` is available).
  - On CUDA the target's colour augmentation (jitter, grey, PIL-equivalent blur) runs batched on the
    GPU (gpu_aug.py, same distribution); `--no-gpu-aug` keeps it in the workers.
"""
import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.transforms import functional as TF

import common as C
import harness as H


@dataclass
class Args(H.RunArgs):
    """CMAE pre-training (defaults: official ViT-B/16 ImageNet recipe, 300 epochs)."""
    data: str = H.arg(None, "image folder (uses DIR/train if present) or 'synthetic'", group="data")
    output_dir: str = H.arg(None, "where checkpoint.pth, log.jsonl, args.json and pictures go "
                            "(default runs/cmae)", group="data")
    model: str = H.arg("base", "ViT size: nano|micro|tiny|small|base|large", group="model")
    init: str = H.arg(None, "start from these weights at step 0: a checkpoint of this project, the "
                      "official MSN file, an MAE-style 'model' dict or a timm / DeiT state dict "
                      "(read by weights.py)", group="model")
    patch_size: int = H.arg(16, "ViT patch size (px)", group="model", positive=True)
    img_size: int = H.arg(224, "training image size (px)", group="data", positive=True)
    master_size: int = H.arg(256, "master crop; target shift is 0..master-img-1 px",
                             group="views and masking", positive=True)
    epochs: int = H.arg(300, "training epochs (the schedules span them)",
                        group="optimisation", positive=True)
    batch_size: int = H.arg(4096, "GLOBAL batch, all processes (official 256 x 16 GPUs)",
                            group="optimisation", positive=True)
    micro_batch: int = H.arg(512, "images per forward/backward per process (0 = the whole "
                             "per-process batch; memory: docs/DESIGN.md); the step stays exact",
                             group="optimisation", min=0)
    lr: float = H.arg(None, "absolute lr (default blr * global batch / 256)",
                      group="optimisation", positive=True)
    blr: float = H.arg(1.5e-4, "base lr: lr = blr x global batch / 256",
                       group="optimisation", positive=True)
    min_lr: float = H.arg(0.0, "lr at the end of the cosine schedule", group="optimisation", min=0)
    warmup_epochs: float = H.arg(40, "linear lr warm-up epochs", group="optimisation", min=0)
    weight_decay: float = H.arg(0.05, "AdamW weight decay", group="optimisation", min=0)
    betas: tuple = H.arg((0.9, 0.95), "AdamW betas", group="optimisation")
    ema: float = H.arg(0.996, "EMA momentum (constant, per step)", group="optimisation")
    ema_horizon: float = H.arg(0.0, "cap the EMA horizon 1/(1-m) at this fraction of the run's "
                               "steps by lowering the first momentum (0: official; short-run "
                               "presets: 0.02)", group="optimisation", min=0)
    mask_ratio: float = H.arg(0.65, "share of patches masked", group="views and masking")
    mask_unit: int = H.arg(2, "mask in unit x unit patch blocks (1 = per patch)",
                           group="views and masking", positive=True)
    decoder_dim: int = H.arg(512, "decoder width", group="model", positive=True)
    decoder_depth: int = H.arg(8, "decoder blocks", group="model", min=1,
                               why=" (a masked patch sees the visible ones only through them)")
    decoder_heads: int = H.arg(16, "decoder attention heads", group="model", positive=True)
    feature_decoder_depth: int = H.arg(2, "feature decoder blocks", group="model", min=0)
    proj_hidden: int = H.arg(1536, "projector hidden width", group="model", positive=True)
    proj_dim: int = H.arg(256, "projector output width", group="model", positive=True)
    tau: float = H.arg(0.07, "softmax temperature", positive=True)
    lambda_c: float = H.arg(1.0, "weight of the contrastive loss", min=0)
    drop_path: float = H.arg(0.0, "stochastic depth rate of the last block", group="model", min=0)
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

    # Small recipes: the official one above by recipes.scale_recipe's rules; the values here are the budget's or
    # the held-out sweep's (lr_factor). Each value's reason: docs/RESULTS.md.
    PRESETS = {"small": dict(lr_factor=4, model="micro", patch_size=4, img_size=32, epochs=9,
                             batch_size=256, decoder_dim=128, decoder_depth=2, decoder_heads=4,
                             feature_decoder_depth=1, proj_hidden=512, workers=2, log_every=20),
               "gpu": dict(lr_factor=4, model="tiny", patch_size=4, img_size=32, epochs=16,
                           batch_size=512, decoder_dim=128, decoder_depth=2, decoder_heads=4,
                           feature_decoder_depth=1, proj_hidden=512, micro_batch=0, resident=32,
                           gpu_aug=True)}
    SYNTHETIC = dict(model="micro", patch_size=4, img_size=32, epochs=8, batch_size=64,
                     decoder_dim=64, decoder_depth=2, decoder_heads=4, feature_decoder_depth=1,
                     proj_hidden=256, proj_dim=64, workers=2, log_every=20, steps_per_epoch=50)
    RULES = {"master_size": "the official 256 px x img / 224, to a pixel"}

    def preset_rules(cls, preset):
        """recipes.scale_recipe's rules, then CMAE's own (RULES): the master crop x img / 224, to a
        pixel (256 -> 37 px)."""
        recipes = C.optional("recipes")                              # (for a preset only: present)
        out = recipes.scale_recipe(cls, preset)
        master = cls.master_size * preset["img_size"] / recipes.OFFICIAL_IMG
        out.setdefault("master_size", round(master))
        return out

    def check(self):
        """validate()'s rule for CMAE's own flag."""
        if self.master_size < self.img_size:
            raise C.UserError(f"--master-size {self.master_size} is smaller than --img-size "
                              f"{self.img_size}")


# ----------------------------------------------------------------------------------------------
# Model: an MAE-style ViT (models_mae.py): [CLS], fixed 2-D sin-cos position embeddings, masked
# patches dropped before the encoder. timm's key names: the encoder loads into timm's
# VisionTransformer and into every other method's ViT (tests/test_interop.py).
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


def sincos_pos_embed(dim, grid):
    """MAE's fixed 2-D sin-cos table, with a zero row for [CLS] first: (1, 1 + grid^2, dim),
    channels [x sin, x cos, y sin, y cos], frequencies 1 / 10000^(k / (dim/4))."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4.0))
    coords = torch.arange(grid, dtype=torch.float64)
    ys, xs = torch.meshgrid(coords, coords, indexing="ij")
    angles = [p.flatten()[:, None] * omega[None] for p in (xs, ys)]   # (grid^2, dim / 4) each
    table = torch.cat([f(a) for a in angles for f in (torch.sin, torch.cos)], 1)   # (grid^2, dim)
    return torch.cat([torch.zeros(1, dim), table.float()])[None]


def xavier_init(module):
    """MAE's init: Linear xavier-uniform, biases 0; the patch-embedding Conv2d xavier-uniform on its
    (D, 3 p p) view, bias PyTorch's default (as MAE); LayerNorm and BatchNorm keep 1 / 0."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.xavier_uniform_(m.weight.view(m.weight.shape[0], -1))
        elif isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class ViT(nn.Module):
    """forward(x, ids_keep=None, norm=True) -> (B, 1 + n, D), [CLS] first; ids_keep (B, n): the
    visible patches, the only ones the encoder sees."""

    def __init__(self, img_size=224, patch_size=16, dim=768, depth=12, heads=12, drop_path=0.0,
                 in_chans=3):
        super().__init__()
        self.config = dict(img_size=img_size, patch_size=patch_size, dim=dim, depth=depth,
                           heads=heads, mlp_ratio=4.0, pos_embed="sincos", init="xavier")  # ckpt["vit"]
        self.config |= {"in_chans": in_chans} if in_chans != 3 else {}             # RGB's: unsaid
        self.patch_size = patch_size
        self.dim = dim
        self.grid = img_size // patch_size
        self.patch_embed = PatchEmbed(patch_size, dim, in_chans)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.register_buffer("pos_embed", sincos_pos_embed(dim, self.grid))    # fixed, in the state dict
        rates = torch.linspace(0, drop_path, depth).tolist()         # stochastic depth, rising
        self.blocks = nn.ModuleList(Block(dim, heads, p) for p in rates)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.grad_ckpt = False                                       # C.set_grad_checkpointing
        xavier_init(self)
        nn.init.normal_(self.cls_token, std=0.02)

    def forward(self, x, ids_keep=None, norm=True):
        x = self.patch_embed(x) + self.pos_embed[:, 1:]              # (B, N, D)
        if ids_keep is not None:                                     # drop the masked patches
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


# ----------------------------------------------------------------------------------------------
# Masking and patches (MAE)
# ----------------------------------------------------------------------------------------------
def random_masking(batch, grid, ratio, unit=1, device=None):
    """MAE-style random masking of a grid x grid patch map in unit x unit blocks, per image: exactly
    int(n_blocks (1 - ratio)) blocks kept. Returns ids_keep (B, n_keep) kept patch indices
    (ascending), ids_restore (B, N) (gathering cat([kept, masked]) with it restores raster order),
    mask (B, N) float, 1 = masked."""
    if grid % unit:
        raise C.UserError(f"patch grid {grid} is not divisible by the mask unit {unit}")
    g = grid // unit
    n_keep = int(g * g * (1 - ratio)) * unit * unit
    noise = torch.rand(batch, g * g, device=device)                 # argsort of noise (MAE)
    block_masked = noise.argsort(1).argsort(1) >= int(g * g * (1 - ratio))
    mask = block_masked.view(batch, g, 1, g, 1).expand(-1, -1, unit, -1, unit).reshape(batch, -1)
    ids_shuffle = mask.to(torch.uint8).argsort(dim=1, stable=True)  # kept first, then masked
    return ids_shuffle[:, :n_keep], ids_shuffle.argsort(1), mask.float()


def restore_tokens(x, mask_token, ids_restore):
    """(B, 1+n_keep, d) encoder tokens -> (B, 1+N, d): append mask tokens, unshuffle (MAE)."""
    B, N = ids_restore.shape
    patches = torch.cat([x[:, 1:], mask_token.to(x.dtype).expand(B, N + 1 - x.shape[1], -1)], dim=1)
    patches = torch.gather(patches, 1, ids_restore.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    return torch.cat([x[:, :1], patches], dim=1)


def patchify(imgs, p):
    """(B, C, H, W) -> (B, N, p*p*C), row-major patches, (p, p, C) inside each patch (MAE)."""
    B, C3, H, W = imgs.shape
    x = imgs.reshape(B, C3, H // p, p, W // p, p)
    return torch.einsum("bchpwq->bhwpqc", x).reshape(B, (H // p) * (W // p), p * p * C3)


def unpatchify(x, p):
    """Inverse of patchify for square images: (B, N, p*p*C) -> (B, C, h p, h p)."""
    B, N, _ = x.shape
    h, c = int(round(N ** 0.5)), x.shape[-1] // (p * p)
    return torch.einsum("bhwpqc->bchpwq", x.reshape(B, h, h, p, p, c)).reshape(B, c, h * p, h * p)


def norm_pix(target, eps=1e-6):
    """MAE's norm_pix_loss target: each patch's pixels (x - mean) / sqrt(var + eps), per patch."""
    mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
    return (target - mean) / (var + eps) ** 0.5


def unnorm_pix(pred, target, eps=1e-6):
    """norm_pix-space predictions back to pixels with the target patches' mean / var (pictures)."""
    mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
    return pred * (var + eps) ** 0.5 + mean


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
def mlp_head(d_in, hidden, d_out):
    """Linear-BN(eps 1e-6)-ReLU-Linear(no bias): CMAE's projector and predictor (NonLinearNeck),
    PyTorch's default Linear init as official."""
    return nn.Sequential(nn.Linear(d_in, hidden), nn.BatchNorm1d(hidden, eps=1e-6),
                         nn.ReLU(inplace=True), nn.Linear(hidden, d_out, bias=False))


class Decoder(nn.Module):
    """MAE decoder with its own parameters: embed the visible latents, fill the masked slots with
    its [M] token, unshuffle, add fixed sin-cos pos-embeds, blocks, norm, linear output.
    (B, 1+n_vis, D), ids_restore (B, N) -> (B, 1+N, d_out)."""

    def __init__(self, D, grid, dim, depth, heads, d_out):
        super().__init__()
        self.embed = nn.Linear(D, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.register_buffer("pos_embed", sincos_pos_embed(dim, grid))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.out = nn.Linear(dim, d_out)
        self.grad_ckpt = False
        xavier_init(self)
        nn.init.normal_(self.mask_token, std=0.02)

    def forward(self, latent, ids_restore):
        x = restore_tokens(self.embed(latent), self.mask_token, ids_restore) + self.pos_embed
        return self.out(self.norm(C.run_blocks(self.blocks, x, self.grad_ckpt)))


class CMAE(nn.Module):
    """Online branch: encoder F_s, pixel decoder G_p, feature decoder G_f, projector, predictor."""

    def __init__(self, a):
        super().__init__()
        self.encoder = make_vit(a)
        D, g, p = self.encoder.dim, self.encoder.grid, a.patch_size
        dd, heads = a.decoder_dim, a.decoder_heads
        self.pixel_decoder = Decoder(D, g, dd, a.decoder_depth, heads, p * p * a.in_chans)
        self.feature_decoder = Decoder(D, g, dd, a.feature_decoder_depth, heads, D)
        self.projector = mlp_head(D, a.proj_hidden, a.proj_dim)
        self.predictor = mlp_head(a.proj_dim, a.proj_hidden, a.proj_dim)

    def forward(self, x, ids_keep, ids_restore, pixels=True):
        """x (B, 3, H, W) source view. Returns pixel predictions (B, N, p*p*3) (None if not pixels)
        and the online prediction u (B, proj_dim) of the feature branch."""
        latent = self.encoder(x, ids_keep)                                     # (B, 1+n_vis, D)
        pred = self.pixel_decoder(latent, ids_restore)[:, 1:] if pixels else None   # (B, N, p*p*3)
        y_s = self.feature_decoder(latent, ids_restore)[:, 1:].mean(1)         # (B, D) all patch tokens
        return pred, self.predictor(self.projector(y_s))


def no_decay_rule(model):
    """Official paramwise custom_keys: no decay on biases, LayerNorms ('ln'), pos_embed, mask and
    cls tokens. The heads' BatchNorm weights are decayed."""
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    ln = {id(p) for m in norms for p in m.parameters(recurse=False)}
    return lambda name, p: (id(p) in ln or name.endswith(".bias")
                            or any(k in name for k in ("pos_embed", "mask_token", "cls_token")))


def frozen_copy(module):
    """A copy without gradients and with drop path off in every block: the EMA target's outputs are
    deterministic in train mode (its BatchNorm keeps batch statistics, as official)."""
    target = copy.deepcopy(module).requires_grad_(False)
    for m in target.modules():
        if isinstance(m, Block):
            m.drop_path = 0.0
    return target


@torch.no_grad()
def ema_update(target, online, m):
    """theta_t <- m theta_t + (1 - m) theta_s, every parameter (BatchNorm buffers: its own)."""
    online = [p.detach() for p in online.parameters()]
    torch._foreach_lerp_(list(target.parameters()), online, 1.0 - m)


def ema_start(m, steps, horizon):
    """The first EMA momentum: m, lowered where its horizon 1 / (1 - m) exceeds `horizon` x steps
    (the short-run rule: recipes.scale_recipe; the same lines in each EMA method's file, pinned
    equal by tests/test_common.py)."""
    return min(m, 1 - 1 / max(1.0, horizon * steps)) if horizon else m


class Target(nn.Module):
    """Momentum branch F_t: EMA encoder (no final norm) -> mean patch token z_t -> projector."""

    def __init__(self, online):
        super().__init__()
        self.encoder = frozen_copy(online.encoder)
        self.projector = frozen_copy(online.projector)

    def forward(self, x):
        z_t = self.encoder(x, norm=False)[:, 1:].mean(1)                      # (B, D)
        return self.projector(z_t)                                           # (B, proj_dim)

    def online_params(self, online):
        """The online modules this target is an EMA of (same parameter order)."""
        return nn.ModuleList([online.encoder, online.projector])


# ----------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------
def reconstruction_loss(pred, target, mask):
    """L_r: MSE on masked patches only. pred/target (B, N, P) (target already norm-pix),
    mask (B, N), 1 = masked. Mean over the P values of a patch, then mean over masked patches."""
    per_patch = ((pred - target) ** 2).mean(dim=-1)                           # (B, N)
    return (per_patch * mask).sum() / mask.sum()


def cmae_contrastive_loss(online, target, tau=0.07):
    """L_c: InfoNCE with the other images' targets (all processes) as negatives, official scale.

    online (B, d): u = predictor(projector(y_s)); target (B, d): v = projector_t(z_t), no grad.
      logits_ij = <u_i/|u_i|, v_j/|v_j|> / tau over the global batch j   (B, B*world)
      L_c = 2 * tau * mean_i CE(logits_i, own index)                      mean over local rows
    """
    u = F.normalize(online, dim=-1)
    v = F.normalize(C.all_gather(target.detach(), grad=False), dim=-1)       # (B*world, d)
    labels = torch.arange(u.shape[0], device=u.device) + u.shape[0] * C.rank()   # own image
    return 2 * tau * F.cross_entropy(u @ v.T / tau, labels)


# ----------------------------------------------------------------------------------------------
# Data: pixel-shifted view pair from one master crop
# ----------------------------------------------------------------------------------------------
def view_specs(a):
    """The views' geometry: one master RandomResizedCrop (bicubic, scale 0.2-1) + flip, with the
    pixel-shift window img_size (gpu_data.cut's (size, scale, count, resampling, window)): what
    PixelShiftViews makes in the workers and --resident cuts on the device."""
    return [(a.master_size, (0.2, 1.0), 1, "bicubic", a.img_size)]


class PixelShiftViews:
    """One RandomResizedCrop(master, 0.2-1, bicubic) + flip shared by both views.
    Source = master[0:S, 0:S], no colour augmentation; target = master[dh:dh+S, dw:dw+S] with
    dh, dw ~ U{0..master-S-1} and colour augmentation. Returns (source, target, (dh, dw))."""

    def __init__(self, a, color=True):
        from torchvision import transforms as T
        [(master, scale, _, _, self.S)] = view_specs(a)
        self.shift = master - self.S
        self.master = T.Compose([T.RandomResizedCrop(master, scale=scale,
                                                     interpolation=T.InterpolationMode.BICUBIC),
                                 T.RandomHorizontalFlip()])
        self.color = C.color_augment() if color else (lambda im: im)

    def __call__(self, img):
        m = self.master(img)
        S = self.S
        no_shift = torch.zeros(2, dtype=torch.long)
        dh, dw = (torch.randint(0, self.shift, (2,)) if self.shift > 0 else no_shift).tolist()
        source = C.to_uint8(TF.crop(m, 0, 0, S, S))                  # PIL, or a tensor (--in-chans)
        target = C.to_uint8(self.color(TF.crop(m, dh, dw, S, S)))
        return source, target, torch.tensor([dh, dw])


# ----------------------------------------------------------------------------------------------
# The training step: views -> networks -> losses, forward and backward
# ----------------------------------------------------------------------------------------------
def train_step(online, target, x_s, x_t, ids_keep, ids_restore, mask, a, micro=None,
               autocast=contextlib.nullcontext(), scale=None, ddp=None):
    """One CMAE step on this process's B images; gradients are left in the online parameters.

    x_s (B, 3, H, W): source view -> online encoder (visible patches ids_keep), both decoders; L_r
      reads the decoder's predictions at the MASKED patches (mask (B, N), 1 = masked) against x_s's
      own norm-pix patches;
    x_t (B, 3, H, W): pixel-shifted, colour-augmented view -> EMA target only, unmasked, no grad.
    micro: images per forward/backward; InfoNCE stays over the whole (all-gathered) batch.
    """
    B = x_s.shape[0]
    micro = micro or B
    scale = scale or (lambda t: t)
    with torch.no_grad(), autocast:                                     # x_t -> momentum target only
        v = torch.cat([target(x_t[i:i + micro]) for i in range(0, B, micro)]).float()   # (B, d)
    px = norm_pix(patchify(x_s, a.patch_size))                          # (B, N, p*p*3) targets

    if micro >= B:                                                      # the paper's step, one pass
        with autocast:
            pred, u = online(x_s, ids_keep, ids_restore)                # (B, N, p*p*3), (B, d)
        l_r = reconstruction_loss(pred.float(), px, mask)               # Eq. (1): masked patches of x_s
        l_c = cmae_contrastive_loss(u.float(), v, a.tau)                # Eq. (3): global-batch negatives
        loss = l_r + a.lambda_c * l_c
        scale(loss).backward()
        return loss.detach(), {"loss": loss.detach(), "l_r": l_r.detach(), "l_c": l_c.detach()}
    # Micro-batches: InfoNCE couples the whole batch, so the gradient cache computes the same loss and
    # gradient (tests/test_step.py); L_r enters as each micro-batch's share of the mean.
    def forward(sl, local):
        with autocast:
            pred, u = online(x_s[sl], ids_keep[sl], ids_restore[sl], pixels=local)
        if not local:
            return None, u.float(), {}
        l_r = reconstruction_loss(pred.float(), px[sl], mask[sl]) * (len(px[sl]) / B)   # share of the mean
        return l_r, u.float(), {"l_r": l_r.detach()}

    def coupled(u):
        l_c = cmae_contrastive_loss(u, v, a.tau)
        return a.lambda_c * l_c, {"l_c": l_c.detach()}

    loss, parts = C.gradient_cache(forward, coupled, B, micro, scale, ddp)
    return loss, {"loss": loss, **parts}


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def loader_and_views(args, run, dataset, per):
    """The training loader and views(batch): its batch as (x_s, x_t), each (B, 3, H, W) on the
    device, normalised, the target view x_t after its colour ops: batched on the device with
    --gpu-aug (compiled on CUDA), else in the PIL workers. The paper's views come from
    PixelShiftViews in the workers; --resident cuts the same view_specs on the device from the
    images decoded there once (gpu_data.py), no workers."""
    if not args.resident:                                            # the paper's: the PIL workers
        viewed = C.Views(dataset, PixelShiftViews(args, color=not args.gpu_aug), args.seed)
        loader = C.make_loader(viewed, per, args.workers, args.seed)
    else:
        gpu_data = C.optional("gpu_data", "--resident needs gpu_data.py next to this file")
        loader = gpu_data.loader(dataset, args, run, per, view_specs(args))
    color = None
    if args.gpu_aug:
        color = C.optional("gpu_aug").color_augmenter(args.compile or run.device.type == "cuda")

    def views(batch):
        x_s, x_t, _ = (v.to(run.device, non_blocking=True) for v in batch)
        x_t = color(x_t, normalize=True) if color else C.normalize(x_t)
        return C.normalize(x_s), x_t
    return loader, views


@torch.no_grad()
def picture(run, model, x_s, ids_keep, ids_restore, mask, a, epoch, step):
    """The epoch's picture (recon_ep<epoch>_step<step>.png, and TensorBoard): 8 source views, what
    the encoder sees of them, the pixel decoder's reconstruction of the masked patches."""
    n = min(8, x_s.shape[0])
    with run.autocast:
        pred = model.eval()(x_s[:n], ids_keep[:n], ids_restore[:n])[0].float()
    model.train()
    px, m = patchify(x_s[:n], a.patch_size), mask[:n, :, None]
    recon = torch.where(m.bool(), unnorm_pix(pred, px), px)          # masked: predicted, others: given
    rows = [x_s[:n], unpatchify(px * (1 - m), a.patch_size), unpatchify(recon, a.patch_size)]
    path = f"{run.out}/recon_ep{epoch:04d}_step{step:06d}.png"
    C.save_image_grid(path, rows, ["source view", "masked input", "reconstruction"], step, run.tb)


def train(args):
    run = H.setup(args, "cmae")
    dev = run.device
    grid = args.img_size // args.patch_size

    def masked():
        return random_masking(1, grid, args.mask_ratio, args.mask_unit)[2].sum()
    H.check_mask_ratio(args.mask_ratio, masked, grid * grid)
    per, micro = H.batch_plan(args, run, 4096, f"InfoNCE has {args.batch_size - 1} negatives per "
                              "image instead of 4095", batchnorm="the projector's and predictor's")
    dataset = C.image_dataset(args.data, "train", skip_unreadable=True, holdout=args.holdout)
    loader, views = loader_and_views(args, run, dataset, per)
    ipe = min(len(loader), args.steps_per_epoch or len(loader))
    total = args.epochs * ipe
    m = ema_start(args.ema, total, args.ema_horizon)                 # short runs: horizon <= a share
    peak_lr = args.lr or args.blr * args.batch_size / 256

    model = CMAE(args).to(dev)                                       # seeded in setup: all ranks
    if args.init and not run.resuming:                               # --init: start from these weights
        weights = C.optional("weights", "--init needs weights.py next to this file")
        weights.init_weights(args.init, model, model.encoder, "cmae")
    target = Target(model).to(dev)                                   # F_t: an EMA copy, no drop path
    if run.world > 1 and dev.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        target = nn.SyncBatchNorm.convert_sync_batchnorm(target)
    C.set_grad_checkpointing(model, args.grad_ckpt)
    opt = C.make_optimizer(model, peak_lr, args.weight_decay, args.betas, dev, no_decay_rule(model))
    start = H.resume_run(run, "cmae", args, model, opt, target, data={"train": dataset})
    online, ddp = H.distribute(torch.compile(model) if args.compile else model, run)
    target_fwd = torch.compile(target) if args.compile else target

    def save(step, **kw):                                            # snapshot=True: the encoder alone
        C.save_run(run, "cmae", args, step // ipe, step, model.encoder, model, opt, target, **kw)
    log = C.Logger(run, args, total, start, ipe)
    if log.done:                                                     # a finished or stopped run, rerun
        return
    why = "" if args.lr else f" (= blr {args.blr:g} x global batch {args.batch_size} / 256)"
    C.print0(f"{len(dataset)} images, {ipe} steps/epoch, {total} steps, lr {peak_lr:.3g}{why}; "
             f"EMA momentum {m:g}")
    knn = None
    if H.knn_wanted(args):                                           # --knn, --eval-every: eval_linear's k-NN
        eval_linear = C.optional("eval_linear", "--knn / --eval-every need eval_linear.py and "
                                 "weights.py next to this file")
        knn = eval_linear.KNNMonitor(args, run, log, model.encoder, "cmae", "online encoder")
        if start == 0:
            knn(0)                                                   # the initial encoder

    batches = C.Batches(loader, ipe, args.max_unreadable)          # from the checkpoint's step on

    for epoch in range(start // ipe, args.stop_epoch or args.epochs):
        if epoch * ipe >= start:                                     # a fresh epoch: masks and drop path from
            C.seed_epoch(args.seed, epoch, run.rank)                 # (seed, epoch, rank); resumed: the checkpoint's
        model.train()
        target.train()                                               # BatchNorm: batch statistics
        for it, (batch, _) in batches.epoch(epoch, start):
            step = epoch * ipe + it
            lr = C.cosine_schedule(step, total, peak_lr, args.min_lr, args.warmup_epochs * ipe)
            C.set_hparams(opt, lr)
            x_s, x_t = views(batch)                                  # source, shifted target view
            ids_keep, ids_restore, mask = random_masking(x_s.shape[0], grid, args.mask_ratio,
                                                         args.mask_unit, dev)
            opt.zero_grad(set_to_none=True)
            loss, parts = train_step(online, target_fwd, x_s, x_t, ids_keep, ids_restore, mask,
                                     args, micro, run.autocast, run.scaler.scale, ddp)
            parts["grad_norm"] = C.optimizer_step(run, opt, model.parameters())   # official: no clip
            ema_update(target, target.online_params(model), m)
            stop = C.end_step(run, log, save, batches, step + 1, epoch, parts, lr=lr)
            if knn and knn.due(step + 1):                            # --eval-every (a --stop-step's too)
                knn(step + 1, save)                                  # its checkpoint first
            if stop:
                return                                               # preempted, --stop-step: saved
        save((epoch + 1) * ipe)
        picture(run, model, x_s, ids_keep, ids_restore, mask, args, epoch, (epoch + 1) * ipe)

    if knn:                                                          # the final checkpoint is written: a stop
        run.control.trained = run.ckpt                               # signal in this k-NN ends the program at once
        knn(log.end)


if __name__ == "__main__":
    H.main(train, Args)
