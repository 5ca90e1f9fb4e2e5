"""srun without torchrun: harness.py imports this only inside an srun step that torchrun did not start, to turn SLURM's
variables into torchrun's (one task per GPU). Copy it along with a method file if you launch with srun that way."""
import os
import re

from common import UserError


def srun_env(env=None):
    """torchrun's variables for a task of an srun step of several tasks: rank, world and local rank from SLURM's,
    MASTER_ADDR as exported (scripts/train.sbatch), MASTER_PORT from the job id or exported. {}: not such a task."""
    env = os.environ if env is None else env
    count = lambda k: int(re.match(r"\d*", env.get(k, "")).group() or 0)    # noqa: E731  SLURM writes "8(x2)"
    world = count("SLURM_STEP_NUM_TASKS") or count("SLURM_NTASKS")
    if "WORLD_SIZE" in env or not ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env) or world < 2:
        return {}
    if "MASTER_ADDR" not in env:
        raise UserError("an srun step of several tasks needs MASTER_ADDR, rank 0's host: export MASTER_ADDR=$(scontrol "
                        "show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1), as scripts/train.sbatch does")
    out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": str(world), "LOCAL_RANK": env["SLURM_LOCALID"],
           "MASTER_PORT": env.get("MASTER_PORT") or str(20000 + count("SLURM_JOB_ID") % 20000)}
    per_node = count("SLURM_STEP_TASKS_PER_NODE") or count("SLURM_NTASKS_PER_NODE")
    return out | ({"LOCAL_WORLD_SIZE": str(per_node)} if per_node else {})
