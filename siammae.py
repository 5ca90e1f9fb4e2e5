"""SiamMAE: Siamese Masked Autoencoders.
Gupta, Wu, Deng, Fei-Fei. NeurIPS 2023. arXiv:2305.14344. (No official code.)

Idea. Two frames of a video, f1 and a later f2, go through one shared ViT encoder: f1 whole, f2 with
95% of its patches dropped. A decoder predicts f2's missing patches; its f2 tokens can only learn
where things went by cross-attending to f1's, which teaches the encoder correspondence (label
propagation: eval_video.py).

Launch. `--batch-size` is the GLOBAL number of videos per step (default 1024 videos x R = 2 pairs =
the paper's 2048), each process's share in micro-batches of --micro-batch videos (default 512;
docs/DESIGN.md measures the memory).
  python siammae.py --data synthetic                     # CPU quickstart, ~5 min
  python siammae.py --data /DAVIS --preset davis         # DAVIS-2016's 30 train videos, 2 CPU cores
  python siammae.py --data /kinetics_frames              # ViT-S/16 ablation recipe, 1 GPU: 2 x 512
  torchrun --nproc_per_node=8 siammae.py --data /kinetics_frames   # 8 GPUs: 8 x 128 videos

--data DIR: videos as folders of frames (JPEG/PNG in file-name order, 2.jpg before 10.jpg) at any
depth (Kinetics frame folders; a DAVIS root trains on its train list).
Files. This file, common.py (the training kit: schedules, the optimiser step, micro-batches, data,
checkpoints, the log) and harness.py (the command line, launching, resume, preemption) train the
paper's recipe on a folder of videos. Beside them, for a flag: recipes.py (--preset, and with
synthetic.py --data synthetic), weights.py (--init).

Paper -> code.
  Frame pair, gap 4..48, same crop + flip .... FramePair
  Siamese encoder, 0% / 95% masking .......... SiamMAE.forward (ViT, random_masking)
  Cross-self decoder (Fig. 2) ................ CrossSelfBlock; `--decoder cross|joint` (ablation)
  Loss: norm-pix MSE on f2's masked patches .. siammae_loss
  (not in the paper) does the decoder read f1? f1_probe, logged every --probe-every steps

Choices (no official code: the paper's text, and its best public re-implementation,
alexandre-eymael/CropMAE, without its known deviations): pre-norm decoder blocks
x += CA(LN(x), LN(f1)); x += SA(LN(x)); x += MLP(LN(x)), decoder position embeddings and CLS tokens
in both streams (not the unofficial post-norm / weight-tied blocks). Joint decoder: self-attention
over [f1 tokens + a learned stream embedding, f2 tokens].

Epochs, batch, lr (MAE-ST's convention): R = --repeated-sampling pairs per video visit,
`--batch-size` counts videos, lr = blr x videos per step / 256, `--epochs` / `--warmup-epochs` count
EFFECTIVE epochs (passes x R; `--stop-epoch` passes). Decoder 4 x 256 x 8 heads: CropMAE's ViT-S
(the paper: "as MAE", 8 x 512). The gap counts stored frames (the paper's 30 fps). No BatchNorm:
micro-batches and processes change only rounding. Initialisation and weight decay as MAE's
(xavier-uniform Linear and patch embedding; no decay on biases and 1-d tensors: the tokens decay).
"""
import contextlib
import os
import types
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

import common as C
import harness as H


@dataclass
class Args(H.RunArgs):
    """SiamMAE pre-training on frame pairs (defaults: ViT-S/16, paper ablation recipe)."""
    data: str = H.arg(None, "directory of frame folders, or 'synthetic'", group="data")
    output_dir: str = H.arg(None, "where checkpoint.pth, log.jsonl, args.json and pictures go "
                            "(default runs/siammae)", group="data")
    model: str = H.arg("small", "ViT size: nano|micro|tiny|small|base|large", group="model")
    patch_size: int = H.arg(16, "ViT patch size (px)", group="model", positive=True)
    img_size: int = H.arg(224, "training image size (px)", group="data", positive=True)
    epochs: int = H.arg(400, "effective epochs: passes over the videos x R",
                        group="optimisation", positive=True)
    batch_size: int = H.arg(1024, "GLOBAL videos a step (x repeated-sampling pairs: 1024 x 2 = the "
                            "paper's 2048)", group="optimisation", positive=True)
    micro_batch: int = H.arg(512, "videos per forward/backward per process (0 = the whole "
                             "per-process batch; memory: docs/DESIGN.md); the step stays exact",
                             group="optimisation", min=0)
    repeated_sampling: int = H.arg(2, "pairs drawn per video visit (R)",
                                   group="optimisation", positive=True)
    lr: float = H.arg(None, "absolute lr (default blr * global videos / 256)",
                      group="optimisation", positive=True)
    blr: float = H.arg(1.5e-4, "base lr: lr = blr x global batch / 256",
                       group="optimisation", positive=True)
    min_lr: float = H.arg(0.0, "lr at the end of the cosine schedule", group="optimisation", min=0)
    warmup_epochs: float = H.arg(40, "effective epochs, like --epochs", group="optimisation", min=0)
    weight_decay: float = H.arg(0.05, "AdamW weight decay", group="optimisation", min=0)
    betas: tuple = H.arg((0.9, 0.95), "AdamW betas", group="optimisation")
    mask_ratio: float = H.arg(0.95, "share of patches masked", group="views and masking")
    gap: tuple = H.arg((4, 48), "frame gap range (clipped to the video length)",
                       group="views and masking")
    crop_scale: tuple = H.arg((0.5, 1.0), "RandomResizedCrop area range", group="data")
    decoder: str = H.arg("cross-self", "cross-self | cross | joint", group="model")
    decoder_dim: int = H.arg(256, "decoder width", group="model", positive=True)
    decoder_depth: int = H.arg(4, "decoder blocks", group="model", min=1,
                               why=" (a masked patch sees the visible ones only through them)")
    decoder_heads: int = H.arg(8, "decoder attention heads", group="model", positive=True)
    drop_path: float = H.arg(0.0, "stochastic depth rate of the last block", group="model", min=0)
    init: str = H.arg(None, "start from these weights at step 0: a checkpoint of this project, the "
                      "official MSN file, an MAE-style 'model' dict or a timm / DeiT state dict "
                      "(read by weights.py)", group="model")
    weight_init: str = H.arg("xavier", "the initialisation drawn otherwise: xavier (MAE's) | trunc "
                             "(trunc-normal 0.02, DeiT)", group="model")
    probe_every: int = H.arg(200, "steps between f1 probes (how much the decoder reads f1; 0 = "
                             "off), and at the end", group="run control", min=0)

    # Small recipes: the official one above by recipes.scale_recipe's rules; the values here are the budget's or
    # the held-out sweep's (lr_factor). Each value's reason: docs/RESULTS.md.
    PRESETS = {"davis": dict(lr_factor=213.33, model="nano", patch_size=4, img_size=64, epochs=2000,
                             batch_size=8, decoder_dim=64, decoder_depth=2, decoder_heads=4,
                             gap=(8, 48), workers=2, log_every=20)}
    SYNTHETIC = dict(model="nano", patch_size=4, img_size=64, epochs=16, batch_size=32,
                     decoder_dim=64, decoder_depth=2, decoder_heads=4, gap=(2, 8), workers=2,
                     log_every=20)
    RUN_ONLY = {"probe_every"}                                       # a resumed run may change it (harness.resume_run)

    @staticmethod
    def upgrade(old):
        """A checkpoint's args from before --weight-init, when --init named the scheme: as now."""
        if old.get("init") in ("xavier", "trunc") and "weight_init" not in old:
            return {**old, "weight_init": old["init"], "init": None}
        return old

    def check(self):
        """harness.validate's rules for SiamMAE's own flags."""
        if self.in_chans != 3:
            raise C.UserError(f"--in-chans {self.in_chans}: SiamMAE reads the RGB frames of "
                              "videos (--in-chans 3 only)")
        if not 1 <= self.gap[0] <= self.gap[1]:
            raise C.UserError(f"--gap must be 1 <= min <= max frames (0 pairs a frame with "
                              f"itself), got {self.gap}")
        R = self.repeated_sampling
        passes = self.epochs // R
        if self.epochs % R:
            raise C.UserError(f"--epochs {self.epochs} counts effective epochs (passes x "
                              f"--repeated-sampling {R}): make it a multiple of it")
        if self.stop_epoch > passes:
            raise C.UserError(f"--stop-epoch {self.stop_epoch} counts passes: this run has "
                              f"{passes}")


# ----------------------------------------------------------------------------------------------
# Video data: folders of frames (the synthetic clips are in synthetic.py)
# ----------------------------------------------------------------------------------------------
class FrameFolder:
    """One video's frame files in order; load(t) -> PIL RGB. In training (owner: the
    VideoFolders) an unreadable frame is replaced by the nearest readable one (deterministic:
    resume stays exact) and the video counted once."""

    def __init__(self, paths, owner=None, index=0):
        self.paths = paths
        self.owner = owner
        self.index = index

    def __len__(self):
        return len(self.paths)

    def load(self, t):
        n = len(self.paths)
        for u in [t] + [u for d in range(1, n) for u in (t + d, t - d) if 0 <= u < n]:
            try:
                with Image.open(self.paths[u]) as im:
                    return C.to_rgb(im)
            except Exception as e:
                if self.owner is None:
                    raise C.UserError(f"cannot read frame {self.paths[u]}: {e}; remove or replace "
                                      "the file") from None
                self.owner.unreadable(self.index, self.paths[u], e, "frame",
                                      "using the nearest readable frame")
        folder = os.path.dirname(self.paths[0])
        raise C.UserError(f"no frame of {folder} can be read: is --data right?")


class VideoFolders(torch.utils.data.Dataset, C.CountsUnreadable):
    """Every directory under root with >= 2 image files is a video (any depth); shorter ones or
    an unreadable first frame are skipped with a warning; an unreadable frame later is replaced
    and its video counted (--max-unreadable)."""
    unit = "videos"                                      # what --max-unreadable's share counts

    def __init__(self, root, min_frames=2, holdout=0):
        if not os.path.isdir(root):
            raise C.UserError(f"--data {root}: no such directory (give a folder of frame folders "
                              "or 'synthetic')")
        self.videos, short, bad = [], 0, 0
        listed = davis_train_folders(root)
        for dirpath, _, files in (listed or sorted(os.walk(root, followlinks=True))):
            frames = sorted((f for f in files if f.lower().endswith(C.IMG_EXTS)), key=C.frame_order)
            if len(frames) < min_frames:
                short += len(frames) > 0                             # a folder of no frame is no video
                continue
            try:
                with Image.open(os.path.join(dirpath, frames[0])) as im:
                    im.verify()
            except Exception:
                bad += 1
                continue
            paths = [os.path.join(dirpath, f) for f in frames]
            self.videos.append(FrameFolder(paths, self, len(self.videos)))
        if short or bad:
            C.print0(f"warning: skipped {short} video(s) with < {min_frames} frames and {bad} with "
                     "an unreadable first frame")
        if not self.videos:
            raise C.UserError(f"--data {root}: no usable videos (folders with >= {min_frames} "
                              "JPEG/PNG frames)")
        self.root = root
        self.held = []
        if holdout:                                                  # eval_video.py --holdout scores them
            self.held = [p for v in C.held_out(self.videos, holdout, True) for p in v.paths]
            kept = C.held_out(self.videos, holdout)
            self.videos = [FrameFolder(v.paths, self, i) for i, v in enumerate(kept)]
        self.count_unreadable_of(len(self.videos))                  # distinct videos, an unreadable frame

    def fingerprint(self):
        """What a resumed run must find again (harness.resume_run): the counts, the frames (and the
        held-out ones)."""
        held = {"held_out": C.digest(self.held, self.root)} if self.held else {}
        return {"videos": len(self), "frames": sum(len(v) for v in self.videos),
                "files": C.digest([p for v in self.videos for p in v.paths], self.root), **held}

    def __len__(self):
        return len(self.videos)

    def load(self, i):
        return self.videos[i], 0


def davis_train_folders(root):
    """A DAVIS root (JPEGImages/480p/ and ImageSets/480p/train.txt of DAVIS-2016 or
    ImageSets/2017/train.txt): (folder, [], frame files) of its train videos only (walked whole
    it would train on the val videos and the annotations too); None for any other folder."""
    img = os.path.join(root, "JPEGImages", "480p")
    lists = [os.path.join(root, "ImageSets", *s, "train.txt") for s in (("480p",), ("2017",))]
    lst = next((q for q in lists if os.path.isfile(q)), None)
    if not os.path.isdir(img) or lst is None:
        return None
    names = sorted({ln.split()[0].strip("/").split("/")[-2] if "/" in ln else ln.strip()
                    for ln in open(lst) if ln.strip()})
    missing = [v for v in names if not os.path.isdir(os.path.join(img, v))]
    if missing or not names:
        what = "no video" if not names else f"{missing[0]}, which has no folder in {img}"
        raise C.UserError(f"--data {root}: {lst} lists {what}")
    C.print0(f"DAVIS root: training on the {len(names)} videos of {os.path.relpath(lst, root)} "
             "(JPEGImages/480p)")
    return [(os.path.join(img, v), [], os.listdir(os.path.join(img, v))) for v in names]


def video_dataset(data, split="train", holdout=0):
    """--data: `synthetic` (synthetic.py's clips) or a folder of frame folders; holdout:
    VideoFolders'."""
    if data == "synthetic":
        if holdout:
            raise C.UserError("--holdout: the synthetic clips have their own val split; leave "
                              "--holdout out")
        synthetic = C.optional("synthetic", "--data synthetic needs synthetic.py next to this file")
        return synthetic.SyntheticVideos(split)
    return VideoFolders(data, holdout=holdout)


class FramePair:
    """video -> R pairs (f1, f2) uint8 (R, 2, 3, S, S): gap ~ U{gap}, the same crop and flip, no
    colour ops."""

    def __init__(self, a):
        self.size = a.img_size
        self.scale = a.crop_scale
        self.gap = a.gap
        self.R = a.repeated_sampling

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
            size = [self.size, self.size]
            crops = [TF.resized_crop(f, i, j, h, w, size, antialias=True) for f in (f1, f2)]
            pairs.append(torch.stack([C.to_uint8(TF.hflip(f) if flip else f) for f in crops]))
        return torch.stack(pairs)


# ----------------------------------------------------------------------------------------------
# Model: an MAE-style ViT (models_mae.py): [CLS], fixed 2-D sin-cos position embeddings, masked patches dropped
# before the encoder; timm's key names (it loads into timm's VisionTransformer and every other method's ViT).
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
    def __init__(self, patch_size, dim):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch_size, patch_size)

    def forward(self, x):                                            # (B, 3, H, W) -> (B, N, D)
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


def init_weights(module, style="xavier"):
    """"xavier" (MAE's): Linear and the patch embedding's (D, 3 p p) view xavier-uniform, Linear
    biases 0 (the patch embedding's PyTorch's default). "trunc" (DeiT): trunc-normal(0.02), patch
    embedding kaiming-normal, biases 0."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            if style == "xavier":
                nn.init.xavier_uniform_(m.weight.view(m.weight.shape[0], -1))
            else:
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            if style == "xavier":
                nn.init.xavier_uniform_(m.weight)
            else:
                nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def init_token(t, style="xavier"):
    return nn.init.normal_(t, std=0.02) if style == "xavier" else nn.init.trunc_normal_(t, std=0.02)


class ViT(nn.Module):
    """forward(x, ids_keep=None, norm=True) -> (B, 1 + n, D), [CLS] first; ids_keep (B, n): the
    visible patches."""

    def __init__(self, img_size=224, patch_size=16, dim=768, depth=12, heads=12, drop_path=0.0,
                 init="xavier"):
        super().__init__()
        self.config = dict(img_size=img_size, patch_size=patch_size, dim=dim, depth=depth,
                           heads=heads, mlp_ratio=4.0, pos_embed="sincos", init=init)  # ckpt["vit"]
        self.patch_size = patch_size
        self.dim = dim
        self.grid = img_size // patch_size
        self.patch_embed = PatchEmbed(patch_size, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.register_buffer("pos_embed", sincos_pos_embed(dim, self.grid))    # fixed, in the state dict
        rates = torch.linspace(0, drop_path, depth).tolist()         # stochastic depth, rising
        self.blocks = nn.ModuleList(Block(dim, heads, p) for p in rates)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.grad_ckpt = False                                       # C.set_grad_checkpointing
        init_weights(self, init)
        init_token(self.cls_token, init)

    def forward(self, x, ids_keep=None, norm=True):
        x = self.patch_embed(x) + self.pos_embed[:, 1:]              # (B, N, D)
        if ids_keep is not None:                                     # drop the masked patches
            x = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        cls = self.cls_token + self.pos_embed[:, :1]
        x = torch.cat([cls.expand(x.shape[0], -1, -1), x], dim=1)
        x = C.run_blocks(self.blocks, x, self.grad_ckpt)
        return self.norm(x) if norm else x


# ----------------------------------------------------------------------------------------------
# Masking and patches (MAE)
# ----------------------------------------------------------------------------------------------
def random_masking(batch, grid, ratio, device=None):
    """MAE's per-image random masking: exactly int(N (1 - ratio)) of the N patches kept, by the
    ranks of uniform noise. ids_keep (B, n_keep) ascending, ids_restore (B, N) (gathers
    cat([kept, masked]) back to raster order), mask (B, N) float, 1 = masked."""
    n_keep = int(grid * grid * (1 - ratio))
    noise = torch.rand(batch, grid * grid, device=device)           # argsort of noise (MAE)
    mask = noise.argsort(1).argsort(1) >= n_keep
    ids_shuffle = mask.to(torch.uint8).argsort(dim=1, stable=True)  # kept first, then masked
    return ids_shuffle[:, :n_keep], ids_shuffle.argsort(1), mask.float()


def restore_tokens(x, mask_token, ids_restore):
    """(B, 1+n_keep, d) encoder tokens -> (B, 1+N, d): append mask tokens, unshuffle (MAE)."""
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


def unnorm_pix(pred, target, eps=1e-6):
    """norm_pix-space predictions back to pixels with the target patches' mean / var (pictures)."""
    mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
    return pred * (var + eps) ** 0.5 + mean


def norm_pix(target, eps=1e-6):
    """MAE's norm_pix_loss target: each patch's pixels (x - mean) / sqrt(var + eps), per patch."""
    mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
    return (target - mean) / (var + eps) ** 0.5


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
class CrossAttention(nn.Module):
    """Multi-head attention with queries from x (B, N, d) and keys/values from ctx (B, M, d)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, ctx):
        B, N, D = x.shape
        h = self.heads
        q = self.q(x).view(B, N, h, D // h).transpose(1, 2)                   # (B, h, N, d_h)
        k, v = self.kv(ctx).view(B, ctx.shape[1], 2, h, D // h).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D))


class CrossSelfBlock(nn.Module):
    """Pre-norm: x += CA(LN(x), LN(f1)); [x += SA(LN(x))]; x += MLP(LN(x)). self_attn=False:
    the 'cross' ablation."""

    def __init__(self, dim, heads, self_attn=True):
        super().__init__()
        self.norm_x = nn.LayerNorm(dim, eps=1e-6)
        self.norm_ctx = nn.LayerNorm(dim, eps=1e-6)
        self.cross = CrossAttention(dim, heads)
        self.norm_sa = nn.LayerNorm(dim, eps=1e-6) if self_attn else None
        self.attn = Attention(dim, heads) if self_attn else None
        self.norm_mlp = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim)

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
        if a.weight_init not in ("xavier", "trunc") or a.model not in SIZES:
            raise C.UserError(f"--weight-init must be xavier or trunc (got {a.weight_init!r}), "
                              f"--model one of {', '.join(SIZES)} (got {a.model!r})")
        self.encoder = ViT(a.img_size, a.patch_size, *SIZES[a.model], a.drop_path, a.weight_init)
        D, dd, p = self.encoder.dim, a.decoder_dim, a.patch_size
        self.kind = a.decoder
        self.decoder_embed = nn.Linear(D, dd)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dd))
        self.register_buffer("decoder_pos_embed", sincos_pos_embed(dd, self.encoder.grid))
        if self.kind == "joint":
            self.stream_embed = nn.Parameter(torch.zeros(1, 1, dd))            # marks f1 tokens
            self.blocks = nn.ModuleList(Block(dd, a.decoder_heads) for _ in range(a.decoder_depth))
        else:
            with_self = self.kind == "cross-self"
            self.blocks = nn.ModuleList(CrossSelfBlock(dd, a.decoder_heads, with_self)
                                        for _ in range(a.decoder_depth))
        self.grad_ckpt = False
        self.norm = nn.LayerNorm(dd, eps=1e-6)
        self.pred = nn.Linear(dd, p * p * 3)
        init_weights(self, a.weight_init)                                     # MAE: the whole model
        init_token(self.mask_token, a.weight_init)

    def forward(self, f1, f2, ids_keep, ids_restore):
        """f1, f2 (B, 3, H, W); f2 keeps ids_keep. Returns predicted f2 patches (B, N, p*p*3)."""
        h1 = self.decoder_embed(self.encoder(f1)) + self.decoder_pos_embed              # (B, 1+N, dd)
        h2 = self.decoder_embed(self.encoder(f2, ids_keep))                             # (B, 1+n, dd)
        h2 = restore_tokens(h2, self.mask_token, ids_restore) + self.decoder_pos_embed   # (B, 1+N, dd)
        if self.kind == "joint":
            both = torch.cat([h1 + self.stream_embed, h2], dim=1)                        # (B, 2+2N, dd)
            x = C.run_blocks(self.blocks, both, self.grad_ckpt)
            x = x[:, h1.shape[1]:]
        else:
            x = C.run_blocks(self.blocks, h2, self.grad_ckpt, h1)                      # f2 attends to f1
        return self.pred(self.norm(x))[:, 1:]


# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
def siammae_loss(pred, target, mask):
    """MSE on f2's masked patches: pred, target (norm-pix f2 patches) (B, N, p*p*3), mask (B, N),
    1 = masked."""
    return (((pred - target) ** 2).mean(-1) * mask).sum() / mask.sum()


# ----------------------------------------------------------------------------------------------
# The training step: frame pair -> network -> loss, forward and backward
# ----------------------------------------------------------------------------------------------
def train_step(net, f1, f2, ids_keep, ids_restore, mask, a, micro=None,
               autocast=contextlib.nullcontext(), scale=None, ddp=None):
    """One SiamMAE step on this process's P pairs; gradients are left in the network.

    f1 (P, 3, S, S): the earlier frame, encoded whole, the decoder's context;
    f2 (P, 3, S, S): the later one, encoded at ids_keep only; the loss reads the predictions at
      f2's MASKED patches (mask (P, N), 1 = masked) against f2's norm-pix patches.
    Per pair: micro-batches accumulate directly."""
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
# The f1 probe: does the decoder read f1? The objective can fall from f2's visible patches alone (a flat patch)
# ----------------------------------------------------------------------------------------------
PROBE_SEED = 20231113                   # the probe pairs' and masks' own draw, never a training draw


def probe_pairs(dataset, a, n=48):
    """Fixed pairs for f1_probe, drawn under PROBE_SEED (the caller's RNG left alone): one pair
    from each of up to n videos spread over the dataset (unreadable ones left out, uncounted) and
    f2's masks. (f1, f2 uint8 (k, 3, S, S), ids_keep, ids_restore, mask), or None where no video
    could be read."""
    idx = torch.linspace(0, len(dataset) - 1, min(n, len(dataset))).round().long().unique().tolist()
    if isinstance(dataset, VideoFolders):          # read outside its unreadable-frame count (--max-unreadable's)
        videos = dataset.videos
        dataset = types.SimpleNamespace(load=lambda i: (FrameFolder(videos[i].paths), 0))
    viewed, clips = C.Views(dataset, FramePair(a), PROBE_SEED), []
    for i in idx:
        try:
            clips.append(viewed[i][0][0])                                  # (2, 3, S, S): the video's first pair
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
    """The loss on the probe pairs' masked f2 patches with f1 = the true frame, another video's,
    a grey one and f2 itself (the answer in place); f1_gap = other - true: 0 where the decoder
    ignores what f1 shows."""
    dev = next(model.parameters()).device
    f1, f2, ids_keep, ids_restore, mask = (t.to(dev) for t in probe)
    x1, x2 = C.normalize(f1), C.normalize(f2)
    target, was = norm_pix(patchify(x2, a.patch_size)), model.training
    model.eval()
    out = {}
    contexts = {"true": x1, "other": x1.roll(1, 0), "grey": torch.zeros_like(x1), "self": x2}
    for name, ctx in contexts.items():
        with autocast:
            pred = model(ctx, x2, ids_keep, ids_restore)                        # (k, N, p*p*3)
        out[f"f1_{name}"] = round(siammae_loss(pred.float(), target, mask).item(), 5)
    model.train(was)
    out["f1_gap"] = round(out["f1_other"] - out["f1_true"], 5)
    return out


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def picture(run, model, f1, f2, ids_keep, ids_restore, mask, a, epoch, step):
    """The pass's picture (pairs_ep<epoch>_step<step>.png, and TensorBoard) of 8 pairs: f1, f2, what
    the encoder sees of f2, and f2 predicted (its masked patches)."""
    n = min(8, f2.shape[0])
    with run.autocast:
        pred = model.eval()(f1[:n], f2[:n], ids_keep[:n], ids_restore[:n]).float()
    model.train()
    p, m = a.patch_size, mask[:n, :, None]
    px = patchify(f2[:n], p)
    predicted = torch.where(m.bool(), unnorm_pix(pred, px), px)      # masked: predicted, others: given
    rows = [f1[:n], f2[:n], unpatchify(px * (1 - m), p), unpatchify(predicted, p)]
    labels = ["f1 (seen whole)", "f2 (target)", "f2 as encoded (95% masked)", "f2 predicted"]
    path = f"{run.out}/pairs_ep{epoch:04d}_step{step:06d}.png"
    C.save_image_grid(path, rows, labels, step, run.tb)


def train(args):
    run = H.setup(args, "siammae")
    dev = run.device
    grid = args.img_size // args.patch_size

    def masked():
        return random_masking(1, grid, args.mask_ratio)[2].sum()
    H.check_mask_ratio(args.mask_ratio, masked, grid * grid, need_kept=False)   # all of f2: valid
    per, micro = H.batch_plan(args, run, 1024, "the loss is per pair, so only the gradient noise "
                              "and the lr / batch pairing of the recipe change", unit="videos")
    dataset = video_dataset(args.data, holdout=args.holdout)
    viewed = C.Views(dataset, FramePair(args), args.seed)
    loader = C.make_loader(viewed, per, args.workers, args.seed)
    ipe = min(len(loader), args.steps_per_epoch or len(loader))
    R = args.repeated_sampling
    videos = args.batch_size                                         # MAE-ST: the lr scales with videos
    passes = args.epochs // R                                        # epochs: effective (x R)
    pairs = videos * R
    peak_lr = args.lr or args.blr * videos / 256
    total = passes * ipe
    warmup = round(args.warmup_epochs / R * ipe)

    model = SiamMAE(args).to(dev)                                    # seeded in setup: all ranks
    if args.init and not run.resuming:                               # --init: start from these weights
        weights = C.optional("weights", "--init needs weights.py next to this file")
        weights.init_weights(args.init, model, model.encoder, "siammae")
    C.set_grad_checkpointing(model, args.grad_ckpt)
    opt = C.make_optimizer(model, peak_lr, args.weight_decay, args.betas, dev)
    start = H.resume_run(run, "siammae", args, model, opt, data={"train": dataset})   # global step
    net, ddp = H.distribute(torch.compile(model) if args.compile else model, run)

    def save(step, **kw):                                            # snapshot=True: the encoder alone
        C.save_run(run, "siammae", args, step // ipe, step, model.encoder, model, opt, **kw)
    log = C.Logger(run, args, total, start, ipe, per_step=pairs)
    if log.done:                                                     # a finished or stopped run, rerun
        return
    C.print0(f"{len(dataset)} videos, {args.epochs} effective epochs = {passes} passes of {ipe} "
             f"steps, {total} steps, {videos} videos = {pairs} pairs/step, lr {peak_lr:.3g} "
             f"(blr x {videos} videos / 256)")
    probe = probe_pairs(dataset, args) if args.probe_every and C.is_main() else None

    batches = C.Batches(loader, ipe, args.max_unreadable)          # from the checkpoint's step on

    for epoch in range(start // ipe, args.stop_epoch or passes):    # epoch = one pass over the videos
        if epoch * ipe >= start:                                     # a fresh epoch: masks and drop path from
            C.seed_epoch(args.seed, epoch, run.rank)                 # (seed, epoch, rank); resumed: the checkpoint's
        model.train()
        for it, (clips, _) in batches.epoch(epoch, start):
            step = epoch * ipe + it
            lr = C.cosine_schedule(step, total, peak_lr, args.min_lr, warmup)
            C.set_hparams(opt, lr)
            x = C.normalize(clips.to(dev, non_blocking=True).flatten(0, 1))   # (B*R, 2, 3, S, S)
            f1, f2 = x[:, 0], x[:, 1]
            ids_keep, ids_restore, mask = random_masking(f2.shape[0], grid, args.mask_ratio,
                                                         device=dev)
            opt.zero_grad(set_to_none=True)
            loss, parts = train_step(net, f1, f2, ids_keep, ids_restore, mask, args, micro * R,
                                     run.autocast, run.scaler.scale, ddp)
            parts["grad_norm"] = C.optimizer_step(run, opt, model.parameters())   # MAE: no clipping
            if probe is not None and ((step + 1) % args.probe_every == 0 or step + 1 == total):
                log.write({"step": step + 1, **f1_probe(model, probe, args, run.autocast)})
            stop = C.end_step(run, log, save, batches, step + 1, epoch, parts, lr=lr)
            if stop:
                return                                               # preempted, --stop-step: saved
        save((epoch + 1) * ipe)
        every = 10 * args.log_every                                  # short passes (DAVIS: 1 step):
        quiet = ipe < every and (epoch + 1) * ipe // every == epoch * ipe // every   # one picture per
        if not quiet or epoch + 1 == passes:                         # 10 log lines, and the last
            picture(run, model, f1, f2, ids_keep, ids_restore, mask, args, epoch, (epoch + 1) * ipe)


if __name__ == "__main__":
    H.main(train, Args)
