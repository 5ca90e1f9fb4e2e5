"""Frozen dense probe: linear semantic segmentation of a frozen encoder's patch tokens, the
"linear" protocol of DINOv2 (its BNHead) and iBOT: the last block's patch tokens after the final
norm -> BatchNorm -> a 1x1 convolution to the classes -> the logits upsampled bilinearly to the
label map -> cross-entropy; scored by mIoU (and pixel accuracy) on the val images.

  python eval_dense.py --ckpt runs/cmae-cifar/checkpoint.pth --data DAVIS --img-size 64   # fg / bg
  python eval_dense.py --ckpt runs/siammae/checkpoint.pth --data DAVIS --img-size 64
  python eval_dense.py --pixels --patch-size 4 --data DAVIS --img-size 64    # raw-pixel baseline
  python eval_dense.py --ckpt runs/msn/checkpoint.pth --data synthetic --random-init

--data: a DAVIS-2016 root (ImageSets/480p/train.txt fits the head, val.txt is scored: every
annotated frame, background 0 / object 1), a folder with images/<split>/ and masks/<split>/ (a
PNG label map per image, same file stem: class ids, 255 ignored; train/ fits, --split is scored),
or `synthetic` (the shape images: background 0, the shape's class + 1). Reads every file the other
evaluations read (weights.py). Images are resized to --img-size on the short side (aspect kept:
a non-square grid goes through the encoder's position-table interpolation, BEiT's relative
position bias tables resized alike: weights.grid_bias) and cropped bottom / right to whole
patches; labels are resized the same way (nearest) and scored at that size.

Differences from DINOv2's linear protocol (mmsegmentation, ADE20k / VOC, 512-px crops): each
image's tokens are extracted once, with no random resize, crop, flip or photometric augmentation
(so they are cached and the head trains in seconds on a CPU); one scale; scored at the resized
size, not the original; the head trains --epochs passes over the cached train tokens with AdamW
(lr 1e-3, weight decay 1e-4, batch 16 images, cosine schedule) where DINOv2 runs 40k iterations
of 16 crops (its configs ship beside its weights, not in its repository: these values are ours).
Full fine-tuning with a UperNet or detection head is out of scope: `eval_linear.py --export OUT`
writes the encoder for mmsegmentation / detectron2 (README).

Output: one JSON line with miou, pixel_acc and the per-class IoU; --output DIR also writes each
val image's predicted label map (PNG, DAVIS palette).
"""
import json
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

import common as C
import harness as H
import eval_linear
import eval_video
import weights


@dataclass
class Args:
    """Linear segmentation of a checkpoint's frozen patch tokens (mIoU)."""
    ckpt: str = H.arg(None, "checkpoint (any file eval_linear.py reads)", group="model")
    data: str = H.arg(None, "DAVIS-2016 root, a folder with images/ and masks/, or 'synthetic'",
                      group="data")
    split: str = H.arg("val", "the scored split (DAVIS: ImageSets/480p/<split>.txt)", group="data")
    img_size: int = H.arg(None, "short side of the resized images (default: the checkpoint's "
                          "training size)", group="data", positive=True)
    model: str = H.arg(None, "ViT size, checked (eval_linear.py)", group="model")
    patch_size: int = H.arg(None, "checked against the checkpoint's; --pixels: the patch",
                            group="model", positive=True)
    random_init: bool = H.arg(False, "the same ViT at its initialisation", group="model")
    online: bool = H.arg(False, "the online network's encoder of an EMA method", group="model")
    pixels: bool = H.arg(False, "baseline, no checkpoint: each patch's normalised pixels as its "
                         "token")
    epochs: int = H.arg(40, "passes of the head over the cached train tokens", positive=True)
    batch_size: int = H.arg(16, "images a step", positive=True)
    lr: float = H.arg(1e-3, "AdamW peak lr (cosine to 0)", positive=True)
    weight_decay: float = H.arg(1e-4, "AdamW weight decay", min=0)
    max_images: int = H.arg(0, "at most this many images a split, evenly spaced (0 = all)", min=0)
    seed: int = H.arg(0, "random seed (the head, the order)")
    output: str = H.arg(None, "also write the predicted val label maps here", group="run control")
    device: str = H.arg(None, "cpu | cuda | cuda:N (default: cuda if available)",
                        group="run control")


# ----------------------------------------------------------------------------------------------
# Data: (PIL image, label map (H, W) uint8, name) of each image of a split
# ----------------------------------------------------------------------------------------------
def pairs(root, split, max_images=0):
    """(the split's (image path or PIL image, label array or path, name), davis: its labels are
    DAVIS-2016 masks), by the layout of root."""
    davis = root != "synthetic" and os.path.isdir(os.path.join(root, "ImageSets", "480p"))
    if root == "synthetic":
        from synthetic import synthetic_image
        n = {"train": 400, "val": 100}[split if split == "train" else "val"]
        out = []
        for i in range(n):
            im, label, mask = synthetic_image(i, 0, "train" if split == "train" else "val",
                                              mask=True)
            out.append((im, (mask * (label + 1)).astype(np.uint8), f"synthetic_{i:04d}"))
    elif davis:
        lst = os.path.join(root, "ImageSets", "480p", f"{split}.txt")
        if not os.path.isfile(lst):
            raise C.UserError(f"--data {root}: no ImageSets/480p/{split}.txt (DAVIS-2016)")
        out = [(f, m, f"{v}/{os.path.splitext(os.path.basename(f))[0]}")
               for v, fm in eval_video.davis2016_list(root, lst).items() for f, m in fm]
    else:
        folder, masks = (os.path.join(root, d, split) for d in ("images", "masks"))
        if not os.path.isdir(folder) or not os.path.isdir(masks):
            raise C.UserError(f"--data {root}: expected a DAVIS-2016 root (ImageSets/480p/) or "
                              f"images/{split}/ and masks/{split}/ folders")
        out = []
        for f in sorted(os.listdir(folder)):
            if not f.lower().endswith(C.IMG_EXTS):
                continue
            stem = os.path.splitext(f)[0]
            m = os.path.join(masks, stem + ".png")
            if not os.path.isfile(m):
                raise C.UserError(f"image {os.path.join(folder, f)} has no label map {m}")
            out.append((os.path.join(folder, f), m, stem))
        if not out:
            raise C.UserError(f"--data {root}: no images in {folder}")
    if max_images and len(out) > max_images:
        out = [out[i] for i in np.linspace(0, len(out) - 1, max_images).round().astype(int)]
    return out, davis


def load_pair(image, label, davis):
    """(RGB PIL image, (H, W) uint8 labels); DAVIS-2016 masks: object 1. Sizes must agree."""
    im = image if isinstance(image, Image.Image) else eval_video._read(image, "RGB")
    lab = label
    if not isinstance(label, np.ndarray):
        lab = eval_video.davis_mask(label) if davis else np.asarray(eval_video._read(label))
    if lab.ndim != 2:
        raise C.UserError(f"label map {label}: {lab.shape} is not one class id a pixel (a palette "
                          "or greyscale PNG)")
    if lab.shape != (im.size[1], im.size[0]):
        raise C.UserError(f"label map {label} is {lab.shape[1]}x{lab.shape[0]} px but its image "
                          f"is {im.size[0]}x{im.size[1]}")
    return im, lab


def resized(im, lab, short, p):
    """Image and labels with the short side `short` (aspect kept; bicubic, nearest), cropped to
    whole patches: ((3, H, W) uint8, (H, W) int64)."""
    im = eval_video.resize_short(im, short, Image.BICUBIC)
    lab = eval_video.resize_short(Image.fromarray(lab), short, Image.NEAREST)
    H_, W_ = im.size[1] // p * p, im.size[0] // p * p
    return C.to_uint8(im)[:, :H_, :W_], torch.from_numpy(np.asarray(lab)[:H_, :W_].astype(np.int64))


@torch.no_grad()
def patch_tokens(enc, x, p):
    """(1, 3, H, W) -> (h, w, D): the last block's patch tokens after the final norm, row-major."""
    tok = enc(C.normalize(x))[:, 1:]                                  # (1, h w, D)
    return tok[0].float().view(x.shape[-2] // p, x.shape[-1] // p, -1)


def extract(enc, items, davis, size, p, device):
    """[(tokens (h, w, D) on the CPU, labels (H, W))] of each item."""
    out = []
    with eval_linear.Progress(f"tokens of {len(items)} images", len(items)) as bar:
        for image, label, _ in items:
            x, lab = resized(*load_pair(image, label, davis), size, p)
            out.append((patch_tokens(enc, x[None].to(device), p).cpu(), lab))
            bar.step()
    return out


# ----------------------------------------------------------------------------------------------
# The head, its training and the score
# ----------------------------------------------------------------------------------------------
class BNHead(nn.Module):
    """DINOv2's BNHead: BatchNorm over the tokens' channels, then a 1x1 convolution (a linear map
    of each token) to the classes; the logits upsampled bilinearly to each label map's size."""

    def __init__(self, dim, classes):
        super().__init__()
        self.bn = nn.BatchNorm1d(dim)
        self.conv = nn.Linear(dim, classes)                          # = Conv2d(dim, classes, 1)

    def forward(self, grids, sizes):
        """grids: [(h, w, D)] (sizes may differ: BatchNorm's statistics are over all their tokens)
        -> [(classes, H, W)] logits at each `sizes` (H, W)."""
        flat = self.conv(self.bn(torch.cat([g.reshape(-1, g.shape[-1]) for g in grids])))
        out, at = [], 0
        for g, hw in zip(grids, sizes):
            n = g.shape[0] * g.shape[1]
            logits = flat[at:at + n].T.reshape(1, -1, g.shape[0], g.shape[1])   # (1, K, h, w)
            out.append(F.interpolate(logits, size=hw, mode="bilinear", align_corners=False)[0])
            at += n
        return out


def fit(train, classes, a, device):
    """The head trained on the cached (tokens, labels): AdamW, cosine lr, cross-entropy over the
    labelled pixels (255 ignored), --batch-size images a step."""
    head = BNHead(train[0][0].shape[-1], classes).to(device).train()
    opt = torch.optim.AdamW(head.parameters(), lr=a.lr, weight_decay=a.weight_decay)
    g = torch.Generator().manual_seed(a.seed)
    steps = a.epochs * -(-len(train) // a.batch_size)
    step = 0
    bar = eval_linear.Progress(f"the head, {a.epochs} epochs", a.epochs)
    for _ in range(a.epochs):
        order = torch.randperm(len(train), generator=g).tolist()
        for i in range(0, len(order), a.batch_size):
            batch = [train[j] for j in order[i:i + a.batch_size]]
            C.set_hparams(opt, C.cosine_schedule(step, steps, a.lr))
            logits = head([t.to(device) for t, _ in batch], [lab.shape for _, lab in batch])
            loss = F.cross_entropy(torch.cat([lg.flatten(1).T for lg in logits]),
                                   torch.cat([lab.flatten() for _, lab in batch]).to(device),
                                   ignore_index=255)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
        bar.step()
    bar.done()
    return head.eval()


@torch.no_grad()
def score(head, val, classes, device):
    """(confusion (K, K) over every labelled val pixel, predictions)."""
    hist = np.zeros((classes, classes), np.int64)
    preds = []
    for t, lab in val:
        pred = head([t.to(device)], [lab.shape])[0].argmax(0).cpu().numpy()
        hist += eval_video.confusion(lab.numpy(), pred, classes)
        preds.append(pred.astype(np.uint8))
    return hist, preds


def evaluate(a):
    H.validate(a)
    if a.pixels == bool(a.ckpt):
        raise C.UserError("give --ckpt (a checkpoint) or --pixels (the raw-pixel baseline)")
    if a.pixels and not (a.patch_size and a.img_size):
        raise C.UserError("--pixels needs --patch-size and --img-size")
    if not a.data:
        raise C.UserError("--data is required: a DAVIS-2016 root, images/ + masks/, or 'synthetic'")
    device = H.resolve_device(a.device)
    torch.manual_seed(a.seed)
    if a.pixels:
        enc, ckpt = eval_video.PatchPixels(a.patch_size), {"method": "pixels"}
        p, size = a.patch_size, a.img_size
    else:
        enc, ckpt = weights.load_encoder(a.ckpt, a.random_init, a.model, a.patch_size,
                                         online=a.online, rgb_only="eval_dense.py")
        p, size = enc.patch_size, a.img_size or ckpt["vit"]["img_size"]
    if size < p:
        raise C.UserError(f"--img-size {size} is smaller than the patch ({p} px)")
    (train_items, davis), (val_items, _) = (pairs(a.data, s, a.max_images)
                                            for s in ("train", a.split))
    enc = enc.to(device).eval()
    train = extract(enc, train_items, davis, size, p, device)
    val = extract(enc, val_items, davis, size, p, device)
    seen = [int(lab[lab != 255].max()) for _, lab in train + val if (lab != 255).any()]
    classes = max(seen + [1]) + 1
    head = fit(train, classes, a, device)
    hist, preds = score(head, val, classes, device)
    tp = np.diag(hist).astype(float)
    union = hist.sum(0) + hist.sum(1) - tp
    res = {"method": ckpt["method"], "ckpt": a.ckpt, "random_init": a.random_init,
           "online": a.online, "split": a.split, "img_size": size, "classes": classes,
           "train_images": len(train), "val_images": len(val),
           "miou": 100 * eval_video.mean_iou(hist), "pixel_acc": 100 * tp.sum() / hist.sum(),
           "iou": [round(100 * t / u, 2) if u else None for t, u in zip(tp, union)]}
    if a.output:
        os.makedirs(a.output, exist_ok=True)
        for (_, _, name), pred in zip(val_items, preds):
            out = os.path.join(a.output, name + ".png")
            os.makedirs(os.path.dirname(out), exist_ok=True)
            im = Image.fromarray(pred, "P")
            im.putpalette(eval_video.PALETTE)
            im.save(out)
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}))
    return res


if __name__ == "__main__":
    H.main(evaluate, Args)
