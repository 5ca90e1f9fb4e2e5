"""Does this working tree train the same weights as a git revision? For a change that promises to be
numerically identical (a refactor): each method's short run on --data synthetic (nano, 2 epochs of
3 steps of 8, stopped after step 2 and resumed across the epoch's end), from the same seed, once
with the revision's files (`git archive` into a temporary folder) and once with these, their
checkpoints compared tensor by tensor: the online network, the EMA target, the evaluated encoder,
the optimiser's state and the step.

  python scripts/same_training.py HEAD~1                   # every method
  python scripts/same_training.py 8c15df7 --methods msn can
  python scripts/same_training.py HEAD~1 --methods msn cmae conmim can --flags="--gpu-aug --resident 32"

Prints one line a method (identical, or the first tensor that differs and by how much); exit 1 where
one differs. CPU, fp32, no compile: the same kernels on both sides.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--data", "synthetic", "--model", "nano", "--batch-size", "8", "--epochs", "2", "--steps-per-epoch", "3",
         "--workers", "0", "--device", "cpu", "--no-compile", "--log-every", "1", "--seed", "3"]


def train(src, method, out, flags=()):
    """The run in folder `src` (its method file), stopped after step 2, then resumed to its end."""
    for stop in (["--stop-step", "2"], []):
        own = ["--epochs", "4"] if method == "siammae" else ["--no-knn"]   # SiamMAE: passes x 2; no k-NN
        cmd = [sys.executable, os.path.join(src, f"{method}.py"), *FLAGS, *own, *flags, *stop, "--output-dir", out]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=src)
        if r.returncode:
            raise SystemExit(f"error: {method} in {src}: {(r.stderr or r.stdout).strip().splitlines()[-1]}")
    return torch.load(os.path.join(out, "checkpoint.pth"), map_location="cpu", weights_only=True)


def tensors(tree, prefix=""):
    """{path: tensor} of the tensors in a nested checkpoint (dicts and lists)."""
    if torch.is_tensor(tree):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else []
    return {k: v for key, sub in items for k, v in tensors(sub, f"{prefix}/{key}").items()}


def differ(a, b):
    """None where the checkpoints hold the same step and tensors, else what differs first."""
    if a["step"] != b["step"]:
        return f"step {a['step']} vs {b['step']}"
    for part in ("model", "target", "encoder", "optimizer"):
        ta, tb = tensors(a.get(part) or {}), tensors(b.get(part) or {})
        if ta.keys() != tb.keys():
            return f"{part}: other tensors ({sorted(ta.keys() ^ tb.keys())[:3]})"
        for k in ta:
            if ta[k].shape != tb[k].shape or not torch.equal(ta[k], tb[k]):
                gap = (ta[k].double() - tb[k].double()).abs().max().item() if ta[k].shape == tb[k].shape else "shape"
                return f"{part}{k}: max |difference| {gap}"
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rev", help="the git revision to compare against (e.g. HEAD~1, a commit)")
    p.add_argument("--methods", nargs="+", default=["msn", "cmae", "conmim", "can", "siammae"])
    p.add_argument("--flags", default="", help="more flags for both runs (e.g. the device paths: --gpu-aug)")
    a = p.parse_args()
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        old = os.path.join(tmp, "rev")
        os.makedirs(old)
        tar = subprocess.run(["git", "-C", ROOT, "archive", a.rev, "*.py"], capture_output=True)
        if tar.returncode:
            raise SystemExit(f"error: git archive {a.rev}: {tar.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", old], input=tar.stdout, check=True)
        for m in a.methods:
            flags = a.flags.split()
            why = differ(train(old, m, os.path.join(tmp, f"{m}_rev"), flags),
                         train(ROOT, m, os.path.join(tmp, f"{m}_now"), flags))
            failed |= why is not None
            print(f"{m}: {'identical to ' + a.rev if why is None else 'DIFFERS: ' + why}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
