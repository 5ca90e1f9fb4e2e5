"""The real-data GPU tier: each image method pre-trained on CIFAR-10 with `--preset gpu` for a fixed ~2 minutes,
then k-NN of the encoder its paper evaluates against the same run's initial encoder and raw pixels.

  python benchmarks/gpu_cifar.py --data /data/cifar10 --out gpu_check_out              # all four methods, ~10 min
  python benchmarks/gpu_cifar.py --data DIR --methods can msn --minutes 2 --workers 15
  python benchmarks/gpu_cifar.py --data DIR --small                                 # CPU dry run (nano, 3 steps)

Each method runs its real train() in this process, once, its curve from the run's own k-NN monitor (`--eval-every`
a quarter of the run: eval_linear's k-NN, k 20, T 0.07, the 10,000 test images against the 50,000 train images, of
the encoder the paper evaluates): at step 0 (the run's initial encoder), 1/4, 1/2, 3/4 and the end, each a
log.jsonl record. --minutes caps a method's run (training and its evaluations): at the cap its loop stops as on a
preemption signal (finishes the step, writes the checkpoint), the rest is skipped, said in the table, and the last
checkpoint is scored instead. Then the online encoder of MSN and ConMIM at the end (`eval_linear.py --online`) and
raw pixels. The runs are eager (--no-compile): a compile would take a large share of two minutes. Writes
<out>/gpu_cifar.json (docs/results.json's layout), <out>/gpu_cifar.png (docs/plot_results.py's picture, where
matplotlib is installed), each run's log as <out>/<method>.log.jsonl, and prints the table last. Runs go to --runs
(default a temporary folder).
"""
import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
import common as C  # noqa: E402
import harness as H  # noqa: E402
import eval_linear as E  # noqa: E402
import weights  # noqa: E402

LABEL = {"msn": "MSN (EMA target)", "cmae": "CMAE (online)", "conmim": "ConMIM (EMA teacher)", "can": "CAN (online)"}
SMALL = ["--model", "nano", "--batch-size", "8", "--epochs", "1", "--log-every", "1", "--device", "cpu"]


def train_watched(method, a, run_dir):
    """Trains `method` to the end of its preset (or the time cap), its k-NN monitor every quarter of the run; returns
    the run's log records, the seconds its training took (the monitor's evaluations left out), the steps planned,
    its args and whether the cap stopped it."""
    mod = importlib.import_module(method)
    argv = ["--data", a.data, "--preset", "gpu", "--output-dir", run_dir, "--workers", str(a.workers), "--knn",
            "--save-every-minutes", "0", "--no-compile"] + (SMALL if a.small else []) + (["--device",
                                                                                          a.device] if a.device else [])
    args = H.parse_args(mod.Args, argv)
    ipe = len(C.image_dataset(args.data, "train")) // args.batch_size          # as the loops count (full batches)
    ipe = min(ipe, args.steps_per_epoch or ipe)
    total = ipe * args.epochs
    args.eval_every = max(1, total // 4)
    spent, real = [0.0], E.KNNMonitor.__call__

    def timed(self, step, *save):                                    # the evaluations' time (with the checkpoint
        t = time.time()                                              # each writes first), left out of training's
        try:
            return real(self, step, *save)
        finally:
            spent[0] += time.time() - t
    timer = threading.Timer(60 * a.minutes, lambda: H.Control.current.stop("the --minutes cap"))   # as a signal would
    t0 = time.time()
    E.KNNMonitor.__call__ = timed
    timer.start()
    try:
        mod.train(args)
    finally:
        timer.cancel()
        E.KNNMonitor.__call__ = real
    log = [json.loads(ln) for ln in open(os.path.join(run_dir, "log.jsonl"))]
    step = C.load_checkpoint(os.path.join(run_dir, "checkpoint.pth"), method)["step"]
    return log, time.time() - t0 - spent[0], total, args, step < total


def eval_images(a):
    """eval_linear's evaluation images, decoded once for every checkpoint (its resize + centre crop, uint8): the
    train and test splits as (images, labels), test labels mapped to train's classes, and the number of classes."""
    train, test, to_train = E.splits(a.data)
    tf = E.eval_transform(32)
    out = []
    for ds in (train, test):
        xs, ys = zip(*torch.utils.data.DataLoader(C.Views(ds, tf), 1024, num_workers=a.workers))
        out.append((torch.cat(xs), torch.cat(ys)))
    return out[0], (out[1][0], to_train[out[1][1]]), len(train.classes)


def features(a, images, ckpt=None, online=False, pixels=False):
    """[train, test] features of the decoded `images` (eval_images) as eval_linear computes them: a checkpoint's
    evaluated encoder (online: its online network's) with its method's default pooling, bf16 on CUDA; or the raw
    pixels centred by the train mean. Equal to eval_linear's (tests/test_benchmarks.py)."""
    dev = H.resolve_device(a.device)
    enc, c = (E.Pixels(), {"method": "pixels"}) if pixels else weights.load_encoder(ckpt, online=online)
    enc, pool = enc.to(dev), weights.DEFAULT_POOL.get(c["method"], "cls")
    amp = torch.autocast("cuda", torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    feats = [E.extract_features(enc, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), 1024), dev,
                                lambda e, x: E.features_of(e, x, pool), amp)[0] for x, y in images[:2]]
    return [f - feats[0].mean(0) for f in feats] if pixels else feats


def knn(a, images, ckpt=None, online=False, pixels=False):
    """eval_linear's k-NN top-1 (%) (k 20, T 0.07) on those features (`eval_linear.py --mode knn`)."""
    train, test = features(a, images, ckpt, online, pixels)
    return E.knn(train, images[0][1], test, images[1][1], images[2])["knn_top1"]


def curve(a, images, method, log, run_dir, batch):
    """The run's k-NN curve [[images seen, top-1]] from its monitor's records, a capped run's last checkpoint scored
    at its end, and that checkpoint's online encoder (MSN and ConMIM evaluate their EMA network; --online) or
    None."""
    points = [[r["step"] * batch, r["knn_top1"]] for r in log if "knn_top1" in r]
    ckpt = os.path.join(run_dir, "checkpoint.pth")
    last = C.load_checkpoint(ckpt, method)["step"]
    if points[-1][0] != last * batch:                                # cut short by the cap: the last checkpoint
        points.append([last * batch, knn(a, images, ckpt)])
    return points, knn(a, images, ckpt, online=True) if method in ("msn", "conmim") else None


def record(method, log, points, online, seconds, total, args, capped):
    """A method's entry of gpu_cifar.json: its k-NN curve (init: the run's initial encoder, step 0), steps, speed
    (the run's and the loop's median per log line), losses at the start and the end, the online encoder's k-NN."""
    steps = points[-1][0] // args.batch_size
    r = {"label": LABEL[method], "knn": points, "init": points[0][1], "steps": steps, "planned_steps": total,
         "batch_size": args.batch_size, "model": args.model, "train_seconds": round(seconds, 1),
         "images_per_second": round(steps * args.batch_size / max(seconds, 1e-9)), "capped": capped}
    train = [x for x in log if "loss" in x]                          # the training records (not the monitor's)
    steady = sorted(x["img_s"] for x in train if x["step"] > 1) or [0]          # the loop's own rate per log line
    r |= {"logged_img_s": steady[len(steady) // 2], "first_loss": train[0]["loss"], "last_loss": train[-1]["loss"],
          "data_wait": sorted(x["data_wait"] for x in train)[len(train) // 2]}
    if online is not None:
        r["online"] = {"knn_top1": online}
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="CIFAR-10 as class folders: train/ and test/ (or val/)")
    p.add_argument("--methods", nargs="+", default=["msn", "cmae", "conmim", "can"])
    p.add_argument("--minutes", type=float, default=2.5, help="cap on each method's training time")
    p.add_argument("--workers", type=int, default=min(15, os.cpu_count() or 1))
    p.add_argument("--out", default="gpu_check_out", help="where gpu_cifar.json / .png go")
    p.add_argument("--runs", default=None, help="run folders (default: a temporary folder, removed at the end)")
    p.add_argument("--device", default=None)
    p.add_argument("--small", action="store_true", help="a dry run: nano models, 3 steps of 8 images, on the CPU")
    a = p.parse_args()
    if not os.path.isdir(os.path.join(a.data, "train")):
        sys.exit(f"error: --data {a.data}: no train/ folder (CIFAR-10 as class folders: train/ and test/)")
    os.makedirs(a.out, exist_ok=True)
    runs = a.runs or tempfile.mkdtemp(prefix="gpu_cifar_")
    device = torch.cuda.get_device_name() if H.resolve_device(a.device).type == "cuda" else "CPU"
    H.catch_preemption()
    res = {"title": f"CIFAR-10, --preset gpu ({device}, seed 0)", "device": device, "torch": torch.__version__,
           "commit": os.environ.get("COMMIT", "unknown"),
           "source": "python benchmarks/gpu_cifar.py --data cifar10 (bash benchmarks/gpu_check.sh "
                     "cifar)", "methods": {}}
    rows, images = [], eval_images(a)

    def save(res):
        with open(os.path.join(a.out, "gpu_cifar.json"), "w") as f:
            json.dump(res, f, indent=1)

    for m in a.methods:
        t0 = time.time()
        log, seconds, total, args, capped = train_watched(m, a, os.path.join(runs, m))
        shutil.copyfile(os.path.join(runs, m, "log.jsonl"), os.path.join(a.out, f"{m}.log.jsonl"))
        points, online = curve(a, images, m, log, os.path.join(runs, m), args.batch_size)
        r = res["methods"][m] = record(m, log, points, online, seconds, total, args, capped)
        rows.append(m)
        print(f"{m}: {r['steps']}/{total} steps in {seconds:.0f} s of training, {time.time() - t0:.0f} s with the "
              f"evaluations", flush=True)
        save(res)                                                          # after each method: a cut run keeps it
    res["pixels"] = knn(a, images, pixels=True)
    save(res)
    try:
        sys.path.insert(0, os.path.join(ROOT, "docs"))
        import plot_results
        plot_results.cifar10(res, os.path.join(a.out, "gpu_cifar.png"))
    except ImportError as e:
        print(f"no picture: {e} (pip install -r docs/requirements.txt)")
    if not a.runs:
        shutil.rmtree(runs, ignore_errors=True)
    print(f"\n{res['title']}, commit {res['commit']}, torch {res['torch']}")
    print("| method | steps x batch | training s | img/s (run; loop's median) | data wait | loss start -> end | "
          "k-NN init | k-NN 1/4, 1/2, 3/4 | k-NN end | online end |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in rows:
        r = res["methods"][m]
        steps = f"{r['steps']} of {r['planned_steps']} (cap)" if r["capped"] else str(r["steps"])
        mid = ", ".join(f"{acc:.1f}" for _, acc in r["knn"][1:-1])
        online = f"{r['online']['knn_top1']:.1f}" if "online" in r else "-"
        print(f"| {r['label']} | {steps} x {r['batch_size']} | {r['train_seconds']:.0f} | {r['images_per_second']}; "
              f"{r['logged_img_s']:.0f} | {r['data_wait']:.2f} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} | "
              f"{r['init']:.1f} | {mid} | **{r['knn'][-1][1]:.1f}** | {online} |")
    print(f"| raw pixels | - | - | - | - | - | - | - | {res['pixels']:.1f} | - |")


if __name__ == "__main__":
    main()
