"""What a checkpoint learned, on your images: one PNG grid of a few images (or, for SiamMAE, frame pairs).

  python scripts/visualize.py runs/cmae-cifar/checkpoint.pth /data/cifar10/test     # any image folder
  python scripts/visualize.py runs/siammae-davis/checkpoint.pth /data/DAVIS          # folders of frames, a DAVIS root

Rows, each image a column (the evaluation's resize and centre crop, at the run's image size):
  input                  the image (SiamMAE: f2, with f1, the frame it is predicted from, in a row above)
  masked input           what the encoder sees: the run's own mask ratio, a fixed draw (CMAE, CAN, SiamMAE's f2)
  reconstruction         the decoder's prediction at the masked patches, the visible ones as given (CMAE, CAN, SiamMAE)
  attention              the evaluated encoder's last block, averaged over heads: from the [CLS] token (MSN, which is
                         evaluated on it), or from the patches on average (the mean-token methods), over the image
MSN and ConMIM reconstruct nothing (their objectives compare features): input and attention only. Any file
weights.py reads (a --keep-every snapshot, an --export, the official MSN file, MAE-style, timm) gives input and
attention. Pictures are written with PIL (common.save_image_grid); nothing else is needed. Prints the path.
"""
import argparse
import dataclasses
import importlib
import math
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common as C  # noqa: E402
import eval_linear as E  # noqa: E402
import weights  # noqa: E402


@torch.no_grad()
def attention_weights(enc, x):
    """(B, heads, T, T): the softmax weights of the encoder's last block, its q / k as its Attention computes them
    (qkv or BEiT's q / v biases, the relative position bias where there is one)."""
    attn, got = enc.blocks[-1].attn, {}
    hook = attn.register_forward_pre_hook(lambda m, args: got.update(x=args[0], bias=(args + (None,) * 2)[1],
                                                                     hw=(args + (None,) * 2)[2]))
    enc(x)
    hook.remove()
    h, (B, T, D) = attn.heads, got["x"].shape
    q, k, _ = F.linear(got["x"], attn.qkv.weight, attn.qkv_bias()).view(B, T, 3, h, D // h).permute(2, 0, 3, 1, 4)
    logits = q @ k.transpose(-1, -2) / math.sqrt(D // h)                     # (B, h, T, T)
    if hasattr(attn, "relative_position_bias_table"):                      # BEiT, a table per block
        logits = logits + weights.grid_bias(attn.relative_position_bias_table, attn.relative_position_index,
                                            attn.grid, got["hw"])
    elif got["bias"] is not None:                                          # BEiT, the shared table
        logits = logits + got["bias"]
    return logits.softmax(-1)


def last_attention(enc, x, pool):
    """(B, N) attention of the encoder's last block over the N patches, averaged over heads: the [CLS] query's row
    (pool "cls" / "cls-prenorm") or the patch queries' rows averaged (pool "mean")."""
    a = attention_weights(enc, x).mean(1)                                   # (B, T, T)
    return a[:, 0, 1:] if pool.startswith("cls") else a[:, 1:, 1:].mean(1)


def heat(x, a, grid):
    """The image x (B, C, H, W) normalised, darkened where the attention a (B, N) is low and tinted red where it
    is high (the first channel, grey images: brighter): a picture in [0, 1] of C channels."""
    mean, std = (torch.tensor(v).view(-1, 1, 1) for v in C.MEAN_STD)     # the checkpoint's (weights.load_encoder)
    img = (x * std + mean).clamp(0, 1)
    tint = torch.tensor([0.6, 0.1, 0.0, *[0.0] * x.shape[1]])[:x.shape[1]].view(-1, 1, 1)
    a = a / a.amax(1, keepdim=True).clamp_min(1e-12)
    a = F.interpolate(a.view(-1, 1, grid, grid), size=x.shape[-2:], mode="nearest")
    return img * (0.15 + 0.85 * a) + tint * a * (1 - img)


def method_model(ckpt):
    """(the method file, its Args, its online network with the checkpoint's weights, or None where the file holds
    the encoder alone: a --keep-every snapshot, an --export) of a file of this project's methods, or None."""
    if ckpt.get("method") not in ("msn", "cmae", "conmim", "can", "siammae"):
        return None
    mod = importlib.import_module(ckpt["method"])
    names = {f.name for f in dataclasses.fields(mod.Args)}                  # a flag since removed: dropped
    a = mod.Args(**{k: tuple(v) if isinstance(v, list) else v for k, v in ckpt["args"].items() if k in names})
    a = dataclasses.replace(a, img_size=ckpt["vit"]["img_size"], patch_size=ckpt["vit"]["patch_size"])
    if not ckpt.get("model"):
        return mod, a, None
    net = {"msn": lambda: mod.MSN(a), "cmae": lambda: mod.CMAE(a), "conmim": lambda: mod.Net(a),
           "can": lambda: mod.CAN(a), "siammae": lambda: mod.SiamMAE(a)}[ckpt["method"]]()
    net.load_state_dict(ckpt["model"])
    return mod, a, net.eval()


@torch.no_grad()
def reconstruct(mod, a, net, x, f1=None, seed=0):
    """(masked input, reconstruction) of x (B, 3, S, S) normalised by the method's own masking and decoder; f1:
    SiamMAE's earlier frame. None where the method reconstructs nothing or the file has no decoder."""
    if mod.__name__ not in ("cmae", "can", "siammae") or net is None:
        return None
    p, grid = a.patch_size, a.img_size // a.patch_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        args = (len(x), grid, a.mask_ratio, a.mask_unit) if mod.__name__ == "cmae" else (len(x), grid, a.mask_ratio)
        keep, restore, mask = mod.random_masking(*args)
    if mod.__name__ == "cmae":
        pred = net(x, keep, restore)[0]
    elif mod.__name__ == "can":
        pred = net(x, torch.zeros(len(x)), keep, restore)[0]                # no noise added
    else:
        pred = net(f1, x, keep, restore)
    px, m = mod.patchify(x, p), mask[..., None].bool()
    if mod.__name__ != "can" or a.norm_pix:                                 # predictions in norm-pix units
        pred = mod.unnorm_pix(pred, px)
    return mod.unpatchify(px * ~m, p), mod.unpatchify(torch.where(m, pred, px), p)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    p.add_argument("ckpt")
    p.add_argument("data", help="an image folder (flat or class folders); for SiamMAE a folder of frame folders")
    p.add_argument("--images", type=int, default=8, help="columns (evenly spaced over the folder)")
    p.add_argument("--out", default=None, help="the PNG (default: visualize.png beside the checkpoint)")
    p.add_argument("--seed", type=int, default=0, help="the masks' draw")
    a = p.parse_args(argv)
    try:
        enc, ckpt = weights.load_encoder(a.ckpt)
        built = method_model(ckpt)
        size = ckpt["vit"]["img_size"]
        pool = weights.pool_of(ckpt)
        if ckpt["method"] == "siammae":
            mod, margs, net = built
            pairs = mod.probe_pairs(mod.video_dataset(a.data), margs, a.images)
            if pairs is None:
                raise C.UserError(f"{a.data}: no video whose frames can be read")
            f1, x = (C.normalize(t) for t in pairs[:2])
        else:
            ds = C.image_dataset(a.data, "train") if a.data == "synthetic" else C.ImageFiles(a.data, every=True)
            tf = E.eval_transform(size, synthetic=a.data == "synthetic")
            idx = torch.linspace(0, len(ds) - 1, min(a.images, len(ds))).round().long().unique().tolist()
            x, f1 = C.normalize(torch.stack([tf(ds.load(i)[0]) for i in idx])), None
    except C.UserError as e:
        raise SystemExit(f"error: {e}") from None
    rows, labels = ([f1], ["f1 (context)"]) if f1 is not None else ([], [])
    rows.append(x)
    labels.append("f2 (input)" if f1 is not None else "input")
    pictures = reconstruct(*built, x, f1, a.seed) if built else None    # None: the encoder alone
    if pictures:
        rows += list(pictures)
        labels += ["masked input", "reconstruction"]
    grid = size // ckpt["vit"]["patch_size"]
    rows.append(C.normalize(heat(x, last_attention(enc, x, pool), grid)))
    labels.append(f"attention ({'[CLS]' if pool.startswith('cls') else 'mean token'})")
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(a.ckpt)), "visualize.png")
    C.save_image_grid(out, rows, labels)
    print(out)
    return out


if __name__ == "__main__":
    main()
