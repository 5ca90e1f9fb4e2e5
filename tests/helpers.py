"""Test helpers shared by the test files: CLI runs with one-line errors, exact resume, a tiny ViT checkpoint."""
import os
import socket
import subprocess
import sys

import torch

import common as C

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, cwd=ROOT, timeout=300, env=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_cmd(*args, nproc=2):
    """`torchrun --nproc_per_node=nproc <args> --device cpu` on a free port: CPU (gloo) processes even on a
    GPU host (a 1-GPU host cannot give 2 ranks a GPU each), and tests can run side by side (pytest -n)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
            *args, "--device", "cpu"]


def torchrun(*args, nproc=2, timeout=300):
    return subprocess.run(torchrun_cmd(*args, nproc=nproc), capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def one_line_error(r, *needles):
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def exact_resume(train, make_args, tmp_path, method, keys):
    """Uninterrupted 2-epoch run == run stopped after epoch 1 (--stop-epoch 1) and restarted with
    the same flags: every tensor of the checkpoint parts in `keys` is identical. Returns
    (full, part after epoch 1) checkpoints."""
    train(make_args(tmp_path / "full"))
    train(make_args(tmp_path / "part", stop_epoch=1))
    part1 = C.load_checkpoint(str(tmp_path / "part" / "checkpoint.pth"), method)
    train(make_args(tmp_path / "part"))
    full = C.load_checkpoint(str(tmp_path / "full" / "checkpoint.pth"), method)
    part = C.load_checkpoint(str(tmp_path / "part" / "checkpoint.pth"), method)
    for key in keys:
        for k, v in full[key].items():
            assert torch.equal(v, part[key][k]), (key, k)
    return full, part1


def vit_checkpoint(path, method, **vit):
    """A checkpoint in this project's format holding only a randomly initialised tiny ViT encoder (seed 0),
    for the evaluation scripts; `method` picks their per-method defaults (pooling, fine-tuning recipe)."""
    import weights as W
    vit = dict(dict(img_size=16, patch_size=4, dim=32, depth=1, heads=2), **vit)
    torch.manual_seed(0)
    C.save_checkpoint(str(path), {"method": method, "vit": vit, "encoder": W.ViT(**vit).state_dict(),
                                  "args": {"seed": 0}, "epoch": 1, "step": 1})
    return str(path)


def slim_checkpoint(src, dst):
    """The encoder of a training checkpoint, in fp16, with what the evaluation scripts read (method, ViT
    config, args): tests/data/cmae_synthetic_quickstart.pth is
    slim_checkpoint("runs/cmae/checkpoint.pth", "tests/data/cmae_synthetic_quickstart.pth")."""
    c = C.load_checkpoint(src)
    C.save_checkpoint(dst, {"method": c["method"], "vit": c["vit"], "args": c["args"], "epoch": c["epoch"],
                            "step": c["step"], "encoder": {k: v.half() if v.is_floating_point() else v
                                                           for k, v in c["encoder"].items()}})


def knn_monitor(encoder, data, size, method="cmae", holdout=0):
    """A training script's k-NN monitor (eval_linear.KNNMonitor: the method's pooling, k 20) of `encoder` on `data`,
    outside a run; returns (monitor, the records it logs). monitor(step) scores the encoder as it stands."""
    import argparse
    import contextlib
    import eval_linear as E
    records = []
    run = argparse.Namespace(device=torch.device("cpu"), autocast=contextlib.nullcontext(), ckpt="-",
                             control=argparse.Namespace(trained=None, signal=None))
    log = argparse.Namespace(end=10, write=records.append)
    args = argparse.Namespace(eval_every=0, img_size=size, data=data, workers=0, holdout=holdout)
    return E.KNNMonitor(args, run, log, encoder, method, "the encoder"), records
