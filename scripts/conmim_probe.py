"""ConMIM's symmetric start and its shortcuts, measured on a checkpoint (docs/RESULTS.md quotes these numbers).

  python scripts/conmim_probe.py runs/conmim/checkpoint.pth --data /data/cifar10 --split test
  python scripts/conmim_probe.py runs/sweep/checkpoint.pth --data /data/cifar10 --holdout 5000

On --images images of the split (evenly spaced, whole 32-px images, the same masks for every checkpoint: --seed),
the student and the EMA teacher in training mode (as the loss sees them, BatchNorm over the batch), no gradient:
  sym, sym_encoder   the mean pairwise cosine of an image's student outputs (projected; encoder tokens) at its masked
                     positions: 1 = every masked query alike, and then Eq. (2) cannot go below ln N (chance)
  max_bias           the relative position bias table's max |b| (zero at the official start)
  objective          Eq. (2) on these images (the weak view = the image; the teacher's view the same image)
  all_masked         the student sees no pixel (every patch [MASK]): position alone
  other_image        the keys of another image (the batch rolled by one)
  blank_teacher      the teacher fed a blank image
The three probes stay at or above chance (ln N) when the objective cannot be lowered without the image content.
Prints one JSON line.
"""
import argparse
import dataclasses
import json
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common as C  # noqa: E402
import conmim  # noqa: E402


@torch.no_grad()
def probes(student, teacher, x, mask, tau):
    """The objective and its three shortcut probes (module docstring) for student / teacher Nets, images x
    (B, 3, H, W) normalised, mask (B, N); and the symmetry measures."""
    keys = teacher(x)
    full = torch.ones_like(mask)
    tokens = student.encoder(x, mask=mask, mask_token=student.mask_token)     # (B, 1 + N, D), once
    out = student.projector(tokens)[:, 1:]                                    # = student(x, mask)
    tokens = tokens[:, 1:]
    return {"objective": conmim.conmim_loss(out, keys, mask, tau).item(),
            "all_masked": conmim.conmim_loss(student(x, full), keys, full, tau).item(),
            "other_image": conmim.conmim_loss(out, keys.roll(1, 0), mask, tau).item(),
            "blank_teacher": conmim.conmim_loss(out, teacher(torch.zeros_like(x)), mask, tau).item(),
            "sym": conmim.masked_symmetry(out, mask).item(),
            "sym_encoder": conmim.masked_symmetry(tokens, mask).item(),
            "max_bias": student.encoder.rel_pos_bias.relative_position_bias_table.abs().max().item()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    p.add_argument("ckpt")
    p.add_argument("--data", required=True, help="an image folder (e.g. CIFAR-10's, with train/ and test/)")
    p.add_argument("--split", default="test", help="test | val | train (default test)")
    p.add_argument("--holdout", type=int, default=0, help="score the N training images a run held out instead")
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        ck = C.load_checkpoint(a.ckpt, "conmim")
        fields = {f.name for f in dataclasses.fields(conmim.Args)}                # a flag since removed: dropped
        args = conmim.Args(**{k: tuple(v) if isinstance(v, list) else v for k, v in ck["args"].items() if k in fields})
        ds = C.image_dataset(a.data, "holdout" if a.holdout else a.split, holdout=a.holdout)
        if ds is None:
            raise C.UserError(f"--data {a.data} has no {a.split}/ folder")
    except C.UserError as e:
        raise SystemExit(f"error: {e}") from None
    student, teacher = conmim.Net(args), conmim.Net(args)
    student.load_state_dict(ck["model"])
    teacher.load_state_dict(ck["target"])
    idx = torch.linspace(0, len(ds) - 1, min(a.images, len(ds))).long().tolist()
    x = torch.stack([C.to_uint8(ds.load(i)[0].resize((args.img_size, args.img_size))) for i in idx])
    g = torch.Generator().manual_seed(a.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(0, 2 ** 31, (), generator=g)))
        mask = conmim.random_masking(len(x), args.img_size // args.patch_size, args.mask_ratio, args.mask_unit)
    res = probes(student.train(), teacher.train(), C.normalize(x), mask, args.tau)
    res = {"ckpt": a.ckpt, "step": ck["step"], "images": len(x),
           "chance": math.log((args.img_size // args.patch_size) ** 2), **{k: round(v, 5) for k, v in res.items()}}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
