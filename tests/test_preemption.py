"""Preemption as a cluster sends it: SLURM, scancel, `timeout` and `kill -TERM -PGID` signal the whole
process group (DataLoader workers included), Ctrl-C sends SIGINT to the foreground group, and torchrun's
agent forwards the signal to every rank. Each must end the run with its checkpoint written, exit 0, and
the same command must resume from that step."""
import os
import signal
import subprocess
import sys
import time

import pytest

import common as C
from helpers import ROOT, torchrun_cmd
from test_faults import CAN_CLI

RUN = [*CAN_CLI, "--data", "synthetic", "--epochs", "2", "--steps-per-epoch", "200", "--workers", "2"]


def _start(cmd, log, lines=3):
    """Start cmd in its own process group (a job as a scheduler or a shell sees it); wait for `lines` log records."""
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    t = time.time()
    while not (log.exists() and len(log.read_text().splitlines()) >= lines):
        if p.poll() is not None or time.time() - t > 180:
            p.kill()
            pytest.fail(f"run ended or timed out before logging: {p.communicate()[1][-2000:]}")
        time.sleep(0.2)
    return p


def _resumes(tmp_path, step, cmd):
    """Rerunning the same command (with --stop-step to keep it short) continues from `step`."""
    r = subprocess.run(cmd + ["--stop-step", str(step + 2)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed from {tmp_path / 'checkpoint.pth'}: epoch 0, step {step}" in r.stdout
    assert C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")["step"] == step + 2


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1", "SIGINT"])
def test_signal_to_the_process_group_writes_a_checkpoint_and_exits_0(sig, tmp_path):
    cmd = [sys.executable, *RUN, "--output-dir", str(tmp_path)]
    p = _start(cmd, tmp_path / "log.jsonl")
    os.killpg(p.pid, getattr(signal, sig))                  # main process AND its DataLoader workers
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    assert f"signal {sig}" in out and "rerun the same command to resume" in out
    assert "killed by signal" not in err and "Traceback" not in err, err[-2000:]
    step = C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")["step"]
    assert 3 <= step < 200                                  # mid-epoch
    _resumes(tmp_path, step, cmd)


def test_sigterm_to_a_torchrun_job_stops_every_rank_with_a_checkpoint(tmp_path):
    cmd = torchrun_cmd(*RUN, "--batch-size", "4", "--output-dir", str(tmp_path))
    p = _start(cmd, tmp_path / "log.jsonl")
    os.killpg(p.pid, signal.SIGTERM)                        # the agent and both ranks (and their workers)
    out, err = p.communicate(timeout=120)
    assert "signal SIGTERM" in out and "rerun the same command to resume" in out, (out[-1500:], err[-2000:])
    assert "exitcode: 1" not in err and "killed by signal" not in err, err[-2000:]   # no rank failed
    step = C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")["step"]
    assert 3 <= step < 200 and step % 10 == 0               # ranks agree on the stop every 10 steps
    _resumes(tmp_path, step, cmd)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_during_the_end_of_run_knn_ends_the_program_promptly(sig, tmp_path):
    """After the final checkpoint the run computes its k-NN report (minutes on a CPU); a stop signal
    there was remembered for a training step that never came, so `timeout` waited the report out.
    Now it ends the program at once, exit 0, the checkpoint complete."""
    cmd = [sys.executable, *[a for a in RUN if a != "--no-knn"], "--knn", "--steps-per-epoch", "2", "--epochs", "1",
           "--output-dir", str(tmp_path)]
    p = _start(cmd, tmp_path / "log.jsonl", lines=2)                    # both steps logged: training is over
    while not (tmp_path / "checkpoint.pth").exists() or C.load_checkpoint(str(tmp_path / "checkpoint.pth"))["step"] < 2:
        time.sleep(0.1)
    time.sleep(1.0)                                                      # into the k-NN's feature extraction
    t = time.time()
    os.killpg(p.pid, getattr(signal, sig))
    out, err = p.communicate(timeout=60)
    assert time.time() - t < 10 and p.returncode == 0, (time.time() - t, err[-2000:])
    assert f"stopped by {sig} in the k-NN evaluation" in out and "% at step 2" not in out   # the final one cut short
    assert C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")["step"] == 2
