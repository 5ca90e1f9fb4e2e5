"""Clusters: `srun` (no torchrun) forms one process group from SLURM's variables and the exported MASTER_ADDR,
torchrun's win where both are set, and the multi-node paths (torchrun --nnodes 2, srun
tasks on "two nodes") train exactly what the standard 2-process torchrun run trains, into one checkpoint
written by global rank 0; SIGUSR1 under srun checkpoints once and exits 0 on every rank; the sbatch
example requeues itself on SIGUSR1 and its job resumes."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import common as C
import harness as H
from helpers import ROOT, free_port, torchrun
from test_faults import CAN_CLI

RUN = [*CAN_CLI, "--data", "synthetic", "--epochs", "1", "--steps-per-epoch", "3", "--batch-size", "4",
       "--device", "cpu"]
LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", *[k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "PMI", "MV2_"))])


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def slurm_vars(rank, world=2, job=1, nodes="localhost", per_node=None):
    """What srun puts in each task's environment (the variables this project reads, and a few more), and the
    MASTER_ADDR that scripts/train.sbatch exports (the first node)."""
    return {"MASTER_ADDR": nodes, "SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": str(world),
            "SLURM_STEP_NUM_TASKS": str(world), "SLURM_LOCALID": str(rank % (per_node or world)),
            "SLURM_STEP_NODELIST": nodes, "SLURM_JOB_NODELIST": nodes, "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "1",
            "SLURM_STEP_TASKS_PER_NODE": f"{per_node or world}", "SLURM_CPUS_ON_NODE": "2"}


def free_derived_port():
    """A SLURM job id whose derived MASTER_PORT (20000 + id % 20000) is free here."""
    for job in range(int(time.time() * 1000) % 20000, 10 ** 6, 7):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 20000 + job % 20000))
                return job
            except OSError:
                continue


# ----------------------------------------------------------------------------------------------
# An srun task's variables (a pure function of the environment)
# ----------------------------------------------------------------------------------------------
def test_an_srun_task_gets_rank_world_local_rank_and_the_rendezvous():
    env = H.srun_env(slurm_vars(5, world=16, job=123456, nodes="gpu07", per_node=8))   # MASTER_ADDR: as exported
    assert env == {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "MASTER_PORT": str(20000 + 123456 % 20000),
                   "LOCAL_WORLD_SIZE": "8"}
    second_node = H.srun_env(slurm_vars(13, world=16, job=123456, per_node=8))
    assert (second_node["RANK"], second_node["LOCAL_RANK"]) == ("13", "5")        # device by local rank, data by rank
    assert H.srun_env({**slurm_vars(0, job=9), "MASTER_PORT": "1234"})["MASTER_PORT"] == "1234"
    assert H.srun_env({**slurm_vars(0, world=2), "SLURM_STEP_TASKS_PER_NODE": "2(x3)"})["LOCAL_WORLD_SIZE"] == "2"


def test_an_srun_step_inside_a_larger_job_takes_the_steps_task_count():
    """`srun -n 2` inside an 8-task allocation: SLURM_NTASKS is the job's 8, SLURM_STEP_NUM_TASKS the step's 2; the
    process group is the step's (reading the job's first, each task waited for 6 ranks that never came)."""
    env = H.srun_env({**slurm_vars(1, world=2), "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "8"})
    assert (env["WORLD_SIZE"], env["RANK"], env["LOCAL_WORLD_SIZE"]) == ("2", "1", "2")


def test_torchrun_wins_and_a_single_process_stays_single():
    both = {**slurm_vars(3, world=4), "WORLD_SIZE": "8", "RANK": "3", "LOCAL_RANK": "3"}
    assert H.srun_env(both) == {} and H.srun_env({}) == {}              # torchrun inside an sbatch / srun step
    assert H.srun_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == {}   # a 1-task job
    assert H.srun_env(slurm_vars(0, world=1)) == {}                         # srun -n 1: one process, no group


def test_a_wrong_cluster_launch_is_refused_saying_how_to_launch():
    """`python msn.py` in an sbatch script of several tasks, outside an srun step, trained one process on one GPU
    without a word; srun tasks that each start torchrun trained duplicate runs into one output. One line each."""
    with pytest.raises(C.UserError, match=r"this job has 4 SLURM tasks but this process was not started by srun: "
                                          r"it would train alone, on one GPU. Launch with `srun python"):
        H.srun_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"})
    with pytest.raises(C.UserError, match=r"srun started 4 tasks, each running torchrun with --nnodes 1: 4 duplicate"):
        H.srun_env({**slurm_vars(1, world=4), "WORLD_SIZE": "2", "RANK": "1", "GROUP_WORLD_SIZE": "1"})
    assert H.srun_env({**slurm_vars(1, world=4), "WORLD_SIZE": "8", "RANK": "1", "GROUP_WORLD_SIZE": "4"}) == {}


def test_an_srun_step_without_master_addr_is_one_line():
    env = {k: v for k, v in slurm_vars(1).items() if k != "MASTER_ADDR"}
    with pytest.raises(C.UserError, match="needs MASTER_ADDR.*scontrol show hostnames.*scripts/train.sbatch"):
        H.srun_env(env)


# ----------------------------------------------------------------------------------------------
# Multi-node paths on localhost: the same training as the standard 2-process torchrun run
# ----------------------------------------------------------------------------------------------
def start_srun_tasks(out, extra=(), world=2, job=None):
    """2 processes with only srun's variables (no torchrun), each as its own process group leader."""
    job = job if job is not None else free_derived_port()
    return [subprocess.Popen([sys.executable, *RUN, *extra, "--output-dir", str(out)], cwd=ROOT,
                             env=clean_env(**slurm_vars(r, world=world, job=job)), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True) for r in range(world)]


def finish(procs, timeout=240):
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-3000:]
    return outs


def weights(out):
    ck = C.load_checkpoint(str(out / "checkpoint.pth"), "can")
    return ck["step"], ck["model"]


def test_srun_tasks_and_two_node_torchrun_train_what_torchrun_trains_into_one_checkpoint(tmp_path):
    ref = torchrun(*RUN[:-2], "--output-dir", str(tmp_path / "ref"))           # --device cpu is added by torchrun()
    assert ref.returncode == 0, ref.stderr[-3000:]
    step, want = weights(tmp_path / "ref")
    assert step == 3

    outs = finish(start_srun_tasks(tmp_path / "srun"))
    assert "launcher: srun, 2 processes" in outs[0][0] and "2 process(es)" in outs[0][0]
    assert outs[1][0].strip() == ""                                           # rank 1 prints and writes nothing
    port = free_port()                                                        # two nodes' torchrun, c10d rendezvous
    node = lambda n: subprocess.Popen(                                        # noqa: E731
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={n}",
         "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=job1", *RUN,
         "--output-dir", str(tmp_path / "nodes")], cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    outs = finish([node(0), node(1)])
    assert "launcher: torchrun, 2 processes" in outs[0][0] + outs[1][0]
    for run in ("srun", "nodes"):
        got_step, got = weights(tmp_path / run)
        assert got_step == step and got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=f"{run}: {k}")
        assert sorted(os.listdir(tmp_path / run)) == sorted(os.listdir(tmp_path / "ref"))   # one checkpoint, one log


def test_sigusr1_under_srun_checkpoints_once_and_every_rank_exits_0(tmp_path):
    """SLURM's --signal=USR1@120 signals every task of the step: the ranks agree on the stop, rank 0 alone
    writes the checkpoint, both exit 0; the same srun command resumes from it."""
    out = tmp_path / "out"
    long = ["--steps-per-epoch", "400", "--log-every", "1"]
    procs = start_srun_tasks(out, long)
    t = time.time()
    while not ((out / "log.jsonl").exists() and len((out / "log.jsonl").read_text().splitlines()) >= 3):
        assert all(p.poll() is None for p in procs) and time.time() - t < 180, \
            [p.communicate()[1][-2000:] for p in procs]
        time.sleep(0.2)
    for p in procs:
        os.kill(p.pid, signal.SIGUSR1)
    outs = finish(procs)
    assert "signal SIGUSR1" in outs[0][0] and "rerun the same command to resume" in outs[0][0]
    assert outs[1][0].strip() == "" and "Traceback" not in outs[1][1] + outs[0][1]
    step = C.load_checkpoint(str(out / "checkpoint.pth"), "can")["step"]
    assert 3 <= step < 400 and step % 10 == 0                                  # agreed at a sync step
    assert [f for f in os.listdir(out) if ".tmp." in f] == []
    assert outs[0][0].count("checkpoint.pth written") == 1                     # once, by rank 0
    outs = finish(start_srun_tasks(out, [*long, "--stop-step", str(step + 2)]))
    assert f"resumed from {out / 'checkpoint.pth'}: epoch 0, step {step}" in outs[0][0]
    assert C.load_checkpoint(str(out / "checkpoint.pth"), "can")["step"] == step + 2


# ----------------------------------------------------------------------------------------------
# The sbatch example, run by bash with stand-ins for srun and scontrol
# ----------------------------------------------------------------------------------------------
FAKE_SRUN = """#!/bin/bash
# stand-in for srun: start SLURM_NTASKS copies of the command with each task's variables, forward
# SIGUSR1 / SIGTERM to them, and return the first non-zero exit status
while [[ "$1" == -* ]]; do shift; done          # srun's own options
pids=()
for ((r = 0; r < SLURM_NTASKS; r++)); do
  SLURM_STEP_ID=0 SLURM_PROCID=$r SLURM_LOCALID=$r SLURM_STEP_NUM_TASKS=$SLURM_NTASKS \\
    SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST "$@" &
  pids+=($!)
done
trap 'kill -USR1 "${pids[@]}"' USR1
trap 'kill -TERM "${pids[@]}"' TERM
rc=0
for p in "${pids[@]}"; do
  while true; do wait "$p"; s=$?; kill -0 "$p" 2>/dev/null || break; done
  [ "$s" -ne 0 ] && rc=$s
done
exit $rc
"""


def test_the_sbatch_example_forwards_sigusr1_requeues_and_its_job_resumes(tmp_path):
    script = os.path.join(ROOT, "scripts", "train.sbatch")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    text = open(script).read()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --signal=B:USR1@120", "#SBATCH "
                                                                                                    "--requeue"):
        assert line in text
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text(FAKE_SRUN)
    (bin_ / "scontrol").write_text(f"#!/bin/bash\n[ \"$1\" = show ] && {{ echo localhost; exit; }}\n"    # hostnames
                                   f"echo \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    for f in ("srun", "scontrol"):
        os.chmod(bin_ / f, 0o755)
    out = tmp_path / "out"
    env = clean_env(PATH=f"{bin_}:{os.environ['PATH']}", SLURM_JOB_ID=str(free_derived_port()), SLURM_NTASKS="2",
                    SLURM_JOB_NODELIST="localhost", PYTHON=sys.executable, METHOD="can", DATA="synthetic",
                    OUTPUT_DIR=str(out))
    args = [a for a in RUN[1:] if a not in ("--data", "synthetic")] + ["--steps-per-epoch", "400", "--log-every", "1"]
    job = subprocess.Popen(["bash", script, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    t = time.time()
    while not ((out / "log.jsonl").exists() and len((out / "log.jsonl").read_text().splitlines()) >= 3):
        assert job.poll() is None and time.time() - t < 180, job.communicate()[1][-3000:]
        time.sleep(0.2)
    job.send_signal(signal.SIGUSR1)                                 # --signal=B:USR1: the batch shell only
    o, e = job.communicate(timeout=180)
    assert job.returncode == 0, (o[-2000:], e[-2000:])
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", env["SLURM_JOB_ID"]]
    step = C.load_checkpoint(str(out / "checkpoint.pth"), "can")["step"]
    assert 3 <= step < 400 and "signal SIGUSR1" in o
    (tmp_path / "scontrol.log").unlink()
    job = subprocess.run(["bash", script, *args, "--stop-step", str(step + 2)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)                  # the requeued job
    assert job.returncode == 0 and f"resumed from {out / 'checkpoint.pth'}: epoch 0, step {step}" in job.stdout, \
        job.stderr[-2000:]
    assert not (tmp_path / "scontrol.log").exists()                                   # finished: no requeue
    assert shutil.which("bash")
