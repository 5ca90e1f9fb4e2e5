"""Does SiamMAE learn correspondence? Measured against the synthetic clips' ground-truth motion.

  python scripts/eval_correspondence.py --ckpt runs/siammae/checkpoint.pth                 # trained
  python scripts/eval_correspondence.py --ckpt runs/siammae/checkpoint.pth --random-init   # same ViT at init

SiamMAE's decoder predicts a later frame f2 from a few of its own patches and the whole earlier
frame f1; the paper's claim is that this teaches the encoder where things went. The synthetic val
clips (synthetic.py) know the true source in f1 of every pixel of f2 (object translation and
rotation, background drift: SyntheticClip.source), so the claim can be checked directly instead of
only through label propagation. For each val clip and each --gaps g, the pair (frame t, frame t+g)
at the clips' native size (the training size of the synthetic config), t drawn per clip and gap:

  truth   each f2 patch's source: the mean true f1 position of its pixels of the majority kind (object
          or background), in patch units; object patch: most of its pixels belong to a shape.
          Patches whose source lies outside f1 are left out. "Correct" = the chosen f1 patch is within
          one patch of the source in both axes (a 3 x 3 neighbourhood; chance ~9 / N).
  (a) enc   for each f2 patch, the f1 patch whose encoder feature (last layer, normed, as
            eval_video.py) is the most similar (cosine): accuracy, object and background patches.
  (b) attn  f2 masked at the checkpoint's --mask-ratio (the training one), the decoder's
            cross-attention from each masked f2 token over f1's patch tokens, averaged over heads
            and blocks: where it peaks, same accuracy (cross-self and cross decoders).
  (c) loss  the objective (norm-pix MSE) on f2's masked patches for the model and four trivial
            predictors: each patch's own mean ("mean": 0 in norm-pix units, a loss of ~1), one constant
            vector everywhere, the mean norm-pix target of 64 training clips ("const": what a model
            that ignores both frames can reach; flat patches of grey clips all had one target), f1's
            patch at the same place ("copy"), and f1 warped by the true motion ("oracle", bilinear;
            occluded points included). A model that uses f1 must beat "copy" on moving objects.
            The same loss with f1 replaced by another clip's frame ("other_f1") or a blank frame
            ("blank_f1") is the shortcut probe: a model that reads f1 gets worse without it.
  zero      the "no motion" baseline of (a) and (b): each f2 patch's own position as its source.
  moved     (a) and (b) on the patches that moved more than one patch (where "no motion" scores 0):
            correspondence beyond copying the same place.

Output: one JSON line per gap and a summary line; --output FILE also writes them to FILE.
"""
import json
import math
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402
import harness as H  # noqa: E402


@dataclass
class Args:
    """Correspondence of a SiamMAE checkpoint against the synthetic clips' true motion."""
    ckpt: str = H.arg(None, "siammae checkpoint.pth (trained with --data synthetic)", group="model")
    random_init: bool = H.arg(False, "the same model at its initialisation (run's seed)",
                              group="model")
    gaps: tuple = H.arg((4, 8), "frame gaps to measure, one or more (the synthetic config trains "
                        "on 2..8)", group="data", nargs="+")
    videos: int = H.arg(20, "synthetic val clips", group="data", positive=True)
    pairs: int = H.arg(4, "pairs per clip and gap (start frames drawn with --seed)",
                       group="data", positive=True)
    seed: int = H.arg(0, "random seed", group="run control", min=0)
    output: str = H.arg(None, "also write the JSON lines here", group="run control")
    device: str = H.arg(None, "cpu | cuda | cuda:N (default: cuda if available)",
                        group="run control")


# ----------------------------------------------------------------------------------------------
# Ground truth per patch, and the accuracy of a choice of f1 patches
# ----------------------------------------------------------------------------------------------
def patch_truth(src, ids, p):
    """src (H, W, 2) true f1 (x, y) of each f2 pixel, ids (H, W) object ids -> (N, 2) source of each f2
    patch in patch units (patch c's centre at c), (N,) object-patch flags, row-major patches."""
    H, W = ids.shape
    h, w = H // p, W // p
    s = src[:h * p, :w * p].reshape(h, p, w, p, 2).transpose(0, 2, 1, 3, 4).reshape(h * w, p * p, 2)
    o = (ids[:h * p, :w * p] > 0).reshape(h, p, w, p).transpose(0, 2, 1, 3).reshape(h * w, p * p)
    obj = o.mean(1) >= 0.5
    pick = np.where(obj[:, None], o, ~o)[..., None]                      # the majority kind's pixels
    pos = (s * pick).sum(1) / pick.sum(1)
    return (pos - (p - 1) / 2) / p, obj


def accuracy(choice, truth, grid, valid):
    """choice (N,) chosen f1 patch index (row-major, grid = (h, w)); truth (N, 2) source (x, y) in patch
    units; valid (N,) bool. Fraction of valid patches whose choice is within one patch in x and y."""
    h, w = grid
    cy, cx = choice // w, choice % w
    ok = (np.abs(cx - truth[:, 0]) <= 1) & (np.abs(cy - truth[:, 1]) <= 1)
    return float(ok[valid].mean()) if valid.any() else float("nan")


def nearest(f1, f2):
    """f1 (M, D), f2 (N, D) features -> (N,) index of each f2 row's most cosine-similar f1 row."""
    return (F.normalize(f2, dim=-1) @ F.normalize(f1, dim=-1).T).argmax(1)


# ----------------------------------------------------------------------------------------------
# The model's pieces: encoder features, decoder cross-attention, predictions
# ----------------------------------------------------------------------------------------------
def load_model(path, random_init=False):
    import siammae
    ckpt = C.load_checkpoint(path, "siammae")
    names = set(siammae.Args.__dataclass_fields__)
    a = siammae.Args(**{k: tuple(v) if isinstance(v, list) else v for k, v in ckpt["args"].items() if k in names})
    torch.manual_seed(a.seed)
    model = siammae.SiamMAE(a)
    if not random_init:
        model.load_state_dict(ckpt["model"])
    return model.eval(), a


@torch.no_grad()
def cross_attention(model, f1, f2, ids_keep, ids_restore):
    """(pred (B, N, p*p*3), attention (B, 1 + N, 1 + N) of f2's tokens over f1's, mean over heads and
    blocks), from hooks on the decoder's cross-attention (None for the joint decoder)."""
    maps, hooks = [], []

    def hook(m, inp, out):
        x, ctx = inp
        B, N, D = x.shape
        q = m.q(x).view(B, N, m.heads, D // m.heads).transpose(1, 2)
        k = m.kv(ctx)[..., :D].view(B, ctx.shape[1], m.heads, D // m.heads).transpose(1, 2)
        maps.append(torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D // m.heads), -1).mean(1))
    for blk in model.blocks:
        if hasattr(blk, "cross"):
            hooks.append(blk.cross.register_forward_hook(hook))
    try:
        pred = model(f1, f2, ids_keep, ids_restore)
    finally:
        for h in hooks:
            h.remove()
    return pred, (torch.stack(maps).mean(0) if maps else None)


# ----------------------------------------------------------------------------------------------
# The measurement
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def mean_target(p, clips=64, device="cpu"):
    """(p*p*3,) the mean norm-pix target over every patch of frames 0, 8, 16, 24 of `clips` TRAIN clips:
    the best constant prediction (for the MSE) that training could learn without reading any frame."""
    import siammae
    import synthetic as S
    x = torch.stack([C.to_uint8(S.SyntheticClip(i, "train").load(t)) for i in range(clips) for t in (0, 8, 16, 24)])
    return siammae.norm_pix(siammae.patchify(C.normalize(x.to(device)), p)).mean((0, 1))


def measure(model, a, gap, videos=20, pairs=4, seed=0, device="cpu"):
    import siammae
    import synthetic as S
    p = a.patch_size
    rng = np.random.default_rng([seed, gap])
    acc = {k: [] for k in ("enc_obj", "enc_bg", "enc_moved", "attn_obj", "attn_bg", "attn_moved", "zero_obj", "zero_bg",
                           "zero_attn_obj", "zero_attn_bg")}
    loss = {f"{n}_{k}": [] for k in ("obj", "bg")
            for n in ("model", "other_f1", "blank_f1", "mean", "const", "copy", "oracle")}
    const = mean_target(p, device=device)
    for v in range(videos):
        clip = S.SyntheticClip(v, "val")
        if clip.size != a.img_size:
            raise C.UserError(f"{a.img_size}px checkpoint: the synthetic clips are {clip.size}px (train with "
                              "--data synthetic and its default --img-size)")
        for _ in range(pairs):
            t1 = int(rng.integers(0, len(clip) - gap))
            x = torch.stack([C.to_uint8(clip.load(t)) for t in (t1, t1 + gap)]).to(device)
            f1, f2 = C.normalize(x).unbind(0)
            f1, f2 = f1[None], f2[None]
            src, ids = clip.source(t1, t1 + gap)
            truth, obj = patch_truth(src, ids, p)
            g = a.img_size // p
            inside = (truth > -0.5).all(1) & (truth < g - 0.5).all(1)
            own = np.arange(g * g)
            moved = (np.abs(truth - np.stack([own % g, own // g], 1)) > 1).any(1)    # where "no motion" is wrong
            # (a) encoder features
            e1, e2 = model.encoder(f1)[0, 1:], model.encoder(f2)[0, 1:]
            choice = nearest(e1, e2).cpu().numpy()
            for kind, sel in (("obj", obj), ("bg", ~obj)):
                acc[f"enc_{kind}"].append(accuracy(choice, truth, (g, g), inside & sel))
                acc[f"zero_{kind}"].append(accuracy(own, truth, (g, g), inside & sel))
            acc["enc_moved"].append(accuracy(choice, truth, (g, g), inside & moved))
            # (b) decoder cross-attention, (c) the objective and its trivial predictors
            torch.manual_seed(seed * 1000 + v)
            ids_keep, ids_restore, mask = siammae.random_masking(1, g, a.mask_ratio, device=device)
            pred, attn = cross_attention(model, f1, f2, ids_keep, ids_restore)
            m = mask[0].bool().cpu().numpy()
            if attn is not None:
                choice = attn[0, 1:, 1:].argmax(1).cpu().numpy()
                for kind, sel in (("obj", obj), ("bg", ~obj)):
                    acc[f"attn_{kind}"].append(accuracy(choice, truth, (g, g), inside & sel & m))
                    acc[f"zero_attn_{kind}"].append(accuracy(own, truth, (g, g), inside & sel & m))
                acc["attn_moved"].append(accuracy(choice, truth, (g, g), inside & moved & m))
            grid = torch.tensor(src / ((a.img_size - 1) / 2) - 1, dtype=f1.dtype, device=device)[None]
            warped = F.grid_sample(f1, grid, mode="bilinear", padding_mode="border", align_corners=True)
            target = siammae.norm_pix(siammae.patchify(f2, p))[0]
            other = C.normalize(C.to_uint8(S.SyntheticClip((v + 1) % videos, "val").load(t1)).to(device))[None]
            with torch.no_grad():
                pred_other = model(other, f2, ids_keep, ids_restore)[0].float()        # f1 of another clip
                pred_blank = model(torch.zeros_like(f1), f2, ids_keep, ids_restore)[0].float()
            for name, y in (("model", pred[0].float()), ("other_f1", pred_other), ("blank_f1", pred_blank),
                            ("mean", torch.zeros_like(target)), ("const", const.expand_as(target)),
                            ("copy", siammae.norm_pix(siammae.patchify(f1, p))[0]),
                            ("oracle", siammae.norm_pix(siammae.patchify(warped, p))[0])):
                err = ((y - target) ** 2).mean(-1).cpu().numpy()
                for kind, sel in (("obj", obj), ("bg", ~obj)):
                    if (sel & m).any():
                        loss[f"{name}_{kind}"].append(float(err[sel & m].mean()))
    mean = lambda xs: round(100 * float(np.nanmean(xs)), 1) if xs and not np.isnan(xs).all() else None  # noqa: E731
    out = {"gap": gap, **{f"acc_{k}": mean(v) for k, v in acc.items()}}
    out |= {f"loss_{k}": round(float(np.mean(v)), 4) if v else None for k, v in loss.items()}
    return out


def evaluate(a):
    H.validate(a)                                                    # ranges, finite numbers: one line each
    if not a.ckpt:
        raise C.UserError("--ckpt is required (a siammae checkpoint.pth)")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, margs = load_model(a.ckpt, a.random_init)
    model.to(device)
    rows = [measure(model, margs, g, a.videos, a.pairs, a.seed, device) for g in a.gaps]
    for r in rows:
        print(json.dumps(r))
    if a.output:
        with open(a.output, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    H.main(evaluate, Args)
