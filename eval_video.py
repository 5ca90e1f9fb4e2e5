"""Video label propagation (DAVIS-2017 semi-supervised protocol) for video checkpoints (SiamMAE).

  python eval_video.py --ckpt runs/siammae/checkpoint.pth --data /davis
  python eval_video.py --ckpt runs/siammae/checkpoint.pth --data synthetic [--random-init]

The first frame's object masks are propagated through each video with the frozen encoder's
patch features (last layer, after the final norm, L2-normalised). For frame t, each patch takes a
soft label from its top-k most similar patches among the context frames, with weights
softmax(affinity / T). Flags: --n-context 20 --topk 7 --radius 20 --temperature 0.7 (top-k and T
from ../shared/methods/siammae.md).

Context (as CRW's test.py, which SiamMAE / CropMAE evaluate with): the first frame as long-term
memory, matched over the whole frame, plus the previous n-context frames, matched only within a
spatial radius (cells at distance < radius). Difference: CRW pads the start of the video with
n-context copies of the first frame, so early frames draw their top-k from duplicates of it; here
the short-term memory holds only the frames seen so far (the first frame once).

Label geometry. Frames are resized (short side --short-side, aspect kept) and cropped at the
bottom/right to a multiple of the patch size; the patch grid covers that crop. First-frame labels
get the same resize (nearest) and crop, then each cell takes the label at its patch's centre pixel
(index p/2 inside the patch). Propagated soft labels are upsampled bilinearly with
align_corners=False (cell values sit at patch centres, as sampled), the uncovered bottom/right
border (< p pixels) repeats the last row/column, then argmax, and a nearest resize back to the
annotation size. DINO instead stretches frames and labels to multiples of 64 px and samples
labels with PIL's nearest (also patch centres); CRW downsamples labels to the feature grid. All
three sample at patch centres; ours does not stretch the aspect ratio.

Data: DAVIS-2017 layout (JPEGImages/480p/<video>/*.jpg, Annotations/480p/<video>/*.png palette
masks, ImageSets/2017/val.txt), or `synthetic` (moving-shape clips of synthetic.py, val split).
Metrics: J (region IoU) and F (boundary F-measure, boundary tolerance 0.008 x image diagonal, as
the DAVIS toolkit), per object, on all frames but the first and last, void pixels (label 255)
left out of both as the toolkit does; J&F = (J + F) / 2. Where no
frame beyond the first is annotated (DAVIS test-dev), --output writes the predictions and the
scores are null.
"""
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import common as C
from eval_linear import load_encoder


@dataclass
class Args:
    """Label-propagation evaluation (J&F) of a checkpoint's encoder."""
    ckpt: str = field(default=None, metadata={"help": "checkpoint.pth (siammae, or any image method)"})
    data: str = field(default=None, metadata={"help": "DAVIS-2017 root, or 'synthetic'"})
    split: str = field(default="val", metadata={"help": "DAVIS split scored: the videos listed in ImageSets/2017/<split>.txt"})
    short_side: int = field(default=480, metadata={"help": "resize frames so the short side is this (0 = native)"})
    n_context: int = field(default=20, metadata={"help": "previous frames in the short-term memory (radius-limited)"})
    topk: int = 7
    radius: float = 20.0
    temperature: float = 0.7
    model: str = field(default=None, metadata={"help": "ViT size (tiny|small|base|large): picks the "
                       "heads of a foreign checkpoint of non-standard width; checked against any checkpoint"})
    patch_size: int = field(default=None, metadata={"help": "checked against the checkpoint's patch "
                            "size"})
    random_init: bool = False
    output: str = field(default=None, metadata={"help": "write predicted masks as DAVIS palette PNGs here"})
    device: str = None


# ----------------------------------------------------------------------------------------------
# Propagation
# ----------------------------------------------------------------------------------------------
def radius_mask(h, w, radius):
    """(hw, hw) bool: cell pairs of an h x w grid at distance < radius (CRW's MaskedAttention), from
    exact integer squared distances."""
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    yy, xx = yy.flatten(), xx.flatten()
    return (yy[:, None] - yy[None]) ** 2 + (xx[:, None] - xx[None]) ** 2 < radius ** 2


def propagate(feats, labels0, n_context=20, topk=7, radius=20.0, temperature=0.7):
    """feats (T, h, w, D) L2-normalised patch features; labels0 (h, w, C) first-frame soft labels.
    Context of frame t: frame 0 (any position) + frames max(0, t - n_context) .. t - 1 (positions
    at distance < radius cells). Returns soft labels (T, h, w, C); frame 0 keeps labels0."""
    T, h, w, D = feats.shape
    near = radius_mask(h, w, radius)                                           # (hw, hw)
    f0, l0 = feats[0].reshape(h * w, D), labels0.reshape(h * w, -1)
    mem_f, mem_l = ([f0], [l0]) if n_context else ([], [])                     # short-term memory
    out = [labels0]
    for t in range(1, T):
        f = feats[t].reshape(h * w, D)
        kf = torch.stack([f0] + mem_f)                                         # (1 + M, hw, D)
        aff = torch.einsum("nd,mkd->nmk", f, kf) / temperature                 # (hw, 1 + M, hw)
        aff[:, 1:] = aff[:, 1:].masked_fill(~near[:, None, :], float("-inf"))  # long-term: no radius
        aff = aff.reshape(h * w, -1)
        val, idx = aff.topk(min(topk, aff.shape[1]), dim=1)                    # (hw, k)
        wgt = torch.softmax(val, dim=1)
        lab = (wgt[..., None] * torch.cat([l0] + mem_l)[idx]).sum(1)           # (hw, C)
        out.append(lab.reshape(h, w, -1))
        mem_f.append(f)
        mem_l.append(lab)
        drop = max(0, len(mem_f) - n_context)                                  # keep the last n_context (a
        del mem_f[:drop], mem_l[:drop]                                         # negative slice end would cut more)
    return torch.stack(out)


# ----------------------------------------------------------------------------------------------
# Metrics (DAVIS definitions)
# ----------------------------------------------------------------------------------------------
def jaccard(pred, gt, void=None):
    """Region similarity J = |P & G| / |P | G| for boolean masks, void pixels (label 255) left out of
    both; 1 when the union is empty (DAVIS db_eval_iou)."""
    keep = np.ones_like(gt, dtype=bool) if void is None else ~void
    union = (np.logical_or(pred, gt) & keep).sum()
    return 1.0 if union == 0 else (np.logical_and(pred, gt) & keep).sum() / union


def boundary(mask):
    """One-pixel boundary of a boolean mask: pixels that differ from the right, lower or lower-right
    neighbour (DAVIS seg2bmap at the mask's own resolution)."""
    m = mask.astype(bool)
    e, s, se = np.zeros_like(m), np.zeros_like(m), np.zeros_like(m)
    e[:, :-1], s[:-1, :], se[:-1, :-1] = m[:, 1:], m[1:, :], m[1:, 1:]
    b = (m ^ e) | (m ^ s) | (m ^ se)
    b[-1, :], b[:, -1] = m[-1, :] ^ e[-1, :], m[:, -1] ^ s[:, -1]
    b[-1, -1] = False
    return b


def _dilate(b, r):
    if r == 0:
        return b
    k = torch.arange(-r, r + 1)
    disk = ((k[:, None] ** 2 + k[None] ** 2) <= r * r).float()[None, None]
    x = torch.from_numpy(b.astype(np.float32))[None, None]
    return (F.conv2d(x, disk, padding=r)[0, 0] > 0).numpy()


def f_measure(pred, gt, void=None, bound_th=0.008):
    """Boundary F = 2PR / (P + R), boundaries matched within ceil(bound_th * diagonal) pixels; void
    pixels are cleared from both masks first (DAVIS f_measure)."""
    if void is not None:
        pred, gt = pred & ~void, gt & ~void
    r = math.ceil(bound_th * math.hypot(*pred.shape))
    bp, bg = boundary(pred), boundary(gt)
    if bp.sum() == 0 and bg.sum() == 0:
        return 1.0
    if bp.sum() == 0 or bg.sum() == 0:
        return 0.0
    precision = (bp & _dilate(bg, r)).sum() / bp.sum()
    recall = (bg & _dilate(bp, r)).sum() / bg.sum()
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def davis_videos(root, split):
    """(name, frames, masks) of each video listed in ImageSets/2017/<split>.txt; masks[t] is None where
    frame t has no annotation. Anything missing or unreadable is a one-line error naming the file."""
    img_root, ann_root = os.path.join(root, "JPEGImages", "480p"), os.path.join(root, "Annotations", "480p")
    if not os.path.isdir(img_root) or not os.path.isdir(ann_root):
        raise C.UserError(f"--data {root}: expected DAVIS layout JPEGImages/480p/ and Annotations/480p/")
    lst = os.path.join(root, "ImageSets", "2017", f"{split}.txt")
    if not os.path.isfile(lst):                 # all of Annotations/ would mix the train and val videos
        raise C.UserError(f"--data {root}: no {os.path.relpath(lst, root)}, the list of the --split {split} videos")
    names = open(lst).read().split()
    if not names:
        raise C.UserError(f"{lst} lists no video")

    def read(path, convert=None):
        try:
            with Image.open(path) as im:
                return im.convert(convert) if convert else np.array(im)
        except Exception as e:
            raise C.UserError(f"cannot read {path} ({type(e).__name__}: {e})") from None
    for v in names:
        if not os.path.isdir(os.path.join(img_root, v)):
            raise C.UserError(f"video {v} listed in {lst} has no folder {os.path.join(img_root, v)}")
        frames = sorted((f for f in os.listdir(os.path.join(img_root, v)) if f.lower().endswith(C.IMG_EXTS)),
                        key=C.frame_order)                        # 2.jpg before 10.jpg
        if not frames:
            raise C.UserError(f"video {v}: no frames in {os.path.join(img_root, v)}")
        ann = [os.path.join(ann_root, v, os.path.splitext(f)[0] + ".png") for f in frames]
        if not os.path.isfile(ann[0]):
            raise C.UserError(f"video {v}: no first-frame annotation {ann[0]}")
        masks = [read(a) if os.path.isfile(a) else None for a in ann]
        if not any(i not in (0, 255) for i in np.unique(masks[0])):
            raise C.UserError(f"video {v}: its first-frame annotation {ann[0]} has no object to propagate")
        yield v, [read(os.path.join(img_root, v, f), "RGB") for f in frames], masks


def synthetic_videos():
    from synthetic import SyntheticVideos
    ds = SyntheticVideos("val")
    for i in range(len(ds)):
        clip, _ = ds.load(i)
        yield f"synthetic_{i:03d}", [clip.load(t) for t in range(len(clip))], [clip.mask(t) for t in range(len(clip))]


PALETTE = [v for i in range(256) for v in
           [sum(((i >> (3 * j + c)) & 1) << (7 - j) for j in range(8)) for c in range(3)]]   # PASCAL/DAVIS palette


# ----------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------
def resize_short(im, short_side, resample):
    """PIL image with its short side resized to short_side (0 = unchanged), aspect kept."""
    if not short_side:
        return im
    W, H = im.size
    s = short_side / min(W, H)
    return im.resize((round(W * s), round(H * s)), resample)


@torch.no_grad()
def frame_features(enc, frames, short_side, device):
    """List of PIL frames -> (T, h, w, D) L2-normalised last-layer patch tokens (after the final norm)
    of each frame resized to short_side and cropped at the bottom/right to (h p, w p)."""
    p = enc.patch_size
    out = []
    for im in frames:
        im = resize_short(im, short_side, Image.BILINEAR)
        W, H = im.size
        x = C.normalize(C.to_uint8(im)[:, :H // p * p, :W // p * p][None].to(device))
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            tok = enc(x)[:, 1:].float()
        out.append(F.normalize(tok, dim=-1).view(H // p, W // p, -1).cpu())
    return torch.stack(out)


def labels_to_grid(gt0, ids, p, short_side):
    """(H, W) first-frame ids -> (h, w, C) one-hot labels at the patch centres of the frame grid
    (same resize and crop as frame_features), C = 1 + len(ids) with background first."""
    lab = np.asarray(resize_short(Image.fromarray(gt0), short_side, Image.NEAREST))
    h, w = lab.shape[0] // p, lab.shape[1] // p
    centre = lab[p // 2:h * p:p, p // 2:w * p:p]                                       # (h, w)
    return torch.stack([torch.from_numpy(centre == i) for i in [0] + ids], -1).float()


def grid_to_frame(soft, p, size, out_size):
    """(T, h, w, C) soft labels -> (T, H, W) argmax class index: bilinear to (h p, w p) with cell values
    at patch centres, the uncovered border (< p px) repeats the edge, nearest resize to out_size."""
    T, h, w, _ = soft.shape
    up = F.interpolate(soft.permute(0, 3, 1, 2), scale_factor=p, mode="bilinear", align_corners=False)
    W, H = size
    up = F.pad(up, (0, W - w * p, 0, H - h * p), mode="replicate")                     # (T, C, H, W)
    idx = up.argmax(1)
    if (H, W) != tuple(out_size):
        idx = F.interpolate(idx[:, None].float(), size=tuple(out_size), mode="nearest-exact")[:, 0].long()
    return idx


def evaluate_video(enc, frames, masks, a, short_side, device):
    gt0 = masks[0]
    H, W = gt0.shape
    ids = [int(i) for i in np.unique(gt0) if i not in (0, 255)]
    feats = frame_features(enc, frames, short_side, device)                   # (T, h, w, D)
    p = enc.patch_size
    lab0 = labels_to_grid(gt0, ids, p, short_side)                            # (h, w, C)
    assert lab0.shape[:2] == feats.shape[1:3], (lab0.shape, feats.shape)
    soft = propagate(feats, lab0, a.n_context, a.topk, a.radius, a.temperature)   # (T, h, w, C)
    size = resize_short(frames[0], short_side, Image.BILINEAR).size
    pred = torch.tensor([0] + ids)[grid_to_frame(soft, p, size, (H, W))].numpy().astype(np.uint8)
    pred[0] = gt0
    T = len(frames)
    J, Fm = {i: [] for i in ids}, {i: [] for i in ids}
    for t in range(1, T - 1):                                                  # DAVIS: not first / last
        if masks[t] is None:
            continue
        void = masks[t] == 255                                                # DAVIS: VOID_LABEL
        for i in ids:
            J[i].append(jaccard(pred[t] == i, masks[t] == i, void))
            Fm[i].append(f_measure(pred[t] == i, masks[t] == i, void))
    return pred, {i: (float(np.mean(J[i])), float(np.mean(Fm[i]))) for i in ids if J[i]}


def evaluate(a):
    if not a.ckpt or not a.data:
        raise C.UserError("--ckpt and --data are required (a DAVIS-2017 root or 'synthetic')")
    for k in ("topk", "radius", "temperature"):
        if not getattr(a, k) > 0:
            raise C.UserError(f"--{k} must be positive, got {getattr(a, k)}")
    if a.n_context < 0 or a.short_side < 0:
        raise C.UserError("--n-context and --short-side must be >= 0")
    device = C.resolve_device(a.device)
    if a.output:
        C.check_writable(a.output, "--output")
        C._OUT[0] = a.output                                                  # main's closing line
    enc, ckpt = load_encoder(a.ckpt, a.random_init, a.model, a.patch_size)
    if 0 < a.short_side < enc.patch_size:
        raise C.UserError(f"--short-side {a.short_side} is below the patch size {enc.patch_size}: a frame would "
                          "have no patch")
    enc = enc.to(device)
    synthetic = a.data == "synthetic"
    short_side = 0 if synthetic else a.short_side                  # synthetic clips: native 64 px
    videos = synthetic_videos() if synthetic else davis_videos(a.data, a.split)
    n_videos, Js, Fs = 0, [], []                                   # Js, Fs: each object's mean over its frames
    for name, frames, masks in videos:
        pred, per_obj = evaluate_video(enc, frames, masks, a, short_side, device)
        j, f = [v[0] for v in per_obj.values()], [v[1] for v in per_obj.values()]
        Js, Fs, n_videos = Js + j, Fs + f, n_videos + 1
        print(f"{name:24s} " + (f"J {100 * np.mean(j):5.1f}  F {100 * np.mean(f):5.1f}  objects {len(j)}" if j else
                                "no annotated frame to score (frames 1 .. T-2)"), flush=True)
        if a.output:
            os.makedirs(os.path.join(a.output, name), exist_ok=True)
            for t, m in enumerate(pred):
                im = Image.fromarray(m, mode="P")
                im.putpalette(PALETTE)
                im.save(os.path.join(a.output, name, f"{t:05d}.png"))
    if not Js and not a.output:                    # e.g. DAVIS test-dev: first-frame masks only
        raise C.UserError(f"no video of {a.data} has an annotated frame to score beyond the first: give --output "
                          "to write the predicted masks")
    res = {"method": ckpt["method"], "random_init": a.random_init, "videos": n_videos,
           "J_mean": 100 * float(np.mean(Js)) if Js else None, "F_mean": 100 * float(np.mean(Fs)) if Js else None}
    res["JF_mean"] = (res["J_mean"] + res["F_mean"]) / 2 if Js else None
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}))
    return res


if __name__ == "__main__":
    C.main(evaluate, Args)
