"""Video label propagation for video checkpoints (SiamMAE): DAVIS-2016/2017 (J&F), VIP (mIoU), JHMDB
(PCK).

  python eval_video.py --ckpt runs/siammae/checkpoint.pth --data /davis      # --task davis
  python eval_video.py --ckpt runs/siammae/checkpoint.pth --data /VIP --task vip
  python eval_video.py --ckpt runs/siammae/checkpoint.pth --data /jhmdb --task jhmdb
  python eval_video.py --ckpt runs/siammae/checkpoint.pth --data synthetic [--task vip|jhmdb]
  python eval_video.py --pixels --patch-size 8 --data /davis    # baselines: raw-pixel features, or
  python eval_video.py --copy-first --data /davis               # the first frame's labels, unmoved

The first frame's labels are propagated through each video with the frozen encoder's patch features
(last layer, after the final norm, L2-normalised). For frame t, each patch takes a soft label from
its top-k most similar patches among the context frames, with weights softmax(affinity / T).
Defaults per task (the settings CropMAE's public evaluation, alexandre-eymael/CropMAE
downstreams/propagation/util.py, uses for SiamMAE-style ViTs; DAVIS's follow CRW's protocol, which
SiamMAE evaluates with): --n-context 20 --radius 20 --temperature 0.7 everywhere, --topk 7 (davis,
jhmdb) or 10 (vip); frames: DAVIS short side 480 (--short-side, aspect kept), VIP long side 880 with
the short side scaled and floored to a multiple of 64 (--size), JHMDB stretched to 320 x 320
(--size).

Context (as CRW's test.py, which SiamMAE / CropMAE evaluate with): the first frame as long-term
memory, matched over the whole frame, plus the previous n-context frames, matched only within a
spatial radius (cells at distance < radius). Difference: CRW pads the start of the video with
n-context copies of the first frame, so early frames draw their top-k from duplicates of it; here
the short-term memory holds only the frames seen so far (the first frame once).

Label geometry (DAVIS, VIP). Frames are resized as above and cropped at the bottom/right to a
multiple of the patch size; the patch grid covers that crop. First-frame labels get the same
resize (nearest) and crop, then each cell takes the label at its patch's centre pixel (index p/2
inside the patch). Propagated soft labels are upsampled bilinearly with align_corners=False (cell
values sit at patch centres, as sampled), the uncovered bottom/right border (< p pixels) repeats
the last row/column, then argmax, and a nearest resize back to the annotation size. DINO instead
stretches frames and labels to multiples of 64 px and samples labels with PIL's nearest (also
patch centres); CRW downsamples labels to the feature grid. All three sample at patch centres.

DAVIS. Layout JPEGImages/480p/<video>/*.jpg, Annotations/480p/<video>/*.png, and the split's list,
which tells the edition: DAVIS-2017 ImageSets/2017/<split>.txt (video names; palette masks, several
objects, 255 = void) or DAVIS-2016 ImageSets/480p/<split>.txt ("frame mask" path pairs; one object,
greyscale masks where 255 = the object, no void). Every annotation must have its frame's size
(checked before any propagation). J (region IoU) and F (boundary F-measure, tolerance 0.008 x image
diagonal, as the DAVIS toolkit), per object, on all frames but the first and last, void pixels
(label 255) left out of both; J&F = (J + F) / 2. Where no frame beyond the first is annotated
(test-dev), --output writes the predictions and the scores are null.

VIP (video human parsing, 20 classes: background + 19 parts). Layout Images/<video>/*.jpg (the
annotated frames, one in 25 of the videos) and Annotations/Category_ids/<video>/<frame>.png (class
ids 0..19; 255 not scored), videos listed in lists/<split>_videos.txt. Every frame needs its
annotation. Score as CRW's eval_vip.py: one confusion histogram over every frame of every video,
the first included (it goes through the same grid round trip), IoU per class, mIoU = the mean over
classes that occur in the ground truth or the predictions.

JHMDB (15 joints). Layout Rename_Images/<action>/<video>/*.png, joint_positions/<action>/<video>/
joint_positions.mat ('pos_img', 2 x 15 x frames, 1-based pixels: scipy reads it), and the split
files <action>_test_split1.txt anywhere under the root; the videos of split 1 marked 2 (test, 268)
are scored, as CRW. Labels as CRW's JhmdbSet: each joint of the first frame (pos_img - 1, scaled to
feature cells) is a label map, a Gaussian of std 0.5 cells with peak 1 at its rounded cell (cells
within 3 std), plus a background channel (1 where no joint reaches). Differences from CRW's
draw_labelmap_np: its 4-cell window adds a column and row at -2 cells (values 3e-4), and its int()
truncates toward zero, which puts a joint within 1.5 cells of the top or left edge one cell further
in. A joint's position in frame t is read back as CRW's process_pose: the mean position of its 3
highest cells weighted by their values (CropMAE uses 5), in cells, times the frame size over the
grid size. PCK as CRW's eval_pck.py: per frame, the scale is 0.6 x the diagonal of the box around
the ground-truth joints; frame 0 not scored; each joint's normalised distances pooled over all
videos, PCK@a = % within a x scale, averaged over the joints. A joint outside the first frame cannot
be propagated: a warning line names it and it is not scored in that video (CRW's map is empty there
too, so its eval drops it).

Baselines: --random-init (the checkpoint's ViT drawn with its seed; SiamMAE's training model draws
the whole model at once, so a run's own initial encoder is its --stop-step 1 checkpoint); without a
checkpoint, --pixels (each p x p patch's normalised pixels, L2-normalised like the tokens, through
the same propagation on the same grid; --patch-size p) and --copy-first (the first frame's labels
or joints for every frame).

Synthetic (`--data synthetic`, the moving-shape clips of synthetic.py, val split, native 64 px):
davis scores each object; vip labels each object by its shape class (1..10); jhmdb propagates
each object's centre and four axis points (synthetic.SyntheticClip.keypoints).
"""
import dataclasses
import glob
import json
import math
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import common as C
import harness as H
from weights import load_encoder


TASKS = ("davis", "vip", "jhmdb")
TOPK = {"davis": 7, "vip": 10, "jhmdb": 7}                  # per-task defaults (see the docstring)
SIZE = {"vip": 880, "jhmdb": 320}
VIP_CLASSES = 20                                           # background + 19 parts
POSE_TOPK, POSE_SIGMA, PCK_AT = 3, 0.5, (0.1, 0.2)         # CRW's process_pose / JhmdbSet / the reported PCK


@dataclass
class Args:
    """Label-propagation evaluation (DAVIS J&F, VIP mIoU, JHMDB PCK) of a checkpoint's encoder."""
    ckpt: str = H.arg(None, "checkpoint.pth (siammae, or any image method)", group="model")
    data: str = H.arg(None, "DAVIS-2016 or -2017, VIP or JHMDB root (see --task), or 'synthetic'",
                      group="data")
    task: str = H.arg("davis", "davis (J&F) | vip (mIoU) | jhmdb (PCK@0.1/0.2)")
    split: str = H.arg("val", "davis: ImageSets/2017/<split>.txt (or 480p/ for 2016); vip: "
                       "lists/<split>_videos.txt; jhmdb: split 1's test videos always",
                       group="data")
    short_side: int = H.arg(None, "davis: resize frames so the short side is this (default 480; 0 "
                                  "= native)",
                            group="data", min=0)
    size: int = H.arg(None, "vip: long side (default 880, short side floored to a multiple of "
                      "64); jhmdb: square side (default 320); 0 = native", group="data", min=0)
    n_context: int = H.arg(20, "previous frames in the short-term memory (radius-limited)", min=0)
    topk: int = H.arg(None, "neighbours per patch (default 7; vip 10)", positive=True)
    radius: float = H.arg(20.0, "short-term memory radius (patch cells)", positive=True)
    temperature: float = H.arg(0.7, "softmax temperature", positive=True)
    model: str = H.arg(None, "ViT size (tiny|small|base|large): picks the heads of a foreign "
                       "checkpoint of non-standard width; checked against any checkpoint",
                       group="model")
    patch_size: int = H.arg(None, "checked against the checkpoint's patch size", group="model",
                            positive=True)
    random_init: bool = H.arg(False, "evaluate the same ViT at its initialisation", group="model")
    online: bool = H.arg(False, "evaluate the online network's encoder (the checkpoint's `model`) "
                         "instead of the evaluated one (for SiamMAE they are the same)")
    holdout: int = H.arg(0, "davis: evaluate only the N videos of --split (train) that a "
                         "siammae.py --holdout N run kept out (the lr sweep's validation)",
                         group="data", min=0)
    pixels: bool = H.arg(False, "baseline, no checkpoint: each patch's normalised pixels (3 x p^2 "
                         "numbers, p = --patch-size) as its feature, through the same propagation")
    copy_first: bool = H.arg(False, "baseline, no checkpoint: every frame's prediction is the "
                             "first frame's labels (davis, vip) or joints (jhmdb), unmoved")
    output: str = H.arg(None, "write predictions here (davis, vip: palette PNGs; jhmdb: "
                        "<video>.json keypoints)", group="run control")
    device: str = H.arg(None, "cpu | cuda | cuda:N (default: cuda if available)",
                        group="run control")


def resolved(a):
    """Args with the task's defaults in place of None (topk); the others are read where used."""
    return a if a.topk is not None else dataclasses.replace(a, topk=TOPK.get(a.task, 7))


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


def keypoint_maps(xy, h, w, sigma=POSE_SIGMA):
    """(J, 2) joint positions (x, y) in feature cells -> (h, w, 1 + J) label maps (CRW's JhmdbSet):
    channel 1 + j a Gaussian of std sigma cells, peak 1 at the joint's rounded cell, zero beyond 3
    sigma; channel 0 (background) is 1 where no joint reaches. A joint whose cell lies outside the
    grid gets an empty map."""
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    maps = [torch.zeros(h, w)]
    for x, y in xy:
        cx, cy = math.floor(x + 0.5), math.floor(y + 0.5)
        g = torch.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * sigma ** 2))
        g[((xx - cx).abs() > 3 * sigma) | ((yy - cy).abs() > 3 * sigma)] = 0
        maps.append(g if 0 <= cx < w and 0 <= cy < h else torch.zeros(h, w))
    lab = torch.stack(maps, -1)
    lab[..., 0] = (lab[..., 1:].sum(-1) == 0).float()
    return lab


def keypoints_from_maps(soft, topk=POSE_TOPK):
    """(h, w, 1 + J) propagated label maps -> (J, 2) positions (x, y) in cells: per joint, the mean
    position of its topk highest cells weighted by their values (CRW's process_pose); NaN where a
    joint's map is all zero."""
    h, w, c = soft.shape
    flat = soft[..., 1:].reshape(h * w, c - 1)                                 # (hw, J)
    val, idx = flat.topk(min(topk, h * w), dim=0)                              # (k, J)
    wgt = val / val.sum(0).clamp_min(1e-30)
    xy = torch.stack([(idx % w * wgt).sum(0), (idx // w * wgt).sum(0)], -1)    # (J, 2)
    xy[flat.sum(0) <= 0] = float("nan")
    return xy


# ----------------------------------------------------------------------------------------------
# Metrics (DAVIS definitions)
# ----------------------------------------------------------------------------------------------
def jaccard(pred, gt, void=None):
    """Region similarity J = |P & G| / |P | G| for boolean masks, void pixels (label 255) left out
    of both; 1 when the union is empty (DAVIS db_eval_iou)."""
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
    """b dilated by the closed disk of radius r (dx^2 + dy^2 <= r^2): for each row offset dy, a
    window of half-width isqrt(r^2 - dy^2) along the rows (a difference of row-wise cumulative sums
    > 0), shifted by dy (exact; the disk as a convolution is ~100x slower on a CPU at 480p)."""
    if r == 0:
        return b
    H, W = b.shape
    cs = np.zeros((H, W + 1), np.int32)
    np.cumsum(b, axis=1, out=cs[:, 1:])
    x, rows, out = np.arange(W), {}, np.zeros((H, W), bool)
    for dy in range(-r, r + 1):
        w = math.isqrt(r * r - dy * dy)
        if w not in rows:                                                       # any of b[y, x - w .. x + w]
            rows[w] = cs[:, np.minimum(x + w + 1, W)] - cs[:, np.maximum(x - w, 0)] > 0
        if dy >= 0:                                                             # out[y] |= row[y + dy]
            out[:H - dy] |= rows[w][dy:]
        else:
            out[-dy:] |= rows[w][:H + dy]
    return out


def _near(a, b, r):
    """(a & _dilate(b, r)).sum(): the pixels of a within r of a pixel of b, with b dilated only
    inside a's bounding box grown by r (the pixels of b that can reach a; exact)."""
    ys, xs = np.nonzero(a)
    if len(ys) == 0:
        return 0
    y0, x0 = max(ys.min() - r, 0), max(xs.min() - r, 0)
    y1, x1 = ys.max() + r + 1, xs.max() + r + 1
    return int((a[y0:y1, x0:x1] & _dilate(b[y0:y1, x0:x1], r)).sum())


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
    precision = _near(bp, bg, r) / bp.sum()
    recall = _near(bg, bp, r) / bg.sum()
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


def confusion(gt, pred, n):
    """(n, n) histogram of (ground truth, prediction) pixel pairs; ground-truth labels outside
    0..n-1 (255) are not counted (CRW eval_vip's fast_hist)."""
    keep = (gt >= 0) & (gt < n)
    return np.bincount(n * gt[keep].astype(np.int64) + pred[keep], minlength=n * n).reshape(n, n)


def mean_iou(hist):
    """Mean over classes of IoU = TP / (GT + predicted - TP), classes in neither left out
    (nanmean)."""
    tp = np.diag(hist).astype(float)
    union = hist.sum(0) + hist.sum(1) - tp
    with np.errstate(invalid="ignore", divide="ignore"):
        return float(np.nanmean(tp / union))


def pck(videos, thresholds=PCK_AT):
    """videos: (gt, pred) pairs of (T, J, 2) pixel positions (x, y); pred NaN where a joint is not
    propagated. Per frame, the scale is 0.6 x the diagonal of the box around the ground-truth joints
    that have a prediction (frames where it is 0 are skipped); frame 0 is not scored; each joint's
    distance / scale pooled over videos and frames; PCK@a = % of them <= a, averaged over joints
    (CRW eval_pck.py). Returns {a: PCK}."""
    dist = {}
    for gt, pred in videos:
        for t in range(1, len(gt)):
            ok = ~np.isnan(pred[t]).any(-1)                                        # (J,)
            if not ok.any():
                continue
            scale = 0.6 * np.linalg.norm(gt[t][ok].max(0) - gt[t][ok].min(0))
            if scale <= 0:
                continue
            for j in np.flatnonzero(ok):
                dist.setdefault(j, []).append(np.linalg.norm(pred[t, j] - gt[t, j]) / scale)
    if not dist:
        return {a: None for a in thresholds}
    return {a: 100 * float(np.mean([np.mean(np.array(d) <= a) for d in dist.values()]))
            for a in thresholds}


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def davis_mask(path):
    """A DAVIS-2016 annotation, (H, W) uint8: 1 on the object (>= 128 in its greyscale), else 0
    (2016's masks are 0 / 255; in 2017's palettes 255 is void)."""
    return (np.asarray(_read(path, "L")) >= 128).astype(np.uint8)


def _read(path, convert=None, size=False):
    """A PIL image converted to `convert`, or its array (labels), or with size=True only its (width,
    height) from the header; unreadable -> one line naming it."""
    try:
        with Image.open(path) as im:
            if size:
                return im.size
            if convert == "RGB":
                return C.to_rgb(im)                                 # 16-bit greyscale scaled, not clipped
            return im.convert(convert) if convert else np.array(im)
    except Exception as e:
        raise C.UserError(f"cannot read {path} ({type(e).__name__}: {e})") from None


def _listed_videos(root, lst, split, img_root):
    """(name, folder, frame names) of each video listed in lst (a file under root) whose frames are
    img_root/<name>/; a missing or empty list, folder or video is a one-line error naming it."""
    if not os.path.isfile(lst):
        raise C.UserError(f"--data {root}: no {os.path.relpath(lst, root)}, the list of the "
                          f"--split {split} videos")
    names = open(lst).read().split()
    if not names:
        raise C.UserError(f"{lst} lists no video")
    for v in names:
        folder = os.path.join(img_root, v)
        if not os.path.isdir(folder):
            raise C.UserError(f"video {v} listed in {lst} has no folder {folder}")
        yield v, folder, _frames(folder, f"video {v}")


def _frames(folder, what):
    """Frame file names of a folder in frame order (2.jpg before 10.jpg); none -> one line."""
    names = sorted((f for f in os.listdir(folder) if f.lower().endswith(C.IMG_EXTS)),
                   key=C.frame_order)
    if not names:
        raise C.UserError(f"{what}: no frames in {folder}")
    return names


def davis2016_list(root, lst):
    """{video: [(frame path, mask path)]} from a DAVIS-2016 list (ImageSets/480p/<split>.txt: one
    "/JPEGImages/480p/<video>/<frame>.jpg /Annotations/480p/<video>/<frame>.png" pair per line,
    paths from the root), videos by name, frames in frame order. A malformed line or a missing file
    is one line."""
    videos = {}
    for n, line in enumerate(open(lst), 1):
        if not line.strip():
            continue
        pair = line.split()
        if len(pair) != 2:
            raise C.UserError(f"{lst} line {n}: expected '<frame> <mask>' (DAVIS-2016), got "
                              f"{line.strip()!r}")
        frame, mask = (os.path.join(root, q.lstrip("/")) for q in pair)
        for q in (frame, mask):
            if not os.path.isfile(q):
                raise C.UserError(f"{lst} line {n}: no file {q}")
        videos.setdefault(os.path.basename(os.path.dirname(frame)), []).append((frame, mask))
    if not videos:
        raise C.UserError(f"{lst} lists no frame")
    return {v: sorted(videos[v], key=lambda fm: C.frame_order(os.path.basename(fm[0])))
            for v in sorted(videos)}


def davis_videos(root, split, holdout=0):
    """(name, frames, masks) of each video of the split; masks[t] is None where frame t has no
    annotation. The layout is recognised from its list file: DAVIS-2016, ImageSets/480p/<split>.txt
    ("frame mask" pairs; one object per video, mask 255 = the object, read as label 1, no void), or
    DAVIS-2017, ImageSets/2017/<split>.txt (video names; palette masks, 255 = void). Before any
    frame is propagated, every annotation's size is checked against its frame's. Anything missing,
    unreadable or mismatched is a one-line error naming the file."""
    img_root = os.path.join(root, "JPEGImages", "480p")
    ann_root = os.path.join(root, "Annotations", "480p")
    if not os.path.isdir(img_root) or not os.path.isdir(ann_root):
        raise C.UserError(f"--data {root}: expected DAVIS layout JPEGImages/480p/ and "
                          "Annotations/480p/")
    l16 = os.path.join(root, "ImageSets", "480p", f"{split}.txt")
    lst = os.path.join(root, "ImageSets", "2017", f"{split}.txt")   # (all of Annotations/ mixes train and val)
    if os.path.isfile(l16):
        videos = [(v, [f for f, _ in fm], [m for _, m in fm])
                  for v, fm in davis2016_list(root, l16).items()]
    elif not os.path.isfile(lst):
        raise C.UserError(f"--data {root}: no ImageSets/2017/{split}.txt, the list of the --split "
                          f"{split} videos (DAVIS-2017), nor ImageSets/480p/{split}.txt "
                          "(DAVIS-2016): neither layout")
    else:
        videos = [(v, [os.path.join(folder, f) for f in frames],
                   [os.path.join(ann_root, v, os.path.splitext(f)[0] + ".png") for f in frames])
                  for v, folder, frames in _listed_videos(root, lst, split, img_root)]
    if holdout:                                                      # the videos a siammae.py --holdout run left out
        videos = C.held_out(sorted(videos), holdout, held=True)
    for v, frames, ann in videos:                                    # all checked before any work
        if not os.path.isfile(ann[0]):
            raise C.UserError(f"video {v}: no first-frame annotation {ann[0]}")
        for f, m in zip(frames, ann):
            sm, sf = (_read(m, size=True), _read(f, size=True)) if os.path.isfile(m) else (0, 0)
            if sm != sf:
                raise C.UserError(f"video {v}: annotation {m} is {'x'.join(map(str, sm))} px but "
                                  f"its frame {f} is {'x'.join(map(str, sf))}: fix or remove the "
                                  "annotation (nothing was evaluated)")
    binary = os.path.isfile(l16)
    for v, frames, ann in videos:
        masks = [_read(m) if os.path.isfile(m) else None for m in ann]
        if binary:                                                  # 2016: 255 is the object, not void
            masks = [davis_mask(m) if os.path.isfile(m) else None for m in ann]
        if not any(i not in (0, 255) for i in np.unique(masks[0])):
            raise C.UserError(f"video {v}: its first-frame annotation {ann[0]} has no object to "
                              "propagate")
        yield v, [_read(f, "RGB") for f in frames], masks


def vip_videos(root, split):
    """(name, frames, labels) of each VIP video in lists/<split>_videos.txt: the frames of
    Images/<video>/ and their class-id maps from Annotations/Category_ids/<video>/<frame>.png."""
    img_root = os.path.join(root, "Images")
    where = (os.path.join(root, "Annotations", "Category_ids"), os.path.join(root, "Category_ids"))
    ann_root = next((d for d in where if os.path.isdir(d)), None)
    if not os.path.isdir(img_root) or ann_root is None:
        raise C.UserError(f"--data {root}: expected the VIP layout Images/<video>/ and "
                          "Annotations/Category_ids/<video>/")
    lst = os.path.join(root, "lists", f"{split}_videos.txt")
    for v, folder, frames in _listed_videos(root, lst, split, img_root):
        ann = [os.path.join(ann_root, v, os.path.splitext(f)[0] + ".png") for f in frames]
        missing = [a for a in ann if not os.path.isfile(a)]
        if missing:
            raise C.UserError(f"video {v}: frame {os.path.basename(missing[0])[:-4]} has no "
                              f"annotation {missing[0]} ({len(missing)} of {len(ann)} missing; VIP "
                              "scores every frame)")
        labels = [m[..., 0] if m.ndim == 3 and (m == m[..., :1]).all() else m   # grey saved as RGB
                  for m in map(_read, ann)]
        ok = [*range(VIP_CLASSES), 255]
        bad = next((a for a, m in zip(ann, labels) if m.ndim != 2 or np.setdiff1d(m, ok).size),
                   None)
        if bad:
            raise C.UserError(f"{bad}: not a map of class ids 0..{VIP_CLASSES - 1} (255 = not "
                              "scored)")
        yield v, [_read(os.path.join(folder, f), "RGB") for f in frames], labels


def read_joints(path):
    """pos_img of a JHMDB joint_positions.mat: (2, 15, T) 1-based pixel positions. scipy reads
    it."""
    try:
        from scipy.io import loadmat
    except ImportError:
        raise C.UserError("--task jhmdb reads joint_positions.mat with scipy: pip install "
                          "scipy") from None
    try:
        return np.asarray(loadmat(path)["pos_img"], dtype=np.float64)
    except Exception as e:
        raise C.UserError(f"cannot read pos_img from {path} ({type(e).__name__}: {e})") from None


def jhmdb_videos(root):
    """(name, frames, joints) of each video of JHMDB split 1's test set (marked 2 in the
    <action>_test_split1.txt files): frames from Rename_Images/<action>/<video>/, joints (T, 15, 2)
    0-based pixel positions (x, y) = pos_img - 1 from joint_positions/<action>/<video>/."""
    splits = sorted(glob.glob(os.path.join(root, "**", "*_test_split1.txt"), recursive=True))
    img_root, pos_root = os.path.join(root, "Rename_Images"), os.path.join(root, "joint_positions")
    if not splits or not os.path.isdir(img_root) or not os.path.isdir(pos_root):
        raise C.UserError(f"--data {root}: expected the JHMDB layout "
                          "Rename_Images/<action>/<video>/, "
                          "joint_positions/<action>/<video>/joint_positions.mat and the "
                          "<action>_test_split1.txt files")
    for lst in splits:
        action = os.path.basename(lst)[:-len("_test_split1.txt")]
        for line in open(lst):
            row = line.split()
            if len(row) != 2 or row[1] not in ("1", "2"):
                if row:
                    raise C.UserError(f"{lst}: expected '<video>.avi 1|2' lines, got "
                                      f"{line.strip()!r}")
                continue
            if row[1] != "2":
                continue
            v = os.path.splitext(row[0])[0]
            folder = os.path.join(img_root, action, v)
            mat = os.path.join(pos_root, action, v, "joint_positions.mat")
            if not os.path.isdir(folder):
                raise C.UserError(f"video {v} listed in {lst} has no folder {folder}")
            if not os.path.isfile(mat):
                raise C.UserError(f"video {v}: no joint annotation {mat}")
            frames = _frames(folder, f"video {v}")
            pos = read_joints(mat)
            if pos.ndim != 3 or pos.shape[0] != 2 or pos.shape[2] != len(frames):
                raise C.UserError(f"{mat}: pos_img is {tuple(pos.shape)}, expected (2, joints, "
                                  f"{len(frames)}) for the {len(frames)} frames of {folder}")
            images = [_read(os.path.join(folder, f), "RGB") for f in frames]
            yield v, images, pos.transpose(2, 1, 0) - 1


def synthetic_videos(task="davis", n=None):
    """The synthetic clips (val split) with the task's labels: davis object ids, vip shape classes
    (1..10, 0 = background), jhmdb every object's keypoints (T, J, 2)."""
    from synthetic import SyntheticVideos
    ds = SyntheticVideos("val", n)
    for i in range(len(ds)):
        clip, _ = ds.load(i)
        T = len(clip)
        if task == "jhmdb":
            labels = np.stack([clip.keypoints(t) for t in range(T)])
        else:
            ids = None
            if task == "vip":
                ids = np.array([0] + [o["shape"] + 1 for o in clip.objs], np.uint8)
            labels = [clip.mask(t) if ids is None else ids[clip.mask(t)] for t in range(T)]
        yield f"synthetic_{i:03d}", [clip.load(t) for t in range(T)], labels


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


def resize_frame(im, geom, resample):
    """The task's frame geometry. geom: an int, the short side (aspect kept; DAVIS); ("long", n):
    the long side to n, the short side scaled and floored to a multiple of 64 (VIP, as CropMAE); or
    ("square", n): stretched to n x n (JHMDB, as CRW). 0 / n = 0: unchanged."""
    if not isinstance(geom, tuple):
        return resize_short(im, geom, resample)
    kind, n = geom
    if not n:
        return im
    W, H = im.size
    if kind == "square":
        return im.resize((n, n), resample)
    if W > H:                                                                   # CropMAE's branches, ties -> height
        return im.resize((n, max(64, int(H * n / W) // 64 * 64)), resample)
    return im.resize((max(64, int(W * n / H) // 64 * 64), n), resample)


class PatchPixels(torch.nn.Module):
    """--pixels, the raw-pixel baseline in the encoder's place: (B, 3, H, W) -> (B, 1 + N, 3 p^2),
    each p x p patch's (normalised) pixels, row-major patches, behind a zero [CLS] as a ViT's token
    layout."""

    def __init__(self, patch_size):
        super().__init__()
        self.patch_size = patch_size

    def forward(self, x):
        p, B = self.patch_size, x.shape[0]
        t = x.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(B, -1, 3 * p * p)   # (B, N, 3p^2)
        return torch.cat([t.new_zeros(B, 1, t.shape[-1]), t], 1)


@torch.no_grad()
def frame_features(enc, frames, geom, device):
    """List of PIL frames -> (T, h, w, D) L2-normalised last-layer patch tokens (after the final
    norm) of each frame resized to geom (resize_frame) and cropped at the bottom/right to (h p, w
    p)."""
    p = enc.patch_size
    out = []
    for im in frames:
        im = resize_frame(im, geom, Image.BILINEAR)
        W, H = im.size
        x = C.normalize(C.to_uint8(im)[:, :H // p * p, :W // p * p][None].to(device))
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            tok = enc(x)[:, 1:].float()
        out.append(F.normalize(tok, dim=-1).view(H // p, W // p, -1).cpu())
    return torch.stack(out)


def labels_to_grid(gt0, ids, p, geom):
    """(H, W) first-frame ids -> (h, w, C) one-hot labels at the patch centres of the frame grid
    (same resize and crop as frame_features), C = 1 + len(ids) with background first."""
    lab = np.asarray(resize_frame(Image.fromarray(gt0), geom, Image.NEAREST))
    h, w = lab.shape[0] // p, lab.shape[1] // p
    centre = lab[p // 2:h * p:p, p // 2:w * p:p]                                       # (h, w)
    return torch.stack([torch.from_numpy(centre == i) for i in [0] + ids], -1).float()


def grid_to_frame(soft, p, size, out_size):
    """(T, h, w, C) soft labels -> (T, H, W) argmax class index: bilinear to (h p, w p) with cell
    values at patch centres, the uncovered border (< p px) repeats the edge, nearest resize to
    out_size."""
    T, h, w, _ = soft.shape
    up = F.interpolate(soft.permute(0, 3, 1, 2), scale_factor=p, mode="bilinear",
                       align_corners=False)
    W, H = size
    up = F.pad(up, (0, W - w * p, 0, H - h * p), mode="replicate")                     # (T, C, H, W)
    idx = up.argmax(1)
    if (H, W) != tuple(out_size):
        idx = F.interpolate(idx[:, None].float(), size=tuple(out_size), mode="nearest-exact")
        idx = idx[:, 0].long()
    return idx


def propagate_labels(enc, frames, gt0, a, geom, device):
    """First-frame label map gt0 (H, W) -> (T, H, W) uint8 predicted labels of every frame (frame 0
    through the same grid round trip) and the propagated ids (0, the background, not among them;
    255 never propagated)."""
    a = resolved(a)
    ids = [int(i) for i in np.unique(gt0) if i not in (0, 255)]
    if a.copy_first:                                                         # the no-motion baseline
        return np.repeat(np.asarray(gt0, np.uint8)[None], len(frames), 0), ids
    feats = frame_features(enc, frames, geom, device)                        # (T, h, w, D)
    p = enc.patch_size
    lab0 = labels_to_grid(gt0, ids, p, geom)                                 # (h, w, C)
    assert lab0.shape[:2] == feats.shape[1:3], (lab0.shape, feats.shape)
    soft = propagate(feats, lab0, a.n_context, a.topk, a.radius, a.temperature)   # (T, h, w, C)
    size = resize_frame(frames[0], geom, Image.BILINEAR).size
    labels = torch.tensor([0] + ids)[grid_to_frame(soft, p, size, gt0.shape)]
    return labels.numpy().astype(np.uint8), ids


def evaluate_video(enc, frames, masks, a, geom, device):
    """DAVIS: predicted masks (frame 0 = its annotation) and {object: (J, F)} over frames 1 ..
    T-2."""
    pred, ids = propagate_labels(enc, frames, masks[0], a, geom, device)
    pred[0] = masks[0]
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


def evaluate_parts(enc, frames, labels, a, geom, device):
    """VIP: predicted class maps and the video's (n, n) confusion histogram over all its frames."""
    pred, _ = propagate_labels(enc, frames, labels[0], a, geom, device)
    return pred, sum(confusion(g, p_, VIP_CLASSES) for g, p_ in zip(labels, pred))


def evaluate_pose(enc, frames, joints, a, geom, device, name=""):
    """JHMDB: joints (T, J, 2) ground-truth pixel positions -> predicted (T, J, 2) positions (NaN
    for a joint that cannot be propagated: outside the first frame, which a warning line names)."""
    a = resolved(a)
    if a.copy_first:                                                         # the no-motion baseline
        return np.repeat(np.asarray(joints[:1], float), len(frames), 0)
    feats = frame_features(enc, frames, geom, device)                        # (T, h, w, D)
    T, h, w, _ = feats.shape
    W, H = frames[0].size
    Wr, Hr = resize_frame(frames[0], geom, Image.BILINEAR).size
    cell = np.array([W / Wr * enc.patch_size, H / Hr * enc.patch_size])        # pixels per cell, x and y
    lab0 = keypoint_maps(joints[0] / cell, h, w)                              # (h, w, 1 + J)
    for j in torch.nonzero(lab0[..., 1:].amax((0, 1)) == 0)[:, 0].tolist():   # an empty map: outside the grid
        x, y = joints[0][j]
        print(f"warning: {name}: joint {j + 1} at ({x:.1f}, {y:.1f}) lies outside the first "
              "frame's feature grid: not propagated or scored in this video", file=sys.stderr,
              flush=True)
    soft = propagate(feats, lab0, a.n_context, a.topk, a.radius, a.temperature)
    return np.stack([keypoints_from_maps(s).numpy() * cell for s in soft])


def write_labels(folder, pred):
    os.makedirs(folder, exist_ok=True)
    for t, m in enumerate(pred):
        im = Image.fromarray(m, mode="P")
        im.putpalette(PALETTE)
        im.save(os.path.join(folder, f"{t:05d}.png"))


def evaluate(a):
    H.validate(a)                                                    # ranges, finite numbers: one line each
    baseline = a.pixels or a.copy_first
    if not (a.ckpt or baseline) or not a.data:
        raise C.UserError("--ckpt (or a baseline: --pixels, --copy-first) and --data are required "
                          "(a DAVIS-2016/2017, VIP or JHMDB root, or 'synthetic')")
    if baseline and (a.ckpt or a.random_init or a.pixels and a.copy_first):
        raise C.UserError("--pixels and --copy-first are baselines without a checkpoint: give one "
                          "of them, and no --ckpt / --random-init")
    if a.pixels and not a.patch_size:
        raise C.UserError("--pixels needs --patch-size (the cell of the propagation grid; a "
                          "checkpoint's patch size)")
    if a.task not in TASKS:
        raise C.UserError(f"--task {a.task}: choose one of {', '.join(TASKS)}")
    if a.task == "davis" and a.size is not None:
        raise C.UserError("--size is for --task vip / jhmdb: DAVIS frames are set by --short-side")
    if a.task != "davis" and a.short_side is not None:
        raise C.UserError(f"--short-side is for --task davis: --task {a.task} frames are set by "
                          "--size")
    a = resolved(a)
    device = H.resolve_device(a.device)
    if a.output:
        _lock = H.claim_dir(a.output, "--output")                   # held while this evaluation writes
    if baseline:
        enc = PatchPixels(a.patch_size or 1)
        ckpt = {"method": "pixels" if a.pixels else "copy-first"}
    else:
        enc, ckpt = load_encoder(a.ckpt, a.random_init, a.model, a.patch_size, online=a.online,
                                 rgb_only="eval_video.py")
    if a.holdout and (a.task != "davis" or a.data == "synthetic"):
        raise C.UserError("--holdout is for --task davis on a DAVIS root (the train videos a "
                          "--holdout run left out)")
    trained = ckpt.get("args", {}).get("holdout", 0) if a.ckpt and not a.random_init else a.holdout
    if a.holdout and trained != a.holdout:
        raise C.UserError(f"--holdout {a.holdout}: {a.ckpt} was trained with --holdout {trained}: "
                          "its held-out videos are not these")
    if a.online and (a.random_init or baseline):
        raise C.UserError("--online reads a checkpoint's trained online network: not with "
                          "--random-init or a baseline")
    side = a.short_side if a.task == "davis" else a.size
    side = {"davis": 480, **SIZE}[a.task] if side is None else side
    if 0 < side < enc.patch_size:
        flag = "--short-side" if a.task == "davis" else "--size"
        raise C.UserError(f"{flag} {side} is below the patch size {enc.patch_size}: a frame would "
                          "have no patch")
    enc = enc.to(device)
    synthetic = a.data == "synthetic"
    side = 0 if synthetic else side                                # synthetic clips: native 64 px
    geom = side if a.task == "davis" else ({"vip": "long", "jhmdb": "square"}[a.task], side)
    if synthetic:
        videos = synthetic_videos(a.task)
    else:
        videos = {"davis": lambda: davis_videos(a.data, a.split, a.holdout),
                  "vip": lambda: vip_videos(a.data, a.split),
                  "jhmdb": lambda: jhmdb_videos(a.data)}[a.task]()
    res = {"method": ckpt["method"], "random_init": a.random_init, "online": a.online,
           "task": a.task, "videos": 0}
    Js, Fs, hist, poses = [], [], 0, []                            # Js, Fs: each object's mean over its frames
    for name, frames, labels in videos:
        res["videos"] += 1
        if a.task == "davis":
            pred, per_obj = evaluate_video(enc, frames, labels, a, geom, device)
            j, f = [v[0] for v in per_obj.values()], [v[1] for v in per_obj.values()]
            Js, Fs = Js + j, Fs + f
            line = "no annotated frame to score (frames 1 .. T-2)"
            if j:
                line = f"J {100 * np.mean(j):5.1f}  F {100 * np.mean(f):5.1f}  objects {len(j)}"
        elif a.task == "vip":
            pred, h = evaluate_parts(enc, frames, labels, a, geom, device)
            hist = hist + h
            line = f"mIoU {100 * mean_iou(h):5.1f}  frames {len(frames)}"
        else:
            pred = evaluate_pose(enc, frames, labels, a, geom, device, name)
            poses.append((labels, pred))
            p1 = pck([poses[-1]])[0.1]                                 # None: no frame to score
            score = "-" if p1 is None else f"{p1:5.1f}"
            line = f"PCK@0.1 {score}  joints {labels.shape[1]}  frames {len(frames)}"
        print(f"{name:24s} {line}", flush=True)
        if a.output and a.task == "jhmdb":
            os.makedirs(a.output, exist_ok=True)
            with open(os.path.join(a.output, f"{name}.json"), "w") as fh:
                json.dump({"xy": np.round(pred, 2).tolist(), "note": "(frames, joints, x y) "
                                                                     "0-based pixels"}, fh)
        elif a.output:
            write_labels(os.path.join(a.output, name), pred)
    if not res["videos"]:
        raise C.UserError(f"--data {a.data}: no video to evaluate")
    if a.task == "davis":
        if not Js and not a.output:                    # e.g. DAVIS test-dev: first-frame masks only
            raise C.UserError(f"no video of {a.data} has an annotated frame to score beyond the "
                              "first: give --output to write the predicted masks")
        res.update(J_mean=100 * float(np.mean(Js)) if Js else None,
                   F_mean=100 * float(np.mean(Fs)) if Js else None)
        res["JF_mean"] = (res["J_mean"] + res["F_mean"]) / 2 if Js else None
    elif a.task == "vip":
        res.update(mIoU=100 * mean_iou(hist),
                   pixel_acc=100 * float(np.diag(hist).sum() / max(hist.sum(), 1)))
    else:
        res.update({f"PCK@{t}": v for t, v in pck(poses).items()})
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}))
    return res


if __name__ == "__main__":
    H.main(evaluate, Args)
