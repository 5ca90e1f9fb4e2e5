"""The run harness of msn.py, cmae.py, conmim.py, siammae.py and can.py (`import harness as H`): everything about
starting, sizing and stopping a run. The training kit those loops call (schedules, the optimiser step, micro-batches,
data, checkpoints, the log) is common.py, which this module imports and which never imports it.

Top to bottom: launching (the device, torchrun / srun / sbatch, the process group, the collectives autograd sees); the
command line and the small recipes (RunArgs, scale_recipe, parse_args); starting a run (main, setup, resume and the
flags a resumed run may change, validation, the batch plan); stopping one (the non-finite guard, preemption signals,
checkpoint timing, the end-of-run k-NN's hand-over).
"""
import argparse
import contextlib
import dataclasses
import gc
import glob
import importlib.util
import itertools
import json
import math
import os
import re
import sys
import time

import torch
import torch.distributed as dist

import common as C
from common import UserError, print0, is_main, world_size


# ----------------------------------------------------------------------------------------------
# Launching: the device, torchrun / srun / sbatch, the process group, collectives autograd sees
# ----------------------------------------------------------------------------------------------
def resolve_device(name=None):
    """--device: None (cuda if available, else cpu), cpu, cuda or cuda:N; else a one-line error."""
    name = name or ("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise UserError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    if name.startswith("cuda"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise UserError(f"--device {name}: no CUDA GPU is available here (torch {torch.__version__}); use --device cpu")
        if ":" in name and int(name.split(":")[1]) >= n:
            raise UserError(f"--device {name}: this host has {n} GPU(s) (cuda:0..cuda:{n - 1})")
    return torch.device(name)


def expand_nodelist(nodelist):
    """SLURM's compressed host list -> hosts, in order, without calling scontrol (which may be absent):
    "gpu[01-03,07],cpu5" -> gpu01 gpu02 gpu03 gpu07 cpu5 (zero padding kept); a name with several bracket groups
    ("r[1-2]n[3,5]") expands to their product, the last group fastest."""
    hosts, depth, item = [], 0, ""
    for ch in nodelist.strip() + ",":                          # split on the commas outside brackets
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise UserError(f"SLURM nodelist {nodelist!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            if item:
                hosts += _expand_host(item, nodelist)
            item = ""
        else:
            item += ch
    if depth or not hosts:
        raise UserError(f"SLURM nodelist {nodelist!r}: no host in it, or unbalanced brackets")
    return hosts


def _expand_host(item, nodelist):
    parts = re.split(r"\[([^\]]*)\]", item)                   # text, group, text, group, ..., text
    choices = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            choices.append([part])
            continue
        vals = []
        for r in part.split(","):
            m = re.fullmatch(r"(\d+)(?:-(\d+))?", r.strip())
            if not m or (m[2] and int(m[2]) < int(m[1])):
                raise UserError(f"SLURM nodelist {nodelist!r}: cannot read the range {r!r}")
            lo, hi = m[1], m[2] or m[1]
            vals += [str(k).zfill(len(lo)) for k in range(int(lo), int(hi) + 1)]
        choices.append(vals)
    return ["".join(c) for c in itertools.product(*choices)]


MPI_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")      # mpirun's, if any


def launcher(env=None):
    """How this process was started, from the environment: (name, torchrun-style variables or None). torchrun (WORLD_SIZE
    set; also inside an sbatch script) wins; else an srun step (SLURM_STEP_ID): rank SLURM_PROCID, world
    SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), local rank SLURM_LOCALID, MASTER_ADDR the step's first host
    (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST), MASTER_PORT derived from SLURM_JOB_ID unless set. Several tasks of
    a launcher that do not form one process group here (an sbatch script's own shell with --ntasks > 1, srun tasks
    each running a standalone torchrun, mpirun) would train as duplicates into one output: a one-line error naming the
    fix. Partial or inconsistent variables: one line."""
    env = os.environ if env is None else env
    num = lambda k: _int_var(env, k)                           # noqa: E731
    slurm_tasks = num("SLURM_STEP_NUM_TASKS") or num("SLURM_NTASKS") or 1
    step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    if "WORLD_SIZE" in env:
        world, rank = num("WORLD_SIZE"), num("RANK")
        if rank is None or rank >= world:
            raise UserError(f"torchrun variables: RANK={env.get('RANK')} with WORLD_SIZE={world} (need 0 <= RANK < "
                            "WORLD_SIZE): start with torchrun, or unset WORLD_SIZE")
        agents = num("GROUP_WORLD_SIZE")
        if step and slurm_tasks > 1 and agents is not None and agents != slurm_tasks:
            raise UserError(f"srun started {slurm_tasks} tasks, each running torchrun with --nnodes {agents}: they "
                            f"would train as {slurm_tasks // agents} duplicate runs into one output. Use srun alone "
                            f"(one task per GPU), or one torchrun per node with --nnodes {slurm_tasks} and a shared "
                            "--rdzv-endpoint")
        return "torchrun", None
    if "SLURM_PROCID" in env and num("SLURM_NTASKS") is None and num("SLURM_STEP_NUM_TASKS") is None:
        raise UserError("SLURM_PROCID is set but not SLURM_NTASKS: the SLURM variables are partial (start the run "
                        "with srun, or unset SLURM_PROCID)")
    if slurm_tasks > 1 and not step:
        raise UserError(f"this job has {slurm_tasks} SLURM tasks (SLURM_NTASKS) but this process was not started by "
                        "srun: it would train alone, as one of duplicates if the script runs it in several tasks. "
                        "Launch with `srun python <method>.py ...` (one task per GPU) or torchrun")
    if step and slurm_tasks > 1:
        rank, local = num("SLURM_PROCID"), num("SLURM_LOCALID")
        if rank is None or local is None:
            raise UserError(f"srun step of {slurm_tasks} tasks without SLURM_PROCID / SLURM_LOCALID: the SLURM "
                            "variables are partial")
        if rank >= slurm_tasks:
            raise UserError(f"SLURM_PROCID={rank} but the step has {slurm_tasks} tasks (need SLURM_PROCID < tasks)")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist and "MASTER_ADDR" not in env:
            raise UserError("srun step without SLURM_STEP_NODELIST / SLURM_JOB_NODELIST: cannot find rank 0's host "
                            "(set MASTER_ADDR)")
        job = num("SLURM_JOB_ID") or num("SLURM_JOBID") or 0
        out = {"RANK": str(rank), "WORLD_SIZE": str(slurm_tasks), "LOCAL_RANK": str(local),
               "MASTER_ADDR": env.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
               "MASTER_PORT": env.get("MASTER_PORT") or str(20000 + job % 20000)}
        per_node = re.match(r"\d+", env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE") or "")
        if per_node:
            out["LOCAL_WORLD_SIZE"] = per_node[0]
        return "srun", out
    for k in MPI_SIZES:
        if (num(k) or 1) > 1:
            raise UserError(f"{k}={env[k]}: an MPI launcher started {env[k]} processes, but this script forms its "
                            "process group from torchrun's or srun's variables, not MPI's: they would train as "
                            "duplicates. Launch with torchrun or srun")
    return ("srun" if step else "none"), None


def _int_var(env, k):
    if k not in env:
        return None
    try:
        v = int(env[k].split("(")[0].split(",")[0])            # SLURM counts may read "8(x2)"
    except ValueError:
        raise UserError(f"{k}={env[k]!r} is not a number") from None
    if v < 0:
        raise UserError(f"{k}={v} is negative")
    return v


def init_distributed(device):
    """One process group from torchrun's variables, or an srun step's (launcher()): nccl on CUDA, gloo on CPU; one line
    (rank 0) names the launcher and the layout. Returns (rank, world, device)."""
    device = str(resolve_device(device))
    name, derived = launcher() if not dist.is_initialized() else ("an initialised process group", None)
    if derived:
        os.environ.update(derived)                          # env:// rendezvous as under torchrun
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        cuda = device.startswith("cuda")
        if cuda:
            local, n = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
            if int(os.environ.get("LOCAL_WORLD_SIZE", local + 1)) > n and not (name == "srun" and n == 1):
                flag = "--ntasks-per-node / --gpus-per-task" if name == "srun" else "--nproc_per_node"
                raise UserError(f"{os.environ.get('LOCAL_WORLD_SIZE')} processes on this node but {n} GPU(s): "
                                f"use {flag} {n} (one process per GPU), or --device cpu")
            device = "cuda:0" if n == 1 else f"cuda:{local}"   # srun --gpus-per-task binds one GPU per task
            if local >= n and n > 1:
                raise UserError(f"local rank {local} but this node shows {n} GPU(s): one process per GPU")
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        r, w = dist.get_rank(), dist.get_world_size()
        nodes = (os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_NNODES")) if name == "srun" else None
        print0(f"launcher: {name}, {w} processes{f' on {nodes} node(s)' if nodes else ''}, rank 0 at "
               f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}; devices by local rank, "
               "data and seeds by global rank, rank 0 writes")
        return r, w, torch.device(device)
    return 0, 1, torch.device(device)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x.contiguous())
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad):
        # d(sum of every rank's loss)/d(my rows) = sum over ranks of their grads on my rows
        grad = grad.contiguous()
        dist.all_reduce(grad)
        n = grad.shape[0] // dist.get_world_size()
        return grad[dist.get_rank() * n:(dist.get_rank() + 1) * n]


def all_gather(x, grad=True):
    """Concatenate x (equal shapes) from all ranks along dim 0, rank order; autograd-aware."""
    if world_size() == 1:
        return x
    return _AllGather.apply(x) if grad else _AllGather.forward(None, x)


def all_reduce_mean(x):
    """Mean of x over ranks, autograd-aware (backward: mean of the incoming grads' sum)."""
    if world_size() == 1:
        return x
    return all_gather(x[None]).mean(0)


def all_reduce_sum_(x):
    """In-place sum over ranks, no autograd (for statistics under no_grad)."""
    if world_size() > 1:
        dist.all_reduce(x)
    return x


# ----------------------------------------------------------------------------------------------
# The command line and the small recipes
# ----------------------------------------------------------------------------------------------
def arg(default, help):
    """A dataclass field with its --help text."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class RunArgs:
    """Run plumbing shared by every method's Args (its hyper-parameters live in the method file)."""
    workers: int = arg(min(10, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1),
                       "DataLoader workers per process (here: min(10, the CPUs this process may use))")
    seed: int = 0
    resume: bool = arg(True, "continue from <output-dir>/checkpoint.pth when it exists (rerunning a command resumes "
                       "it; a rerun with other model / objective / data / recipe flags is refused): --no-resume starts over")
    precision: str = arg(None, "bf16|fp16|fp32 (default bf16 on CUDA, fp32 on CPU)")
    compile: bool = arg(None, "torch.compile the networks (default: on with CUDA, off on CPU)")
    log_every: int = 50
    device: str = None
    micro_batch: int = arg(0, "samples per forward/backward per process (0: the whole per-process batch); exact")
    grad_ckpt: bool = arg(False, "activation checkpointing of every transformer block: less memory, ~1/3 more compute")
    steps_per_epoch: int = arg(0, "cap steps per epoch (0 = full epoch)")
    stop_epoch: int = arg(0, "exit after this epoch (schedules still span --epochs)")
    stop_step: int = arg(0, "write a checkpoint and exit after this global step")
    save_every: int = arg(0, "also write the checkpoint every N steps (0 = per epoch only)")
    save_every_minutes: float = arg(30.0, "also write it when this many minutes passed since the last one (0 = off)")
    max_unreadable: float = arg(0.01, "stop if more than this fraction of the images (SiamMAE: videos) read in an "
                                "epoch is unreadable (they are skipped otherwise)")
    allow_batch_change: bool = arg(False, "resume a checkpoint trained with another --batch-size (from the same "
                                   "number of images seen)")
    preset: str = arg(None, "a named small recipe (e.g. small: 32-px images such as CIFAR-10 on a CPU), derived from the "
                      "official one by stated rules; flags given explicitly win (the values: end of --help)")
    tensorboard: bool = arg(False, "also write every logged scalar and the pictures to <output-dir>/tensorboard "
                            "(needs the tensorboard package)")
    holdout: int = arg(0, "keep this many training images (SiamMAE: videos) out of training, a fixed draw: the "
                       "validation split that eval_linear.py / eval_video.py --holdout N score (scripts/lr_sweep.py)")


HELP = {  # help of the flags several scripts share, where a script gives none of its own
    "batch_size": "images per batch", "betas": "AdamW betas", "blr": "base lr: lr = blr x global batch / 256",
    "clip_grad": "max gradient norm (0 = off)", "crop_scale": "RandomResizedCrop area range",
    "decoder_depth": "decoder blocks", "decoder_dim": "decoder width", "decoder_heads": "decoder attention heads",
    "device": "cpu | cuda | cuda:N (default: cuda if available)", "drop_path": "stochastic depth rate of the last block",
    "epochs": "training epochs (the schedules span them)", "eval_batch": "images per evaluation batch",
    "feature_decoder_depth": "feature decoder blocks", "final_weight_decay": "weight decay at the end (cosine)",
    "focal_scale": "crop area range of the focal views", "focal_size": "focal view size (px)",
    "focal_views": "focal views per image", "head_dim": "projection output width", "head_hidden": "projection hidden width",
    "img_size": "training image size (px)", "k": "neighbours of the k-NN", "layer_decay": "layer-wise lr decay",
    "linear_batch": "linear probe batch", "linear_epochs": "linear probe epochs", "linear_lr": "linear probe peak lr",
    "log_every": "steps between log lines", "mask_ratio": "share of patches masked",
    "me_max_weight": "weight of the ME-MAX regulariser", "min_lr": "lr at the end of the cosine schedule",
    "num_prototypes": "prototypes K", "patch_size": "ViT patch size (px)", "proj_dim": "projector output width",
    "proj_hidden": "projector hidden width", "radius": "short-term memory radius (patch cells)",
    "rand_scale": "crop area range of the random anchor views", "random_init": "evaluate the same ViT at its initialisation",
    "repeated_sampling": "pairs drawn per video visit (R)", "seed": "random seed (weights, data order, augmentation)",
    "sigma_max": "noise level sigma ~ U[0, sigma_max]", "sinkhorn_iters": "Sinkhorn-Knopp iterations",
    "smoothing": "label smoothing", "tau": "softmax temperature of the loss", "temperature": "softmax temperature",
    "topk": "neighbours voting per patch", "warmup_epochs": "linear lr warm-up epochs",
    "weight_decay": "AdamW weight decay", "output_dir": "where checkpoint.pth, log.jsonl, args.json and pictures go",
    "ckpt": "checkpoint to evaluate",
}


GROUPS = (  # --help sections, in order; a flag in none of them is the script's own
    ("data", {"data", "output_dir", "img_size", "crop_scale", "workers", "max_unreadable", "split", "short_side",
              "size", "subset_file", "videos", "pairs", "gaps"}),
    ("model", {"model", "patch_size", "drop_path", "init", "layer_scale", "decoder", "decoder_dim", "decoder_depth",
               "decoder_heads", "feature_decoder_depth", "proj_hidden", "proj_dim", "head_hidden", "head_dim",
               "num_prototypes", "ckpt", "random_init", "pool"}),
    ("optimisation", {"preset", "epochs", "batch_size", "micro_batch", "grad_ckpt", "lr", "blr", "min_lr", "start_lr", "warmup_lr",
                      "warmup_epochs", "weight_decay", "final_weight_decay", "betas", "clip_grad", "ema", "layer_decay",
                      "repeated_sampling", "ipe_scale", "allow_batch_change", "rel_pos_lr"}),
    ("views and masking", {"mask_ratio", "mask_unit", "rand_views", "rand_size", "rand_scale", "focal_views",
                           "focal_size", "focal_scale", "gap", "master_size", "shift", "gpu_aug", "gpu_decode"}),
    ("run control", {"output", "seed", "resume", "precision", "compile", "log_every", "device", "steps_per_epoch", "knn",
                     "stop_epoch", "stop_step", "save_every", "save_every_minutes", "cache", "tensorboard", "probe_every"}),
)


OFFICIAL_IMG = 224                  # the image size every official recipe here trains at
SHORT_EMA = 0.02                    # a short run's EMA horizon 1/(1 - m): at most this fraction of its steps


def scale_recipe(cls, preset):
    """A small recipe: the official one (cls's defaults) at the preset's batch, length and image size,
    by these rules (a value the preset sets itself wins; the preset's other choices are the budget's;
    docs/RESULTS.md gives the reasons):
      - lr linear in the global batch, per image as the official recipe: lr (and the schedule's start /
        end lr) x batch / official batch (blr recipes, lr = blr x batch / 256, keep their blr), times the
        preset's `lr_factor` (default 1), which scripts/lr_sweep.py chooses on held-out training images.
      - warm-up the same fraction of the run: warmup_epochs x epochs / official epochs.
      - EMA: the horizon 1/(1 - m) at most SHORT_EMA of the run's steps (ema_horizon; the official
        momentum where it is shorter). Weight-decay schedules keep their official values.
      - batch-coupled counts keep their ratio to the batch: MSN's prototypes x batch / official batch.
      - view geometry x img_size / 224: focal crops rounded to a multiple of the patch, the master crop
        to a pixel, the masking blocks (mask_unit, in patches) to whole patches. Crop scales are fractions
        of the area and do not change.
    Returns the preset with the derived values added."""
    d = {f.name: f.default for f in dataclasses.fields(cls)}
    out, scale = dict(preset), preset["img_size"] / OFFICIAL_IMG
    factor, ratio = out.pop("lr_factor", 1.0), preset["batch_size"] / d["batch_size"]
    if d.get("lr") is not None:                                   # an absolute lr for the official batch
        for k in ("lr", "start_lr", "min_lr"):
            if d.get(k):
                out.setdefault(k, float(f"{d[k] * ratio * factor:.4g}"))
    elif d.get("blr"):
        out.setdefault("blr", float(f"{d['blr'] * factor:.4g}"))
    out.setdefault("warmup_epochs", float(f"{d['warmup_epochs'] * preset['epochs'] / d['epochs']:.4g}"))
    if "ema_horizon" in d:
        out.setdefault("ema_horizon", SHORT_EMA)
    if "num_prototypes" in d:
        out.setdefault("num_prototypes", max(2, round(d["num_prototypes"] * ratio)))
    p = preset.get("patch_size", d["patch_size"])
    if "focal_size" in d:
        out.setdefault("focal_size", max(p, round(d["focal_size"] * scale / p) * p))
    if "master_size" in d:
        out.setdefault("master_size", round(d["master_size"] * scale))
    if "mask_unit" in d:                                          # official 2 x 16 px blocks: 32 px
        out.setdefault("mask_unit", max(1, round(d["mask_unit"] * d["patch_size"] * scale / p)))
    return out


def ema_start(m, steps, horizon):
    """The EMA's first momentum: m, lowered where its horizon 1 / (1 - m) exceeds `horizon` x steps (scale_recipe)."""
    return min(m, 1 - 1 / max(1.0, horizon * steps)) if horizon else m


def presets(cls, given=None):
    """{name: derived values} of cls's small recipes, 'synthetic' among them; `given` flags enter the rules (--epochs)."""
    named = {**({"synthetic": cls.SYNTHETIC} if hasattr(cls, "SYNTHETIC") else {}), **getattr(cls, "PRESETS", {})}
    return {k: scale_recipe(cls, {**v, **(given or {})}) if hasattr(cls, "PRESETS") else v for k, v in named.items()}


def parse_args(cls, argv=None):
    """`cls` (a dataclass) from the command line, `--field-name value` per field. `--preset NAME` (or `--data synthetic`,
    which implies `--preset synthetic`): fields not given take that small recipe's values, derived from the official
    defaults by scale_recipe's rules. --help: the flags in groups, each with its help and default, and every preset's
    values."""
    named = presets(cls)
    show = lambda d: ", ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, tuple) else v}"  # noqa: E731
                               for k, v in d.items())
    epilog = " | ".join(("--data synthetic: a CPU-sized config replaces these defaults for every flag not given: "
                         if k == "synthetic" else f"--preset {k}: ") + show(v) for k, v in named.items()) or None
    p = argparse.ArgumentParser(description=(cls.__doc__ or "").strip().split("\n")[0], epilog=epilog)
    own = "evaluation" if not issubclass(cls, RunArgs) else "the method's own"
    groups = {g: p.add_argument_group(g) for g, _ in GROUPS[:3]}
    groups[own] = p.add_argument_group(own)
    groups |= {g: p.add_argument_group(g) for g, _ in GROUPS[3:]}
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in ("data", "ckpt")):   # --data / --ckpt first
        group = groups[next((g for g, members in GROUPS if f.name in members), own)]
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = " ".join(map(str, default)) if isinstance(default, tuple) else default
        text = f.metadata.get("help") or HELP.get(f.name, f.name.replace("_", " "))
        if text.startswith("default") and f.name in HELP:                            # "default runs/msn": say what
            text = f"{HELP[f.name]} ({text})"
        text = text if "default" in text else f"{text} (default: {shown})"                     # said once
        flag, kw = "--" + f.name.replace("_", "-"), dict(default=argparse.SUPPRESS, help=text.replace("%", "%%"))
        if f.type in (bool, "bool"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif isinstance(f.default, tuple):
            group.add_argument(flag, type=type(f.default[0]), nargs=f.metadata.get("nargs", len(f.default)), **kw)
        else:
            group.add_argument(flag, type={"int": int, "float": float, "str": str}.get(f.type, f.type), **kw)
    for a in p._actions:
        if a.dest in ("data", "ckpt"):
            a.help = a.help.replace("(default: None)", "(required)")
    given = vars(p.parse_args(argv))
    synthetic = given.get("data", getattr(cls, "data", None)) == "synthetic" and "synthetic" in named
    preset = given.get("preset") or ("synthetic" if synthetic else None)
    if preset:
        if preset not in named:
            p.error(f"--preset {preset}: this script has {', '.join(named) if named else 'no presets'}")
        given = {**presets(cls, given)[preset], **given, "preset": preset}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})


# ----------------------------------------------------------------------------------------------
# Starting a run: main, setup, resume, validation, the batch plan
# ----------------------------------------------------------------------------------------------
_OUT = [None]                                      # the run's output directory, for main's closing line


def main(train, cls):
    """`python method.py ...`: parse, train, and turn UserError into a one-line message. Preemption signals are caught
    here for training runs (RunArgs), not when train() is called from other code."""
    if issubclass(cls, RunArgs):
        catch_preemption()
    t0 = time.time()
    try:
        train(parse_args(cls))
        if dist.is_initialized():
            dist.barrier()                      # all ranks done before any tears the group down
        files = sorted(os.listdir(_OUT[0])) if _OUT[0] and os.path.isdir(_OUT[0]) else []
        wrote = f": {', '.join(files) if len(files) <= 12 else f'{len(files)} files'} in {_OUT[0]}" if files else ""
        print0(f"done in {time.time() - t0:.0f} s{wrote}")
    except UserError as e:
        msg = str(e).strip().splitlines()[-1]          # DataLoader workers wrap the message
        print(f"error: {msg.removeprefix('common.UserError: ').removeprefix('UserError: ')}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted by a second Ctrl-C: stopped at once, the last checkpoint written is kept",
              file=sys.stderr)
        sys.exit(130)
    finally:
        if dist.is_initialized():
            gc.collect()            # free DDP's reducer and gloo's pending work while Python is alive: left to
            dist.destroy_process_group()      # the interpreter's exit, they aborted ~1 gloo run in 12 (SIGABRT)


def setup(args, method):
    """Distributed init, seed, device, precision, output dir. Returns a namespace used by train()."""
    validate(args)
    rank, world, device = init_distributed(args.device)
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    if precision not in ("bf16", "fp16", "fp32"):
        raise UserError(f"--precision must be bf16, fp16 or fp32, got {precision!r}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]
    if not args.data:
        raise UserError("--data is required: an image folder (ImageFolder layout) or 'synthetic'")
    if args.data != "synthetic" and not os.path.isdir(args.data):                   # before any plan is printed
        raise UserError(f"--data {args.data}: no such directory (give an image folder or 'synthetic')")
    if getattr(args, "knn", None) and args.data != "synthetic" and importlib.util.find_spec("eval_linear"):
        ev = next((s for s in ("val", "test") if os.path.isdir(os.path.join(args.data, s))), None)   # as eval_linear's
        names = lambda s: {e.name for e in os.scandir(os.path.join(args.data, s)) if e.is_dir()} if s else set()  # noqa: E731
        extra = sorted(names(ev) - names("train" if os.path.isdir(os.path.join(args.data, "train")) else None))
        if not ev or extra:                          # the k-NN monitor reads them after training: refused before it
            raise UserError(f"--knn: --data {args.data} has no val/ (or test/) next to train/ (the k-NN's queries): add one "
                            f"or leave out --knn" if not ev else f"--knn: {ev}/ has class {extra[0]!r}, which train/ lacks")
    torch.manual_seed(args.seed)                        # same initial weights on every rank
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    out = args.output_dir or os.path.join("runs", method)
    device_defaults(args, device)
    ckpt = os.path.join(out, "checkpoint.pth")
    if is_main():
        check_writable(out, "--output-dir")
        for tmp in glob.glob(glob.escape(ckpt) + ".tmp.*"):         # a run killed while writing (SIGKILL, node loss)
            os.remove(tmp)
            print(f"removed {tmp}: the unfinished checkpoint write of a run killed while saving")
        aug = (f", colour augmentation {'batched on ' + device.type if args.gpu_aug else 'in the workers'}"
               if hasattr(args, "gpu_aug") else "")
        print(f"{method}: {world} process(es) on {device}, precision {precision}, torch.compile "
              f"{'on' if args.compile else 'off'}{aug}, output {out}")
        print(json.dumps(dataclasses.asdict(args)))
        with open(os.path.join(out, "args.json"), "w") as f:                      # the run's flags, readable
            json.dump(dataclasses.asdict(args), f, indent=1)
        C._TB[0] = None
        if getattr(args, "tensorboard", False):                                     # the package is needed only then
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("--tensorboard needs the tensorboard package (pip install tensorboard), or leave the flag out") from None
            C._TB[0] = SummaryWriter(os.path.join(out, "tensorboard"))
    _OUT[0] = out
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext())
    return argparse.Namespace(rank=rank, world=world, device=device, precision=precision, autocast=autocast,
                              scaler=torch.amp.GradScaler(device.type, enabled=precision == "fp16"), out=out,
                              ckpt=ckpt, guard=Guard(device, precision, ckpt), control=Control(args, device))


RUN_ONLY = {"workers", "resume", "compile", "log_every", "device", "micro_batch", "grad_ckpt", "stop_epoch",
            "stop_step", "save_every", "save_every_minutes", "max_unreadable", "allow_batch_change", "batch_size",
            "output_dir", "knn", "precision", "tensorboard", "probe_every"}   # run control: a resumed run may change them
SCHEDULE = {"epochs", "steps_per_epoch"}              # may change on resume, with a line (the schedules follow)


def resume_run(run, method, args, model, optimizer, target=None):
    """Continue from <output-dir>/checkpoint.pth when it exists and --resume; returns the global step to start from (0
    for a new run). The RNG state is this rank's at the checkpoint."""
    if not (args.resume and os.path.isfile(run.ckpt)):
        return 0
    ckpt = C.load_checkpoint(run.ckpt, method)
    old_batch = ckpt["args"].get("batch_size", args.batch_size)
    if old_batch != args.batch_size:
        changes = (f"{run.ckpt} was trained with --batch-size {old_batch}, this run asks for {args.batch_size}: "
                   f"steps per epoch, the lr (if scaled with the batch) and every per-step schedule change")
        if not args.allow_batch_change:
            raise UserError(f"{changes}; rerun with --batch-size {old_batch}, or add --allow-batch-change to "
                            "continue from the same number of images seen, or use another --output-dir")
        print0(f"warning: {changes}; continuing from the same number of images seen (--allow-batch-change)")
    old = {k: tuple(v) if isinstance(v, list) else v for k, v in ckpt["args"].items()}
    changed = {k: f"--{k.replace('_', '-')} {old[k]} -> {v}" for k, v in vars(args).items()
               if k in old and old[k] != v and k not in RUN_ONLY}
    other = [c for k, c in changed.items() if k not in SCHEDULE]
    if other:                                   # another experiment in the same directory: never silently continued
        raise UserError(f"{run.ckpt} was trained with other settings ({', '.join(other)}): rerun with its flags to "
                        "resume it, or start a new run with --no-resume (overwrites it) or another --output-dir")
    if changed:
        print0(f"warning: resuming with {', '.join(changed.values())}: the schedules follow the new length from this step")
    try:
        C.unwrap(model).load_state_dict(ckpt["model"])
        if target is not None:
            target.load_state_dict(ckpt["target"])
    except RuntimeError as e:
        raise UserError(f"{run.ckpt} does not fit this model ({str(e).splitlines()[0]}); use the "
                        "flags it was trained with or another --output-dir") from None
    optimizer.load_state_dict(ckpt["optimizer"])
    run.scaler.load_state_dict(ckpt["scaler"])
    rng = ckpt["rng"]
    if torch.is_tensor(rng):                                             # checkpoints before per-rank states
        torch.set_rng_state(rng)
    else:
        C.set_rng_state(rng[C.rank() % len(rng)])
    run.guard.saved = step = ckpt["step"]
    if old_batch != args.batch_size:                          # same images seen, at the new batch size
        step = round(step * old_batch / args.batch_size)
        print0(f"step {ckpt['step']} at batch {old_batch} = step {step} at batch {args.batch_size}; the data order and "
               "random draws of the old run are not continued exactly")
    print0(f"resumed from {run.ckpt}: epoch {ckpt['epoch']}, step {ckpt['step']}")
    return step


def device_defaults(args, device):
    """Flags whose default (None) follows the device, on with CUDA: --compile (torch.compile of the networks; the first
    steps compile) and, where the method has it, --gpu-aug (gpu_aug.py: workers only decode, crop and flip; the colour
    ops run batched on the device; off, with a line, where gpu_aug.py was not copied along). A compile that is on by
    default and fails (e.g. a graph torch cannot compile) falls back to eager with a warning, not an error."""
    if args.compile is None:
        args.compile = device.type == "cuda"
        if args.compile:
            import torch._dynamo
            torch._dynamo.config.suppress_errors = True
    if getattr(args, "gpu_aug", False) is None:
        args.gpu_aug = device.type == "cuda" and importlib.util.find_spec("gpu_aug") is not None
        if device.type == "cuda" and not args.gpu_aug:
            print0("no gpu_aug.py next to this file: the colour augmentation runs in the workers")
    if getattr(args, "gpu_aug", False) and importlib.util.find_spec("gpu_aug") is None:   # the method imports it
        raise UserError("--gpu-aug needs gpu_aug.py next to this file (or --no-gpu-aug: colour in the workers)")


def distribute(net, run):
    """(net, ddp): net in DistributedDataParallel when several processes run (ddp: that wrapper, whose no_sync the
    micro-batch helpers use), else (net, None)."""
    if run.world == 1:
        return net, None
    ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=[run.device] if run.device.type == "cuda" else None)
    return ddp, ddp


def check_writable(out, what):
    """Create `out` and write (then remove) a probe file in it, before any work: an unusable output directory (not
    creatable, a file, read-only, full) is a one-line error at start."""
    probe = os.path.join(out, f".write_test.{os.getpid()}")
    try:
        os.makedirs(out, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UserError(f"{what} {out} is not a writable directory ({e.strerror or type(e).__name__})") from None


POSITIVE = {"epochs", "batch_size", "img_size", "patch_size", "focal_size", "master_size", "num_prototypes", "head_hidden",
            "head_dim", "proj_hidden", "proj_dim", "decoder_dim", "decoder_heads", "repeated_sampling", "mask_unit",
            "log_every", "rand_views", "tau", "tau_plus", "lr", "blr", "sigma_max", "rel_pos_lr"}


NON_NEGATIVE = {"seed", "warmup_lr", "start_lr", "steps_per_epoch", "stop_epoch", "stop_step", "save_every", "workers",
                "save_every_minutes", "micro_batch", "warmup_epochs", "min_lr", "weight_decay", "final_weight_decay",
                "clip_grad", "drop_path", "me_max_weight", "lambda_c", "sinkhorn_iters", "focal_views",
                "feature_decoder_depth", "holdout", "ema_horizon"}


def validate(args):
    """One-line errors for flags out of range, before anything starts. Rules by field name, so every method's Args is
    covered: sizes / counts / temperatures positive, ratios and probabilities in [0, 1], scale ranges ordered within
    (0, 1], warm-up within training, sizes multiples of the patch."""
    d = dataclasses.asdict(args)
    bad = lambda msg: UserError(f"--{msg}")                                    # noqa: E731
    for k, v in d.items():
        flag = k.replace("_", "-")
        if isinstance(v, bool) or v is None:
            continue
        if any(isinstance(x, float) and not math.isfinite(x) for x in (v if isinstance(v, tuple) else (v,))):
            raise bad(f"{flag} must be a finite number, got {v}")
        if k in POSITIVE and v <= 0 or k in NON_NEGATIVE and v < 0:
            raise bad(f"{flag} must be {'positive' if k in POSITIVE else '>= 0'}, got {v}")
        if k in ("mask_ratio", "drop_path", "max_unreadable") and not 0 <= v < 1:
            raise bad(f"{flag} must be in [0, 1), got {v}")
        if k == "ema" and not all(0 <= m <= 1 for m in (v if isinstance(v, tuple) else (v,))):
            raise bad(f"{flag} momentum must be in [0, 1], got {v}")
        if k.endswith("scale") and isinstance(v, tuple) and not 0 < v[0] <= v[1] <= 1:
            raise bad(f"{flag} must be 0 < min <= max <= 1, got {v}")
        if k == "betas" and not all(0 <= b < 1 for b in v):
            raise bad(f"{flag} must be two numbers in [0, 1) (AdamW's beta1 beta2), got {v}")
        if k == "weights" and not (min(v) >= 0 < sum(v)):
            raise bad(f"{flag} (loss weights) must be >= 0 and not all 0, got {v}")
        if k == "gap" and not 1 <= v[0] <= v[1]:
            raise bad(f"{flag} must be 1 <= min <= max frames (0 pairs a frame with itself), got {v}")
    if d.get("stop_epoch", 0) > d.get("epochs", 1):
        raise bad(f"stop-epoch {d['stop_epoch']} is after the last epoch (--epochs {d['epochs']})")
    peak = d.get("lr") or (d["blr"] * d["batch_size"] / 256 if d.get("blr") else None)    # each loop's rule
    for k in ("start_lr", "warmup_lr", "min_lr"):
        if peak and d.get(k) is not None and d[k] > peak:
            raise bad(f"{k.replace('_', '-')} {d[k]:g} is above the peak lr {peak:g}: the schedule would rise")
    if d.get("warmup_epochs", 0) > d.get("epochs", 1):
        raise bad(f"warmup-epochs {d['warmup_epochs']:g} is longer than --epochs {d['epochs']}")
    for k in ("img_size", "focal_size"):
        if d.get(k) is not None and d.get("patch_size") and d[k] % d["patch_size"]:
            raise bad(f"{k.replace('_', '-')} {d[k]} is not a multiple of --patch-size {d['patch_size']}")
    if d.get("decoder_dim", 0) % d.get("decoder_heads", 1):
        raise bad(f"decoder-dim {d['decoder_dim']} is not divisible by --decoder-heads {d['decoder_heads']}")
    if d.get("ipe_scale", 1) < 1:
        raise bad(f"ipe-scale must be >= 1 (the schedules span ipe-scale x the run: below 1 they would end "
                  f"before it), got {d['ipe_scale']}")
    if d.get("decoder_depth", 1) < 1:
        raise bad(f"decoder-depth must be >= 1 (with no decoder block a masked patch's prediction cannot see the "
                  f"visible patches: the encoder would get no gradient from it), got {d['decoder_depth']}")
    if d.get("num_prototypes", 2) < 2:
        raise bad(f"num-prototypes must be >= 2 (a softmax over one prototype is constant: nothing to learn), "
                  f"got {d['num_prototypes']}")
    if "master_size" in d and d["master_size"] < d["img_size"]:
        raise bad(f"master-size {d['master_size']} is smaller than --img-size {d['img_size']}")


def check_mask_ratio(ratio, count_masked, n, need_masked=True, need_kept=True):
    """--mask-ratio as the method's masking rounds it (count_masked(): patches masked of n in one draw, under fork_rng):
    all masked leaves the encoder nothing (CAN's pooled feature was NaN), none leaves nothing for a loss over masked
    patches (NaN at step 1)."""
    with torch.random.fork_rng(devices=[]):
        n_masked = int(count_masked())
    if need_kept and n_masked == n:
        raise UserError(f"--mask-ratio {ratio} masks all {n} patches: the encoder would see none of the image")
    if need_masked and n_masked == 0:
        raise UserError(f"--mask-ratio {ratio} masks no patch: nothing for the loss over masked patches")


def batch_plan(args, run, recipe, weakens, unit="images", batchnorm=None):
    """(per-process batch, micro-batch) from the GLOBAL --batch-size, printed; a warning, saying what it weakens, when
    the global batch is below the recipe's. batchnorm: the modules whose BatchNorm normalises over the images of one
    forward (a micro-batch needs 2, unless SyncBN spans processes)."""
    B, W = args.batch_size, run.world
    if B <= 0 or args.micro_batch < 0:
        raise UserError(f"--batch-size must be positive and --micro-batch >= 0, got {B} and {args.micro_batch}")
    if B % W:
        raise UserError(f"--batch-size {B} is the GLOBAL batch: it must be divisible by the {W} processes")
    per = B // W
    micro = min(args.micro_batch or per, per)
    if per % micro:
        raise UserError(f"--micro-batch {micro} must divide the per-process batch {per} (= {B} / {W} processes)")
    if batchnorm and micro < 2 and not (W > 1 and run.device.type == "cuda"):       # SyncBN: over all processes
        raise UserError(f"{micro} image per forward (--batch-size {B} / {W} process(es), --micro-batch "
                        f"{args.micro_batch}): {batchnorm} BatchNorm needs at least 2 in training; raise them")
    print0(f"global batch {B} {unit} = {W} process(es) x {per} per process = {per // micro} micro-batch(es) of "
           f"{micro}{' with activation checkpointing' if args.grad_ckpt else ''}")
    if B < recipe:
        print0(f"warning: global batch {B} < the recipe's {recipe}: {weakens}")
    return per, micro


# ----------------------------------------------------------------------------------------------
# Stopping a run: the non-finite guard, preemption signals, checkpoint timing, the end-of-run k-NN
# ----------------------------------------------------------------------------------------------
class Guard:
    """Device-side watch for a non-finite loss or gradient norm (bf16 / fp32), or, with fp16, a run of `max_skipped`
    GradScaler-skipped steps. No host sync in the step: check() syncs at log steps and before every checkpoint, so no
    checkpoint with non-finite weights is written."""

    def __init__(self, device, precision, ckpt, max_skipped=100):
        self.fp16, self.ckpt, self.max_skipped = precision == "fp16", ckpt, max_skipped
        self.bad_step = torch.full((), -1, dtype=torch.long, device=device)
        self.skipped = torch.zeros((), dtype=torch.long, device=device)
        self.scale, self.parts, self.names, self.saved = None, None, [], None

    def update(self, step, parts, scaler=None):
        """parts: the step's 0-d loss terms and grad_norm; scaler: the GradScaler, after update()."""
        if self.fp16:                                   # the scale drops when a step is skipped (halved in place)
            scale = scaler._scale.detach().clone()
            prev = self.scale if self.scale is not None else torch.full_like(scale, scaler._init_scale)  # or resumed
            self.skipped = torch.where(scale < prev, self.skipped + 1, 0)
            self.scale = scale
            return
        vals = torch.stack([torch.as_tensor(v, device=self.bad_step.device).float().reshape(()) for v in parts.values()])
        first = ~torch.isfinite(vals).all() & (self.bad_step < 0)
        self.bad_step = torch.where(first, step, self.bad_step)
        self.parts = vals if self.parts is None else torch.where(first, vals, self.parts)
        self.names = list(parts)

    def check(self):
        kept = (f"{self.ckpt} is the last finite checkpoint (step {self.saved})" if self.saved is not None
                else "no checkpoint of this run was written")
        if int(self.bad_step) >= 0:
            parts = ", ".join(f"{n} {v:.4g}" for n, v in zip(self.names, self.parts.tolist()))
            raise UserError(f"non-finite loss or gradient at step {int(self.bad_step)} ({parts}): stopped; {kept}. "
                            "Lower --lr, check the data, or try --precision fp32")
        if self.fp16 and int(self.skipped) >= self.max_skipped:
            raise UserError(f"{int(self.skipped)} fp16 steps in a row skipped for non-finite gradients: stopped; {kept}")


class Control:
    """When to write a mid-epoch checkpoint and when to stop: SIGTERM / SIGUSR1 (preemption: finish the step, write,
    exit), --save-every, --save-every-minutes, --stop-step. With several processes, agreed by one all_reduce every
    `sync_every` steps (signals reach ranks at different steps; saving is collective)."""

    def __init__(self, args, device, sync_every=10):
        self.args, self.device, self.sync_every = args, device, sync_every
        self.t = time.time()
        _SIGNAL.clear()
        _TRAINED.clear()

    @property
    def signal(self):
        return _SIGNAL[0][0] if _SIGNAL else None

    def poll(self, step):
        """(save, stop) after global step `step`."""
        a = self.args
        save = bool(a.save_every) and step % a.save_every == 0           # step-based: the same on every rank
        planned = bool(a.stop_step) and step >= a.stop_step
        timed = bool(a.save_every_minutes) and time.time() - self.t > 60 * a.save_every_minutes
        stop = self.signal is not None
        if world_size() > 1:                                             # clocks and signals: agreed
            if step % self.sync_every:
                timed = stop = False
            else:
                flags = torch.tensor([float(stop), float(timed)], device=self.device)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                stop, timed = bool(flags[0]), bool(flags[1])
        stop = stop or planned
        if save or timed or stop:
            self.t = time.time()
        return save or timed or stop, stop


_SIGNAL = []                                       # the preemption signal received, if any (see main)


_TRAINED = []                                      # set once the final checkpoint is written: a signal ends the run


def catch_preemption():
    """SIGTERM / SIGUSR1 / SIGINT -> remembered in _SIGNAL; the loop finishes its step, writes a checkpoint and exits 0.
    Clusters (SLURM, scancel, timeout, kill -TERM -PGID) signal the whole process group: the DataLoader workers ignore
    these signals (ignore_stop_signals) so the main process can finish. A second Ctrl-C more than a second after the
    first stops at once (not under torchrun, whose agent forwards the signal it got to every rank, a second copy of
    the same one). Workers that survive SIGTERM need stop_workers_at_exit: an error or crash would otherwise hang."""
    import atexit
    import signal

    def handler(num, frame):
        name = signal.Signals(num).name
        again = name == "SIGINT" and any(n == "SIGINT" and time.time() - t > 1 for n, t in _SIGNAL)
        if again and "LOCAL_RANK" not in os.environ:
            raise KeyboardInterrupt
        if _TRAINED:                               # after the final checkpoint (the k-NN report): stop now
            print0(f"stopped by {name} after training: {_TRAINED[0]} is complete")
            raise SystemExit(0)
        _SIGNAL.append((name, time.time()))
    for name in C.STOP_SIGNALS:
        signal.signal(getattr(signal, name), handler)
    atexit.unregister(stop_workers_at_exit)        # once, however often called
    atexit.register(stop_workers_at_exit)          # runs before multiprocessing's exit hook (registered earlier)


def stop_workers_at_exit():
    """At interpreter exit, multiprocessing terminates (SIGTERM) its daemonic children, the DataLoader workers, then
    joins them. Ours ignore SIGTERM (ignore_stop_signals; eval loaders inherit the handler), so a run ending with
    workers alive (an error or a crash keeps its loaders referenced from the traceback) waited forever after printing
    its error: SIGKILL them first, as the SIGTERM multiprocessing means them to get (tests/test_faults.py)."""
    import multiprocessing
    import signal
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)     # torch's SIGCHLD check would report the kills as errors
    for p in multiprocessing.active_children():
        if p.daemon:
            p.kill()


def knn_wanted(args):
    """Whether this process runs the end-of-run k-NN monitor (eval_linear.knn_report): on with --knn, or by default for
    --data synthetic, on rank 0, and only where eval_linear.py is next to this file (a method file copied with
    common.py alone skips it, with a line). The method file imports it: this module never imports the evaluation (a
    lower floor does not import a higher one). Called after the final checkpoint: from here on a stop signal ends the
    program at once (exit 0)."""
    _TRAINED[:] = [os.path.join(_OUT[0], "checkpoint.pth")]                   # the run's (setup)
    if not (args.knn if args.knn is not None else args.data == "synthetic") or not is_main():
        return False
    if importlib.util.find_spec("eval_linear") is None:
        print0("k-NN monitor skipped: it is eval_linear.py's, which is not next to this file")
        return False
    return True
