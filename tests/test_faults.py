"""Fault tolerance: non-finite losses stop the run without touching the last good checkpoint,
unreadable images are skipped deterministically, preemption signals and --stop-step write a
mid-epoch checkpoint that resumes bit-exactly, one failing rank takes the others down, flags are
validated up front, and a failed checkpoint write keeps the previous file."""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import can
import cmae
import common as C
import harness as H
import conmim
import synthetic as S
import msn
from helpers import ROOT, exact_resume, one_line_error, run_cli, torchrun, vit_checkpoint
from test_can import tiny_args as can_args
from test_cmae import tiny_args as cmae_args
from test_conmim import tiny_args as conmim_args
from test_msn import tiny_args as msn_args

CAN_CLI = ["can.py", "--model", "nano", "--patch-size", "4", "--img-size", "16", "--batch-size", "8",
           "--decoder-dim", "32", "--decoder-depth", "1", "--decoder-heads", "2", "--proj-hidden", "32",
           "--proj-dim", "16", "--no-knn", "--workers", "0", "--warmup-epochs", "0", "--log-every", "1"]


def test_non_finite_loss_stops_and_keeps_the_last_finite_checkpoint(tmp_path):
    out = str(tmp_path)
    cmd = [*CAN_CLI, "--data", "synthetic", "--epochs", "3", "--steps-per-epoch", "3", "--lr", "1e30", "--output-dir",
           out]
    r = run_cli(*cmd, "--stop-step", "1")                  # step 1's update, lr 1e30: weights ~1e30, still finite
    assert r.returncode == 0, r.stderr
    before = open(tmp_path / "checkpoint.pth", "rb").read()
    r = run_cli(*cmd)                                      # resumed: step 2's loss is not finite
    one_line_error(r, "non-finite loss or gradient at step 2", "last finite checkpoint (step 1)")
    assert open(tmp_path / "checkpoint.pth", "rb").read() == before
    ck = C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")
    assert ck["step"] == 1 and all(torch.isfinite(v).all() for v in ck["model"].values() if v.is_floating_point())


def test_no_checkpoint_is_written_after_a_non_finite_step_even_with_finite_weights(tmp_path, monkeypatch):
    """A non-finite loss term whose weights stay finite (a term that feeds no gradient, a skipped update)
    at step 3 of a run that saves every step and logs every 10: the save at step 3 checks the guard
    first, so the checkpoint stays at step 2."""
    real = can.train_step

    def step_3_logs_nan(*a, **kw):
        loss, parts = real(*a, **kw)
        step_3_logs_nan.calls += 1
        if step_3_logs_nan.calls == 3:
            parts = {**parts, "rec": torch.tensor(float("nan"))}
        return loss, parts
    step_3_logs_nan.calls = 0
    monkeypatch.setattr(can, "train_step", step_3_logs_nan)
    with pytest.raises(C.UserError, match="non-finite loss or gradient at step 3 .*last finite checkpoint \\(step "
                                          "2\\)"):
        can.train(can_args(tmp_path, epochs=2, steps_per_epoch=3, save_every=1, log_every=10))
    assert C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")["step"] == 2


def test_weights_made_non_finite_with_a_finite_loss_are_never_written(tmp_path, monkeypatch):
    """Weights that turn non-finite while the watched loss and gradient norm stay finite (here one weight set
    to inf after step 3's update): the save at step 3 refuses, the checkpoint stays at step 2."""
    real = C.optimizer_step

    def step_3_breaks_a_weight(run, opt, params, *a, **kw):
        norm = real(run, opt, params, *a, **kw)
        step_3_breaks_a_weight.calls += 1
        if step_3_breaks_a_weight.calls == 3:
            with torch.no_grad():
                opt.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return norm
    step_3_breaks_a_weight.calls = 0
    monkeypatch.setattr(C, "optimizer_step", step_3_breaks_a_weight)
    with pytest.raises(C.UserError, match="non-finite weights at step 3: not written; .* keeps the last finite "
                                          "checkpoint"):
        can.train(can_args(tmp_path, epochs=2, steps_per_epoch=3, save_every=1, log_every=10))
    assert C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")["step"] == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_guard_reports_the_first_non_finite_step_of_any_part(bad):
    """bf16 / fp32: NaN and +-Inf in any part (a loss term or the gradient norm) stop at check() with the
    FIRST bad step and its values; finite steps never do."""
    g = H.Guard(torch.device("cpu"), "bf16", "ck.pth")
    for step in (1, 2):
        g.update(step, {"loss": torch.tensor(1.0), "grad_norm": torch.tensor(2.0)})
    g.check()
    g.update(3, {"loss": torch.tensor(1.5), "grad_norm": torch.tensor(bad)})
    g.update(4, {"loss": torch.tensor(bad), "grad_norm": torch.tensor(bad)})
    with pytest.raises(C.UserError, match=f"at step 3 \\(loss 1.5, grad_norm {bad}\\)"):
        g.check()


def test_guard_ignores_isolated_fp16_skips_but_not_a_long_run(tmp_path):
    g = H.Guard(torch.device("cpu"), "fp16", "ck.pth", max_skipped=3)
    scaler = argparse.Namespace(_scale=torch.tensor(1024.0), _init_scale=1024.0)
    for step, scale in enumerate([1024.0, 512.0, 512.0, 256.0, 128.0, 64.0], 1):   # a skip, a recovery...
        scaler._scale = torch.tensor(scale)
        g.update(step, {"loss": torch.tensor(float("nan"))}, scaler)
        if step < 6:
            g.check()
    with pytest.raises(C.UserError, match="3 fp16 steps in a row skipped"):   # ...then 3 skips in a row
        g.check()


def test_guard_counts_the_skips_of_a_real_grad_scaler():
    """torch's GradScaler halves its scale in place (the fake scaler above swaps in a new tensor): the
    guard must keep its own copy to see the drop. Steps with non-finite gradients, as fp16 overflows give."""
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    g = H.Guard(torch.device("cpu"), "fp16", "ck.pth", max_skipped=3)
    for step in range(1, 4):
        opt.zero_grad()
        scaler.scale(lin(torch.ones(1, 3)).sum() * float("inf")).backward()   # inf gradients: step skipped
        scaler.step(opt)
        scaler.update()
        g.update(step, {"loss": torch.tensor(1.0)}, scaler)
    assert scaler.get_scale() == 128.0                                       # 3 halvings
    with pytest.raises(C.UserError, match="3 fp16 steps in a row skipped"):
        g.check()


def _image_folder(root, n=22):
    for i in range(n):
        img, label = S.synthetic_image(i)
        os.makedirs(root / f"c{label}", exist_ok=True)
        img.save(root / f"c{label}" / f"{i:03d}.png")
    good = open(root / "c0" / "000.png", "rb").read()
    (root / "c1" / "truncated.png").write_bytes(good[:len(good) // 2])        # a truncated image
    (root / "c2" / "notes.jpg").write_text("this is not an image")            # a non-image file
    return str(root)


def test_unreadable_images_are_skipped_deterministically_and_resume_stays_exact(tmp_path):
    data = _image_folder(tmp_path / "data")
    ds = C.image_dataset(data, skip_unreadable=True)
    bad_i = [i for i, (p, _) in enumerate(ds.samples) if p.endswith(("truncated.png", "notes.jpg"))]
    img, label = ds.load(bad_i[0])                                        # replaced by the next readable
    ref, ref_label = ds.load(bad_i[0] + 1)
    assert torch.equal(C.to_uint8(img), C.to_uint8(ref)) and label == ref_label and ds.bad.value == 1
    with pytest.raises(C.UserError, match="cannot read image"):          # evaluation stays strict
        C.image_dataset(data).load(bad_i[0])

    def make(out, **kw):
        return can_args(out, data=data, batch_size=8, epochs=2, steps_per_epoch=0, max_unreadable=0.2, **kw)
    full, _ = exact_resume(can.train, make, tmp_path, "can", ("model", "encoder"))
    recs = [json.loads(line) for line in open(tmp_path / "full" / "log.jsonl") if '"step"' in line]
    assert sum(r.get("bad_images", 0) > 0 for r in recs) >= 1                # the count is logged


@pytest.mark.parametrize("method", ["msn", "cmae", "conmim", "can"])
def test_each_loop_stops_at_the_epoch_end_when_too_many_images_are_unreadable(method, tmp_path):
    """2 unreadable files of 24, below the 1000 reads from which the share is judged mid-epoch: each
    image-folder loop judges it at the epoch's end (1 epoch of 3 steps, --max-unreadable 0.05)."""
    data = _image_folder(tmp_path / "data")
    mod, args = {"msn": (msn, msn_args), "cmae": (cmae, cmae_args), "conmim": (conmim, conmim_args),
                 "can": (can, can_args)}[method]
    with pytest.raises(C.UserError, match=r"2 of 24 images read in this epoch were unreadable \(> --max-unreadable "
                                          r"0.05\)"):
        mod.train(args(tmp_path / "out", data=data, batch_size=8, epochs=1, steps_per_epoch=0, warmup_epochs=0,
                       max_unreadable=0.05))


def _train_mid_epoch(train, make, tmp_path, stop_step):
    """Uninterrupted run vs the same run stopped after `stop_step` (mid-epoch) and rerun."""
    train(make(tmp_path / "full"))
    train(make(tmp_path / "part", stop_step=stop_step))
    part = C.load_checkpoint(str(tmp_path / "part" / "checkpoint.pth"))
    assert part["step"] == stop_step
    train(make(tmp_path / "part"))
    return (C.load_checkpoint(str(tmp_path / d / "checkpoint.pth")) for d in ("full", "part"))


@pytest.mark.parametrize("method", ["msn", "can"])
def test_mid_epoch_resume_is_bit_exact(method, tmp_path):
    train, args = (msn.train, msn_args) if method == "msn" else (can.train, can_args)
    make = lambda out, **kw: args(out, epochs=3, steps_per_epoch=3, save_every_minutes=0, **kw)   # noqa: E731
    full, part = _train_mid_epoch(train, make, tmp_path, stop_step=4)       # step 4 of 9: inside epoch 2, and
    for key in ("model", "encoder", "target") if method == "msn" else ("model", "encoder"):   # the resumed run
        for k, v in full[key].items():                                      # goes on into epoch 3
            assert torch.equal(v, part[key][k]), (key, k)
    assert full["step"] == part["step"] == 9


def test_save_every_writes_mid_epoch_checkpoints(tmp_path, monkeypatch):
    steps = []
    real = C.save_run
    monkeypatch.setattr(C, "save_run", lambda run, m, a, e, s, *r, **kw: (steps.append(s), real(run, m, a, e, s, *r,
                                                                                                **kw)))
    can.train(can_args(tmp_path, epochs=2, steps_per_epoch=3, save_every=2, save_every_minutes=0))
    assert steps == [2, 3, 4, 6, 6]                                         # every 2 steps + each epoch end


def test_sigterm_writes_a_checkpoint_and_the_same_command_resumes(tmp_path):
    cmd = [sys.executable, *CAN_CLI, "--data", "synthetic", "--epochs", "2", "--steps-per-epoch", "200",
           "--output-dir", str(tmp_path)]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "log.jsonl"
    t = time.time()
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert p.poll() is None and time.time() - t < 120, p.stderr.read() if p.poll() is not None else "timeout"
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "signal SIGTERM" in out and "rerun the same command to resume" in out
    step = C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")["step"]
    assert 3 <= step < 200                                                   # mid-epoch
    r = subprocess.run(cmd[:cmd.index("--epochs")] + ["--epochs", "2", "--steps-per-epoch", "200", "--stop-step",
                       str(step + 2), "--output-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"step {step}" in r.stdout and C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")["step"] == step + 2


def test_one_failing_rank_takes_the_others_down(tmp_path):
    """torchrun, 2 processes with 2 DataLoader workers each: one bad image with --max-unreadable 0 stops the
    rank that reads it; the other rank must not hang in a collective, nor at exit on its workers (the
    collective's error left them alive: H.stop_workers_at_exit)."""
    data = tmp_path / "data"
    for i in range(15):
        img, label = S.synthetic_image(i)
        os.makedirs(data / f"c{label % 2}", exist_ok=True)
        img.save(data / f"c{label % 2}" / f"{i:03d}.png")
    (data / "c0" / "zz_bad.png").write_bytes(b"broken")
    t = time.time()
    r = torchrun(*CAN_CLI, "--data", str(data), "--batch-size", "4", "--epochs", "2", "--max-unreadable", "0",
                 "--workers", "2", "--output-dir", str(tmp_path / "out"))
    elapsed = time.time() - t
    assert r.returncode != 0 and "unreadable (> --max-unreadable 0)" in r.stderr, r.stderr[-2000:]
    assert "SIGKILL" not in r.stderr, r.stderr[-2000:]           # each rank exited by itself (was: rank 0 killed
    assert elapsed < 90, elapsed                                 # by torchrun 30 s after its SIGTERM)


def _ends_within(cmd, limit=60):
    """(stderr, returncode) of cmd, run in its own process group; fails (and kills the group) if it is still
    running after `limit` s."""
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        return p.communicate(timeout=limit)[1], p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"still running {limit} s later, after printing: {p.communicate()[1][-1500:]}")


def test_a_crash_with_dataloader_workers_ends_the_process(tmp_path):
    """A crash (here a RuntimeError in the 2nd optimiser step; on a GPU: out of memory, an NCCL error) with
    --workers 2: the traceback is printed and the process exits 1. It waited forever instead (until
    SIGKILL): the crash's traceback keeps the loader's persistent iterator alive at exit, and
    multiprocessing's exit hook SIGTERMs the workers, which ignore it (C.ignore_stop_signals), then joins
    them (fixed by H.stop_workers_at_exit)."""
    script = tmp_path / "crash.py"
    script.write_text(f"""import sys
sys.path.insert(0, {ROOT!r})
import can, common as C, harness as H
real, calls = C.optimizer_step, []
def optimizer_step(*a, **kw):
    calls.append(1)
    if len(calls) == 2:
        raise RuntimeError("boom at step 2")
    return real(*a, **kw)
C.optimizer_step = optimizer_step
sys.argv = {[*CAN_CLI, "--data", "synthetic", "--epochs", "1", "--steps-per-epoch", "20", "--workers", "2",
             "--output-dir", str(tmp_path / "out")]!r}
H.main(can.train, can.Args)
""")
    err, rc = _ends_within([sys.executable, str(script)])
    assert rc == 1 and err.strip().splitlines()[-1] == "RuntimeError: boom at step 2", err[-2000:]


def test_an_error_raised_in_an_evaluation_loader_worker_ends_the_process(tmp_path):
    """eval_finetune with --workers 2 and an unreadable val/ image: the one-line error, exit 2, at once. It
    waited forever after the error: the error a worker raises is re-raised in a reference cycle that
    keeps its loader (and the training loader) alive at exit, with workers that survive SIGTERM."""
    for split, n in (("train", 6), ("val", 1)):
        for c in "ab":
            os.makedirs(tmp_path / "d" / split / c)
            for i in range(n):
                S.synthetic_image(i)[0].resize((16, 16)).save(tmp_path / "d" / split / c / f"{i}.png")
    (tmp_path / "d" / "val" / "b" / "zz_bad.png").write_bytes(b"broken")
    err, rc = _ends_within([sys.executable, "eval_finetune.py", "--ckpt", vit_checkpoint(tmp_path / "c.pth", "cmae"),
                            "--data", str(tmp_path / "d"), "--batch-size", "4", "--epochs", "1", "--warmup-epochs",
                            "0", "--workers", "2", "--output-dir", str(tmp_path / "out")])
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error: cannot read image"), err[-2000:]


@pytest.mark.parametrize("flags,msg", [
    (["--batch-size", "-1"], "--batch-size must be positive"),
    (["--epochs", "0"], "--epochs must be positive"),
    (["--mask-ratio", "1.5"], "--mask-ratio must be in [0, 1)"),
    (["--warmup-epochs", "5", "--epochs", "2"], "--warmup-epochs 5 is longer than --epochs 2"),
    (["--img-size", "18"], "--img-size 18 is not a multiple of --patch-size 4"),
    (["--crop-scale", "0.5", "0.2"], "--crop-scale must be 0 < min <= max <= 1"),
    (["--batch-size", "8", "--micro-batch", "3"], "--micro-batch 3 must divide the per-process batch 8"),
    (["--steps-per-epoch", "-2"], "--steps-per-epoch must be >= 0"),
    (["--stop-epoch", "3"], "--stop-epoch 3 is after the last epoch (--epochs 2)"),
])
def test_flags_are_validated_with_one_line_errors(flags, msg, tmp_path):
    one_line_error(run_cli(*CAN_CLI, "--data", "synthetic", "--epochs", "2", *flags, "--output-dir", str(tmp_path)),
                   msg)


def test_global_batch_must_divide_over_processes():
    run = argparse.Namespace(world=3)
    with pytest.raises(C.UserError, match="GLOBAL batch: it must be divisible by the 3 processes"):
        H.batch_plan(can_args("/tmp/u", batch_size=8), run, 4096, "")


@pytest.mark.parametrize("method", ["msn", "cmae"])
def test_one_image_per_forward_is_refused_where_batchnorm_normalises_over_images(method, tmp_path):
    """MSN's heads and CMAE's projector / predictor normalise over the images of a forward: with one
    image per forward (--micro-batch 1, or --batch-size = processes) training stopped at step 1 with
    BatchNorm's ValueError traceback. Now a one-line error at start; SyncBN over several CUDA
    processes normalises over all of them, so one image each is fine there."""
    mod, make = {"msn": (msn, msn_args), "cmae": (cmae, cmae_args)}[method]
    for kw in (dict(batch_size=4, micro_batch=1), dict(batch_size=1, micro_batch=0)):
        with pytest.raises(C.UserError, match=r"1 image per forward .*BatchNorm needs at least 2 in training"):
            mod.train(make(tmp_path, **kw))
    a = make(tmp_path, batch_size=2, micro_batch=1)
    for world, device, ok in ((2, "cuda", True), (2, "cpu", False), (1, "cuda", False)):
        run = argparse.Namespace(world=world, device=torch.device(device))
        if ok:
            assert H.batch_plan(a, run, 1024, "", batchnorm="the head's") == (1, 1)
        else:
            with pytest.raises(C.UserError, match="the head's BatchNorm needs at least 2"):
                H.batch_plan(a, run, 1024, "", batchnorm="the head's")
    assert H.batch_plan(a, argparse.Namespace(world=1, device=torch.device("cpu")), 1024, "") == (2, 1)


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    """The disk fills up in the middle of the second write: the half-written temporary file is
    removed and the first checkpoint is intact."""
    real, calls = torch.save, []

    def failing_save(obj, f, *a, **kw):
        calls.append(f)
        if len(calls) == 2:
            with open(f, "wb") as out:
                out.write(b"PK\x03\x04 half a checkpoint")
            raise OSError(28, "No space left on device")
        return real(obj, f, *a, **kw)
    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(C.UserError, match="cannot write checkpoint .*No space left on device.*the previous one is "
                                          "intact"):
        can.train(can_args(tmp_path, epochs=2, steps_per_epoch=2, save_every_minutes=0))
    ck = C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")
    assert ck["step"] == 2 and not [f for f in os.listdir(tmp_path) if ".tmp." in f]


def test_a_run_killed_while_saving_leaves_no_lasting_temporary_file(tmp_path, capsys):
    """SIGKILL or a lost node during a checkpoint write leaves checkpoint.pth.tmp.<pid> (GBs for a
    ViT-L); the next run in that directory removes it and resumes from the intact checkpoint."""
    can.train(can_args(tmp_path, epochs=2, steps_per_epoch=2, stop_epoch=1))
    stale = tmp_path / "checkpoint.pth.tmp.4242"
    stale.write_bytes(b"PK half written")
    (tmp_path / "other.tmp.4242").write_bytes(b"not ours")
    can.train(can_args(tmp_path, epochs=2, steps_per_epoch=2))
    assert not stale.exists() and (tmp_path / "other.tmp.4242").exists()
    assert f"removed {stale}" in capsys.readouterr().out
    assert C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")["step"] == 4


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """A run killed after its checkpoint at step 3 had logged steps 4 and 5 (the last line cut off);
    the resumed run trains them again and the log holds every step once, in order, with the records
    that have no step (end-of-run reports) kept."""
    can.train(can_args(tmp_path, epochs=2, steps_per_epoch=3, stop_epoch=1, log_every=1))
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write(json.dumps({"note": "kept"}) + "\n" + json.dumps({"epoch": 1, "step": 4, "loss": 9.0}) + "\n")
        f.write('{"epoch": 1, "step": 5, "lo')
    can.train(can_args(tmp_path, epochs=2, steps_per_epoch=3, log_every=1))
    recs = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert [r["step"] for r in recs if "step" in r] == [1, 2, 3, 4, 5, 6]
    assert {"note": "kept"} in recs and all(r.get("loss") != 9.0 for r in recs)


def test_one_loader_iterator_serves_every_epoch(tmp_path, monkeypatch):
    """The training DataLoader is iterated once per run (its workers prefetch across epoch boundaries,
    no restart at an epoch's first step); a resumed run starts one new iterator."""
    calls = []
    real = torch.utils.data.DataLoader.__iter__
    monkeypatch.setattr(torch.utils.data.DataLoader, "__iter__", lambda self: (calls.append(1), real(self))[1])
    can.train(can_args(tmp_path, epochs=4, steps_per_epoch=2, workers=2, stop_epoch=3))   # 3 epochs, 2 boundaries
    assert len(calls) == 1
    can.train(can_args(tmp_path, epochs=4, steps_per_epoch=2, workers=2))           # resumes at epoch 3
    assert len(calls) == 2
    assert C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")["step"] == 8


def test_a_run_that_stops_early_logs_its_last_step(tmp_path):
    """Whatever ends the run, its last step is in the log, between --log-every steps too: the end of
    --stop-epoch's epoch, --stop-step, a preemption signal (the stop end_step forces)."""
    def steps(d):
        return [json.loads(line)["step"] for line in open(tmp_path / d / "log.jsonl") if '"step"' in line]
    can.train(can_args(tmp_path / "epoch", epochs=3, steps_per_epoch=3, log_every=2, stop_epoch=1))
    can.train(can_args(tmp_path / "step", epochs=3, steps_per_epoch=3, log_every=2, stop_step=5))
    assert steps("epoch") == [2, 3] and steps("step") == [2, 4, 5]


def test_the_log_reports_the_share_of_time_spent_waiting_for_data(tmp_path, monkeypatch):
    """data_wait: the share of each log interval the loop spent blocked on the next batch. On a clock that only the
    slow parts move (whatever the machine's speed: a real sleep against a real step failed on a loaded machine), a
    loader that takes 0.1 s an image (read in the main process) waits all of each interval, a 0.4 s step none."""
    now = [0.0]
    clock = lambda: now[0]                                                          # noqa: E731
    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(time, "time", clock)
    def slow(seconds, f):
        return lambda *a, **kw: (now.__setitem__(0, now[0] + seconds), f(*a, **kw))[1]
    real_load, real_step = S.SyntheticImages.load, can.train_step
    monkeypatch.setattr(S.SyntheticImages, "load", slow(0.1, real_load))
    can.train(can_args(tmp_path / "slow_data", epochs=1, steps_per_epoch=2, warmup_epochs=0))
    monkeypatch.setattr(S.SyntheticImages, "load", real_load)
    monkeypatch.setattr(can, "train_step", slow(0.4, real_step))
    can.train(can_args(tmp_path / "slow_step", epochs=1, steps_per_epoch=2, warmup_epochs=0))
    wait = {d: [json.loads(line)["data_wait"] for line in open(tmp_path / d / "log.jsonl") if '"step"' in line]
            for d in ("slow_data", "slow_step")}
    assert wait == {"slow_data": [1.0, 1.0], "slow_step": [0.0, 0.0]}, wait


# ----------------------------------------------------------------------------------------------
# No result of another run: a fresh log, the data a checkpoint was trained on, one run per folder
# ----------------------------------------------------------------------------------------------
def test_a_run_from_step_0_moves_the_earlier_runs_files_aside_whole(tmp_path, capsys):
    """A fresh start in a used folder (--no-resume; a rerun of a run killed before its first checkpoint) moves the
    earlier run's files together (checkpoint, log, args.json, --keep-every snapshots, pictures) into
    earlier/<time>/: the new run's folder holds its own only (the first run's snapshot stayed beside the second's,
    its args saying another --blr). A fresh start that fails before its first checkpoint leaves no earlier
    checkpoint behind it: the next plain rerun starts at step 0 (it resumed the OLD checkpoint, under a log that had
    been moved away, starting at step 3)."""
    args = lambda **kw: can_args(tmp_path, epochs=1, steps_per_epoch=2, keep_every=1, **kw)   # noqa: E731
    steps = lambda d: [json.loads(ln)["step"] for ln in open(d / "log.jsonl")]             # noqa: E731
    can.train(args(blr=1e-4))
    os.makedirs(tmp_path / "tensorboard")                            # its events (--tensorboard) go along too
    first = sorted(f for f in os.listdir(tmp_path) if f != ".lock")
    can.train(args(blr=1e-3, resume=False))
    assert "held an earlier run's files (args.json, checkpoint.pth, encoder_step0000001.pth" in capsys.readouterr().out
    (kept,) = os.listdir(tmp_path / "earlier")
    assert sorted(os.listdir(tmp_path / "earlier" / kept)) == first and steps(tmp_path / "earlier" / kept) == [1, 2]
    assert json.load(open(tmp_path / "earlier" / kept / "args.json"))["blr"] == 1e-4
    for f in ("encoder_step0000001.pth", "encoder_step0000002.pth", "checkpoint.pth"):
        assert C.load_checkpoint(str(tmp_path / f), "can")["args"]["blr"] == 1e-3, f
    assert json.load(open(tmp_path / "args.json"))["blr"] == 1e-3 and steps(tmp_path) == [1, 2]
    with pytest.raises(C.UserError, match="does not exist"):
        can.train(args(blr=1e-2, resume=False, init=str(tmp_path / "missing.pth")))   # fails before its checkpoint
    assert not (tmp_path / "checkpoint.pth").exists() and len(os.listdir(tmp_path / "earlier")) == 2
    can.train(args(blr=1e-2, init=None))                             # the plain rerun: from step 0, its own log
    assert steps(tmp_path) == [1, 2] and C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")["step"] == 2


def test_a_refused_resume_leaves_the_checkpoints_flags_in_args_json(tmp_path):
    """args.json is written once the run is known to start or resume: a rerun refused as another experiment leaves
    the flags of the checkpoint there (it had written its own: blr 0.001 beside a checkpoint of 0.00015)."""
    can.train(can_args(tmp_path, epochs=2, stop_epoch=1, steps_per_epoch=1, blr=1.5e-4))
    with pytest.raises(C.UserError, match="was trained with other settings"):
        can.train(can_args(tmp_path, epochs=2, steps_per_epoch=1, blr=1e-3))
    assert json.load(open(tmp_path / "args.json"))["blr"] == 1.5e-4


def test_stop_step_evaluates_its_k_nn_after_its_checkpoint_once(tmp_path, monkeypatch):
    """--eval-every 2 --stop-step 2: the k-NN of step 2 is logged before the run stops (the loop returned before
    asking the monitor: the log had 0, then after the resume 4, never 2); the resumed run does not repeat it."""
    real = S.SyntheticImages
    monkeypatch.setattr(S, "SyntheticImages", lambda split="train", **kw: real(split, n=24 if split == "train" else 8))
    can.train(can_args(tmp_path, epochs=2, steps_per_epoch=2, eval_every=2, stop_step=2))
    knn = lambda: [json.loads(ln)["step"] for ln in open(tmp_path / "log.jsonl") if "knn_top1" in ln]   # noqa: E731
    assert knn() == [0, 2]
    can.train(can_args(tmp_path, epochs=2, steps_per_epoch=2, eval_every=2))
    assert knn() == [0, 2, 4]


def _folder(root, n=8):
    for i in range(n):
        os.makedirs(root / f"c{i % 2}", exist_ok=True)
        S.synthetic_image(i)[0].resize((16, 16)).save(root / f"c{i % 2}" / f"{i}.png")
    return str(root)


def test_a_resumed_run_refuses_data_that_changed_in_one_line(tmp_path):
    """The checkpoint holds the data's fingerprint (counts, a hash of the relative paths, of the held-out ones): images
    added, a file renamed, another --holdout draw are each refused by name (the steps per epoch, the schedules and the
    held-out images would shift mid-run; with --holdout the run trained on images it had held out). The same data
    resumes, also from the folder moved whole (another --data path: the fingerprint decides, not the path)."""
    data = _folder(tmp_path / "d", 10)
    run = lambda **kw: can.train(can_args(tmp_path / "o", **{"data": data, "epochs": 2, "steps_per_epoch": 0,  # noqa
                                                             "batch_size": 4, **kw}))
    run(stop_epoch=1)
    S.synthetic_image(99)[0].resize((16, 16)).save(tmp_path / "d" / "c1" / "new.png")
    with pytest.raises(C.UserError, match=r"trained on other data \(train images 10 -> 11, other train files\): "
                                          r"rerun with the data it was trained on"):
        run()
    os.rename(tmp_path / "d" / "c1" / "new.png", tmp_path / "d" / "c0" / "new.png")       # another class: 11 again
    with pytest.raises(C.UserError, match=r"other data \(train images 10 -> 11, other train files\)"):
        run()
    os.remove(tmp_path / "d" / "c0" / "new.png")
    os.rename(tmp_path / "d" / "c0" / "0.png", tmp_path / "d" / "c0" / "00.png")          # renamed: same count
    with pytest.raises(C.UserError, match=r"other data \(other train files\)"):
        run()
    os.rename(tmp_path / "d" / "c0" / "00.png", tmp_path / "d" / "c0" / "0.png")
    run()
    assert C.load_checkpoint(str(tmp_path / "o" / "checkpoint.pth"), "can")["dataset"] == {"train": {
        "images": 10, "classes": 2, "files": C.digest(sorted(str(p) for p in (tmp_path / "d").glob("*/*.png")),
                                                     data)}}
    run(output_dir=str(tmp_path / "h"), holdout=3, stop_epoch=1)                         # 7 trained, 3 held out
    S.synthetic_image(98)[0].resize((16, 16)).save(tmp_path / "d" / "c0" / "8a.png")       # a draw of 3 in 11
    with pytest.raises(C.UserError, match=r"other data \(train images 7 -> 8, other train files, another train "
                                          r"held-out draw\)"):
        run(output_dir=str(tmp_path / "h"), holdout=3)
    os.remove(tmp_path / "d" / "c0" / "8a.png")
    os.rename(tmp_path / "d", tmp_path / "moved")                                          # the folder moved whole
    can.train(can_args(tmp_path / "h", data=str(tmp_path / "moved"), epochs=2, steps_per_epoch=0, batch_size=4,
                       holdout=3))
    assert C.load_checkpoint(str(tmp_path / "h" / "checkpoint.pth"), "can")["step"] == 2   # resumed, trained on


def test_a_filesystem_without_posix_locks_says_so_and_how_to_go_on(tmp_path, monkeypatch):
    """fcntl.lockf failing with ENOLCK (Lustre without flock, some FUSE mounts) is not "in use by another run": the
    line says the filesystem has no POSIX locks and where to put --output-dir; a lock held elsewhere still reads as
    in use."""
    import errno
    import fcntl

    def no_locks(f, how):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "lockf", no_locks)
    with pytest.raises(C.UserError, match=r"cannot lock .*\.lock \(No locks available\): its filesystem has no POSIX "
                                          r"locks; give a --output-dir on one that has"):
        H.claim_dir(str(tmp_path / "o"), "--output-dir")
    monkeypatch.setattr(fcntl, "lockf", lambda f, how: (_ for _ in ()).throw(OSError(errno.EAGAIN, "busy")))
    with pytest.raises(C.UserError, match="is in use by another run"):
        H.claim_dir(str(tmp_path / "o"), "--output-dir")


_HOLD = ("import os, sys, time, harness as H; f = H.claim_dir(sys.argv[1], \"--output-dir\"); "
         "open(os.path.join(sys.argv[1], f'checkpoint.pth.tmp.{os.getpid()}'), 'w').write('half written'); "
         "print('locked', flush=True); time.sleep(120)")


def test_a_second_run_in_the_same_output_dir_is_refused_and_the_first_ones_files_stay(tmp_path):
    """A run holds <output-dir>/.lock while it lives: a second run there stops in one line naming the holder, before
    it writes anything or removes the first run's checkpoint being written (which stopped the first run); once the
    holder is gone, the next run starts and removes the temporary file its dead writer left."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        tmp = tmp_path / f"checkpoint.pth.tmp.{holder.pid}"
        r = run_cli(*CAN_CLI, "--data", "synthetic", "--epochs", "1", "--steps-per-epoch", "1", "--output-dir",
                    str(tmp_path))
        one_line_error(r, f"--output-dir {tmp_path} is in use by another run (pid {holder.pid} on ")
        assert tmp.exists() and not (tmp_path / "args.json").exists() and not (tmp_path / "log.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    r = run_cli(*CAN_CLI, "--data", "synthetic", "--epochs", "1", "--steps-per-epoch", "1", "--output-dir",
                str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert not tmp.exists() and f"removed {tmp}" in r.stdout


def test_a_stop_signal_before_the_run_begins_exits_0_saying_nothing_was_written(tmp_path):
    """SIGTERM while the run is being set up (before a step could be trained): nothing to checkpoint, exit 0 as for any
    preemption (it exited 130, "interrupted by a second Ctrl-C ... the last checkpoint written is kept")."""
    code = ("import os, signal, harness as H, can; real = H.setup; "
            "H.setup = lambda *a, **k: (os.kill(os.getpid(), signal.SIGTERM), real(*a, **k))[1]; "
            "H.main(can.train, can.Args)")
    r = run_cli("-c", code, *CAN_CLI[1:], "--data", "synthetic", "--output-dir", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "stopped by SIGTERM before training began: nothing written; rerun the same command to start" in r.stdout
    assert not (tmp_path / "o" / "checkpoint.pth").exists()


def test_ctrl_c_says_what_it_interrupted_and_what_is_kept(tmp_path, capsys, monkeypatch):
    """Ctrl-C in an evaluation (which writes no checkpoint): "interrupted (Ctrl-C)", exit 130; a second Ctrl-C in a
    run: stopped at once, and which checkpoint is kept, or that none of this run was written."""
    code = ("import os, signal, time, harness as H, eval_linear as E, weights as W; "   # SIGINT as a terminal's: a
            "signal.signal(signal.SIGINT, signal.default_int_handler); "                # job started with & ignores it
            "W.load_encoder = lambda *a, **k: (os.kill(os.getpid(), signal.SIGINT), time.sleep(30)); "
            "H.main(E.evaluate, E.Args)")
    r = run_cli("-c", code, "--ckpt", vit_checkpoint(tmp_path / "c.pth", "cmae"), "--data", "synthetic")
    assert (r.returncode, r.stderr.strip()) == (130, "error: interrupted (Ctrl-C)")
    import signal
    old = {n: signal.getsignal(getattr(signal, n)) for n in C.STOP_SIGNALS}
    for saved, said in ((3, f"{tmp_path / 'o' / 'checkpoint.pth'} is the last checkpoint (step 3)"),
                        (None, "no checkpoint of this run was written")):
        def train(args, saved=saved):                               # a second Ctrl-C after the checkpoint of step 3
            run = H.setup(args, "can")
            run.guard.saved = saved
            raise KeyboardInterrupt
        monkeypatch.setattr(sys, "argv", ["can.py", "--data", "synthetic", "--output-dir", str(tmp_path / "o")])
        try:
            with pytest.raises(SystemExit) as e:
                H.main(train, can.Args)
        finally:
            for n, h in old.items():
                signal.signal(getattr(signal, n), h)
        assert e.value.code == 130
        assert capsys.readouterr().err.strip() == f"error: interrupted by a second Ctrl-C: stopped at once; {said}"


@pytest.mark.parametrize("part,call", [("share_features", 3), ("sharded_knn", 2)])
def test_a_stop_signal_in_a_k_nn_evaluation_ends_the_run_at_once_with_that_steps_checkpoint(part, call, tmp_path):
    """--eval-every: the monitor writes the step's checkpoint before it evaluates, and a SIGTERM during the
    evaluation, its extraction or its scoring, ends the program at once, exit 0, that checkpoint kept (the run waited
    for the whole k-NN, minutes on CPU, past train.sbatch's 120 s grace, with nothing saved: killed, the steps since
    the last checkpoint lost). Step 1's evaluation: share_features' 3rd call, sharded_knn's 2nd."""
    code = ("import os, signal, time, can, eval_linear as E, harness as H, synthetic as S\n"
            "few = S.SyntheticImages                      # 24 + 8 images: the evaluations take no time\n"
            "S.SyntheticImages = lambda split='train', **kw: few(split, n=24 if split == 'train' else 8)\n"
            f"real, n = E.{part}, [0]\n"
            "def slow(*a, **k):\n"
            "    n[0] += 1\n"
            f"    if n[0] == {call}:\n"
            "        os.kill(os.getpid(), signal.SIGTERM); time.sleep(60)\n"
            "    return real(*a, **k)\n"
            f"E.{part} = slow\n"
            "H.main(can.train, can.Args)")
    t = time.time()
    r = run_cli("-c", code, *CAN_CLI[1:], "--data", "synthetic", "--eval-every", "1", "--epochs", "2",
                "--steps-per-epoch", "2", "--output-dir", str(tmp_path / "o"))
    assert r.returncode == 0 and time.time() - t < 40, r.stderr[-2000:]          # not the 60 s sleep
    assert "stopped by SIGTERM in the k-NN evaluation: " in r.stdout
    assert C.load_checkpoint(str(tmp_path / "o" / "checkpoint.pth"), "can")["step"] == 1


def test_conmims_monitor_scores_the_steps_trained_and_a_resume_may_add_keep_every(tmp_path, monkeypatch):
    """ConMIM's loop asks the monitor about the step just trained (--eval-every 2: steps 0, 2, 4; asking about the one
    before scored 1, 3), as the other loops do; a resume that adds --keep-every (run control) resumes, not refused as
    another experiment, and keeps the snapshots from there."""
    real = S.SyntheticImages
    monkeypatch.setattr(S, "SyntheticImages", lambda split="train", **kw: real(split, n=24 if split == "train" else 8))
    conmim.train(conmim_args(tmp_path, epochs=2, steps_per_epoch=2, eval_every=2, stop_epoch=1))
    conmim.train(conmim_args(tmp_path, epochs=2, steps_per_epoch=2, eval_every=2, keep_every=1))
    assert [json.loads(ln)["step"] for ln in open(tmp_path / "log.jsonl") if "knn_top1" in ln] == [0, 2, 4]
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("encoder_step")) == [
        "encoder_step0000003.pth", "encoder_step0000004.pth"]
