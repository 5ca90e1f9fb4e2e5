"""Run a function in 2 gloo processes on CPU and collect what each rank returns."""
import gc
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, out_dir, args):
    sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        gc.collect()                          # as harness.main: no gloo work left to the interpreter's exit
        dist.destroy_process_group()


def spawn(fn, *args, world=2):
    """fn(rank, world, *args) must be a top-level function; returns [result of rank r]."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, _free_port(), fn, d, args), nprocs=world)
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(world)]
