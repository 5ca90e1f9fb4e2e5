"""Fine-tuning choices (eval_finetune.py --preset small: label budget, length, lr), made on training images held out
of fine-tuning, never on a test split.

  python scripts/finetune_sweep.py --pre runs/conmim-cifar/checkpoint.pth --init runs/conmim-cifar/init.pth \\
      --data cifar10 --points "labels-per-class=100 epochs=64" "labels-per-class=500 epochs=13"

Each point is a set of flags added to `eval_finetune.py --preset small --holdout N` (N = --holdout, default 5,000:
the same fixed draw as the pre-training sweeps, common.held_out); at each point the pre-trained checkpoint and the
initial encoder (--init: the run's first checkpoint, e.g. its --stop-step 1 one; or "random": --random-init of
--pre) are fine-tuned with the same flags and seed, on the training images minus those N, and scored on the N.
With --holdout 0 the same pair is the final comparison on the data's val/ (else test/). Prints a table (best and
last top-1 of each, the gap of the last) and writes <out>/sweep.json with each run's curve; rerunning reuses the
finished runs (each one's final JSON line is read back from its log).
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def curve(run_dir):
    """[[epoch + 1, top-1]] of a run's evaluations (its log.jsonl)."""
    recs = [json.loads(ln) for ln in open(os.path.join(run_dir, "log.jsonl")) if '"val_top1"' in ln]
    return [[r["epoch"] + 1, r["val_top1"]] for r in recs]


def result(log):
    """The final JSON line (best_top1 ...) of a finished fine-tuning run's output, or None."""
    if not os.path.isfile(log):
        return None
    for line in reversed(open(log).read().splitlines()):
        if line.startswith("{") and "best_top1" in line:
            return json.loads(line)
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    p.add_argument("--pre", required=True, help="the pre-trained checkpoint")
    p.add_argument("--init", required=True,
                   help="its initial encoder's checkpoint, or 'random' (--random-init of --pre)")
    p.add_argument("--data", required=True)
    p.add_argument("--points", nargs="+", default=[""], help='flag sets, e.g. "labels-per-class=100 epochs=3" '
                   '(default: the preset as it is)')
    p.add_argument("--holdout", type=int, default=5000, help="0: no held-out images, score the evaluated split "
                   "(the data's val/, else test/): the final comparison, never a choice")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="default: runs/finetune-sweep/<name of --pre's folder>")
    a = p.parse_args(argv)
    out = a.out or os.path.join("runs", "finetune-sweep", os.path.basename(os.path.dirname(os.path.abspath(a.pre))))
    os.makedirs(out, exist_ok=True)
    rows = []
    for point in a.points:
        flags = [f for kv in point.split() for f in (f"--{kv.split('=')[0]}", kv.split("=", 1)[1])]
        name = "_".join(kv.replace("=", "") for kv in point.split()) or "preset"
        res, curves = {}, {}
        for which in ("pre", "init"):
            ckpt = ["--ckpt", a.pre, "--random-init"] if which == "init" and a.init == "random" else \
                   ["--ckpt", a.pre if which == "pre" else a.init]
            run_dir = os.path.join(out, f"{name}_{which}")
            log = run_dir + ".log"
            if result(log) is None:
                cmd = [sys.executable, "eval_finetune.py", *ckpt, "--data", a.data, "--preset", "small", "--holdout",
                       str(a.holdout), "--seed", str(a.seed), "--output-dir", run_dir, *flags]
                print("$", " ".join(cmd[1:]), flush=True)
                with open(log, "a") as f:
                    if subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode:
                        raise SystemExit(f"error: the run failed; its output is in {log}")
            res[which], curves[which] = result(log), curve(run_dir)
        rows.append({"point": point, **{f"{w}_{k}": res[w][k] for w in res for k in ("best_top1", "last_top1")},
                     "gap_last": round(res["pre"]["last_top1"] - res["init"]["last_top1"], 2),
                     "split": res["pre"]["split"], "pre_curve": curves["pre"], "init_curve": curves["init"]})
        with open(os.path.join(out, "sweep.json"), "w") as f:
            json.dump({"pre": a.pre, "init": a.init, "holdout": a.holdout, "seed": a.seed, "rows": rows}, f, indent=1)
    where = f"{a.holdout} held-out training images" if a.holdout else f"{rows[0]['split']}/"
    print(f"\ntop-1 (%) on {where}, pre-trained vs initial encoder, seed {a.seed}:")
    print("| flags | pre best / last | init best / last | gap (last) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['point']} | {r['pre_best_top1']} / {r['pre_last_top1']} | {r['init_best_top1']} / "
              f"{r['init_last_top1']} | {r['gap_last']:+.2f} |")


if __name__ == "__main__":
    main()
