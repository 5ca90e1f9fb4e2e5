"""CAN: A Simple, Efficient and Scalable Contrastive Masked Autoencoder for Learning Visual
Representations.
Mishra, Robinson, Chang, Jacobs, Sarna, Maschinot, Krishnan. 2022. arXiv:2210.16870.

Idea. Three objectives on one MAE-style network. Two augmented views of each image are masked
independently (50%) and made noisy (x + sigma e, sigma ~ U[0, 0.05] per view); the encoder sees
only the visible patches. (C) its mean-pooled, projected output is contrasted across the 2n views
(InfoNCE); (A) the decoder reconstructs the clean image on masked patches; (N) on visible patches
it predicts the added noise sigma e, told the noise level through an embedding added to every
decoder token. Total: 0.03 L_InfoNCE + 0.67 L_rec + 0.3 L_denoise.

Launch. `--batch-size` is the GLOBAL batch of images, 2 views each (paper: 4096); each process
takes batch / processes images in micro-batches of --micro-batch (default 256; docs/DESIGN.md
measures the memory) and the step is exact: InfoNCE stays over the global 2 x batch views.
  python can.py --data synthetic                        # CPU quickstart, ~5 min, ends with k-NN
  python can.py --data /cifar10 --preset small          # CIFAR-10 folders, 2 CPU cores
  python can.py --data /imagenet                        # ViT-B/16 paper recipe on 1 GPU: 16 x 256
  torchrun --nproc_per_node=8 can.py --data /imagenet   # the same objective on 8 GPUs: 8 x 2 x 256

Files. This file, common.py (the training kit: schedules, the optimiser step, micro-batches, data,
checkpoints, the log) and harness.py (the command line, launching, resume, preemption) train the
paper's recipe on an image folder. Beside them, for a flag: recipes.py (--preset, and with
synthetic.py --data synthetic), weights.py (--init), eval_linear.py and weights.py (--knn,
--eval-every), gpu_aug.py (the colour ops on the GPU, default on CUDA; without it they run in the
workers).

Paper -> code (follows the paper).
  Two views, independent 50% masks ............ TwoViews, random_masking per view
  x <- x + sigma e, sigma ~ U[0, sigma_max] ...... train(): sigma, noise; train_step: x + noise
  Noise-level embedding p_v (sin -> 2-layer MLP) . NoiseEmbed, added to every decoder token
  (C) mean-pool + projector + InfoNCE over 2n ... CAN.forward -> u, info_nce (negatives gathered
                                                  WITH their gradient)
  (A) L_rec on masked patches, clean target ..... reconstruction_loss
  (N) L_denoise on visible patches, target sigma e denoising_loss
  Total 0.03 / 0.67 / 0.3 ....................... can_loss

Reductions. The paper writes L_rec = 1/2n sum_v sum_i ||M o (x - x^)||^2 (and likewise for
L_denoise). Summed over every pixel value, the reconstruction term would be ~10^5 x the InfoNCE
term and the 0.03 weight meaningless; we read ||.||^2 as the mean squared error per predicted value
(MAE convention): sum over masked (resp. visible) values / their count.

Known deviations of the official code (shlokk/mae-contrastive), not copied here: mask ratio 0.75
(paper 0.5); sigma_max effectively 0.1 (flag parsed but unused); noise added in place, so the
reconstruction target is the noisy image; noise embedding added only to visible tokens;
contrastive loss per GPU without all-gather; weights 0.97 * (0.3 / 0.7) + 0.03.
Where this file follows the paper rather than the official code, and other differences:
  - Contrastive embedding: mean of the visible patch tokens (paper); official mean-pools the CLS
    token together with the visible tokens.
  - Projector Linear(D,4096)-BN-ReLU-Linear(4096,256) (SimCLR-style, our choice); official is
    Linear(D,D)-ReLU-Linear(D,128) without BN.
  - BatchNorm scope (our projector; official has none): one micro-batch, across processes with
    SyncBN on multi-GPU CUDA.
  - sigma is in ImageNet-normalised units, as official: sigma_max 0.05 is about 0.05 x 0.226 =
    0.011 of the [0, 1] pixel range, i.e. about 3/255.
  - blr 1.5e-4 (MAE's); the official README recipe uses blr 2.5e-4 (`--blr 2.5e-4`).
  - The noise embedding is also added to the decoder's CLS slot; sigma is fed to the sinusoid as
    1000 * sigma (diffusion-timestep scale); reconstruction targets are raw normalised pixels
    (`--norm-pix` for MAE's per-patch normalisation).
  - On CUDA the colour ops of both views run batched on the GPU (same distribution);
    `--no-gpu-aug` keeps them in the workers.
  - Initialisation and weight decay as the official (MAE) code: xavier-uniform Linear and patch
    embedding, normal(0.02) cls / mask tokens; no decay on biases and 1-d tensors only (timm
    add_weight_decay), so cls and mask tokens are decayed.
"""
import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import common as C
import harness as H


@dataclass
class Args(H.RunArgs):
    """CAN pre-training (defaults: paper ViT-B/16 with MAE-style optimisation)."""
    data: str = H.arg(None, "image folder (uses DIR/train if present) or 'synthetic'", group="data")
    output_dir: str = H.arg(None, "where checkpoint.pth, log.jsonl, args.json and pictures go "
                            "(default runs/can)", group="data")
    model: str = H.arg("base", "ViT size: nano|micro|tiny|small|base|large", group="model")
    init: str = H.arg(None, "start from these weights at step 0: a checkpoint of this project, the "
                      "official MSN file, an MAE-style 'model' dict or a timm / DeiT state dict "
                      "(read by weights.py)", group="model")
    patch_size: int = H.arg(16, "ViT patch size (px)", group="model", positive=True)
    img_size: int = H.arg(224, "training image size (px)", group="data", positive=True)
    epochs: int = H.arg(800, "training epochs (the schedules span them)",
                        group="optimisation", positive=True)
    batch_size: int = H.arg(4096, "GLOBAL batch of images (2 views each), all processes (paper "
                            "4096)", group="optimisation", positive=True)
    micro_batch: int = H.arg(256, "images per forward/backward per process (0 = the whole "
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
    mask_ratio: float = H.arg(0.5, "share of patches masked", group="views and masking")
    sigma_max: float = H.arg(0.05, "noise level sigma ~ U[0, sigma_max]", positive=True)
    decoder_dim: int = H.arg(512, "decoder width", group="model", positive=True)
    decoder_depth: int = H.arg(8, "decoder blocks", group="model", min=1,
                               why=" (a masked patch sees the visible ones only through them)")
    decoder_heads: int = H.arg(16, "decoder attention heads", group="model", positive=True)
    proj_hidden: int = H.arg(4096, "projector hidden width", group="model", positive=True)
    proj_dim: int = H.arg(256, "projector output width", group="model", positive=True)
    tau: float = H.arg(0.1, "softmax temperature", positive=True)
    weights: tuple = H.arg((0.03, 0.67, 0.3), "InfoNCE, reconstruction, denoising")
    norm_pix: bool = H.arg(False, "per-patch normalised reconstruction targets (MAE)")
    crop_scale: tuple = H.arg((0.2, 1.0), "RandomResizedCrop area range", group="data")
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
    PRESETS = {"small": dict(lr_factor=4, model="micro", patch_size=4, img_size=32, epochs=6,
                             batch_size=256, decoder_dim=128, decoder_depth=2, decoder_heads=4,
                             proj_hidden=512, workers=2, log_every=20),
               "gpu": dict(lr_factor=4, model="tiny", patch_size=4, img_size=32, epochs=16,
                           batch_size=512, decoder_dim=128, decoder_depth=2, decoder_heads=4,
                           proj_hidden=512, micro_batch=0, resident=32, gpu_aug=True)}
    SYNTHETIC = dict(model="micro", patch_size=4, img_size=32, epochs=8, batch_size=64,
                     decoder_dim=64, decoder_depth=2, decoder_heads=4, proj_hidden=256, proj_dim=64,
                     crop_scale=(0.3, 1.0), workers=2, log_every=20, steps_per_epoch=35)

    def check(self):
        """validate()'s rule for CAN's own flag."""
        if not (min(self.weights) >= 0 < sum(self.weights)):
            raise C.UserError(f"--weights (loss weights) must be >= 0 and not all 0, got "
                              f"{self.weights}")


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
def random_masking(batch, grid, ratio, device=None):
    """MAE's per-image random masking of the grid x grid patches: exactly int(N (1 - ratio)) kept,
    chosen by the ranks of uniform noise. Returns ids_keep (B, n_keep) kept patch indices
    (ascending), ids_restore (B, N) (gathering cat([kept, masked]) with it restores raster order),
    mask (B, N) float, 1 = masked."""
    n_keep = int(grid * grid * (1 - ratio))
    noise = torch.rand(batch, grid * grid, device=device)           # argsort of noise (MAE)
    mask = noise.argsort(1).argsort(1) >= n_keep                     # a patch's rank: masked past n_keep
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
def sinusoid(s, dim, max_period=10000.0):
    """Sinusoidal embedding of scalars s (B,) -> (B, dim): [sin(s w_k), cos(s w_k)],
    w_k = max_period^(-k / half)."""
    half = dim // 2
    k = torch.arange(half, device=s.device, dtype=torch.float32)
    w = torch.exp(-math.log(max_period) * k / half)
    a = s.float()[:, None] * w[None]
    return torch.cat([a.sin(), a.cos()], dim=-1)


class NoiseEmbed(nn.Module):
    """p_v = MLP2(sinusoid(1000 sigma_v)): Linear-ReLU-Linear, (B,) -> (B, d)."""

    def __init__(self, d):
        super().__init__()
        self.d = d
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.ReLU(inplace=True), nn.Linear(d, d))

    def forward(self, sigma):
        return self.mlp(sinusoid(1000 * sigma, self.d))


class CAN(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.encoder = make_vit(a)
        D, p, dd = self.encoder.dim, a.patch_size, a.decoder_dim
        self.projector = nn.Sequential(nn.Linear(D, a.proj_hidden), nn.BatchNorm1d(a.proj_hidden),
                                       nn.ReLU(inplace=True), nn.Linear(a.proj_hidden, a.proj_dim))
        self.decoder_embed = nn.Linear(D, dd)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dd))
        self.register_buffer("decoder_pos_embed", sincos_pos_embed(dd, self.encoder.grid))
        self.noise_embed = NoiseEmbed(dd)
        self.decoder = nn.ModuleList(Block(dd, a.decoder_heads) for _ in range(a.decoder_depth))
        self.grad_ckpt = False
        self.decoder_norm = nn.LayerNorm(dd, eps=1e-6)
        self.decoder_pred = nn.Linear(dd, p * p * a.in_chans)
        xavier_init(self)                                                     # MAE: the whole model
        nn.init.normal_(self.mask_token, std=0.02)

    def forward(self, x_noisy, sigma, ids_keep, ids_restore, decode=True):
        """x_noisy (B, 3, H, W), sigma (B,). Returns x^ (B, N, p*p*3) (None if not decode: the
        gradient cache's embedding pass, which keeps u alone) and u (B, proj_dim)."""
        latent = self.encoder(x_noisy, ids_keep)                              # (B, 1+n_vis, D)
        u = self.projector(latent[:, 1:].mean(1))                             # mean of visible tokens
        if not decode:
            return None, u
        t = restore_tokens(self.decoder_embed(latent), self.mask_token, ids_restore)
        t = t + self.decoder_pos_embed + self.noise_embed(sigma)[:, None].to(t.dtype)   # every token
        t = C.run_blocks(self.decoder, t, self.grad_ckpt)
        return self.decoder_pred(self.decoder_norm(t))[:, 1:], u


# ----------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------
def info_nce(u1, u2, tau=0.1):
    """L_InfoNCE over the 2n embeddings (n = global batch), negatives gathered WITH gradient.

    u1, u2 (n_local, r): the two views' projections (L2-normalised here). For each of the 2n rows,
    positive = the other view of the same image, negatives = the other 2n - 2 embeddings:
      L = 1/2n sum_{v, i} -log exp(u_i^v . u_i^v' / tau) / sum_{k != (v,i)} exp(u_i^v . u_k / tau)
    Mean over the local 2 n_local rows (DDP's mean over processes gives the global mean).
    """
    n = u1.shape[0]
    z1, z2 = F.normalize(u1, dim=-1), F.normalize(u2, dim=-1)
    keys = torch.cat([C.all_gather(z1), C.all_gather(z2)])                   # (2 n W, r)
    nW = keys.shape[0] // 2
    g = torch.arange(n, device=u1.device) + n * C.rank()                     # global image index
    logits = torch.cat([z1, z2]) @ keys.T / tau                              # (2n, 2nW)
    self_idx = torch.cat([g, g + nW])
    drop = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, self_idx[:, None], True)
    logits = logits.masked_fill(drop, float("-inf"))                         # drop k = (v, i) (no host copy)
    labels = torch.cat([g + nW, g])                                          # the other view
    return F.cross_entropy(logits, labels)


def reconstruction_loss(pred, target, mask):
    """L_rec: squared error on masked patches (mask 1), target = clean image patches.
    pred/target (B, N, P), mask (B, N): sum over masked values / their count."""
    return (((pred - target) ** 2).mean(-1) * mask).sum() / mask.sum()


def denoising_loss(pred, noise, mask):
    """L_denoise: squared error to the added noise sigma e on VISIBLE patches (1 - mask).
    pred/noise (B, N, P), mask (B, N): sum over visible values / their count."""
    vis = 1 - mask
    return (((pred - noise) ** 2).mean(-1) * vis).sum() / vis.sum()


def can_loss(u1, u2, pred, target, noise, mask, tau=0.1, weights=(0.03, 0.67, 0.3)):
    """0.03 L_InfoNCE + 0.67 L_rec + 0.3 L_denoise; pred/target/noise/mask stack both views."""
    l_c = info_nce(u1, u2, tau)
    l_r = reconstruction_loss(pred, target, mask)
    l_n = denoising_loss(pred, noise, mask)
    loss = weights[0] * l_c + weights[1] * l_r + weights[2] * l_n
    parts = {"infonce": l_c.detach(), "rec": l_r.detach(), "denoise": l_n.detach()}
    return loss, {"loss": loss.detach(), **parts}


# ----------------------------------------------------------------------------------------------
# Data: two SimCLR-style views
# ----------------------------------------------------------------------------------------------
def view_specs(a):
    """The views' geometry: two RandomResizedCrop (bicubic) + flip views (gpu_data.cut's (size,
    scale, count, resampling)): what TwoViews makes in the workers and --resident cuts on the
    device."""
    return [(a.img_size, a.crop_scale, 2, "bicubic")]


class TwoViews:
    """Two RandomResizedCrop(bicubic) + flip + colour views as uint8; with gpu_aug the colour ops
    run batched on the device instead (train loop)."""

    def __init__(self, a):
        from torchvision import transforms as T
        [(size, scale, _, _)] = view_specs(a)
        color = [] if a.gpu_aug else [C.color_augment()]
        self.view = T.Compose([T.RandomResizedCrop(size, scale=scale,
                                                   interpolation=T.InterpolationMode.BICUBIC),
                               T.RandomHorizontalFlip(), *color, C.to_uint8])

    def __call__(self, img):
        return self.view(img), self.view(img)


# ----------------------------------------------------------------------------------------------
# The training step: views -> noise, masks -> network -> losses, forward and backward
# ----------------------------------------------------------------------------------------------
def train_step(net, x, sigma, noise, ids_keep, ids_restore, mask, a, micro=None,
               autocast=contextlib.nullcontext(), scale=None, ddp=None):
    """One CAN step on this process's B images (2 views each); gradients are left in the network.

    x (2, B, 3, H, W): the two CLEAN views; sigma (2, B) and noise (2, B, 3, H, W) = sigma e; masks
    (2, B, ...) as random_masking. The encoder sees x + noise at the visible patches; L_rec reads
    the predictions at the MASKED patches against the CLEAN x, L_denoise at the VISIBLE patches
    against the noise; InfoNCE pairs the two views of an image. Same total as can_loss.
    micro: images per forward/backward; InfoNCE stays over the whole (all-gathered) batch.
    """
    B = x.shape[1]
    def rows(t, sl):                                                    # (2, b, ...) -> (2b, ...) view-major
        return t[:, sl].flatten(0, 1)
    target = patchify(x.flatten(0, 1), a.patch_size).view(2, B, -1, a.in_chans * a.patch_size ** 2)
    target = norm_pix(target) if a.norm_pix else target
    noise_px = patchify(noise.flatten(0, 1), a.patch_size).view_as(target)
    micro = micro or B
    scale = scale or (lambda t: t)

    if micro >= B:                                                      # the paper's step, one pass
        with autocast:                                                  # noisy views, visible patches only
            pred, u = net((x + noise).flatten(0, 1), sigma.flatten(0, 1), ids_keep.flatten(0, 1),
                          ids_restore.flatten(0, 1))                    # (2B, N, p*p*3), (2B, r)
        u1, u2 = u.float().view(2, B, -1)                               # the two views' projections
        loss, parts = can_loss(u1, u2, pred.float(), target.flatten(0, 1), noise_px.flatten(0, 1),
                               mask.flatten(0, 1), a.tau, a.weights)    # 0.03 L_c + 0.67 L_rec + 0.3 L_den
        scale(loss).backward()
        return loss.detach(), parts
    # Micro-batches: InfoNCE couples the whole batch (negatives with gradient), so the gradient cache
    # computes the same loss and gradient (tests/test_step.py); L_rec and L_denoise enter per micro-batch.
    def forward(sl, local):
        with autocast:
            pred, u = net(rows(x + noise, sl), rows(sigma, sl), rows(ids_keep, sl),
                          rows(ids_restore, sl), decode=local)            # no decoder for u alone
        u = u.float().view(2, -1, u.shape[-1]).transpose(0, 1)                # (b, 2, r)
        if not local:
            return None, u, {}
        share = len(u) / B
        l_r = reconstruction_loss(pred.float(), rows(target, sl), rows(mask, sl)) * share
        l_n = denoising_loss(pred.float(), rows(noise_px, sl), rows(mask, sl)) * share
        local = a.weights[1] * l_r + a.weights[2] * l_n
        return local, u, {"rec": l_r.detach(), "denoise": l_n.detach()}

    def coupled(u):                                                         # (B, 2, r)
        l_c = info_nce(u[:, 0], u[:, 1], a.tau)
        return a.weights[0] * l_c, {"infonce": l_c.detach()}

    loss, parts = C.gradient_cache(forward, coupled, B, micro, scale, ddp)
    return loss, {"loss": loss, **parts}


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def loader_and_views(args, run, dataset, per):
    """The training loader and views(batch): its two views of each image as x (2, B, 3, H, W) on the
    device, clean (no noise yet), normalised, after their colour ops: batched on the device with
    --gpu-aug (one call for both views, compiled on CUDA), else in the PIL workers. The paper's
    views come from TwoViews in the workers; --resident cuts the same view_specs on the device from
    the images decoded there once (gpu_data.py), no workers."""
    if not args.resident:                                            # the paper's: the PIL workers
        viewed = C.Views(dataset, TwoViews(args), args.seed)
        loader = C.make_loader(viewed, per, args.workers, args.seed)
    else:
        gpu_data = C.optional("gpu_data", "--resident needs gpu_data.py next to this file")
        loader = gpu_data.loader(dataset, args, run, per, view_specs(args))
    color = None
    if args.gpu_aug:
        color = C.optional("gpu_aug").color_augmenter(args.compile or run.device.type == "cuda")

    def views(batch):
        x = torch.cat([v.to(run.device, non_blocking=True) for v in batch])   # (2B, 3, H, W)
        x = color(x, normalize=True) if color else C.normalize(x)
        return x.unflatten(0, (2, -1))
    return loader, views


@torch.no_grad()
def picture(run, model, x, sigma, noise, ids_keep, ids_restore, mask, a, epoch, step):
    """The epoch's picture (recon_ep<epoch>_step<step>.png, and TensorBoard) of 8 first views: the
    clean view, what the encoder sees (noisy, masked), the reconstruction of the masked patches, the
    predicted noise at the visible ones (/ sigma_max)."""
    n = min(8, x.shape[1])
    noisy = x[0, :n] + noise[0, :n]                                 # the first views, noise added
    x = x[0, :n]
    m = mask[0, :n, :, None]
    with run.autocast:
        pred = model.eval()(noisy, sigma[0, :n], ids_keep[0, :n], ids_restore[0, :n])[0].float()
    model.train()
    p = a.patch_size
    px = patchify(x, p)
    recon = torch.where(m.bool(), unnorm_pix(pred, px) if a.norm_pix else pred, px)
    rows = [x, unpatchify(patchify(noisy, p) * (1 - m), p), unpatchify(recon, p),
            unpatchify(pred * (1 - m) / a.sigma_max, p)]
    labels = ["view", "masked + noise", "reconstruction", "predicted noise / sigma_max"]
    path = f"{run.out}/recon_ep{epoch:04d}_step{step:06d}.png"
    C.save_image_grid(path, rows, labels, step, run.tb)


def train(args):
    run = H.setup(args, "can")
    dev = run.device
    grid = args.img_size // args.patch_size

    def masked():
        return random_masking(1, grid, args.mask_ratio)[2].sum()
    H.check_mask_ratio(args.mask_ratio, masked, grid * grid)
    per, micro = H.batch_plan(args, run, 4096, f"InfoNCE has {2 * args.batch_size - 2} negatives "
                              "per view instead of 8190")
    dataset = C.image_dataset(args.data, "train", skip_unreadable=True, holdout=args.holdout)
    loader, views = loader_and_views(args, run, dataset, per)
    ipe = min(len(loader), args.steps_per_epoch or len(loader))
    total = args.epochs * ipe
    peak_lr = args.lr or args.blr * args.batch_size / 256

    model = CAN(args).to(dev)                                        # seeded in setup: all ranks
    if args.init and not run.resuming:                               # --init: start from these weights
        weights = C.optional("weights", "--init needs weights.py next to this file")
        weights.init_weights(args.init, model, model.encoder, "can")
    if run.world > 1 and dev.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    C.set_grad_checkpointing(model, args.grad_ckpt)
    opt = C.make_optimizer(model, peak_lr, args.weight_decay, args.betas, dev)
    start = H.resume_run(run, "can", args, model, opt, data={"train": dataset})   # global step
    net, ddp = H.distribute(torch.compile(model) if args.compile else model, run)

    def save(step, **kw):                                            # snapshot=True: the encoder alone
        C.save_run(run, "can", args, step // ipe, step, model.encoder, model, opt, **kw)
    log = C.Logger(run, args, total, start, ipe)
    if log.done:                                                     # a finished or stopped run, rerun
        return
    why = "" if args.lr else f" (= blr {args.blr:g} x global batch {args.batch_size} / 256)"
    C.print0(f"{len(dataset)} images, {ipe} steps/epoch, {total} steps, lr {peak_lr:.3g}{why}")
    knn = None
    if H.knn_wanted(args):                                           # --knn, --eval-every: eval_linear's k-NN
        eval_linear = C.optional("eval_linear", "--knn / --eval-every need eval_linear.py and "
                                 "weights.py next to this file")
        knn = eval_linear.KNNMonitor(args, run, log, model.encoder, "can", "encoder")
        if start == 0:
            knn(0)                                                   # the initial encoder

    batches = C.Batches(loader, ipe, args.max_unreadable)          # from the checkpoint's step on

    for epoch in range(start // ipe, args.stop_epoch or args.epochs):
        if epoch * ipe >= start:                                     # a fresh epoch: masks and drop path from
            C.seed_epoch(args.seed, epoch, run.rank)                 # (seed, epoch, rank); resumed: the checkpoint's
        model.train()
        for it, (batch, _) in batches.epoch(epoch, start):
            step = epoch * ipe + it
            lr = C.cosine_schedule(step, total, peak_lr, args.min_lr, args.warmup_epochs * ipe)
            C.set_hparams(opt, lr)
            x = views(batch)                                         # (2, B, 3, H, W), clean
            B = x.shape[1]
            sigma = torch.rand(2 * B, device=dev).view(2, B) * args.sigma_max   # ~ U[0, sigma_max]
            noise = sigma.view(2, B, 1, 1, 1) * torch.randn_like(x)             # sigma_v e_v
            masking = random_masking(2 * B, grid, args.mask_ratio, device=dev)
            ids_keep, ids_restore, mask = (t.view(2, B, -1) for t in masking)   # each view its own
            opt.zero_grad(set_to_none=True)
            loss, parts = train_step(net, x, sigma, noise, ids_keep, ids_restore, mask, args, micro,
                                     run.autocast, run.scaler.scale, ddp)
            parts["grad_norm"] = C.optimizer_step(run, opt, model.parameters())   # MAE: no clipping
            stop = C.end_step(run, log, save, batches, step + 1, epoch, parts, lr=lr)
            if knn and knn.due(step + 1):                            # --eval-every (a --stop-step's too)
                knn(step + 1, save)                                  # its checkpoint first
            if stop:
                return                                               # preempted, --stop-step: saved
        save((epoch + 1) * ipe)
        picture(run, model, x, sigma, noise, ids_keep, ids_restore, mask, args, epoch,
                (epoch + 1) * ipe)

    if knn:                                                          # the final checkpoint is written: a stop
        run.control.trained = run.ckpt                               # signal in this k-NN ends the program at once
        knn(log.end)


if __name__ == "__main__":
    H.main(train, Args)
