"""SiamMAE: Siamese Masked Autoencoders.
Gupta, Wu, Deng, Fei-Fei. NeurIPS 2023. arXiv:2305.14344. (No official code.)

Idea. Two frames of a video, f1 and a later f2, go through one shared ViT encoder: f1 whole (0%
masked), f2 with 95% of its patches dropped. A decoder predicts f2's missing patches; its f2
tokens can only learn where things went by cross-attending to f1's tokens, which teaches the
encoder correspondence (evaluated by label propagation, eval_video.py).

Launch. `--batch-size` is the GLOBAL number of videos per step (default 1024 videos x R = 2
pairs = 2048 pairs, the paper's batch 2048 read as frame pairs); each process takes batch /
processes videos in micro-batches of --micro-batch videos (default 512: about 50 GB on an 80 GB
H100, twice the 25 GB measured at 256; README). The loss is per pair: accumulation is exact.
  python siammae.py --data synthetic                          # CPU quickstart, ~5 min
  python siammae.py --data /DAVIS --preset davis              # DAVIS-2016's 30 train videos, 2 CPU cores
  python siammae.py --data /kinetics_frames                   # ViT-S/16 ablation recipe on 1 GPU: 2 x 512 videos
  torchrun --nproc_per_node=8 siammae.py --data /kinetics_frames   # the same objective on 8 GPUs: 8 x 128

--data DIR: a directory of videos, each a folder of frames (JPEG/PNG, in file-name order with frame
numbers compared as numbers: 2.jpg before 10.jpg), found at any depth (DAVIS
`JPEGImages/480p/<video>/`, Kinetics frame folders, ...).

Files. This file, common.py (the training kit its loop calls: schedules, the optimiser step, micro-batches,
data, checkpoints, the log) and harness.py (the command line and presets, launching, resume, preemption) are all
a run needs: copy the three.

Paper -> code.
  Frame pair, gap 4..48, same crop + flip .... FramePair
  Siamese encoder, 0% / 95% masking .......... SiamMAE.forward (ViT, random_masking)
  Cross-self decoder (Fig. 2) ................ CrossSelfBlock; `--decoder cross|joint` (ablation)
  Loss: norm-pix MSE on f2's masked patches .. siammae_loss
  (not in the paper) does the decoder read f1? f1_probe, logged every --probe-every steps

Choices (no official code; see ../shared/methods/siammae.md): pre-norm decoder blocks
x += CA(LN(x), LN(f1)); x += SA(LN(x)); x += MLP(LN(x)), decoder position embeddings on both
streams, CLS tokens kept in both streams; not the unofficial repos' post-norm / weight-tied blocks.
Joint decoder: self-attention over [f1 tokens, f2 tokens] with a learned stream embedding added to
f1's tokens so the two streams are distinguishable.

Epochs, batch and lr (MAE-ST convention, which SiamMAE's repeated sampling comes from):
`--repeated-sampling R` draws R pairs per video visit, so a step holds R x batch-size pairs;
`--batch-size` counts videos, and lr = blr x (videos per step, all processes) / 256. One pass over
the videos shows each video R times, so `--epochs` and `--warmup-epochs` count EFFECTIVE epochs
(passes x R): the default 400 is 200 passes of R = 2 (`--stop-epoch` counts passes).
Decoder 4 blocks x 256 wide x 8 heads: CropMAE's ViT-S setting (the paper states only that the
other settings follow MAE, whose decoder is 8 x 512; `--decoder-depth 8 --decoder-dim 512`).
The frame gap 4..48 counts stored frames: for frame dumps sub-sampled from the video's frame rate,
scale `--gap` accordingly (the paper samples from 30 fps Kinetics).
No BatchNorm anywhere, so micro-batches and processes change nothing but float rounding.
Initialisation and weight decay follow MAE's code (xavier-uniform Linear and patch embedding;
no decay on biases and 1-d tensors only, so cls / mask tokens are decayed).
"""
import contextlib
import os
import types
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

import common as C
import harness as H


@dataclass
class Args(H.RunArgs):
    """SiamMAE pre-training on frame pairs (defaults: ViT-S/16, paper ablation recipe)."""
    data: str = field(default=None, metadata={"help": "directory of frame folders, or 'synthetic'"})
    output_dir: str = field(default=None, metadata={"help": "default runs/siammae"})
    model: str = field(default="small", metadata={"help": "ViT size: nano|micro|tiny|small|base|large"})
    patch_size: int = 16
    img_size: int = 224
    epochs: int = field(default=400, metadata={"help": "effective epochs = passes over the videos x repeated-sampling"})
    batch_size: int = field(default=1024, metadata={"help": "GLOBAL videos per step, all processes (x repeated-sampling "
                            "pairs: 1024 x 2 = the paper's 2048, read as pairs)"})
    micro_batch: int = field(default=512, metadata={"help": "videos per forward/backward per process (about 50 GB "
                             "on an 80 GB H100, bf16; 0 = the whole per-process batch); the step stays exact"})
    repeated_sampling: int = 2
    lr: float = field(default=None, metadata={"help": "absolute lr (default blr * global videos per step / 256)"})
    blr: float = 1.5e-4
    min_lr: float = 0.0
    warmup_epochs: float = field(default=40, metadata={"help": "effective epochs, like --epochs"})
    weight_decay: float = 0.05
    betas: tuple = (0.9, 0.95)
    mask_ratio: float = 0.95
    gap: tuple = field(default=(4, 48), metadata={"help": "frame gap range (clipped to the video length)"})
    crop_scale: tuple = (0.5, 1.0)
    decoder: str = field(default="cross-self", metadata={"help": "cross-self | cross | joint"})
    decoder_dim: int = 256
    decoder_depth: int = 4
    decoder_heads: int = 8
    drop_path: float = 0.0
    init: str = field(default="xavier", metadata={"help": "xavier (MAE's, default) | trunc (trunc-normal 0.02, DeiT)"})
    probe_every: int = field(default=200, metadata={"help": "steps between f1 probes, and one at the end (0 = off): the "
                             "loss on fixed pairs with the true f1, another video's, a grey one and f2 itself; f1_gap = "
                             "other - true is how much the decoder reads f1 (scripts/siammae_probe.py: any checkpoint)"})

    # Small recipes: the official recipe above scaled by harness.scale_recipe's short-run rules (lr = blr x
    # videos per step / 256 x the preset's lr_factor, chosen by scripts/lr_sweep.py on 6 held-out train
    # videos; warm-up the same fraction of the run); the other values are choices for the budget (model,
    # decoder, batch, length: ~20 min alone on 2 CPU cores) or the data (size, gaps).
    # `--preset davis` (a DAVIS-2016 root: its 30 train videos, 2 CPU cores): 64 px crops, patch 4 (a
    # 16 x 16 grid; official 14 x 14), 8 videos x 2 pairs a step, 3,000 steps. The lr: at the per-video lr
    # (factor 1) the decoder never starts reading f1 (f1 gap ~0.03; it predicts a flat patch; J&F +0.2);
    # it needs ~200x, lr 1e-3 at 8 videos. Sweep (750-step runs, 24 train videos, J&F of the other 6;
    # initial encoder 47.4): x53 50.5, x213 52.6, x853 51.2 (docs/RESULTS.md). Gaps from the videos' motion:
    # a crop of scale 0.5-1 (about 555 px of a 480p frame) at 64 px makes one patch about 35 px of the
    # frame; the objects' median displacement (train masks' centroids) is 23 px at gap 4, 41 at 8, 60 at
    # 16 and 73 at 48, so gaps 8..48 (official 4..48; DAVIS is 24 fps, Kinetics 25-30) keep the median
    # motion above one patch, where copying f1 in place (the synthetic clips' shortcut) does not pay.
    # --data synthetic: 64 px, the clips' native size, so that eval_video (which runs on native
    # frames) sees the patch scale the encoder was trained at (a 32 px run fell below random init
    # there); nano keeps it about 5 min on 2 CPU cores (16 effective epochs = 8 passes of 62 steps).
    PRESETS = {"davis": dict(lr_factor=213.33, model="nano", patch_size=4, img_size=64, epochs=2000, batch_size=8, decoder_dim=64,
                             decoder_depth=2, decoder_heads=4, gap=(8, 48), workers=2, log_every=20)}
    SYNTHETIC = dict(model="nano", patch_size=4, img_size=64, epochs=16, batch_size=32, decoder_dim=64,
                     decoder_depth=2, decoder_heads=4, gap=(2, 8), workers=2, log_every=20)


# ----------------------------------------------------------------------------------------------
# Video data: folders of frames (the synthetic clips are in synthetic.py)
# ----------------------------------------------------------------------------------------------
class FrameFolder:
    """One video: its frame files in order (C.frame_order). len() = number of frames, load(t) -> PIL RGB. In training (owner:
    the VideoFolders) an unreadable frame is replaced by the nearest readable one (t+1, t-1, t+2, ...:
    deterministic, so resume stays exact) and the video is counted as unreadable once per run."""

    def __init__(self, paths, owner=None, index=0):
        self.paths, self.owner, self.index = paths, owner, index

    def __len__(self):
        return len(self.paths)

    def load(self, t):
        n = len(self.paths)
        for u in [t] + [u for d in range(1, n) for u in (t + d, t - d) if 0 <= u < n]:
            try:
                with Image.open(self.paths[u]) as im:
                    return im.convert("RGB")
            except Exception as e:
                if self.owner is None:
                    raise C.UserError(f"cannot read frame {self.paths[u]}: {e}; remove or replace the file") from None
                self.owner.unreadable(self.index, self.paths[u], e, "frame", "using the nearest readable frame")
        raise C.UserError(f"no frame of {os.path.dirname(self.paths[0])} can be read: is --data right?")


class VideoFolders(torch.utils.data.Dataset, C.CountsUnreadable):
    """Every directory under root holding >= 2 image files is a video (any nesting depth).
    Videos with < 2 frames or an unreadable first frame are skipped with a counted warning. A frame
    found unreadable later is replaced (FrameFolder.load), reported once, and its video counted in
    `bad` (shared with forked DataLoader workers; train() stops above --max-unreadable)."""
    unit = "videos"                                      # what --max-unreadable's share counts

    def __init__(self, root, min_frames=2, holdout=0):
        if not os.path.isdir(root):
            raise C.UserError(f"--data {root}: no such directory (give a folder of frame folders or 'synthetic')")
        self.videos, short, bad = [], 0, 0
        listed = davis_train_folders(root)
        for dirpath, _, files in (listed or sorted(os.walk(root, followlinks=True))):
            frames = sorted((f for f in files if f.lower().endswith(C.IMG_EXTS)), key=C.frame_order)
            if not frames:
                continue
            if len(frames) < min_frames:
                short += 1
                continue
            try:
                with Image.open(os.path.join(dirpath, frames[0])) as im:
                    im.verify()
            except Exception:
                bad += 1
                continue
            self.videos.append(FrameFolder([os.path.join(dirpath, f) for f in frames], self, len(self.videos)))
        if short or bad:
            C.print0(f"warning: skipped {short} video(s) with < {min_frames} frames and {bad} with an unreadable first frame")
        if not self.videos:
            raise C.UserError(f"--data {root}: no usable videos (folders with >= {min_frames} JPEG/PNG frames)")
        if holdout:                                                  # --holdout: eval_video.py --holdout scores them
            self.videos = [FrameFolder(v.paths, self, i) for i, v in enumerate(C.held_out(self.videos, holdout))]
        self.count_unreadable_of(len(self.videos))                  # distinct videos with an unreadable frame

    def __len__(self):
        return len(self.videos)

    def load(self, i):
        return self.videos[i], 0


def davis_train_folders(root):
    """A DAVIS root (JPEGImages/480p/ and a train list: DAVIS-2016 ImageSets/480p/train.txt of "frame
    mask" pairs, or DAVIS-2017 ImageSets/2017/train.txt of names): (folder, [], frame files) of its train
    videos only, said in one line; None for any other folder. Walking a DAVIS root whole would also
    train on the val videos and on the annotation PNGs as if they were videos."""
    img = os.path.join(root, "JPEGImages", "480p")
    lists = [os.path.join(root, "ImageSets", *s, "train.txt") for s in (("480p",), ("2017",))]
    lst = next((q for q in lists if os.path.isfile(q)), None)
    if not os.path.isdir(img) or lst is None:
        return None
    names = sorted({ln.split()[0].strip("/").split("/")[-2] if "/" in ln else ln.strip()
                    for ln in open(lst) if ln.strip()})
    missing = [v for v in names if not os.path.isdir(os.path.join(img, v))]
    if missing or not names:
        raise C.UserError(f"--data {root}: {lst} lists {'no video' if not names else f'{missing[0]}, which has no folder in {img}'}")
    C.print0(f"DAVIS root: training on the {len(names)} videos of {os.path.relpath(lst, root)} (JPEGImages/480p)")
    return [(os.path.join(img, v), [], os.listdir(os.path.join(img, v))) for v in names]


def video_dataset(data, split="train", holdout=0):
    if data == "synthetic":
        if holdout:
            raise C.UserError("--holdout: the synthetic clips have their own val split; leave --holdout out")
        from synthetic import SyntheticVideos           # only for --data synthetic
        return SyntheticVideos(split)
    return VideoFolders(data, holdout=holdout)


class FramePair:
    """video -> R pairs (f1, f2) as uint8 (R, 2, 3, S, S): gap ~ U{gap_min..gap_max} clipped to the
    video, the same RandomResizedCrop(scale 0.5-1) and flip on both frames, no colour augmentation."""

    def __init__(self, a):
        self.size, self.scale, self.gap, self.R = a.img_size, a.crop_scale, a.gap, a.repeated_sampling

    def __call__(self, video):
        from torchvision import transforms as T
        from torchvision.transforms import functional as TF
        pairs = []
        for _ in range(self.R):
            n = len(video)
            gap = int(torch.randint(min(self.gap[0], n - 1), min(self.gap[1], n - 1) + 1, ()))
            t1 = int(torch.randint(0, n - gap, ()))
            f1, f2 = video.load(t1), video.load(t1 + gap)
            i, j, h, w = T.RandomResizedCrop.get_params(f1, self.scale, (3 / 4, 4 / 3))
            flip = bool(torch.rand(()) < 0.5)
            out = []
            for f in (f1, f2):
                f = TF.resized_crop(f, i, j, h, w, [self.size, self.size], antialias=True)
                out.append(C.to_uint8(TF.hflip(f) if flip else f))
            pairs.append(torch.stack(out))
        return torch.stack(pairs)


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
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):                                            # (B, N, D)
        B, N, D = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D))


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
    """Pre-norm block: x + DP(Attn(LN(x))); x + DP(MLP(LN(x)))."""

    def __init__(self, dim, heads, drop_path=0.0):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim, eps=1e-6), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim, eps=1e-6), Mlp(dim, 4 * dim)
        self.drop_path = drop_path

    def forward(self, x):
        x = x + drop_path(self.attn(self.norm1(x)), self.drop_path, self.training)
        return x + drop_path(self.mlp(self.norm2(x)), self.drop_path, self.training)


class PatchEmbed(nn.Module):
    def __init__(self, patch_size, dim):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch_size, patch_size)

    def forward(self, x):                                            # (B, 3, H, W) -> (B, N, D)
        return self.proj(x).flatten(2).transpose(1, 2)


def sincos_pos_embed(dim, grid):
    """MAE's fixed 2-D sin-cos table, with a zero row for [CLS] first: (1, 1 + grid^2, dim),
    channels [x sin, x cos, y sin, y cos], frequencies 1 / 10000^(k / (dim/4))."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4.0))
    ys, xs = torch.meshgrid(torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64),
                            indexing="ij")
    table = torch.cat([f(p.flatten()[:, None] * omega[None]) for p in (xs, ys) for f in (torch.sin, torch.cos)], 1)
    return torch.cat([torch.zeros(1, dim), table.float()])[None]


def init_weights(module, style="xavier"):
    """"xavier" (MAE's, default): Linear xavier-uniform, biases 0; the patch-embedding Conv2d
    xavier-uniform on its (D, 3 p p) view, bias PyTorch's default (as MAE). "trunc" (DeiT):
    Linear trunc-normal(0.02), patch embedding kaiming-normal, biases 0. LayerNorm keeps 1 / 0."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            if style == "xavier":
                nn.init.xavier_uniform_(m.weight.view(m.weight.shape[0], -1))
            else:
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            (nn.init.xavier_uniform_ if style == "xavier" else lambda w: nn.init.trunc_normal_(w, std=0.02))(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def init_token(t, style="xavier"):
    return nn.init.normal_(t, std=0.02) if style == "xavier" else nn.init.trunc_normal_(t, std=0.02)


class ViT(nn.Module):
    """forward(x, ids_keep=None, norm=True) -> (B, 1 + n, D), [CLS] first; ids_keep (B, n): the
    visible patches, the only ones the encoder sees."""

    def __init__(self, img_size=224, patch_size=16, dim=768, depth=12, heads=12, drop_path=0.0, init="xavier"):
        super().__init__()
        self.config = dict(img_size=img_size, patch_size=patch_size, dim=dim, depth=depth, heads=heads,
                           mlp_ratio=4.0, pos_embed="sincos", init=init)        # the checkpoint's `vit`
        self.patch_size, self.dim, self.grid = patch_size, dim, img_size // patch_size
        self.patch_embed = PatchEmbed(patch_size, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.register_buffer("pos_embed", sincos_pos_embed(dim, self.grid))    # fixed, in the state dict
        self.blocks = nn.ModuleList(Block(dim, heads, p) for p in torch.linspace(0, drop_path, depth).tolist())
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.grad_ckpt = False                                       # C.set_grad_checkpointing
        init_weights(self, init)
        init_token(self.cls_token, init)

    def forward(self, x, ids_keep=None, norm=True):
        x = self.patch_embed(x) + self.pos_embed[:, 1:]              # (B, N, D)
        if ids_keep is not None:                                     # drop the masked patches
            x = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        x = torch.cat([(self.cls_token + self.pos_embed[:, :1]).expand(x.shape[0], -1, -1), x], dim=1)
        x = C.run_blocks(self.blocks, x, self.grad_ckpt)
        return self.norm(x) if norm else x


def make_vit(a):
    if a.model not in SIZES:
        raise C.UserError(f"--model must be one of {', '.join(SIZES)}, got {a.model!r}")
    dim, depth, heads = SIZES[a.model]
    return ViT(a.img_size, a.patch_size, dim, depth, heads, a.drop_path, a.init)


# ----------------------------------------------------------------------------------------------
# Masking and patches (MAE)
# ----------------------------------------------------------------------------------------------
def random_masking(batch, grid, ratio, device=None):
    """MAE's per-image random masking of the grid x grid patches: exactly int(N (1 - ratio)) kept, chosen
    by the ranks of uniform noise. Returns ids_keep (B, n_keep) kept patch indices (ascending),
    ids_restore (B, N) (gathering cat([kept, masked]) with it restores raster order), mask (B, N)
    float, 1 = masked."""
    n_keep = int(grid * grid * (1 - ratio))
    noise = torch.rand(batch, grid * grid, device=device)           # argsort of noise (MAE)
    mask = noise.argsort(1).argsort(1) >= n_keep
    ids_shuffle = mask.to(torch.uint8).argsort(dim=1, stable=True)  # kept first, then masked
    return ids_shuffle[:, :n_keep], ids_shuffle.argsort(1), mask.float()


def restore_tokens(x, mask_token, ids_restore):
    """(B, 1+n_keep, d) encoder tokens -> (B, 1+N, d): append mask tokens, unshuffle (MAE decoder)."""
    B, N = ids_restore.shape
    patches = torch.cat([x[:, 1:], mask_token.to(x.dtype).expand(B, N + 1 - x.shape[1], -1)], dim=1)
    patches = torch.gather(patches, 1, ids_restore.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    return torch.cat([x[:, :1], patches], dim=1)


def patchify(imgs, p):
    """(B, 3, H, W) -> (B, N, p*p*3), row-major patches, (p, p, 3) inside each patch (MAE)."""
    B, C3, H, W = imgs.shape
    x = imgs.reshape(B, C3, H // p, p, W // p, p)
    return torch.einsum("bchpwq->bhwpqc", x).reshape(B, (H // p) * (W // p), p * p * C3)


def unpatchify(x, p):
    """Inverse of patchify for square images: (B, N, p*p*3) -> (B, 3, h p, h p)."""
    B, N, _ = x.shape
    h = int(round(N ** 0.5))
    return torch.einsum("bhwpqc->bchpwq", x.reshape(B, h, h, p, p, 3)).reshape(B, 3, h * p, h * p)


def norm_pix(target, eps=1e-6):
    """MAE's norm_pix_loss target: each patch's pixels (x - mean) / sqrt(var + eps), over the patch."""
    mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
    return (target - mean) / (var + eps) ** 0.5


def unnorm_pix(pred, target, eps=1e-6):
    """norm_pix-space predictions back to pixels with the target patches' mean / var (for pictures)."""
    mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
    return pred * (var + eps) ** 0.5 + mean


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
class CrossAttention(nn.Module):
    """Multi-head attention with queries from x (B, N, d) and keys/values from ctx (B, M, d)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q, self.kv, self.proj = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)

    def forward(self, x, ctx):
        B, N, D = x.shape
        h = self.heads
        q = self.q(x).view(B, N, h, D // h).transpose(1, 2)                   # (B, h, N, d_h)
        k, v = self.kv(ctx).view(B, ctx.shape[1], 2, h, D // h).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D))


class CrossSelfBlock(nn.Module):
    """Pre-norm: x += CA(LN(x), LN(f1)); [x += SA(LN(x))]; x += MLP(LN(x)). self_attn=False: 'cross'."""

    def __init__(self, dim, heads, self_attn=True):
        super().__init__()
        self.norm_x, self.norm_ctx, self.cross = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6), CrossAttention(dim, heads)
        self.norm_sa, self.attn = (nn.LayerNorm(dim, eps=1e-6), Attention(dim, heads)) if self_attn else (None, None)
        self.norm_mlp, self.mlp = nn.LayerNorm(dim, eps=1e-6), Mlp(dim, 4 * dim)

    def forward(self, x, ctx):
        x = x + self.cross(self.norm_x(x), self.norm_ctx(ctx))
        if self.attn is not None:
            x = x + self.attn(self.norm_sa(x))
        return x + self.mlp(self.norm_mlp(x))


class SiamMAE(nn.Module):
    def __init__(self, a):
        super().__init__()
        if a.decoder not in ("cross-self", "cross", "joint"):
            raise C.UserError(f"--decoder must be cross-self, cross or joint, got {a.decoder!r}")
        if a.init not in ("xavier", "trunc"):
            raise C.UserError(f"--init must be xavier or trunc, got {a.init!r}")
        self.encoder = make_vit(a)
        D, dd, p = self.encoder.dim, a.decoder_dim, a.patch_size
        self.kind = a.decoder
        self.decoder_embed = nn.Linear(D, dd)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dd))
        self.register_buffer("decoder_pos_embed", sincos_pos_embed(dd, self.encoder.grid))
        if self.kind == "joint":
            self.stream_embed = nn.Parameter(torch.zeros(1, 1, dd))            # marks f1 tokens
            self.blocks = nn.ModuleList(Block(dd, a.decoder_heads) for _ in range(a.decoder_depth))
        else:
            self.blocks = nn.ModuleList(CrossSelfBlock(dd, a.decoder_heads, self.kind == "cross-self")
                                        for _ in range(a.decoder_depth))
        self.grad_ckpt = False
        self.norm, self.pred = nn.LayerNorm(dd, eps=1e-6), nn.Linear(dd, p * p * 3)
        init_weights(self, a.init)                                            # MAE: the whole model
        init_token(self.mask_token, a.init)

    def forward(self, f1, f2, ids_keep, ids_restore):
        """f1, f2 (B, 3, H, W); f2 keeps ids_keep. Returns predicted f2 patches (B, N, p*p*3)."""
        h1 = self.decoder_embed(self.encoder(f1)) + self.decoder_pos_embed              # (B, 1+N, dd)
        h2 = restore_tokens(self.decoder_embed(self.encoder(f2, ids_keep)), self.mask_token, ids_restore)
        h2 = h2 + self.decoder_pos_embed                                                 # (B, 1+N, dd)
        if self.kind == "joint":
            x = C.run_blocks(self.blocks, torch.cat([h1 + self.stream_embed, h2], dim=1), self.grad_ckpt)
            x = x[:, h1.shape[1]:]
        else:
            x = C.run_blocks(self.blocks, h2, self.grad_ckpt, h1)                      # f2 attends to f1
        return self.pred(self.norm(x))[:, 1:]


# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
def siammae_loss(pred, target, mask):
    """MSE on f2's masked patches. pred (B, N, p*p*3), target (B, N, p*p*3) = norm-pix f2 patches,
    mask (B, N), 1 = masked. Mean over a patch's values, then mean over masked patches."""
    return (((pred - target) ** 2).mean(-1) * mask).sum() / mask.sum()


# ----------------------------------------------------------------------------------------------
# The training step: frame pair -> network -> loss, forward and backward
# ----------------------------------------------------------------------------------------------
def train_step(net, f1, f2, ids_keep, ids_restore, mask, a, micro=None, autocast=contextlib.nullcontext(),
               scale=None, ddp=None):
    """One SiamMAE step on this process's P pairs; gradients are left in the network.

    f1 (P, 3, S, S): the earlier frame, encoded whole (0% masked), read by the decoder as context;
    f2 (P, 3, S, S): the later frame, encoded at ids_keep only; the loss reads the predictions at
    f2's MASKED patches (mask (P, N), 1 = masked) against f2's own norm-pix patches. Per pair, so
    micro-batches (micro pairs) accumulate directly.
    """
    P = f1.shape[0]
    target = norm_pix(patchify(f2, a.patch_size))                       # (P, N, p*p*3)
    scale, total = scale or (lambda t: t), 0.0
    for sl in C.micro_batches(P, micro or P, ddp):                      # one slice, or exact accumulation
        with autocast:
            pred = net(f1[sl], f2[sl], ids_keep[sl], ids_restore[sl])   # f2's patches from f1 + visible f2
        loss = siammae_loss(pred.float(), target[sl], mask[sl]) * (len(pred) / P)   # share of the mean
        scale(loss).backward()
        total = total + loss.detach()
    return total, {"loss": total}


# ----------------------------------------------------------------------------------------------
# The f1 probe: does the decoder read f1? The objective can be lowered from f2's few visible patches
# alone (towards a flat patch); only reading f1 teaches correspondence, so the run measures it.
# ----------------------------------------------------------------------------------------------
PROBE_SEED = 20231113                   # the probe pairs' and masks' own draw, never a training draw


def probe_pairs(dataset, a, n=48):
    """Fixed frame pairs for f1_probe: one pair (a's gaps and crops) from each of up to n videos spread over the
    dataset (a video with an unreadable frame is left out; the reads do not count towards --max-unreadable),
    and fixed masks of f2, all drawn under PROBE_SEED (the caller's RNG is left alone). Returns
    (f1, f2 uint8 (k, 3, S, S), ids_keep, ids_restore, mask), or None where no video could be read."""
    idx = torch.linspace(0, len(dataset) - 1, min(n, len(dataset))).round().long().unique().tolist()
    if isinstance(dataset, VideoFolders):          # read outside its unreadable-frame count (--max-unreadable's)
        dataset = types.SimpleNamespace(load=lambda i, d=dataset: (FrameFolder(d.videos[i].paths), 0))
    views, clips = C.Views(dataset, FramePair(a), PROBE_SEED), []
    for i in idx:
        try:
            clips.append(views[i][0][0])                                  # (2, 3, S, S): the video's first pair
        except C.UserError:                                               # an unreadable frame: not probed
            continue
    if not clips:
        return None                                                       # nothing readable to probe
    clips = torch.stack(clips)                                            # (k, 2, 3, S, S)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(PROBE_SEED)
        masking = random_masking(len(clips), a.img_size // a.patch_size, a.mask_ratio)
    return (clips[:, 0], clips[:, 1], *masking)


@torch.no_grad()
def f1_probe(model, probe, a, autocast=contextlib.nullcontext()):
    """The loss on the probe pairs' masked f2 patches (probe_pairs) with f1 = the true earlier frame, another
    video's (the next pair's), a grey frame (0 after normalisation) and f2 itself (the answer in place), and
    f1_gap = other - true: 0 where the decoder ignores what f1 shows, large where it reads it."""
    dev = next(model.parameters()).device
    f1, f2, ids_keep, ids_restore, mask = (t.to(dev) for t in probe)
    x1, x2 = C.normalize(f1), C.normalize(f2)
    target, was = norm_pix(patchify(x2, a.patch_size)), model.training
    model.eval()
    out = {}
    for name, ctx in (("true", x1), ("other", x1.roll(1, 0)), ("grey", torch.zeros_like(x1)), ("self", x2)):
        with autocast:
            pred = model(ctx, x2, ids_keep, ids_restore)                        # (k, N, p*p*3)
        out[f"f1_{name}"] = round(siammae_loss(pred.float(), target, mask).item(), 5)
    model.train(was)
    out["f1_gap"] = round(out["f1_other"] - out["f1_true"], 5)
    return out


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def train(args):
    run = H.setup(args, "siammae")
    dev = run.device
    grid = args.img_size // args.patch_size
    H.check_mask_ratio(args.mask_ratio, lambda: random_masking(1, grid, args.mask_ratio)[2].sum(), grid * grid,
                       need_kept=False)                                # all of f2 masked is valid: f1 is seen
    per, micro = H.batch_plan(args, run, 1024, "the loss is per pair, so only the gradient noise and the "
                              "lr / batch pairing of the recipe change", unit="videos")
    dataset = video_dataset(args.data, holdout=args.holdout)
    loader = C.make_loader(C.Views(dataset, FramePair(args), args.seed), per, args.workers, args.seed)
    ipe = min(len(loader), args.steps_per_epoch or len(loader))
    R = args.repeated_sampling
    if args.epochs % R:
        raise C.UserError(f"--epochs {args.epochs} counts effective epochs (passes x --repeated-sampling {R}): "
                          "make it a multiple of it")
    passes = args.epochs // R
    if args.stop_epoch > passes:
        raise C.UserError(f"--stop-epoch {args.stop_epoch} counts passes: this run has {passes} "
                          f"(--epochs {args.epochs} / --repeated-sampling {R})")
    total = passes * ipe
    videos = args.batch_size                                           # MAE-ST: lr scales with videos
    pairs = videos * R
    lr = args.lr or args.blr * videos / 256
    warmup = round(args.warmup_epochs / R * ipe)

    model = SiamMAE(args).to(dev)
    C.set_grad_checkpointing(model, args.grad_ckpt)
    opt = C.make_optimizer(model, lr, args.weight_decay, args.betas, dev)
    start = H.resume_run(run, "siammae", args, model, opt)            # global step
    net, ddp = H.distribute(torch.compile(model) if args.compile else model, run)
    log = C.Logger(run, total, pairs, args.log_every, start, args.stop_epoch * ipe)
    if log.done:                                                    # a finished or stopped run, rerun
        return
    save = lambda s: C.save_run(run, "siammae", args, s // ipe, s, model.encoder, model, opt)  # noqa: E731
    C.print0(f"{len(dataset)} videos, {args.epochs} effective epochs = {passes} passes of {ipe} steps, {total} steps, "
             f"{videos} videos = {pairs} pairs/step, lr {lr:.3g} (blr x {videos} videos / 256)")
    p, grid = args.patch_size, model.encoder.grid
    probe = probe_pairs(dataset, args) if args.probe_every and C.is_main() else None

    for epoch in range(start // ipe, args.stop_epoch or passes):         # epoch = one pass over the videos
        model.train()
        bad0 = C.bad_reads(dataset)
        for it, (clips, _) in C.epoch_batches(loader, epoch, ipe, start, args.seed, run.rank):
            step = epoch * ipe + it
            C.set_hparams(opt, C.cosine_schedule(step, total, lr, args.min_lr, warmup))
            x = C.normalize(clips.to(dev, non_blocking=True).flatten(0, 1))    # (B*R, 2, 3, S, S)
            f1, f2 = x[:, 0], x[:, 1]
            ids_keep, ids_restore, mask = random_masking(f2.shape[0], grid, args.mask_ratio, device=dev)
            opt.zero_grad(set_to_none=True)
            loss, parts = train_step(net, f1, f2, ids_keep, ids_restore, mask, args, micro * R, run.autocast,
                                     run.scaler.scale, ddp)
            parts["grad_norm"] = C.optimizer_step(run, opt, model.parameters())   # MAE recipe: no clipping
            if probe is not None and ((step + 1) % args.probe_every == 0 or step + 1 == total):
                log.write({"step": step + 1, **f1_probe(model, probe, args, run.autocast)})
            if C.end_step(run, log, args, step + 1, epoch, parts, save, dataset, (it + 1) * per, bad0,
                          lr=opt.param_groups[0]["lr"]):                 # log, NaN watch; preempted: stop
                return
        C.check_unreadable(dataset, ipe * per, bad0, args.max_unreadable, final=True)
        save((epoch + 1) * ipe)
        every = 10 * args.log_every                      # short passes (DAVIS: 1 step): a picture per 10 log lines
        if ipe < every and (epoch + 1) * ipe // every == epoch * ipe // every and epoch + 1 < passes:
            continue
        n, m = min(8, f2.shape[0]), mask[:min(8, f2.shape[0]), :, None]      # f1 / masked f2 / predicted f2
        with torch.no_grad(), run.autocast:
            pred = model.eval()(f1[:n], f2[:n], ids_keep[:n], ids_restore[:n]).float()
        xp = patchify(f2[:n], p)
        C.save_image_grid(f"{run.out}/pairs_ep{epoch:04d}_step{(epoch + 1) * ipe:06d}.png", [        # the log's ep, step
            f1[:n], f2[:n], unpatchify(xp * (1 - m), p), unpatchify(torch.where(m.bool(), unnorm_pix(pred, xp), xp), p)],
            ["f1 (seen whole)", "f2 (target)", "f2 as encoded (95% masked)", "f2 predicted"], (epoch + 1) * ipe)


if __name__ == "__main__":
    H.main(train, Args)
