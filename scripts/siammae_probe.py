"""Does a SiamMAE checkpoint's decoder read f1? The f1 probe of siammae.py for any checkpoint.

  python scripts/siammae_probe.py --ckpt runs/siammae/checkpoint.pth --data /DAVIS
  python scripts/siammae_probe.py --ckpt CKPT --data /DAVIS --pairs 48 --device cpu

The loss on f2's masked patches of fixed frame pairs (one pair from each of up to --pairs training videos of the
run, with its gaps and crops, and fixed masks: siammae.probe_pairs, the same pairs the run logs) with f1 = the
true earlier frame, another video's frame, a grey frame and f2 itself, and f1_gap = other - true: 0 where the
decoder ignores what f1 shows. Also the flat-patch level (predicting 0 in norm-pix space), which the objective
reaches from f2's few visible patches alone. Prints one JSON line.
"""
import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402
import harness as H  # noqa: E402
import siammae as M  # noqa: E402


def probe(ckpt, data, pairs=48, device=None):
    """The f1 probe of checkpoint file `ckpt` on the training videos of `data` its run used (its --holdout kept
    out); returns the dict that is printed."""
    c = C.load_checkpoint(ckpt, "siammae")
    names = {f.name for f in dataclasses.fields(M.Args)}
    a = M.Args(**{k: tuple(v) if isinstance(v, list) else v for k, v in c["args"].items() if k in names})
    model = M.SiamMAE(a)
    model.load_state_dict(c["model"])
    model = model.to(H.resolve_device(device))
    p = M.probe_pairs(M.video_dataset(data, holdout=a.holdout), a, pairs)
    if p is None:
        raise C.UserError(f"--data {data}: no video with readable probe frames")
    target = M.norm_pix(M.patchify(C.normalize(p[1]), a.patch_size))
    flat = M.siammae_loss(torch.zeros_like(target), target, p[4]).item()
    return {"ckpt": ckpt, "step": c["step"], "pairs": len(p[0]), **M.f1_probe(model, p, a), "flat_patch": round(flat,
                                                                                                                5)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True, help="a siammae.py checkpoint.pth")
    ap.add_argument("--data", required=True, help="the run's --data (its training videos are probed)")
    ap.add_argument("--pairs", type=int, default=48, help="probe pairs (one per video, at most the videos)")
    ap.add_argument("--device", default=None)
    a = ap.parse_args()
    try:
        print(json.dumps(probe(a.ckpt, a.data, a.pairs, a.device)))
    except C.UserError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
