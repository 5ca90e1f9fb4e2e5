"""The run harness of the method files (`import harness as H`): launching (torchrun, or an srun step
without it), the command line, starting a run (setup, resume, validation, the batch plan) and
stopping it (the non-finite guard, preemption, checkpoint timing). It imports common.py, the
training kit, never the reverse, and recipes.py (the presets) where it was copied along. Nothing
here is one method's: a method's flags (help, group, range, checks) and its preset rules live in its
own file."""
import argparse
import contextlib
import dataclasses
import errno
import gc
import glob
import json
import math
import os
import re
import sys
import time

import torch
import torch.distributed as dist

import common as C
from common import UserError, print0, is_main


# ---- Launching: the device, torchrun or an srun step, the process group ------------------------
def resolve_device(name=None):
    """--device: None (cuda if available, else cpu), cpu, cuda or cuda:N; else a one-line error."""
    name = name or ("cuda" if torch.cuda.is_available() else "cpu")
    n = torch.cuda.device_count()
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise UserError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    if name.startswith("cuda") and n == 0:
        raise UserError(f"--device {name}: no CUDA GPU is available here (torch "
                        f"{torch.__version__}); use --device cpu")
    if name.startswith("cuda:") and int(name[5:]) >= n:
        raise UserError(f"--device {name}: this host has {n} GPU(s) (cuda:0..cuda:{n - 1})")
    return torch.device(name)


def srun_env(env=None):
    """torchrun's variables for a task of an srun step of several tasks (one task per GPU): rank,
    world and local rank from SLURM's (the step's task count, not the job's), MASTER_ADDR as
    exported (scripts/train.sbatch), MASTER_PORT from the job id or exported. {}: not such a task
    (torchrun's variables set, no srun step, or one task)."""
    env = os.environ if env is None else env
    count = lambda k: int(re.match(r"\d*", env.get(k, "")).group() or 0)    # noqa: E731  SLURM writes "8(x2)"
    world = count("SLURM_STEP_NUM_TASKS") or count("SLURM_NTASKS")
    step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    agents = count("GROUP_WORLD_SIZE")                               # torchrun's agents (nodes)
    if "WORLD_SIZE" in env and step and world > 1 and agents and agents != world:
        raise UserError(f"srun started {world} tasks, each running torchrun with --nnodes "
                        f"{agents}: {world // agents} duplicate runs into one output. Use srun "
                        "alone (one task per GPU), or one torchrun a node")
    if "WORLD_SIZE" not in env and not step and world > 1:           # an sbatch script, outside any srun step
        raise UserError(f"this job has {world} SLURM tasks but this process was not started by "
                        "srun: it would train alone, on one GPU. Launch with `srun python "
                        "<method>.py ...` (one task per GPU) or torchrun")
    if "WORLD_SIZE" in env or not step or world < 2:
        return {}
    if "MASTER_ADDR" not in env:
        raise UserError("an srun step of several tasks needs MASTER_ADDR, rank 0's host: export "
                        "MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n "
                        "1), as scripts/train.sbatch does")
    port = env.get("MASTER_PORT") or str(20000 + count("SLURM_JOB_ID") % 20000)
    out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": str(world),
           "LOCAL_RANK": env["SLURM_LOCALID"], "MASTER_PORT": port}
    per_node = count("SLURM_STEP_TASKS_PER_NODE") or count("SLURM_NTASKS_PER_NODE")
    return out | ({"LOCAL_WORLD_SIZE": str(per_node)} if per_node else {})


def init_distributed(device):
    """One process group from torchrun's variables, or from an srun step's (srun_env maps them, as
    DINO's and MAE's init_distributed_mode do); nccl on CUDA, else gloo. Returns (rank, world,
    device)."""
    device = str(resolve_device(device))
    env = os.environ
    derived = srun_env() if not dist.is_initialized() else {}
    env.update(derived)                                          # env:// rendezvous as under torchrun
    if int(env.get("WORLD_SIZE", 1)) == 1:
        return 0, 1, torch.device(device)
    if device.startswith("cuda"):
        local = int(env["LOCAL_RANK"])
        n = torch.cuda.device_count()
        if int(env.get("LOCAL_WORLD_SIZE", local + 1)) > n and not (derived and n == 1):
            raise UserError(f"{env.get('LOCAL_WORLD_SIZE')} processes on this node but {n} GPU(s): "
                            f"one process per GPU (--nproc_per_node / --ntasks-per-node {n}), or "
                            "--device cpu")
        device = "cuda:0" if n == 1 else f"cuda:{local}"       # srun --gpus-per-task binds one GPU per task
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    print0(f"launcher: {'srun' if derived else 'torchrun'}, {dist.get_world_size()} processes, "
           f"rank 0 at {env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}; devices by "
           "local rank, data and seeds by global rank, rank 0 writes")
    return dist.get_rank(), dist.get_world_size(), torch.device(device)


# ---- The command line --------------------------------------------------------------------------
def arg(default, help, **meta):
    """A dataclass field with its --help text and, for parse_args / validate, e.g. group="model",
    positive=True."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@dataclasses.dataclass
class RunArgs:
    """Run plumbing shared by every method's Args (its hyper-parameters live in the method file)."""
    workers: int = arg(min(10, CPUS), "DataLoader workers per process (here: min(10, this "
                       "process's CPUs))", group="data", min=0)
    seed: int = arg(0, "random seed (weights, data order, augmentation)", group="run control",
                    min=0)
    mean: tuple = arg(None, "per-channel mean of the pixels in [0, 1] that the normalisation "
                      "subtracts (default: ImageNet's; --in-chans 1: their average; "
                      "scripts/mean_std.py measures a folder's); kept in the checkpoint, used by "
                      "every evaluation", group="data", nargs="+")
    std: tuple = arg(None, "per-channel std it divides by (default: as --mean)", group="data",
                     nargs="+")
    in_chans: int = arg(3, "image channels: 3 RGB (every image converted); 1 grey (converted); "
                        "N: .npy arrays (N, H, W) or (H, W, N), multi-page .tif stacks or N-band "
                        "images, uint8 / uint16 / float in [0, 1], with --mean / --std of N "
                        "numbers", group="data", positive=True)
    resume: bool = arg(True, "continue from <output-dir>/checkpoint.pth if present (a rerun "
                       "resumes; one with other model / data / recipe flags is refused); "
                       "--no-resume starts over", group="run control")
    precision: str = arg(None, "bf16|fp16|fp32 (default bf16 on CUDA, fp32 on CPU)",
                         group="run control")
    compile: bool = arg(None, "torch.compile the networks (default: on with CUDA, off on CPU)",
                        group="run control")
    log_every: int = arg(50, "steps between log lines", group="run control", positive=True)
    device: str = arg(None, "cpu | cuda | cuda:N (default: cuda if available)", group="run control")
    micro_batch: int = arg(0, "samples per forward/backward per process (0: the whole per-process "
                           "batch); exact", group="optimisation", min=0)
    grad_ckpt: bool = arg(False, "activation checkpointing of every transformer block: less "
                          "memory, ~1/3 more compute", group="optimisation")
    steps_per_epoch: int = arg(0, "cap steps per epoch (0 = full epoch)", group="run control",
                               min=0)
    stop_epoch: int = arg(0, "exit after this epoch (schedules still span --epochs)",
                          group="run control", min=0)
    stop_step: int = arg(0, "write a checkpoint and exit after this global step",
                         group="run control", min=0)
    save_every: int = arg(0, "also write the checkpoint every N steps (0 = per epoch only)",
                          group="run control", min=0)
    save_every_minutes: float = arg(30.0, "also write it when this many minutes passed since the "
                                    "last one (0 = off)", group="run control", min=0)
    keep_every: int = arg(0, "also keep the evaluated encoder every N steps, as "
                          "encoder_step<N>.pth (0 = off)", group="run control", min=0)
    max_unreadable: float = arg(0.01, "stop if more than this fraction of the images (SiamMAE: "
                                "videos) read in an epoch is unreadable (they are skipped "
                                "otherwise)", group="data")
    preset: str = arg(None, "a small recipe by name (e.g. small: 32-px CIFAR-10 on a CPU), "
                      "derived from the official one by recipes.py's rules; flags given win (the "
                      "values: end of --help)", group="optimisation")
    tensorboard: bool = arg(False, "also write every logged scalar and the pictures to "
                            "<output-dir>/tensorboard (needs the tensorboard package)",
                            group="run control")
    holdout: int = arg(0, "keep this many training images (SiamMAE: videos) out of training, a "
                       "fixed draw that eval_linear.py / eval_video.py --holdout N score "
                       "(scripts/lr_sweep.py)", group="data", min=0)


GROUPS = ("data", "model", "optimisation", None, "views and masking", "run control")   # --help's; None: a script's


def parse_args(cls, argv=None):
    """`cls` (a dataclass) from the command line, `--field-name value` per field; `--preset NAME`
    (`--data synthetic` implies `--preset synthetic`) fills the fields not given. --help: the flags
    in groups, each with its help and default, and every preset's values (recipes.py's, where it was
    copied along)."""
    recipes = C.optional("recipes")
    p = argparse.ArgumentParser(description=(cls.__doc__ or "").strip().split("\n")[0],
                                epilog=recipes.describe(cls) if recipes else None)
    own = "evaluation" if not issubclass(cls, RunArgs) else "the method's own"
    groups = {g or own: p.add_argument_group(g or own) for g in GROUPS}
    first = ("data", "ckpt")                                         # --data / --ckpt first
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in first):
        group = groups[f.metadata.get("group") or own]
        default = f.default if f.default is not dataclasses.MISSING else None
        value = " ".join(map(str, default)) if isinstance(default, tuple) else default
        shown = "required" if default is None and f.name in first else f"default: {value}"
        text = f.metadata.get("help") or f.name.replace("_", " ")
        text = text if "default" in text else f"{text} ({shown})"                               # said once
        flag = "--" + f.name.replace("_", "-")
        kw = dict(default=argparse.SUPPRESS, help=text.replace("%", "%%"))
        if f.type in (bool, "bool"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif isinstance(f.default, tuple) or "nargs" in f.metadata:      # None: float numbers
            n = f.metadata.get("nargs", len(f.default or ()))
            group.add_argument(flag, type=type(f.default[0]) if f.default else float, nargs=n, **kw)
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            group.add_argument(flag, type=kind, **kw)
    given = vars(p.parse_args(argv))
    data = given.get("data", getattr(cls, "data", None))
    synthetic = data == "synthetic" and hasattr(cls, "SYNTHETIC")
    preset = given.get("preset") or ("synthetic" if synthetic else None)
    if preset and not recipes:
        p.error("the presets (--preset, --data synthetic) need recipes.py next to this file")
    given = recipes.apply(cls, given, preset, p.error) if preset else given
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})


# ---- Starting a run: main, setup, resume, validation, the batch plan ---------------------------
def main(train, cls):
    """`python script.py ...`: parse, train, and turn UserError into a one-line message. Preemption
    signals are caught for training runs (RunArgs), not when train() is called from other code."""
    Control.current = None
    if issubclass(cls, RunArgs):
        catch_preemption()
    t0 = time.time()
    try:
        args = parse_args(cls)
        train(args)
        if dist.is_initialized():
            dist.barrier()                      # all ranks done before any tears the group down
        out = getattr(args, "output_dir", None) or getattr(args, "output", None)
        files = []
        if out and os.path.isdir(out):
            files = sorted(f for f in os.listdir(out) if not f.startswith("."))
        named = ", ".join(files) if len(files) <= 12 else f"{len(files)} files"
        wrote = f": {named} in {out}" if files else ""
        print0(f"done in {time.time() - t0:.0f} s{wrote}")
    except UserError as e:
        msg = str(e).strip().splitlines()[-1]          # DataLoader workers wrap the message
        msg = msg.removeprefix("common.UserError: ").removeprefix("UserError: ")
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)
    except Preempted as e:                          # a stop signal before the run began: nothing to write
        print(f"stopped by {e} before training began: nothing written; rerun the same command to "
              "start", flush=True)
    except KeyboardInterrupt:
        ctl = Control.current                      # a second Ctrl-C in a run, or Ctrl-C in an evaluation
        how = f"by a second Ctrl-C: stopped at once; {ctl.guard.kept()}" if ctl else "(Ctrl-C)"
        print(f"error: interrupted {how}", file=sys.stderr)
        sys.exit(130)
    finally:
        if dist.is_initialized():
            gc.collect()            # free DDP's reducer and gloo's pending work while Python is alive: left to
            dist.destroy_process_group()      # the interpreter's exit, they aborted ~1 gloo run in 12 (SIGABRT)


def setup(args, method):
    """Distributed init, seed, device, precision, output dir (set in args). Returns the run: rank,
    world, device, precision, autocast, scaler, out, ckpt, guard, control, tb (TensorBoard writer or
    None), lock, data (the fingerprinted datasets, set by resume_run), resuming."""
    validate(args)
    args.mean, args.std = C.set_mean_std(args.mean, args.std, args.in_chans)
    rank, world, device = init_distributed(args.device)
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    if precision not in ("bf16", "fp16", "fp32"):
        raise UserError(f"--precision must be bf16, fp16 or fp32, got {precision!r}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]
    if not args.data:
        raise UserError("--data is required: an image folder (ImageFolder layout) or 'synthetic'")
    if args.data == "synthetic" and args.in_chans != 3:
        raise UserError(f"--data synthetic is RGB; --in-chans {args.in_chans} needs a folder")
    if args.data != "synthetic" and not os.path.isdir(args.data):                   # before any plan is printed
        raise UserError(f"--data {args.data}: no such directory (give an image folder or "
                        "'synthetic')")
    torch.manual_seed(args.seed)                        # same initial weights on every rank
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    out = args.output_dir = args.output_dir or os.path.join("runs", method)
    device_defaults(args, device)
    ckpt = os.path.join(out, "checkpoint.pth")
    tb = None
    resuming = bool(args.resume and os.path.isfile(ckpt))
    lock = claim_dir(out, "--output-dir") if is_main() else None     # held until this process ends
    if is_main():
        for tmp in glob.glob(glob.escape(ckpt) + ".tmp.*"):         # its writer is gone (it held the lock): a run
            os.remove(tmp)                                          # killed while saving (SIGKILL, node loss)
            print(f"removed {tmp}: the unfinished checkpoint write of a run killed while saving")
        aug = (", colour augmentation "
               f"{'batched on ' + device.type if args.gpu_aug else 'in the workers'}"
               if hasattr(args, "gpu_aug") else "")
        print(f"{method}: {world} process(es) on {device}, precision {precision}, torch.compile "
              f"{'on' if args.compile else 'off'}{aug}, output {out}")
        print(json.dumps(dataclasses.asdict(args)))
        if args.in_chans != 3:
            print(f"--in-chans {args.in_chans}: the colour augmentation is brightness and contrast "
                  "jitter per channel, blur and solarisation where the recipe has them; its "
                  "saturation, hue and random greyscale are RGB's: left out")
        recipes = C.optional("recipes") if getattr(args, "preset", None) else None
        if recipes:                                                         # what the preset set, and why
            print(recipes.explain(type(args), args.preset, args))
        moved = None if resuming else set_aside(out)                 # a run from step 0: the earlier run's files
        if moved:
            print(f"{out} held an earlier run's files ({', '.join(moved[1])}): moved to "
                  f"{moved[0]}; this run starts at step 0 (resume that one with --output-dir "
                  "there)")
        if getattr(args, "tensorboard", False):
            tb = C.TensorBoard(out)
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext())
    guard = Guard(device, precision, ckpt)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    return argparse.Namespace(rank=rank, world=world, device=device, precision=precision,
                              autocast=autocast, scaler=scaler, out=out, ckpt=ckpt, guard=guard,
                              control=Control(args, device, guard), tb=tb, lock=lock, data={},
                              resuming=resuming)


RUN_FILES = re.compile(r"checkpoint\.pth|log(\.[\d-]+)?\.jsonl|args\.json|tensorboard|features"
                       r"|visualize\.png|encoder_step\d+\.pth|(recon|pairs)_ep\d+_step\d+\.png")


def set_aside(out):
    """A run from step 0 in a folder where an earlier run wrote: that run's files (checkpoint, log,
    flags, snapshots, pictures, TensorBoard events, features cached for its checkpoint) move
    together into earlier/<time>/, whole (it can be resumed or read there), before this run writes
    anything. Returns (that folder, the names), or None."""
    names = sorted(n for n in os.listdir(out) if RUN_FILES.fullmatch(n))
    if not names:
        return None
    newest = max(os.path.getmtime(os.path.join(out, n)) for n in names)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(newest))
    dest = base = os.path.join(out, "earlier", stamp)
    i = 0
    while os.path.exists(dest):                                     # never over another kept run
        i += 1
        dest = f"{base}-{i}"
    os.makedirs(dest)
    for n in names:
        os.replace(os.path.join(out, n), os.path.join(dest, n))
    return dest, names


def write_args(run, args):
    """<output-dir>/args.json, the run's flags, readable: written once the run is known to start or
    resume (a refused resume leaves the checkpoint's flags in place)."""
    if is_main():
        with open(os.path.join(run.out, "args.json"), "w") as f:
            json.dump(dataclasses.asdict(args), f, indent=1)


def claim_dir(out, what):
    """Create `out` and hold <out>/.lock while this process lives: an unwritable directory, or one
    another run is writing to (the two would write one log, one checkpoint), is a one-line error at
    the start. A POSIX record lock (fcntl.lockf: local disks and NFS), released however the process
    ends. Returns the open file: keep it."""
    try:
        os.makedirs(out, exist_ok=True)
        f = open(os.path.join(out, ".lock"), "a+")
    except OSError as e:
        raise UserError(f"{what} {out} is not a writable directory "
                        f"({e.strerror or type(e).__name__})") from None
    try:
        import fcntl
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:                                             # not POSIX: no lock
        return f
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):              # ENOLCK: Lustre without flock, some FUSE mounts
            raise UserError(f"{what} {out}: cannot lock {f.name} "
                            f"({e.strerror or type(e).__name__}): its filesystem has no POSIX "
                            f"locks; give a {what} on one that has (a local disk, NFS)") from None
        f.seek(0)
        raise UserError(f"{what} {out} is in use by another run "
                        f"({f.read().strip() or 'another process'}): wait for it to end, or use "
                        f"another {what}") from None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {os.uname().nodename}")
    f.flush()
    return f


# run control: a resumed run may change these (a script may add its own: cls.RUN_ONLY); --data: its fingerprint decides
RUN_ONLY = {"data", "workers", "resume", "compile", "log_every", "device", "micro_batch",
            "grad_ckpt", "stop_epoch", "stop_step", "save_every", "save_every_minutes",
            "max_unreadable", "output_dir", "knn", "eval_every", "keep_every", "precision",
            "tensorboard"}
SCHEDULE = {"epochs", "steps_per_epoch"}              # may change on resume, with a line (the schedules follow)


def resume_run(run, method, args, model, optimizer, target=None, data=None):
    """Continue from <output-dir>/checkpoint.pth when it exists and --resume, this rank's RNG state
    included; returns the global step to start from (0 for a new run). data: {split: dataset} the
    run reads; their fingerprints go into every checkpoint, and a rerun whose data changed (images
    added, removed, moved; another --holdout draw: the steps per epoch, the schedules and the
    held-out images would shift under it) is refused like a changed flag."""
    run.data = {k: d.fingerprint() if hasattr(d, "fingerprint") else {"items": len(d)}     # synthetic: its size
                for k, d in (data or {}).items()}
    if not (args.resume and os.path.isfile(run.ckpt)):
        write_args(run, args)
        return 0
    ckpt = C.load_checkpoint(run.ckpt, method)
    old = {k: tuple(v) if isinstance(v, list) else v for k, v in ckpt["args"].items()}
    old = getattr(args, "upgrade", dict)(old)                        # a renamed flag of an older checkpoint
    may = RUN_ONLY | getattr(args, "RUN_ONLY", set())
    changed = {k: f"--{k.replace('_', '-')} {old[k]} -> {v}" for k, v in vars(args).items()
               if k in old and old[k] != v and k not in may}
    other = [c for k, c in changed.items() if k not in SCHEDULE]
    if other:                                   # another experiment in the same directory: never silently continued
        raise UserError(f"{run.ckpt} was trained with other settings ({', '.join(other)}): rerun "
                        "with its flags to resume it, or start a new run with --no-resume (the "
                        "earlier run is set aside) or another --output-dir")
    old_data = ckpt.get("dataset")
    if old_data is not None and old_data != run.data:
        raise UserError(f"{run.ckpt} was trained on other data "
                        f"({data_change(old_data, run.data)}): rerun with the data it was trained "
                        "on, or start a new run with --no-resume or another --output-dir")
    write_args(run, args)
    if changed:
        print0(f"warning: resuming with {', '.join(changed.values())}: the schedules follow the "
               "new length from this step")
    try:
        C.unwrap(model).load_state_dict(ckpt["model"])
        if target is not None:
            target.load_state_dict(ckpt["target"])
    except RuntimeError as e:
        raise UserError(f"{run.ckpt} does not fit this model ({str(e).splitlines()[0]}); use the "
                        "flags it was trained with or another --output-dir") from None
    optimizer.load_state_dict(ckpt["optimizer"])
    run.scaler.load_state_dict(ckpt["scaler"])
    C.set_rng_state(ckpt["rng"][C.rank() % len(ckpt["rng"])])
    run.guard.saved = ckpt["step"]
    print0(f"resumed from {run.ckpt}: epoch {ckpt['epoch']}, step {ckpt['step']}")
    return ckpt["step"]


def data_change(old, new):
    """What differs between two runs' data fingerprints, in words: 'train images 50000 -> 50100,
    other train files'."""
    words = {"files": "other {s} files", "held_out": "another {s} held-out draw"}           # else: a count changed
    out = []
    for s in sorted(set(old) | set(new)):
        o = old.get(s, {})
        n = new.get(s, {})
        keys = sorted(set(o) | set(n), key=lambda k: (k in words, k))
        out += [words.get(k, "{s} {k} {o} -> {n}").format(s=s, k=k, o=o.get(k), n=n.get(k))
                for k in keys if o.get(k) != n.get(k)]
    return ", ".join(out)


def device_defaults(args, device):
    """--compile and --gpu-aug (where a method has it) default to on with CUDA; --gpu-aug off, with
    a line, where gpu_aug.py was not copied along. A compile on by default that fails falls back to
    eager with a warning."""
    if args.compile is None:
        args.compile = device.type == "cuda"
        if args.compile:
            import torch._dynamo
            torch._dynamo.config.suppress_errors = True
    rgb = [f for f in ("gpu_aug", "resident") if getattr(args, f, False)]
    if rgb and args.in_chans != 3:                                  # their decoders and colour ops are RGB's
        raise UserError(f"--{rgb[0].replace('_', '-')} takes RGB images; with --in-chans "
                        f"{args.in_chans} leave it off (the workers read and augment)")
    if getattr(args, "gpu_aug", False) is None:
        wanted = device.type == "cuda" and args.in_chans == 3
        args.gpu_aug = wanted and os.path.isfile(C.sibling("gpu_aug"))
        if wanted and not args.gpu_aug:
            print0("no gpu_aug.py next to this file: the colour augmentation runs in the workers")
    if getattr(args, "gpu_aug", False) and not os.path.isfile(C.sibling("gpu_aug")):   # the method reads it
        raise UserError("--gpu-aug needs gpu_aug.py next to this file (or --no-gpu-aug: colour in "
                        "the workers)")


def distribute(net, run):
    """(net, ddp): net in DistributedDataParallel when several processes run (ddp: that wrapper),
    else (net, None)."""
    if run.world == 1:
        return net, None
    ids = [run.device] if run.device.type == "cuda" else None
    ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=ids)
    return ddp, ddp


def validate(args):
    """One-line errors for flags out of range, before anything starts: each field's by its metadata
    (arg(positive=True), arg(min=...)), the shared vocabulary's rules below, and the script's
    Args.check()."""
    d = dataclasses.asdict(args)
    bad = lambda msg: UserError(f"--{msg}")                                    # noqa: E731
    meta = {f.name: f.metadata for f in dataclasses.fields(args)}
    for k, v in d.items():
        flag = k.replace("_", "-")
        if isinstance(v, bool) or v is None:
            continue
        values = v if isinstance(v, tuple) else (v,)
        if any(isinstance(x, float) and not math.isfinite(x) for x in values):
            raise bad(f"{flag} must be a finite number, got {v}")
        if meta[k].get("positive") and v <= 0:
            raise bad(f"{flag} must be positive, got {v}")
        low = meta[k].get("min")
        if low is not None and v < low:
            raise bad(f"{flag} must be >= {low}{meta[k].get('why', '')}, got {v}")
        if k in ("mask_ratio", "drop_path", "max_unreadable") and not 0 <= v < 1:
            raise bad(f"{flag} must be in [0, 1), got {v}")
        if k == "ema" and not all(0 <= m <= 1 for m in (v if isinstance(v, tuple) else (v,))):
            raise bad(f"{flag} momentum must be in [0, 1], got {v}")
        if k.endswith("scale") and isinstance(v, tuple) and not 0 < v[0] <= v[1] <= 1:
            raise bad(f"{flag} must be 0 < min <= max <= 1, got {v}")
        if k == "betas" and not all(0 <= b < 1 for b in v):
            raise bad(f"{flag} must be two numbers in [0, 1) (AdamW's beta1 beta2), got {v}")
    if d.get("stop_epoch", 0) > d.get("epochs", 1):
        raise bad(f"stop-epoch {d['stop_epoch']} is after the last epoch (--epochs {d['epochs']})")
    peak = d.get("lr") or (d["blr"] * d["batch_size"] / 256 if d.get("blr") else None)    # each loop's rule
    for k in ("warmup_lr", "min_lr"):
        if peak and d.get(k) is not None and d[k] > peak:
            raise bad(f"{k.replace('_', '-')} {d[k]:g} is above the peak lr {peak:g}: the schedule "
                      "would rise")
    if d.get("warmup_epochs", 0) > d.get("epochs", 1):
        raise bad(f"warmup-epochs {d['warmup_epochs']:g} is longer than --epochs {d['epochs']}")
    if d.get("img_size") is not None and d.get("patch_size") and d["img_size"] % d["patch_size"]:
        raise bad(f"img-size {d['img_size']} is not a multiple of --patch-size {d['patch_size']}")
    if d.get("decoder_dim", 0) % d.get("decoder_heads", 1):
        raise bad(f"decoder-dim {d['decoder_dim']} is not divisible by --decoder-heads "
                  f"{d['decoder_heads']}")
    if hasattr(args, "check"):
        args.check()                                                             # the script's own rules


def check_mask_ratio(ratio, count_masked, n, need_masked=True, need_kept=True):
    """--mask-ratio as the method's masking rounds it (count_masked(): patches masked of n, one draw
    under fork_rng): all masked leaves the encoder nothing, none leaves nothing for a loss over
    masked patches (NaN)."""
    with torch.random.fork_rng(devices=[]):
        n_masked = int(count_masked())
    if need_kept and n_masked == n:
        raise UserError(f"--mask-ratio {ratio} masks all {n} patches: the encoder would see none "
                        "of the image")
    if need_masked and n_masked == 0:
        raise UserError(f"--mask-ratio {ratio} masks no patch: nothing for the loss over masked "
                        "patches")


def batch_plan(args, run, recipe, weakens, unit="images", batchnorm=None):
    """(per-process batch, micro-batch) from the GLOBAL --batch-size, printed, with a warning saying
    what it weakens below the recipe's batch. batchnorm: the modules whose BatchNorm needs >= 2
    images a forward (unless SyncBN)."""
    B = args.batch_size                                           # validate() saw B > 0, --micro-batch >= 0
    W = run.world
    if B % W:
        raise UserError(f"--batch-size {B} is the GLOBAL batch: it must be divisible by the {W} "
                        "processes")
    per = B // W
    micro = min(args.micro_batch or per, per)
    if per % micro:
        raise UserError(f"--micro-batch {micro} must divide the per-process batch {per} (= {B} / "
                        f"{W} processes)")
    if batchnorm and micro < 2 and not (W > 1 and run.device.type == "cuda"):       # SyncBN: over all processes
        raise UserError(f"{micro} image per forward (--batch-size {B} / {W} process(es), "
                        f"--micro-batch {args.micro_batch}): {batchnorm} BatchNorm needs at least "
                        "2 in training; raise them")
    ckpt = " with activation checkpointing" if args.grad_ckpt else ""
    print0(f"global batch {B} {unit} = {W} process(es) x {per} per process = {per // micro} "
           f"micro-batch(es) of {micro}{ckpt}")
    if B < recipe:
        print0(f"warning: global batch {B} < the recipe's {recipe}: {weakens}")
    return per, micro


# ---- Stopping a run: the non-finite guard, preemption signals, checkpoint timing ---------------
class Guard:
    """Device-side watch for a non-finite loss or gradient norm (bf16 / fp32), or a run of
    `max_skipped` skipped fp16 steps; no host sync in the step: check() syncs at log steps and
    before every checkpoint."""

    def __init__(self, device, precision, ckpt, max_skipped=100):
        self.fp16 = precision == "fp16"
        self.ckpt = ckpt
        self.max_skipped = max_skipped
        self.bad_step = torch.full((), -1, dtype=torch.long, device=device)
        self.skipped = torch.zeros((), dtype=torch.long, device=device)
        self.scale = None                                            # fp16: the last loss scale
        self.parts = None                                            # the first non-finite step's loss parts
        self.names = []
        self.saved = None                                            # the step of the last checkpoint

    def update(self, step, parts, scaler=None):
        """parts: the step's 0-d loss terms and grad_norm; scaler: the GradScaler, after
        update()."""
        if self.fp16:                                   # the scale drops when a step is skipped (halved in place)
            scale = scaler._scale.detach().clone()
            prev = self.scale                                            # or resumed: its start
            prev = prev if prev is not None else torch.full_like(scale, scaler._init_scale)
            self.skipped = torch.where(scale < prev, self.skipped + 1, 0)
            self.scale = scale
            return
        dev = self.skipped.device
        vals = torch.stack([torch.as_tensor(v, device=dev).float().reshape(())
                            for v in parts.values()])
        first = ~torch.isfinite(vals).all() & (self.bad_step < 0)
        self.bad_step = torch.where(first, step, self.bad_step)
        self.parts = vals if self.parts is None else torch.where(first, vals, self.parts)
        self.names = list(parts)

    def kept(self, what="checkpoint"):
        return (f"{self.ckpt} is the last {what} (step {self.saved})" if self.saved is not None
                else "no checkpoint of this run was written")

    def check(self):
        kept = self.kept("finite checkpoint")
        if int(self.bad_step) >= 0:
            parts = ", ".join(f"{n} {v:.4g}" for n, v in zip(self.names, self.parts.tolist()))
            raise UserError(f"non-finite loss or gradient at step {int(self.bad_step)} ({parts}): "
                            f"stopped; {kept}. Lower --lr, check the data, or try --precision fp32")
        if self.fp16 and int(self.skipped) >= self.max_skipped:
            raise UserError(f"{int(self.skipped)} fp16 steps in a row skipped (non-finite "
                            f"gradients): stopped; {kept}")


class Control:
    """When to write a mid-epoch checkpoint and when to stop (stop(reason): a signal, a time cap;
    --save-every, --save-every-minutes, --stop-step), agreed by all processes in one all_reduce
    every `sync_every` steps (signals reach ranks apart; saving is collective). `trained`: the final
    checkpoint once written. Control.current: newest."""
    current = None

    def __init__(self, args, device, guard=None, sync_every=10):
        self.args = args
        self.device = device
        self.guard = guard
        self.sync_every = sync_every
        self.t = time.time()                                         # of the last checkpoint
        self.signal = None                                           # the stop asked for
        self.trained = None                                          # the final checkpoint, once written
        self.asked = []                                              # (signal, time) received
        Control.current = self

    def stop(self, reason):
        """Ask the loop to stop after its step (a signal's handler, a time cap): checkpoint written,
        exit 0."""
        self.signal = self.signal or reason

    def poll(self, step):
        """(save, snapshot, stop) after global step `step`: the checkpoint is due, the evaluated
        encoder is kept (--keep-every), the run stops."""
        a = self.args
        save = bool(a.save_every) and step % a.save_every == 0           # step-based: the same on every rank
        snapshot = bool(a.keep_every) and step % a.keep_every == 0
        planned = bool(a.stop_step) and step >= a.stop_step
        timed = bool(a.save_every_minutes) and time.time() - self.t > 60 * a.save_every_minutes
        stop = self.signal is not None
        if C.world_size() > 1:                                           # clocks and signals: agreed
            if step % self.sync_every:
                timed = stop = False
            else:
                flags = torch.tensor([float(stop), float(timed)], device=self.device)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                stop, timed = bool(flags[0]), bool(flags[1])
        stop = stop or planned
        if save or timed or stop:
            self.t = time.time()
        return save or timed or stop, snapshot, stop


class Preempted(Exception):
    """A stop signal before the run began (harness.main exits 0: nothing was written, a rerun starts
    it)."""


def catch_preemption():
    """SIGTERM / SIGUSR1 / SIGINT -> Control.current.stop: the loop finishes its step, writes a
    checkpoint and exits 0 (the DataLoader workers ignore them: clusters signal the process group).
    A signal before the run, or in a k-NN evaluation (after its step's checkpoint, the final one's
    too), stops at once, as does a second Ctrl-C a second after the first (not under torchrun, which
    forwards)."""
    import atexit
    import signal

    def handler(num, frame):
        name = signal.Signals(num).name
        ctl = Control.current
        if ctl is None:                                # before the run started: nothing to write, exit 0 (main)
            raise Preempted(name)
        earlier = any(n == "SIGINT" and time.time() - t > 1 for n, t in ctl.asked)
        again = name == "SIGINT" and earlier
        if again and "LOCAL_RANK" not in os.environ:
            raise KeyboardInterrupt
        if ctl.trained:                            # in a k-NN after its step's checkpoint (the final one's too)
            print0(f"stopped by {name} in the k-NN evaluation: {ctl.trained} holds the run up to "
                   "here")
            raise SystemExit(0)
        ctl.asked.append((name, time.time()))
        ctl.stop(f"signal {name}")
    Control.current = None
    for name in C.STOP_SIGNALS:
        signal.signal(getattr(signal, name), handler)
    atexit.unregister(stop_workers_at_exit)        # once, however often called
    atexit.register(stop_workers_at_exit)          # runs before multiprocessing's exit hook (registered earlier)


def stop_workers_at_exit():
    """At exit multiprocessing SIGTERMs its daemonic children, the DataLoader workers, then joins
    them; ours ignore SIGTERM, so a run ending with workers alive (an error keeps its loaders
    referenced) hung: SIGKILL them first."""
    import multiprocessing
    import signal
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)     # torch's SIGCHLD check would report the kills as errors
    for p in multiprocessing.active_children():
        if p.daemon:
            p.kill()


def knn_wanted(args):
    """Whether the run keeps the k-NN monitor (eval_linear.KNNMonitor): --eval-every N, or --knn
    (default: on with --data synthetic)."""
    return bool(args.eval_every) or (args.knn if args.knn is not None else args.data == "synthetic")
