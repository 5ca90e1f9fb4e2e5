"""The lr of a small recipe, chosen on training images held out of training (never on a test split).

  python scripts/lr_sweep.py msn --data /data/cifar10                  # --preset small, lr x 1, 4, 16
  python scripts/lr_sweep.py siammae --data /data/DAVIS --preset davis --holdout 6 --eval-flags "--short-side 96"

For each factor f of --factors: one run of the method's preset with every lr of its schedule x f
(recipes.scale_recipe's `lr_factor`; f = 1 is the official per-image lr) for --fraction of the preset's
epochs (the schedules span that shorter run), trained on the training set minus --holdout N items
(a fixed draw, common.held_out), then scored on those N: the evaluated encoder's weighted k-NN top-1
against the other training images (eval_linear.py --holdout N), or for SiamMAE the DAVIS J&F of the N
held-out train videos (eval_video.py --split train --holdout N). Rerunning resumes unfinished runs and
reuses finished ones. Writes <out>/<method>.json and prints a table; the best factor is what a preset's
`lr_factor` holds (docs/RESULTS.md has the sweeps behind each preset).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import recipes  # noqa: E402

LR_KEYS = ("lr", "start_lr", "min_lr", "blr")


def sweep_flags(cls, preset, factor, fraction):
    """The command-line flags of one sweep run: the preset's epochs x fraction (whole epochs; SiamMAE's a
    multiple of its repeated sampling) and every lr of the recipe derived with lr_factor = factor."""
    raw = {**getattr(cls, "PRESETS", {})}[preset]
    unit = raw.get("repeated_sampling", getattr(cls, "repeated_sampling", 1))
    epochs = max(unit, round(raw["epochs"] * fraction / unit) * unit)
    derived = getattr(cls, "preset_rules", recipes.scale_recipe)(cls, {**raw, "epochs": epochs, "lr_factor": factor})
    flags = ["--epochs", str(epochs)]
    for k in LR_KEYS:
        if derived.get(k) is not None:
            flags += [f"--{k.replace('_', '-')}", f"{derived[k]:g}"]
    return flags, epochs


def last_json(text):
    """The last line of a script's output that is a JSON object (eval_*.py print their results so)."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("no result line in the evaluation's output")


def run(cmd, log):
    """Run cmd (a list) from the repository root, its output appended to `log`; stop the sweep on failure."""
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        f.write(p.stdout)
    if p.returncode:
        raise SystemExit(f"error: {' '.join(cmd[1:3])} ... failed (exit {p.returncode}); its output is in {log}")
    return p.stdout


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    p.add_argument("method", choices=("msn", "cmae", "conmim", "can", "siammae"))
    p.add_argument("--data", required=True,
                   help="the training folder the preset is for (e.g. CIFAR-10's, a DAVIS root)")
    p.add_argument("--preset", default="small", help="the method's preset (default small; SiamMAE: davis)")
    p.add_argument("--factors", type=float, nargs="+", default=[1, 4, 16], help="lr multiples of the per-image lr")
    p.add_argument("--fraction", type=float, default=0.25, help="share of the preset's epochs each run trains")
    p.add_argument("--holdout", type=int, default=5000, help="training images (SiamMAE: videos) held out and scored")
    p.add_argument("--out", default="runs/lr_sweep", help="one folder per run under it, and <method>.json")
    p.add_argument("--train-flags", default="", help="more flags for every training run (e.g. '--workers 4')")
    p.add_argument("--eval-flags", default="", help="more flags for every evaluation (e.g. '--short-side 96')")
    a = p.parse_args(argv)
    if not 0 < a.fraction <= 1 or a.holdout <= 0 or any(not f > 0 for f in a.factors):
        raise SystemExit("error: --fraction must be in (0, 1], --holdout and every factor positive")
    mod = __import__(a.method)
    if a.preset not in getattr(mod.Args, "PRESETS", {}):
        raise SystemExit(f"error: {a.method} has no preset {a.preset!r} (it has: "
                         f"{', '.join(getattr(mod.Args, 'PRESETS', {}))})")
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    rows = []
    for factor in a.factors:
        flags, epochs = sweep_flags(mod.Args, a.preset, factor, a.fraction)
        run_dir = os.path.join(out, f"{a.method}-{a.preset}-x{factor:g}")
        ckpt, log = os.path.join(run_dir, "checkpoint.pth"), run_dir + ".log"
        t0 = time.time()
        run([sys.executable, f"{a.method}.py", "--data", a.data, "--preset", a.preset, "--holdout", str(a.holdout),
             "--output-dir", run_dir, *flags, *a.train_flags.split()], log)
        train_s = time.time() - t0
        if a.method == "siammae":
            res = last_json(run([sys.executable, "eval_video.py", "--ckpt", ckpt, "--data", a.data, "--split", "train",
                                 "--holdout", str(a.holdout), *a.eval_flags.split()], log))
            score, what = res["JF_mean"], "J&F"
        else:
            res = last_json(run([sys.executable, "eval_linear.py", "--ckpt", ckpt, "--data", a.data, "--holdout",
                                 str(a.holdout), "--mode", "knn", *a.eval_flags.split()], log))
            score, what = res["knn_top1"], "k-NN top-1"
        losses = [json.loads(ln) for ln in open(os.path.join(run_dir, "log.jsonl")) if '"loss"' in ln]
        rows.append({"factor": factor, "flags": " ".join(flags), "epochs": epochs, "score": score, "metric": what,
                     "final_loss": losses[-1]["loss"] if losses else math.nan, "train_s": round(train_s)})
        print(f"x{factor:g}: {what} {score:.2f} on the {a.holdout} held-out items ({' '.join(flags)}; loss "
              f"{rows[-1]['final_loss']:.4g})", flush=True)
        with open(os.path.join(out, f"{a.method}-{a.preset}.json"), "w") as f:
            json.dump({"method": a.method, "preset": a.preset, "data": a.data, "holdout": a.holdout,
                       "fraction": a.fraction, "rows": rows}, f, indent=1)
    print("\n" + table(rows))
    return rows


def best(rows):
    """The row the preset takes: the highest held-out score; on a tie the smaller factor (the nearer to the
    official per-image lr)."""
    return max(rows, key=lambda r: (r["score"], -r["factor"]))


def table(rows):
    """The sweep's markdown table, its chosen row marked (best)."""
    pick = best(rows)
    return "\n".join([f"| lr factor | flags | {rows[0]['metric']} (held out) | final loss |", "|---|---|---|---|"] +
                     [f"| {r['factor']:g}{' (best)' if r is pick else ''} | {r['flags']} | {r['score']:.2f} | "
                      f"{r['final_loss']:.4g} |" for r in rows])


if __name__ == "__main__":
    main()
