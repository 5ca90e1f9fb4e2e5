"""Clusters: `srun` (no torchrun) forms one process group from SLURM's variables, torchrun's win where both
are set, duplicates of any launcher are refused, and the multi-node paths (torchrun --nnodes 2, srun
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
from helpers import ROOT, free_port, one_line_error, run_cli, torchrun
from test_faults import CAN_CLI

RUN = [*CAN_CLI, "--data", "synthetic", "--epochs", "1", "--steps-per-epoch", "3", "--batch-size", "4",
       "--device", "cpu"]
LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", *[k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "PMI", "MV2_"))])


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def slurm_vars(rank, world=2, job=1, nodes="localhost", per_node=None):
    """What srun puts in each task's environment (the variables this project reads, and a few more)."""
    return {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world),
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
# Nodelists and launcher detection (pure functions of the environment)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nodelist,hosts", [
    ("gpu01", ["gpu01"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("x[008-010]", ["x008", "x009", "x010"]),                       # zero padding kept
    ("rack[1-2]-n[3,5]", ["rack1-n3", "rack1-n5", "rack2-n3", "rack2-n5"]),   # several groups in one name
    ("a[1],b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("gpu-a100-[1-2]", ["gpu-a100-1", "gpu-a100-2"]),
])
def test_nodelists_expand_without_scontrol(nodelist, hosts):
    assert H.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "gpu[01-03", "gpu]1[", "gpu[3-1]", "gpu[a-b]", "gpu[[1]]"])
def test_a_bad_nodelist_is_one_line(bad):
    with pytest.raises(C.UserError, match="SLURM nodelist"):
        H.expand_nodelist(bad)


def test_srun_variables_give_rank_world_local_rank_and_the_rendezvous():
    name, env = H.launcher(slurm_vars(5, world=16, job=123456, nodes="gpu[07-08]", per_node=8))
    assert name == "srun" and env == {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "MASTER_ADDR": "gpu07",
                                      "MASTER_PORT": str(20000 + 123456 % 20000), "LOCAL_WORLD_SIZE": "8"}
    second_node = H.launcher(slurm_vars(13, world=16, job=123456, nodes="gpu[07-08]", per_node=8))[1]
    assert (second_node["RANK"], second_node["LOCAL_RANK"]) == ("13", "5")   # device by local rank, data by rank
    set_port = H.launcher({**slurm_vars(0, job=9), "MASTER_PORT": "1234", "MASTER_ADDR": "head"})[1]
    assert set_port["MASTER_PORT"] == "1234" and set_port["MASTER_ADDR"] == "head"
    step_only = {k: v for k, v in slurm_vars(1, world=2, nodes="n[1-2]").items() if k != "SLURM_STEP_NODELIST"}
    assert H.launcher(step_only)[1]["MASTER_ADDR"] == "n1"              # the job's list when the step's is absent


def test_torchrun_wins_and_a_single_process_stays_single():
    both = {**slurm_vars(3, world=4), "WORLD_SIZE": "8", "RANK": "3", "LOCAL_RANK": "3", "GROUP_WORLD_SIZE": "4"}
    assert H.launcher(both) == ("torchrun", None)                       # torchrun inside an sbatch / srun step
    assert H.launcher({}) == ("none", None)
    assert H.launcher({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == ("none", None)
    assert H.launcher(slurm_vars(0, world=1)) == ("srun", None)         # srun -n 1: one process, no group


@pytest.mark.parametrize("env,match", [
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"},
     "16 SLURM tasks .* not started by srun.*srun python <method>.py"),        # the sbatch script's own shell
    ({**slurm_vars(0, world=8), "WORLD_SIZE": "1", "RANK": "0", "GROUP_WORLD_SIZE": "1"},
     "srun started 8 tasks, each running torchrun with --nnodes 1: .* 8 duplicate runs"),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_SIZE=4: an MPI launcher"),
    ({"PMI_SIZE": "2", "PMI_RANK": "0"}, "PMI_SIZE=2: an MPI launcher .* torchrun or srun"),
    ({"SLURM_PROCID": "0"}, "SLURM_PROCID is set but not SLURM_NTASKS"),
    ({**slurm_vars(2, world=2)}, "SLURM_PROCID=2 but the step has 2 tasks"),
    ({k: v for k, v in slurm_vars(1).items() if k != "SLURM_LOCALID"}, "without SLURM_PROCID / SLURM_LOCALID"),
    ({k: v for k, v in slurm_vars(1).items() if "NODELIST" not in k}, "cannot find rank 0's host"),
    ({**slurm_vars(0), "SLURM_NTASKS": "two", "SLURM_STEP_NUM_TASKS": "two"}, "SLURM_STEP_NUM_TASKS='two' is not a number"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 with WORLD_SIZE=2"),
    ({**slurm_vars(0, nodes="gpu[1-")}, "SLURM nodelist"),
])
def test_duplicates_and_partial_variables_are_one_line(env, match):
    with pytest.raises(C.UserError, match=match):
        H.launcher(env)


def test_a_sbatch_shell_with_several_tasks_is_refused_before_anything_is_written(tmp_path):
    """`python can.py` typed in an sbatch script of --ntasks 4 (no srun): one line, no output directory."""
    env = clean_env(SLURM_JOB_ID="77", SLURM_NTASKS="4", SLURM_PROCID="0", SLURM_LOCALID="0")
    r = subprocess.run([sys.executable, *RUN, "--output-dir", str(tmp_path / "out")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    one_line_error(r, "4 SLURM tasks", "srun")
    assert not (tmp_path / "out").exists()


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
    assert "launcher: srun, 2 processes on 1 node(s)" in outs[0][0] and "2 process(es)" in outs[0][0]
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
        assert all(p.poll() is None for p in procs) and time.time() - t < 180, [p.communicate()[1][-2000:] for p in procs]
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
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --signal=B:USR1@120", "#SBATCH --requeue"):
        assert line in text
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text(FAKE_SRUN)
    (bin_ / "scontrol").write_text(f"#!/bin/bash\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
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
