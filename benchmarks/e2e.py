"""End-to-end training speed: each method's real train() (DataLoader workers, decode, views, the
batched GPU augmentation where it is on, the step, the EMA update, logging) on an image folder,
and the share of the time the loop waited for data.

  python benchmarks/e2e.py --method all --data /imagenet --workers 8             # recipe model, 1 GPU
  python benchmarks/e2e.py --method msn --data /imagenet --batch-size 256 --no-compile   # eager
  python benchmarks/e2e.py --method all --device cpu --model nano --img-size 32 --patch-size 4 \
      --batch-size 16 --workers 2                                                # CPU smoke run

Each method trains for --steps optimiser steps of --batch-size images (default: the method's
--micro-batch, i.e. one forward/backward per step) with its own ImageNet defaults for every flag not
given here; extra flags are passed to the method's parser unchanged (e.g. --no-compile, --no-gpu-aug,
--precision, --focal-size). The log is read back: the first --log-every steps (worker start-up,
the first prefetch, compile) are dropped, and the table gives, over the rest (time-weighted):
  img/s        images per second of the whole loop (SiamMAE: pairs per second),
  step ms      wall time per optimiser step,
  data wait    the share of that time the loop was blocked on the next batch (common.Batches; near 0
               when the loader keeps up, the GPU idles for the rest).
The folder is read as many times over as the steps need (no epoch end falls in the timed steps).
Without --data, a folder of --n-images photo-sized JPEGs (and clips for SiamMAE) is generated as
benchmarks/data.py does. Numbers belong in BENCHMARKS.md with the device they came from.
"""
import argparse
import importlib
import json
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import common as C  # noqa: E402
import harness as H  # noqa: E402
from data import METHODS, Repeat, write_folder  # noqa: E402


def run(method, data, a, extra, out):
    """Train `method` for a.steps steps; returns the batch and the mean img/s, step ms and data wait
    after the warm-up steps."""
    mod = importlib.import_module(method)
    argv = ["--data", data, "--output-dir", out, "--epochs", "2" if method == "siammae" else "1",   # siammae:
            "--warmup-epochs", "0", "--steps-per-epoch", str(a.steps), "--log-every", str(a.log_every),  # 1 pass x R
            "--workers", str(a.workers), "--no-resume", "--save-every-minutes", "0"]
    argv += (["--device", a.device] if a.device else []) + ([] if method == "siammae" else ["--no-knn"]) + extra
    args = H.parse_args(mod.Args, argv)
    args.batch_size = a.batch_size or args.micro_batch or args.batch_size   # default: one forward/backward a step
    owner, name = (mod, "video_dataset") if method == "siammae" else (C, "image_dataset")
    load = getattr(owner, name)

    def repeated(*x, **kw):                    # the folder, read as often as the steps need (no epoch end)
        ds = load(*x, **kw)
        return Repeat(ds, -(-(a.steps + 1) * args.batch_size // len(ds)))
    setattr(owner, name, repeated)
    try:
        mod.train(args)
    finally:
        setattr(owner, name, load)
    recs = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
    ips, wait = summary([r for r in recs if "img_s" in r], args.batch_size, a.log_every, method)
    return args.batch_size, ips, 1000 * args.batch_size / ips, wait


def summary(recs, batch, warm, method=""):
    """(img/s, data-wait share) over the log records after step `warm`, weighted by time: each
    record covers the steps since the previous one, at its img_s, so it lasted steps x batch / img_s
    seconds; img/s = all those images / all that time (not the mean of the rates, which overstates
    it when the rate varies), the wait share likewise averaged over time."""
    steps = {r["step"]: r["step"] - prev["step"] for prev, r in zip(recs, recs[1:])}
    timed = [(steps[r["step"]] * batch / r["img_s"], r) for r in recs if r["step"] > warm and r["step"] in steps]
    if not timed:
        raise SystemExit(f"{method}: no log line after the first {warm} steps; raise --steps")
    total = sum(dt for dt, _ in timed)
    return (sum(steps[r["step"]] for _, r in timed) * batch / total,
            sum(dt * r["data_wait"] for dt, r in timed) / total)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="all", choices=METHODS + ("all",))
    p.add_argument("--data", default=None, help="image folder (DIR/train used if present); siammae: --video-data")
    p.add_argument("--video-data", default=None, help="folder of frame folders for siammae (default: generated)")
    p.add_argument("--n-images", type=int, default=256, help="JPEGs to generate when --data is not given")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--log-every", type=int, default=10, help="also the warm-up steps left out")
    p.add_argument("--batch-size", type=int, default=0, help="GLOBAL batch (default: the method's --micro-batch)")
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--device", default=None)
    a, extra = p.parse_known_args()
    if a.steps <= a.log_every:
        p.error("--steps must exceed --log-every (the first --log-every steps are warm-up)")
    with tempfile.TemporaryDirectory(prefix="e2e_") as tmp:               # generated data, checkpoints, logs
        table(a, extra, tmp)


def table(a, extra, tmp):
    """Generate the data if needed, train each method, print the table (all files under tmp)."""
    methods = METHODS if a.method == "all" else (a.method,)
    write_folder(tmp, a.n_images, images=a.data is None and methods != ("siammae",),
                 clips=a.video_data is None and "siammae" in methods)
    images, videos = a.data or os.path.join(tmp, "images"), a.video_data or os.path.join(tmp, "videos")
    dev = H.resolve_device(a.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {os.cpu_count()} cores"
    rows = []
    for m in methods:
        batch, ips, ms, wait = run(m, videos if m == "siammae" else images, a, extra, os.path.join(tmp, m))
        rows.append(f"| {m} | {batch} | {ips:.1f} | {ms:.1f} | {wait:.2f} |")
    print(f"\nend to end on {name}, torch {torch.__version__}, {a.workers} workers, {a.steps} steps "
          f"(first {a.log_every} left out), extra flags: {' '.join(extra) or 'none'}")
    print("| method | batch | img/s | step ms | data wait |\n| --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
