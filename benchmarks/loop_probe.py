"""Where a real training run loses time against its step, in one process and one GPU call.

  python benchmarks/loop_probe.py --data cifar10 --workers 15                 # --preset gpu, the four image methods
  python benchmarks/loop_probe.py --data cifar10 --sections loop --methods can --variants workers --workers 4 8 15
  python benchmarks/loop_probe.py --small                                     # CPU dry run (tests/test_benchmarks.py)

Sections, each guarded (a failing section prints one line and the next runs) and each printing its own table:
  step     the step alone on device-resident uint8 batches (benchmarks/throughput.py's), with the loop's colour
           augmentation (one call per view size, normalisation inside, compiled on CUDA) and without it
  aug      MSN's augmentation per step three ways: one call per view, eager (the loop before the grouping); one
           call per view size, eager; the same compiled (the loop now) -- at the preset's sizes and at 224 / 96 px
  loop     the real train() (its loader, augmentation, step, EMA, log), timed over --steps steps after --warm:
           `resident` (--preset gpu's data path: the images on the device, gpu_data.py), `workers N` (the PIL
           workers, --resident 0, for each N of --workers), `fixed batch` (the workers' first batch again and
           again, the loader shut down after it: its workers no longer compete for the CPU), `resident, compiled`
           (the networks compiled, the CUDA default); --variants picks the rows
  ops      aten ops dispatched in one real loop step (a TorchDispatchMode: a CPU stand-in for kernel launches)
  syncs    host-device syncs inside the loop's steps (torch.cuda.set_sync_debug_mode("warn"), log steps left
           out), counted per step by the innermost file:line of this repository that made them (CUDA only)
  profile  torch.profiler over --profile-steps steps of the loop: the GPU's busy time, the union of its kernels'
           intervals (device events only: the profiler also charges each kernel to the CPU op that launched it,
           which summed twice), against the wall time, and the ops that took most of each (CUDA only)
The networks run eager (--no-compile) but in `resident, compiled`; the colour augmentation compiles on CUDA
whatever --compile says. Numbers go to BENCHMARKS.md with the device line printed first.
"""
import argparse
import collections
import contextlib
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import common as C  # noqa: E402
import harness as H  # noqa: E402
import gpu_aug as GA  # noqa: E402
import throughput as T  # noqa: E402

METHODS = ("msn", "cmae", "conmim", "can")


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, n, dev):
    """Seconds per call of fn over n calls, the device drained before and after."""
    sync(dev)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync(dev)
    return (time.perf_counter() - t) / n


def section_step(a, dev):
    print("| method | step + augmentation img/s | ms | step alone img/s | ms | augmentation's share "
          "|\n|---|---|---|---|---|---|")
    for m in a.methods:
        row = []
        for aug in (True, False):
            ns = argparse.Namespace(preset=a.preset, batch_size=a.batch_size, grad_ckpt=False, micro_batch=0,
                                    precision="bf16" if dev.type == "cuda" else "fp32", compile=False, gpu_aug=aug,
                                    model=None)
            torch.manual_seed(0)
            step, n = T.setup(m, ns, dev)[:2]
            for _ in range(a.warm_steps):
                step()
            row.append((n / (dt := timed(step, a.timed_steps, dev)), 1000 * dt))
        (i1, ms1), (i0, ms0) = row
        print(f"| {m} | {i1:.0f} | {ms1:.1f} | {i0:.0f} | {ms0:.1f} | {1 - ms0 / ms1:.2f} |", flush=True)


def section_aug(a, dev):
    msn = importlib.import_module("msn")
    args = H.parse_args(msn.Args, ["--data", "none", "--preset", a.preset])
    R, F_ = args.rand_views, args.focal_views
    sizes = [(args.img_size, args.focal_size, a.batch_size)] + ([] if a.small else [(224, 96, 256)])
    compiled = GA.color_augmenter(True) if dev.type == "cuda" else None
    print("| MSN views (batch) | one call per view, eager ms | per size, eager ms | per size, compiled ms "
          "|\n|---|---|---|---|")
    for big, small, B in sizes:
        u = [torch.randint(0, 256, (n * B, 3, s, s), dtype=torch.uint8, device=dev) for n, s in ((1 + R, big), (F_,
                                                                                                                small))]
        per_view = lambda: [C.normalize(GA.color_augment_batch(v)) for x in u for v in x.split(B)]   # noqa: E731
        grouped = lambda f: lambda: [f(x, normalize=True) for x in u]                                # noqa: E731
        ms = [1000 * timed(f, a.timed_steps, dev) for f in (per_view, grouped(GA.color_augment_batch))]
        if compiled is not None:
            grouped(compiled)()                                                          # compile each shape first
            ms.append(1000 * timed(grouped(compiled), a.timed_steps, dev))
        print(f"| {1 + R} x {big} px + {F_} x {small} px ({B}) | " + " | ".join(f"{v:.1f}" for v in ms)
              + (" | (CUDA only) |" if compiled is None else " |"), flush=True)


class Fixed:
    """The real loader's first batch, handed out again and again; the loader's workers are shut down after it, so
    the timed steps share the CPU with nothing (tests/test_benchmarks.py checks that no worker lives on)."""

    def __init__(self, loader):
        self.loader, self.sampler, self.batch_size, self.dataset = loader, loader.sampler, loader.batch_size, \
            loader.dataset

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        it = iter(self.loader)
        batch = next(it)
        getattr(it, "_shutdown_workers", lambda: None)()         # persistent workers: stop them now
        self.loader._iterator = None
        while True:
            yield batch


def train(m, a, dev, out, variant="resident", hook=None):
    """The method's train() for warm + steps steps, logging every --warm steps (each log line one sync, as a real run
    has every --log-every); hook(step, entering) runs as each step's end_step starts and after it. Returns the wall
    seconds per step from the start of step warm's end_step to that of the last step's (its checkpoint left out),
    and the mean data_wait the log reported over those steps."""
    mod = importlib.import_module(m)
    n = a.warm + a.steps
    workers = variant.split()[1] if variant.startswith("workers") else str(a.workers[-1])
    argv = ["--data", a.data, "--preset", a.preset, "--output-dir", out, "--no-resume", "--stop-step", str(n),
            "--log-every", str(a.warm if hook is None else 10 ** 6), "--workers", workers, "--save-every-minutes", "0",
            "--no-knn", "--device", dev.type, "--batch-size", str(a.batch_size), "--gpu-aug"]
    argv += ["--compile" if "compiled" in variant else "--no-compile"]
    argv += ["--resident", str(a.resident) if variant.startswith("resident") else "0"]
    argv += ["--model", "nano", "--img-size", "16"] if a.small else []
    args = H.parse_args(mod.Args, argv)
    times, real_end, patches = {}, C.end_step, contextlib.ExitStack()

    def end_step(run, log, save, batches, step, *x, **kw):
        if hook:
            hook(step, True)
        if step in (a.warm, n):
            sync(dev)
            times[step] = time.perf_counter()
        stop = real_end(run, log, save, batches, step, *x, **kw)
        if hook:
            hook(step, False)
        return stop
    with patches:
        patches.enter_context(patched(C, "end_step", end_step))
        if variant == "fixed batch":
            real_loader = C.make_loader
            patches.enter_context(patched(C, "make_loader", lambda *x, **kw: Fixed(real_loader(*x, **kw))))
        with open(os.path.join(os.path.dirname(out), f"{os.path.basename(out)}.out"), "w") as f, \
                contextlib.redirect_stdout(f):                       # the run's own lines: beside its output
            mod.train(args)
    recs = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
    waits = [r["data_wait"] for r in recs if "data_wait" in r and r["step"] > a.warm]
    return (times[n] - times[a.warm]) / a.steps, (sum(waits) / len(waits) if waits else float("nan"))


@contextlib.contextmanager
def patched(obj, name, value):
    real = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, real)


def section_loop(a, dev, tmp):
    print("| method | variant | img/s | step ms | data_wait |\n|---|---|---|---|---|")
    rows = {"resident": ["resident"], "workers": [f"workers {w}" for w in a.workers], "fixed": ["fixed batch"],
            "compiled": ["resident, compiled"]}
    for m in a.methods:
        for variant in [v for key in a.variants for v in rows[key]]:
            try:                                                 # a failing row: the next one still runs
                dt, wait = train(m, a, dev, os.path.join(tmp, f"{m}-loop"), variant)
            except Exception as e:                               # noqa: BLE001
                print(f"| {m} | {variant} | FAILED ({type(e).__name__}: {' '.join(str(e).split())[:200]}) |")
                traceback.print_exc(limit=4)
                continue
            print(f"| {m} | {variant} | {a.batch_size / dt:.0f} | {1000 * dt:.1f} | {wait:.3f} |", flush=True)


def section_syncs(a, dev, tmp):
    if dev.type != "cuda":
        print("syncs: CUDA only (torch.cuda.set_sync_debug_mode)")
        return
    print("| method | syncs per step | where (file:line of this repository, count per step) |\n|---|---|---|")
    for m in a.methods:
        seen = collections.Counter()

        def hook(step, entering):                        # on between the end_steps of the timed steps, off in them
            torch.cuda.set_sync_debug_mode("warn" if not entering and a.warm <= step < a.warm + a.steps else 0)

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return
            frames = [f for f in traceback.extract_stack()[:-1]
                      if f.filename.startswith(ROOT) and "loop_probe" not in f.filename]
            f = frames[-1] if frames else traceback.extract_stack()[-2]
            seen[f"{os.path.relpath(f.filename, ROOT)}:{f.lineno}"] += 1
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            try:
                train(m, a, dev, os.path.join(tmp, f"{m}-syncs"), hook=hook)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        total = sum(seen.values()) / a.steps
        where = ", ".join(f"{k} {v / a.steps:g}" for k, v in seen.most_common(8)) or "none"
        print(f"| {m} | {total:g} | {where} |", flush=True)


def section_profile(a, dev, tmp):
    if dev.type != "cuda":
        print("profile: CUDA only (the GPU's busy time)")
        return
    from torch.profiler import ProfilerActivity, profile
    print("| method | wall ms / step | GPU busy ms / step | busy share | top GPU ops (ms / step) | top CPU ops (ms / "
          "step) |\n|---|---|---|---|---|---|")
    for m in a.methods:
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        k, t = a.profile_steps, {}

        def hook(step, entering):
            if step == a.warm and not entering:
                sync(dev)
                prof.start()
                t[0] = time.perf_counter()
            elif step == a.warm + k and entering:
                sync(dev)
                t[1] = time.perf_counter()
                prof.stop()
        train(m, argparse.Namespace(**{**vars(a), "steps": max(a.steps, k)}), dev, os.path.join(tmp, f"{m}-prof"),
              hook=hook)
        ev = prof.key_averages()
        def dev_t(e):                                                # us
            return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
        busy = busy_ms(device_intervals(prof.events())) / k
        wall = 1000 * (t[1] - t[0]) / k
        def top(key):
            return ", ".join(f"{e.key[:40]} {key(e) / 1000 / k:.1f}" for e in sorted(ev, key=key, reverse=True)[:4])
        print(f"| {m} | {wall:.1f} | {busy:.1f} | {busy / wall:.2f} | {top(dev_t)} | "
              f"{top(lambda e: e.self_cpu_time_total)} |",
              flush=True)


def device_intervals(events):
    """(start, end) in us of the profiler's device events (kernels, copies), user annotations left out."""
    from torch.autograd import DeviceType
    return [(e.time_range.start, e.time_range.end) for e in events
            if e.device_type == DeviceType.CUDA and not e.is_user_annotation]


def busy_ms(intervals):
    """The time at least one of the (start, end) us intervals covers, in ms: each kernel counted once, overlapping
    ones (streams) once together."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1000


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched (a CPU stand-in for a GPU's kernel launches)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def section_ops(a, dev, tmp):
    print("| method | variant | aten ops per step |\n|---|---|---|")
    for m in a.methods:
        for variant in ("resident", "fixed batch"):
            mode, counts = OpCount(), []

            def hook(step, entering):                            # the step after warm: from its end_step's end
                if step == a.warm and not entering:              # to the next one's start
                    mode.__enter__()
                elif step == a.warm + 1 and entering:
                    mode.__exit__(None, None, None)
                    counts.append(mode.n)
            train(m, argparse.Namespace(**{**vars(a), "steps": 1}), dev, os.path.join(tmp, f"{m}-ops"), variant,
                  hook=hook)
            print(f"| {m} | {variant} | {counts[0]} |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=None, help="image folder (CIFAR-10's train/ ...); --small: synthetic")
    p.add_argument("--preset", default="gpu")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--sections", nargs="+", default=["loop", "profile", "step", "ops", "syncs", "aug"],
                   choices=["step", "aug", "loop", "ops", "syncs", "profile"])             # most decisive first
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--warm", type=int, default=10, help="loop steps before the timed ones (workers start, compiles)")
    p.add_argument("--steps", type=int, default=60, help="timed loop steps")
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--warm-steps", type=int, default=5, help="step / aug sections: calls before the timed ones")
    p.add_argument("--timed-steps", type=int, default=20, help="step / aug sections: timed calls")
    p.add_argument("--workers", type=int, nargs="+", default=[min(15, os.cpu_count() or 1)],
                   help="the loop's `workers N` rows, one per N (the last: the fixed batch's loader)")
    p.add_argument("--resident", type=int, default=32, help="the `resident` rows' --resident S")
    p.add_argument("--variants", nargs="+", default=["resident", "workers", "fixed"],
                   choices=["resident", "workers", "fixed", "compiled"], help="the loop section's rows")
    p.add_argument("--small", action="store_true", help="CPU dry run: nano models, synthetic data, a few steps")
    a = p.parse_args()
    if a.small:
        a.data, a.preset, a.batch_size, a.warm, a.steps, a.profile_steps = "synthetic", "small", 8, 1, 2, 1
        a.warm_steps, a.timed_steps, a.workers, a.resident = 1, 1, [0], 16
    if not a.data:
        p.error("--data is required (an image folder), or --small")
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.small else "cpu")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"loop_probe: {name}, torch {torch.__version__}, --preset {a.preset}, batch {a.batch_size}, "
          f"{a.workers} workers, commit {os.environ.get('COMMIT', 'unknown')}", flush=True)
    with tempfile.TemporaryDirectory(prefix="loop_probe_") as tmp:
        for s in a.sections:
            print(f"\n## {s}", flush=True)
            t = time.perf_counter()
            try:
                {"step": lambda: section_step(a, dev), "aug": lambda: section_aug(a, dev),
                 "loop": lambda: section_loop(a, dev, tmp), "syncs": lambda: section_syncs(a, dev, tmp),
                 "ops": lambda: section_ops(a, dev, tmp),
                 "profile": lambda: section_profile(a, dev, tmp)}[s]()
            except Exception as e:                                   # noqa: BLE001 -- the next section still runs
                print(f"{s}: FAILED ({type(e).__name__}: {' '.join(str(e).split())[:300]})")
                traceback.print_exc(limit=3)
            print(f"({s}: {time.perf_counter() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
