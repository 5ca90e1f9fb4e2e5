"""scripts/lr_sweep.py: each run's flags follow the preset's rules with the swept lr factor, and a sweep
trains on the training images minus the held-out ones and scores exactly those (never val/ or test/)."""
import json
import os
import sys

import pytest

import common as C
import harness as H
import can
import msn
import siammae
from helpers import ROOT
from test_eval_linear import tiny_folder

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import lr_sweep as L  # noqa: E402


def test_sweep_flags_scale_every_lr_of_the_recipe_and_shorten_the_run():
    flags, epochs = L.sweep_flags(msn.Args, "small", 16, 0.25)
    assert epochs == 1 and flags[:2] == ["--epochs", "1"]
    got = dict(zip(flags[::2], map(float, flags[1::2])))
    assert got["--lr"] == pytest.approx(1e-3 * 256 / 1024 * 16)             # per-image lr x 16 (not x the preset's 4)
    assert got["--start-lr"] == pytest.approx(2e-4 * 256 / 1024 * 16)
    assert got["--min-lr"] == pytest.approx(1e-6 / 4 * 16)
    flags, _ = L.sweep_flags(can.Args, "small", 1, 0.25)
    assert flags == ["--epochs", "2", "--blr", "0.00015"]                    # MAE-style: blr x factor
    flags, epochs = L.sweep_flags(siammae.Args, "davis", 4, 0.3)
    assert epochs % siammae.Args.repeated_sampling == 0 and flags[flags.index("--blr") + 1] == "0.0006"


def test_a_sweep_trains_without_the_held_out_images_and_scores_them(tmp_path, monkeypatch):
    data = tiny_folder(tmp_path / "data")                                    # 18 train/, 9 val/ images
    monkeypatch.setitem(can.Args.PRESETS, "small", {**can.Args.PRESETS["small"], "epochs": 2})
    calls = []
    real = L.run

    def spy(cmd, log):
        calls.append(cmd)
        return real(cmd, log)
    monkeypatch.setattr(L, "run", spy)
    monkeypatch.setattr(L.subprocess, "run", lambda cmd, **kw: _in_process(cmd, **kw))
    tiny = "--model nano --patch-size 4 --img-size 16 --batch-size 4 --decoder-dim 16 --decoder-depth 1 " \
           "--decoder-heads 2 --proj-hidden 16 --proj-dim 8 --workers 0"
    rows = L.main(["can", "--data", data, "--factors", "1", "4", "--fraction", "0.5", "--holdout", "5", "--out",
                   str(tmp_path / "sweep"), "--train-flags", tiny, "--eval-flags", "--workers 0 --k 3"])
    assert [r["factor"] for r in rows] == [1, 4] and all(0 <= r["score"] <= 100 for r in rows)
    trains = calls[0::2]
    assert all("--holdout" in c and c[c.index("--holdout") + 1] == "5" for c in calls)
    assert [c[c.index("--blr") + 1] for c in trains] == ["0.00015", "0.0006"]
    for c in trains:
        ck = C.load_checkpoint(os.path.join(c[c.index("--output-dir") + 1], "checkpoint.pth"))
        assert ck["args"]["holdout"] == 5 and ck["step"] == 3                 # 13 training images / 4, one epoch
    saved = json.load(open(tmp_path / "sweep" / "can-small.json"))
    assert saved["holdout"] == 5 and [r["score"] for r in saved["rows"]] == [r["score"] for r in rows]


class _Done:
    def __init__(self, out):
        self.returncode, self.stdout = 0, out


def _in_process(cmd, cwd=None, **kw):
    """scripts/lr_sweep.py's subprocess, run in this process (a tiny run is faster without a new interpreter)."""
    import contextlib
    import importlib
    import io
    script, argv = os.path.basename(cmd[1])[:-3], cmd[2:]
    mod = importlib.import_module(script)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn = getattr(mod, "train", None) or getattr(mod, "evaluate")
        fn(H.parse_args(mod.Args, argv))
    return _Done(out.getvalue())


def test_the_sweep_marks_the_best_score_and_a_tie_goes_to_the_smaller_factor():
    """The table's (best) is the row a preset takes: the highest held-out score wherever it stands in the order
    the factors were given, and of two equal scores the smaller factor (the nearer to the official lr)."""
    def rows(*scores):
        return [{"factor": f, "flags": f"--lr {f}", "score": s, "metric": "k-NN top-1", "final_loss": 1.0}
                for f, s in scores]

    def marked(rs):
        return [ln.split("|")[1].strip() for ln in L.table(rs).splitlines()[2:] if "(best)" in ln]

    assert marked(rows((1, 30.46), (4, 30.80), (16, 30.24))) == ["4 (best)"]        # MSN's sweep
    assert marked(rows((16, 40.24), (1, 36.60), (4, 42.82))) == ["4 (best)"]        # any order
    assert marked(rows((1, 28.0), (16, 31.5), (4, 31.5))) == ["4 (best)"]           # a tie: the smaller factor
    assert marked(rows((64, 47.0), (1, 47.0))) == ["1 (best)"] and L.best(rows((2, 5.0)))["factor"] == 2
