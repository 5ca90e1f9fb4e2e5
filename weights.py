"""Every weights file this project reads or writes, in one place: the evaluated ViT rebuilt from a
file, each file format's reader, the --export writer, and --init of the training scripts.

Read by read_weights(path) -> (format, record); load_encoder(path) rebuilds the ViT from the record:
  ours           a checkpoint of a training script (checkpoint.pth), a --keep-every snapshot
                 (encoder_step*.pth) or an eval_finetune.py checkpoint: {"method", "vit", "encoder",
                 "args", ...}; one from before --weight-init reads as it is
  export         an --export folder, or its encoder.pth / encoder.safetensors (config.json beside it
                 gives the ViT and its pooling)
  msn-official   the official MSN file: `target_encoder`, `module.` prefix (its `fc` head left out)
  mae-style      a dict with a `model` state dict: MAE, CAN, DeiT, BEiT, ConMIM releases
  timm           a plain state dict: timm / DeiT ViTs (layer scale `ls1.gamma` read as BEiT's
                 `gamma_1`; a position table without a [CLS] row, timm's no_embed_class, given a
                 zero one: the same function), timm / BEiT Beit (shared or per-block relative
                 position bias, q / v biases, layer scale)
Any of these as .safetensors (the package needed only to read or write one). Heads, decoders,
projectors, prototypes and mask tokens are left out, said by name; the BEiT index buffers are
recomputed; any other tensor (register tokens, norm_pre, a distillation token, ...) is a one-line
refusal naming it: nothing is dropped unsaid.
Written: export() -> encoder.pth, encoder.safetensors where that package is, config.json (how timm
rebuilds it, strict, the pooling, the preprocessing); each file whole (temp + rename), no lock file.
"""
import functools
import json
import math
import os
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

import common as C

DEFAULT_POOL = {"msn": "cls-prenorm", "cmae": "mean", "conmim": "mean", "can": "mean",
                "siammae": "mean", "finetune": "mean"}   # eval_finetune's head: the mean patch token


# ----------------------------------------------------------------------------------------------
# The evaluated encoder: a plain ViT with timm's key names, rebuilt from any checkpoint's `vit`
# config (each method file has its own training ViT; tests/test_interop.py pins that they agree)
# ----------------------------------------------------------------------------------------------
SIZES = {"nano": (64, 2, 2), "micro": (128, 4, 4), "tiny": (192, 12, 3), "small": (384, 12, 6),
         "base": (768, 12, 12), "large": (1024, 24, 16)}                # width, depth, heads
HEADS = {192: 3, 384: 6, 768: 12, 1024: 16}                            # timm's ViT-Ti/S/B/L
POOLS = ("cls", "cls-prenorm", "mean")


class Attention(nn.Module):
    """qkv_bias "qkv": one qkv bias (timm ViT); "qv": BEiT's learned q and v biases, k bias 0;
    "none". rel_pos: this block's own BEiT relative position bias table for a rel_pos x rel_pos
    patch grid (fine-tuning expands the shared one)."""

    def __init__(self, dim, heads, qkv_bias="qkv", rel_pos=None):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias == "qkv")
        self.proj = nn.Linear(dim, dim)
        if qkv_bias == "qv":
            self.q_bias = nn.Parameter(torch.zeros(dim))
            self.v_bias = nn.Parameter(torch.zeros(dim))
        if rel_pos is not None:                                      # timm Beit's per-block names
            self.grid = rel_pos
            table = torch.zeros((2 * rel_pos - 1) ** 2 + 3, heads)
            self.relative_position_bias_table = nn.Parameter(table)
            self.register_buffer("relative_position_index", relative_position_index(rel_pos),
                                 persistent=False)

    def qkv_bias(self):
        """The bias of the qkv projection: timm's one, BEiT's q and v with k at 0, or None."""
        if hasattr(self, "q_bias"):
            return torch.cat((self.q_bias, torch.zeros_like(self.v_bias), self.v_bias))
        return self.qkv.bias

    def forward(self, x, bias=None, hw=None):                        # (B, T, D), bias (heads, T, T)
        B, T, D = x.shape                                            # hw: the patch grid (own table)
        qkv = F.linear(x, self.qkv.weight, self.qkv_bias())
        q, k, v = qkv.view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        if hasattr(self, "relative_position_bias_table"):
            bias = grid_bias(self.relative_position_bias_table, self.relative_position_index,
                             self.grid, hw)
        mask = None if bias is None else bias.to(q.dtype).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(B, T, D))


def relative_position_index(grid, gw=None):
    """BEiT's index (1 + N, 1 + N) into the ((2 gh - 1)(2 gw - 1) + 3)-row table of a grid x gw
    patch grid (gw: grid; square, the same as conmim.py's)."""
    gh, gw = grid, gw or grid
    yx = torch.stack(torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")).flatten(1)
    rel = (yx[:, :, None] - yx[:, None, :]).permute(1, 2, 0) + torch.tensor([gh - 1, gw - 1])
    n_rel = (2 * gh - 1) * (2 * gw - 1) + 3
    index = torch.zeros(gh * gw + 1, gh * gw + 1, dtype=torch.long)
    index[1:, 1:] = rel[..., 0] * (2 * gw - 1) + rel[..., 1]
    index[0, :], index[:, 0], index[0, 0] = n_rel - 3, n_rel - 2, n_rel - 1
    return index


def grid_bias(table, index, grid, hw=None):
    """(heads, 1 + N, 1 + N) bias for an hw = (gh, gw) patch grid from a table and index made for a
    grid x grid one (hw None: that one). Another grid: the table's (2 grid - 1)^2 offset rows
    resized bicubically to (2 gh - 1) x (2 gw - 1), the offsets stretched as the absolute position
    tables here are (timm's resize_rel_pos_bias_table_simple; BEiT's segmentation code spaces its
    points geometrically instead), the 3 [CLS] rows kept."""
    if hw is not None and tuple(hw) != (grid, grid):
        n, heads = (2 * grid - 1) ** 2, table.shape[1]
        rows = table[:n].T.reshape(1, heads, 2 * grid - 1, 2 * grid - 1).float()
        rows = F.interpolate(rows, size=(2 * hw[0] - 1, 2 * hw[1] - 1), mode="bicubic",
                             align_corners=False)
        table = torch.cat([rows.reshape(heads, -1).T.to(table.dtype), table[n:]])
        if torch.compiler.is_compiling():                           # built in the graph, once
            index = relative_position_index(*hw).to(table.device)
        else:
            index = grid_index(*hw, table.device)
    return relative_bias(table, index)


@functools.lru_cache(maxsize=16)
def grid_index(gh, gw, device):
    """relative_position_index(gh, gw) on a device, made once per grid (not in every block's
    forward); a normal tensor even when first asked for under inference_mode, so that a later
    training forward can save it for backward."""
    with torch.inference_mode(False):
        return relative_position_index(gh, gw).to(device)


def relative_bias(table, index):
    """(heads, 1 + N, 1 + N) attention bias: the table's row for each token pair's relative
    offset."""
    n = index.shape[0]
    return table[index.view(-1)].view(n, n, -1).permute(2, 0, 1)


class RelativePositionBias(nn.Module):
    def __init__(self, grid, heads):
        super().__init__()
        self.grid = grid
        table = torch.zeros((2 * grid - 1) ** 2 + 3, heads)
        self.relative_position_bias_table = nn.Parameter(table)
        self.register_buffer("relative_position_index", relative_position_index(grid),
                             persistent=False)

    def forward(self, hw=None):                                      # (heads, 1 + N, 1 + N)
        return grid_bias(self.relative_position_bias_table, self.relative_position_index,
                         self.grid, hw)


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
    """Pre-norm block; drop_path: stochastic depth (used by eval_finetune.py only); layer_scale:
    BEiT's gamma_1 / gamma_2 (None: none); qkv_bias / rel_pos: see Attention."""

    def __init__(self, dim, heads, mlp_ratio=4.0, drop_path=0.0, layer_scale=None, qkv_bias="qkv",
                 rel_pos=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads, qkv_bias, rel_pos)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        if layer_scale is not None:
            self.gamma_1 = nn.Parameter(torch.full((dim,), float(layer_scale)))
            self.gamma_2 = nn.Parameter(torch.full((dim,), float(layer_scale)))
        self.drop_path = drop_path

    def forward(self, x, bias=None, hw=None):
        a = self.attn(self.norm1(x), bias, hw)
        if hasattr(self, "gamma_1"):
            a = self.gamma_1 * a
        x = x + drop_path(a, self.drop_path, self.training)
        m = self.mlp(self.norm2(x))
        if hasattr(self, "gamma_2"):
            m = self.gamma_2 * m
        return x + drop_path(m, self.drop_path, self.training)


class PatchEmbed(nn.Module):
    def __init__(self, patch_size, dim, in_chans=3):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, patch_size, patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


def sincos_pos_embed(dim, grid):
    """MAE's fixed 2-D sin-cos table (grid*grid, dim): [x sin, x cos, y sin, y cos]."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4.0))
    axis = torch.arange(grid, dtype=torch.float64)
    ys, xs = torch.meshgrid(axis, axis, indexing="ij")
    return torch.cat([f(p.flatten()[:, None] * omega[None]) for p in (xs, ys)
                      for f in (torch.sin, torch.cos)], 1).float()


class ViT(nn.Module):
    """forward(x, norm=True) -> (B, 1+N, D), [CLS] first. The position table is a parameter here (a
    checkpoint's fixed sin-cos buffer loads into it), interpolated bicubically at other sizes. BEiT
    (ConMIM): pos_embed "none", rel_pos_bias "shared" (one table, pre-training's layout, key
    rel_pos_bias.*) or "block" (one per block, fine-tuning's: load_encoder(per_block_rel_pos=True)
    copies the shared table into every block, as BEiT's run_class_finetuning), layer_scale, qkv_bias
    "qv"; at another patch grid its tables are resized (grid_bias).
    --random-init draws the weights as the method's own ViT does (init "trunc": DeiT / MSN,
    "xavier": MAE / CMAE / CAN / SiamMAE, "beit": ConMIM), in the same order, for the run's seed:
    the run's own initial encoder for MSN, CMAE and ConMIM; CAN's and SiamMAE's training models draw
    the whole model at once (MAE's initialize_weights), so there it is another draw of the same
    initialisation (a run's first checkpoint, --stop-step 1 at lr 0, holds its own start)."""

    def __init__(self, img_size=224, patch_size=16, dim=384, depth=12, heads=6, mlp_ratio=4.0,
                 pos_embed="learned", init="trunc", drop_path=0.0, rel_pos_bias=None,
                 layer_scale=None, qkv_bias="qkv", in_chans=3, **_):
        super().__init__()
        table = "none" if pos_embed == "none" else "learned"           # a sin-cos one is saved
        self.config = dict(img_size=img_size, patch_size=patch_size, dim=dim, depth=depth,
                           heads=heads, mlp_ratio=mlp_ratio, pos_embed=table, init=init)
        extra = dict(rel_pos_bias=rel_pos_bias, layer_scale=layer_scale, qkv_bias=qkv_bias)
        default = dict(rel_pos_bias=None, layer_scale=None, qkv_bias="qkv")
        self.config.update({k: v for k, v in extra.items()
                            if pos_embed == "none" or v != default[k]})
        self.config |= {"in_chans": in_chans} if in_chans != 3 else {}             # RGB's: unsaid
        self.patch_size = patch_size
        self.dim = dim
        self.grid = img_size // patch_size
        self.patch_embed = PatchEmbed(patch_size, dim, in_chans)
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
        rates = torch.linspace(0, drop_path, depth).tolist()
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio, p, layer_scale, qkv_bias,
                                          block_rel) for p in rates)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                conv = isinstance(m, nn.Conv2d)
                if init == "beit":
                    nn.init.trunc_normal_(m.weight, std=0.02, a=-0.02, b=0.02)
                elif init == "xavier":
                    flat = m.weight.view(m.weight.shape[0], -1) if conv else m.weight
                    nn.init.xavier_uniform_(flat)
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
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
            bias = self.rel_pos_bias((gh, gw)) if hasattr(self, "rel_pos_bias") else None
            x = C.run_blocks(self.blocks, x, getattr(self, "grad_ckpt", False), bias, (gh, gw))
            return self.norm(x) if norm else x
        x = x + resize_pos_embed(self.pos_embed, gh, gw)[:, 1:].to(x.dtype)
        cls = self.cls_token + self.pos_embed[:, :1]
        x = torch.cat([cls.expand(x.shape[0], -1, -1), x], dim=1)
        x = C.run_blocks(self.blocks, x, getattr(self, "grad_ckpt", False))
        return self.norm(x) if norm else x


def resize_pos_embed(pe, gh, gw):
    """A position table (1, 1 + g * g, D) (the [CLS] row first) for a gh x gw patch grid: the patch
    rows interpolated bicubically when the grid differs (timm's resample_abs_pos_embed; also
    --init's), the [CLS] row as it is."""
    g = math.isqrt(pe.shape[1] - 1)
    if (gh, gw) == (g, g):
        return pe
    grid = pe[:, 1:].reshape(1, g, g, -1).permute(0, 3, 1, 2).float()
    grid = F.interpolate(grid, size=(gh, gw), mode="bicubic", align_corners=False)
    rows = grid.permute(0, 2, 3, 1).reshape(1, gh * gw, -1).to(pe.dtype)
    return torch.cat([pe[:, :1], rows], dim=1)


# ----------------------------------------------------------------------------------------------
# Reading: each format's reader gives one record {"method", "vit" (the config), "encoder" (its
# state dict in this file's names), "args", and where known "step", "pool", "left_out", "notes"}
# ----------------------------------------------------------------------------------------------
ENCODER_KEY = re.compile(
    r"cls_token|pos_embed|patch_embed\.proj\.(weight|bias)|norm\.(weight|bias)"
    r"|rel_pos_bias\.relative_position_bias_table"
    r"|blocks\.\d+\.((norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)"
    r"|attn\.(q_bias|v_bias|relative_position_bias_table)|gamma_1|gamma_2)")
LAYER_SCALE = re.compile(r"(blocks\.\d+)\.ls([12])\.gamma")          # timm's names for BEiT's gammas
RECOMPUTED = re.compile(r"(.+\.)?(relative_position_index|k_bias)")  # BEiT's buffers: from the grid
LEFT_OUT = re.compile(r"(head|head_dist|fc_norm|attn_pool|fc|lm_head|decoder\w*|mask_token"
                      r"|projector|predictor|prototypes|pixel_decoder|feature_decoder)(\..+)?")
EXPORT_FILES = ("encoder.pth", "encoder.safetensors")


def read_file(path):
    """What a weights file holds: torch.load's object (tensors only), or a .safetensors file's
    dict."""
    if not path.endswith(".safetensors"):
        return C.load_checkpoint(path, ours=False)
    if not os.path.isfile(path):
        raise C.UserError(f"checkpoint {path} does not exist")
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise C.UserError(f"{path}: reading .safetensors needs the safetensors package "
                          "(pip install safetensors), or give the .pth beside it") from None
    try:
        return load_file(path)
    except Exception as e:
        raise C.UserError(f"{path} is not a readable safetensors file "
                          f"({type(e).__name__})") from None


def read_weights(path, model=None):
    """(format, record) of any file or folder this project reads (the module docstring lists them).
    model: --model, the heads of a foreign encoder of non-standard width (checked otherwise)."""
    folder = os.path.dirname(path)
    if os.path.isdir(path) or (os.path.basename(path) in EXPORT_FILES
                               and os.path.isfile(os.path.join(folder, "config.json"))):
        return "export", read_export(path)
    obj = read_file(path)                          # read once (a run's checkpoint holds its optimiser too)
    if isinstance(obj, dict) and "method" in obj and "encoder" in obj:     # a run's, a snapshot, a fine-tuned one
        obj["encoder"].pop("mask_token", None)     # as C.load_checkpoint: ConMIM's before its BEiT backbone
        return "ours", obj
    return read_foreign(obj, path, model)


def read_export(path):
    """An --export folder (or one of its encoder files): the ViT from config.json's `vit`, its
    weights from encoder.pth (else encoder.safetensors), its pooling as exported."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        config = json.load(open(os.path.join(folder, "config.json")))
        vit = dict(config["vit"])
        method = config["method"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise C.UserError(f"{path}: a folder without a readable --export config.json "
                          f"({type(e).__name__}): give a checkpoint file, or an --export "
                          "folder") from None
    if os.path.isdir(path):
        files = [os.path.join(folder, f) for f in EXPORT_FILES]
        path = next((f for f in files if os.path.isfile(f)), files[0])
    sd, _ = encoder_tensors(read_file(path), path)                 # the timm names read back
    args = {"seed": config.get("seed", 0), "holdout": config.get("holdout", 0),
            "mean": config.get("mean"), "std": config.get("std")}
    return {"method": method, "vit": vit, "encoder": sd, "args": args, "step": config.get("step"),
            "pool": config.get("pool")}


def read_foreign(obj, path, model=None):
    """(format, record) of a file not written here: the official MSN file (`target_encoder`), an
    MAE-style `model` dict or a plain timm / DeiT / BEiT state dict. The ViT's config comes from the
    tensors' shapes, its heads from --model (else timm's for the width)."""
    if not isinstance(obj, dict):
        raise C.UserError(f"{path}: not a dict of tensors")
    layouts = (("target_encoder", "msn-official"), ("model", "mae-style"))
    fmt, sd = next(((f, obj[k]) for k, f in layouts if isinstance(obj.get(k), dict)),
                   ("timm", obj))
    vit, left = encoder_tensors(sd, path, obj)
    config, notes = foreign_config(vit, path, model)
    method = {"msn-official": "msn"}.get(fmt, fmt)                  # MSN's pooling for MSN's file
    return fmt, {"method": method, "vit": config, "encoder": vit, "args": {"seed": 0},
                 "left_out": left, "notes": notes}


def encoder_tensors(sd, path, obj=None):
    """(the ViT's tensors in this file's names, {part: count} left out) of a state dict in timm's,
    DeiT's, MAE's or BEiT's names (`module.` dropped). Left out, by name: heads, decoders,
    projectors, prototypes, mask tokens; recomputed: BEiT's index buffers. Any other tensor has no
    place in this ViT: a one-line refusal naming it; so is a file without a ViT (obj: the file's
    object, whose keys the refusal lists)."""
    obj = sd if obj is None else obj
    vit = {}                                                         # the encoder's tensors, timm's names
    left = {}                                                        # left out: heads, decoders, by name
    refused = []
    for key, t in sd.items():
        if not torch.is_tensor(t):
            continue
        key = key.removeprefix("module.")
        name = LAYER_SCALE.sub(r"\1.gamma_\2", key)
        part = LEFT_OUT.fullmatch(key)
        if ENCODER_KEY.fullmatch(name):
            vit[name] = t
        elif part:
            left[part.group(1)] = left.get(part.group(1), 0) + 1
        elif not RECOMPUTED.fullmatch(key):
            refused.append(key)
    if not {"cls_token", "patch_embed.proj.weight", "blocks.0.attn.qkv.weight"} <= set(vit):
        keys = ", ".join(list(obj)[:6]) + (", ..." if len(obj) > 6 else "")
        raise C.UserError(f"{path}: unknown checkpoint layout (keys: {keys}); expected this "
                          "project's format, MSN's target_encoder, an MAE-style 'model' or a timm "
                          "ViT state dict")
    if refused:
        more = f" and {len(refused) - 1} more" if len(refused) > 1 else ""
        raise C.UserError(f"{path}: {refused[0]}{more} has no place in this project's ViT "
                          "(register tokens, norm_pre, a distillation token are other "
                          "architectures): not read")
    return vit, left


def foreign_config(vit, path, model=None):
    """(the ViT config, notes) of a foreign encoder's tensors: width, patch, depth, MLP ratio, the
    position scheme (a learned table; a table without a [CLS] row gets a zero one, which is what
    timm's no_embed_class computes; none, BEiT's, with its relative bias shared or per block), layer
    scale, the q / k / v biases. May add the [CLS] row to vit."""
    dim = vit["cls_token"].shape[-1]
    w = vit["patch_embed.proj.weight"]                               # (dim, channels, p, p)
    p = w.shape[-1]
    notes = []
    if w.shape[1] not in (1, 3):
        raise C.UserError(f"{path}: its patch embedding takes {w.shape[1]} channels and the file "
                          "does not say their normalisation: not read (this project's "
                          "checkpoints and exports of N-channel runs say it)")
    if model is not None and (model not in SIZES or SIZES[model][0] != dim):
        raise C.UserError(f"--model {model} does not match {path} (width {dim})")
    heads = SIZES[model][2] if model else HEADS.get(dim)            # None: load_encoder asks for --model
    rel = "shared" if "rel_pos_bias.relative_position_bias_table" in vit else \
        "block" if "blocks.0.attn.relative_position_bias_table" in vit else None
    mlp_ratio = vit["blocks.0.mlp.fc1.weight"].shape[0] / dim
    depth = 1 + max(int(k.split(".")[1]) for k in vit if k.startswith("blocks."))
    config = dict(patch_size=p, dim=dim, heads=heads, mlp_ratio=mlp_ratio, depth=depth)
    config |= {"in_chans": 1} if w.shape[1] == 1 else {}
    if "pos_embed" in vit:
        if rel:
            raise C.UserError(f"{path}: an absolute position table and a relative position bias "
                              "both: not a layout this project's ViT has")
        n = vit["pos_embed"].shape[1]
        if math.isqrt(n - 1) ** 2 != n - 1:
            if math.isqrt(n) ** 2 != n:
                raise C.UserError(f"{path}: pos_embed has {n} rows, not a square grid (with or "
                                  "without a [CLS] row)")
            zero = vit["pos_embed"].new_zeros(1, 1, dim)
            vit["pos_embed"] = torch.cat([zero, vit["pos_embed"]], 1)
            notes.append("pos_embed has no [CLS] row (timm's no_embed_class): a zero row added, "
                         "the same function")
        config |= dict(img_size=math.isqrt(vit["pos_embed"].shape[1] - 1) * p, pos_embed="learned",
                       init="trunc")
    else:                                                            # BEiT: the grid from the table
        table = vit.get("rel_pos_bias.relative_position_bias_table",
                        vit.get("blocks.0.attn.relative_position_bias_table"))
        grid = (math.isqrt(table.shape[0] - 3) + 1) // 2 if table is not None else 224 // p
        config |= dict(img_size=grid * p, pos_embed="none", init="beit")
    config |= dict(rel_pos_bias=rel, layer_scale=0.1 if "blocks.0.gamma_1" in vit else None,
                   qkv_bias="qv" if "blocks.0.attn.q_bias" in vit else
                   "qkv" if "blocks.0.attn.qkv.bias" in vit else "none")
    return config, notes          # layer_scale 0.1: the init value (the weights do not say it)


def pool_of(record, asked=None):
    """The pooling an evaluation uses: --pool, else the one an --export says, else the method's."""
    return asked or record.get("pool") or DEFAULT_POOL.get(record["method"], "cls")


def mean_std(record):
    """The normalisation a file's encoder was trained with: its run's --mean / --std, an export's
    config.json, else ImageNet's (foreign files)."""
    args = record.get("args") or {}
    return tuple(args.get("mean") or C.IMAGENET_MEAN), tuple(args.get("std") or C.IMAGENET_STD)


def load_encoder(path, random_init=False, model=None, patch_size=None, drop_path=0.0,
                 per_block_rel_pos=False, online=False, rgb_only=None):
    """(encoder, record) of any file read_weights reads, the ViT rebuilt from its config, loaded
    strict, in eval mode. random_init: the same ViT at its default initialisation drawn with the
    run's seed (weights not loaded). per_block_rel_pos: a BEiT encoder's shared relative position
    bias becomes one table per block, each a copy (fine-tuning, as BEiT / ConMIM's
    run_class_finetuning). online: the online network's encoder of a training checkpoint.
    rgb_only: the reading tool's name, which reads RGB images only (an encoder of other channels
    refused)."""
    fmt, ckpt = read_weights(path, model)
    if online:
        if fmt != "ours" or "model" not in ckpt:
            raise C.UserError(f"--online: {path} is not a checkpoint of this project's training "
                              "scripts (no `model`)")
        ckpt["encoder"] = online_encoder(ckpt, path)
    v = ckpt["vit"]
    if v["heads"] is None:
        raise C.UserError(f"{path}: width {v['dim']} is not a standard ViT size; give --model")
    if fmt in ("ours", "export") and model is not None and \
            SIZES.get(model, ())[:3] != (v["dim"], v["depth"], v["heads"]):
        raise C.UserError(f"--model {model} does not match {path} (width {v['dim']}, depth "
                          f"{v['depth']})")
    if patch_size is not None and patch_size != v["patch_size"]:
        raise C.UserError(f"--patch-size {patch_size} does not match {path} (patch "
                          f"{v['patch_size']})")
    if ckpt["method"] == "conmim" and v.get("pos_embed") != "none":
        print(f"{path}: a ConMIM checkpoint from before its BEiT backbone (learned absolute "
              "position embeddings, which let its objective be solved by position alone): "
              "evaluated as the plain ViT it is")
    said = [f"left out {', '.join(f'{k} ({n})' for k, n in ckpt['left_out'].items())}"] \
        if ckpt.get("left_out") else []
    chans = v.get("in_chans", 3)                               # every evaluation reads and normalises
    if rgb_only and chans != 3:
        raise C.UserError(f"{path}: its encoder takes {chans} channel(s); {rgb_only} reads RGB "
                          "images")
    mean, std = C.set_mean_std(*mean_std(ckpt), chans)         # its images as it trained
    if (mean, std) != (C.IMAGENET_MEAN, C.IMAGENET_STD):
        said.append(f"{chans} channel(s), normalised with its mean {mean} and std {std}")
    if said or ckpt.get("notes"):
        C.print0(f"{path} ({fmt}): {'; '.join(said + ckpt.get('notes', []))}")
    vit = dict(v)
    sd = ckpt["encoder"]
    if per_block_rel_pos and vit.get("rel_pos_bias") == "shared":
        vit["rel_pos_bias"] = "block"
        sd = dict(sd)
        table = sd.pop("rel_pos_bias.relative_position_bias_table", None)
        if table is not None:
            sd |= {f"blocks.{i}.attn.relative_position_bias_table": table.clone()
                   for i in range(vit["depth"])}
    torch.manual_seed(ckpt["args"].get("seed", 0))
    enc = ViT(**vit, drop_path=drop_path)
    if not random_init:
        bad = next((k for k, t in sd.items()
                    if t.is_floating_point() and not torch.isfinite(t).all()), None)
        if bad:                                                      # it would score 0 on every metric
            raise C.UserError(f"{path}: the encoder's {bad} holds NaN or infinite values (a "
                              "corrupted file, or a diverged run's weights)")
        try:
            enc.load_state_dict(sd)
        except RuntimeError as e:
            raise C.UserError(f"{path}: the encoder does not fit a ViT "
                              f"({' '.join(str(e).split())[:300]})") from None
    return enc.eval(), ckpt


def online_encoder(ckpt, path):
    """The online network's encoder in a checkpoint's `model` (MSN: net.encoder.*; CMAE, ConMIM,
    CAN, SiamMAE: encoder.*): the keys under the prefix whose names are exactly those of the
    evaluated `encoder` (for CMAE, CAN and SiamMAE the same weights: they evaluate the online
    encoder)."""
    model = ckpt.get("model") or {}
    names = set(ckpt["encoder"])
    for prefix in sorted({k[:k.index("encoder.") + 8] for k in model if "encoder." in k}):
        sd = {k[len(prefix):]: v for k, v in model.items() if k.startswith(prefix)}
        if set(sd) == names:
            return sd
    raise C.UserError(f"--online: {path}'s `model` holds no encoder with the evaluated encoder's "
                      "weights' names")


# ----------------------------------------------------------------------------------------------
# --init of a training script: the online network starts from a file's weights
# ----------------------------------------------------------------------------------------------
def init_weights(path, model, encoder, method):
    """--init PATH: the weights the online network starts from at step 0 (before its EMA target is
    copied from it, so both start there). The encoder (`encoder`, a module of `model`) from any file
    read_weights reads; a checkpoint of this project of the same method also gives the heads,
    decoders, prototypes of its `model` where a name and a shape match (another method's are left
    out, said). Every encoder tensor must be found with its shape, but a learned position table,
    interpolated to this patch grid (resize_pos_embed), and a fixed sin-cos one, which stays this
    model's own (a file's other table left out, said). A tensor of the file's encoder this model has
    no place for, or one that cannot be used, is a one-line refusal naming it. Prints what was
    loaded, started fresh, interpolated and left out. Returns the loaded {key: tensor}."""
    fmt, rec = read_weights(path)
    at = next(n for n, m in model.named_modules() if m is encoder) + "."   # the encoder's prefix
    left = [f"{k} ({n})" for k, n in (rec.get("left_out") or {}).items()]
    source = {}
    if fmt == "ours":
        what = f"a {rec['method']} checkpoint, step {rec.get('step')}"
        if rec["method"] == method:
            source = dict(rec.get("model") or {})
        elif rec.get("model"):
            left.append(f"the {rec['method']} network's heads and decoders (another method's)")
    else:
        what = {"export": f"an --export of {rec['method']}",
                "msn-official": "the official MSN layout",
                "mae-style": "an MAE-style model dict"}.get(fmt, "a timm ViT")
    source |= {at + k: v for k, v in rec["encoder"].items()}   # the evaluated encoder (MSN's, ConMIM's EMA)
    fixed = {n for n, _ in model.named_buffers() if n.endswith("pos_embed")}   # sin-cos: never learned
    own = model.state_dict()
    load = {}                                                        # the tensors loaded
    fresh = []                                                       # the model's tensors not in the file
    resized = []
    for k, v in own.items():
        src = source.get(k)
        name = k.removeprefix(at)
        if k in fixed:                                                 # this model's own, never the file's
            if src is not None and (src.shape != v.shape or not torch.equal(src.to(v.dtype), v)):
                left.append(f"{name} (the file's; this model's is fixed)")
            continue
        if src is not None and src.shape != v.shape and k == at + "pos_embed":
            src = resize_pos_embed(src, encoder.grid, encoder.grid)
            resized.append(f"{name} {math.isqrt(source[k].shape[1] - 1)}^2 -> {encoder.grid}^2")
        if src is not None and k == at + "patch_embed.proj.weight" and src.shape[1] == 3 and \
                src.shape[1] != v.shape[1] and src.shape[::2] == v.shape[::2]:
            src = adapt_channels(src, v.shape[1])
            resized.append(f"{name} 3 -> {v.shape[1]} channels (adapt_channels)")
        if src is not None and src.shape == v.shape:
            load[k] = src
        elif k.startswith(at):                                          # the encoder must come whole
            why = f"no {name}" if src is None else \
                f"{name} of shape {tuple(src.shape)}, this model's {tuple(v.shape)}"
            raise C.UserError(f"--init {path}: its encoder has {why} (another size or "
                              "architecture)")
        else:
            fresh.append(k)
    extra = sorted(k.removeprefix(at) for k in source if k.startswith(at) and k not in own)
    if extra:
        raise C.UserError(f"--init {path}: its encoder has {extra[0]}, which this model lacks "
                          f"({len(extra)} such tensors: another depth or architecture)")
    unused = [k for k in source if not k.startswith(at) and k not in own]
    if unused:                                                         # the same method, other flags
        left.append(f"{len(unused)} tensors this model does not have (e.g. {unused[0]})")
    bad = next((k for k, v in load.items()
                if v.is_floating_point() and not torch.isfinite(v).all()), None)
    if bad:
        raise C.UserError(f"--init {path}: {bad} holds NaN or infinite values")
    model.load_state_dict(load, strict=False)
    path_to_encoder = at.split(".")[:-1]                             # e.g. ["net", "encoder"]

    def count(keys):                                                 # "encoder (42), head (9)"
        groups = {"encoder": 0} if any(k.startswith(at) for k in keys) else {}    # the encoder first
        for k in keys:
            part = "encoder" if k.startswith(at) else next(p for p in k.split(".")
                                                            if p not in path_to_encoder)
            groups[part] = groups.get(part, 0) + 1
        return ", ".join(f"{g} ({n})" for g, n in groups.items()) or "nothing"
    C.print0(f"--init {path} ({what}): loaded {count(load)}; fresh: {count(fresh)}"
             + (f"; interpolated: {', '.join(resized)}" if resized else "")
             + (f"; left out: {', '.join(left)}" if left else "")
             + "".join(f"; {n}" for n in rec.get("notes", [])))
    return load


def adapt_channels(w, chans):
    """An RGB patch embedding (D, 3, p, p) for `chans` input channels, timm's adapt_input_conv rule:
    one channel: the sum of the three filters (a grey image gives the response its RGB copy gave);
    N: the filters repeated R, G, B, R, ... to N and scaled 3 / N (for N a multiple of 3 an image
    equal in every channel keeps its response)."""
    w32 = w.float()
    if chans == 1:
        return w32.sum(1, keepdim=True).to(w.dtype)
    return (w32.repeat(1, math.ceil(chans / 3), 1, 1)[:, :chans] * (3 / chans)).to(w.dtype)


# ----------------------------------------------------------------------------------------------
# Writing: --export, the encoder alone for timm and any other library
# ----------------------------------------------------------------------------------------------
TIMM_NAMES = {192: "tiny", 384: "small", 768: "base", 1024: "large"}


def timm_config(v, pool):
    """(timm.create_model's kwargs, how timm gives the evaluation's features) of a ViT config: the
    model that loads export()'s state dict strict (ConMIM's BEiT: timm's Beit, its shared table or,
    fine-tuned, one per block)."""
    beit = v.get("pos_embed") == "none"
    qkv = v.get("qkv_bias", "qkv")
    size = TIMM_NAMES.get(v["dim"], "small")
    name = "beit_base_patch16_224" if beit else f"vit_{size}_patch16_224"
    kw = dict(model_name=name, pretrained=False, num_classes=0, img_size=v["img_size"],
              patch_size=v["patch_size"], embed_dim=v["dim"], depth=v["depth"],
              num_heads=v["heads"], mlp_ratio=v["mlp_ratio"], init_values=v.get("layer_scale"))
    kw |= {"in_chans": v["in_chans"]} if v.get("in_chans", 3) != 3 else {}
    if beit:
        if qkv == "qkv":
            raise C.UserError("--export: a BEiT encoder with one qkv bias has no timm model")
        kw |= dict(use_abs_pos_emb=False, use_rel_pos_bias=v.get("rel_pos_bias") == "block",
                   use_shared_rel_pos_bias=v.get("rel_pos_bias") == "shared", qkv_bias=qkv == "qv",
                   global_pool="token")
    else:                                                            # timm's "avg" without fc_norm: our "mean"
        if qkv == "qv":
            raise C.UserError("--export: a ViT with q / v biases and a position table has no timm "
                              "model")
        kw |= dict(global_pool="avg" if pool == "mean" else "token", fc_norm=False,
                   qkv_bias=qkv == "qkv")
    how = {"cls": "vit(x)", "cls-prenorm": "vit(x) with vit.norm = torch.nn.Identity()",
           "mean": "vit.forward_features(x)[:, 1:].mean(1)" if beit else "vit(x)"}[pool]
    return kw, how


def export(out, enc, ckpt, pool, source):
    """--export OUT: the evaluated encoder alone, in timm's names, as encoder.pth (and
    encoder.safetensors where that package is; an earlier export's removed where it is not), and
    config.json: how timm rebuilds it (`timm.create_model(**config["timm"])`, load_state_dict
    strict), the pooling and how timm gives it, the preprocessing, the ViT config this module reads
    back. Each file written whole (temp + rename); nothing else is written into OUT."""
    v = ckpt["vit"]
    kw, how = timm_config(v, pool)
    sd = {k: t.contiguous() for k, t in enc.state_dict().items()}
    if v.get("pos_embed") != "none":                                 # timm's ViT names its layer scale ls1 / ls2
        sd = {re.sub(r"(blocks\.\d+)\.gamma_([12])", r"\1.ls\2.gamma", k): t for k, t in sd.items()}
    os.makedirs(out, exist_ok=True)
    C.save_checkpoint(os.path.join(out, "encoder.pth"), sd)
    st = os.path.join(out, "encoder.safetensors")
    try:
        from safetensors.torch import save_file
        save_file(sd, st + ".tmp")
        os.replace(st + ".tmp", st)
    except ImportError:                                              # optional: never required
        if os.path.exists(st):
            os.remove(st)                                            # an earlier export's: not this encoder
    run_args = ckpt.get("args", {})
    mean, std = mean_std(ckpt)
    config = {"method": ckpt["method"], "step": ckpt.get("step"),
              "source": os.path.basename(source), "seed": run_args.get("seed", 0),
              "holdout": run_args.get("holdout", 0),
              "pool": pool, "features": how, "timm": kw,
              "img_size": v["img_size"], "mean": mean, "std": std,
              "resize": "bicubic to img_size * 256 / 224, centre crop img_size "
                        "(eval_linear.eval_transform)",
              "vit": v}
    with open(os.path.join(out, "config.json.tmp"), "w") as f:
        json.dump(config, f, indent=1)
    os.replace(os.path.join(out, "config.json.tmp"), os.path.join(out, "config.json"))
    C.print0(f"the {ckpt['method']} encoder -> {out}: encoder.pth, config.json (timm: "
             f"{kw['model_name']}, pooling {pool})")
    return config
