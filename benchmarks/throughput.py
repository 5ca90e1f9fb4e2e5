"""Training-step throughput, peak memory and MFU of each method on device-resident random batches.

  python benchmarks/throughput.py --method all --model small --batch-size 64
  python benchmarks/throughput.py --method msn --model base --precision bf16 --compile

Times the full step (forward, loss, backward, optimizer step, EMA) after warm-up: each method's
own train_step (its default recipe: views, masking ratios, decoder sizes; --micro-batch and
--grad-ckpt as in training). Reports img/s (pairs/s for SiamMAE), peak CUDA memory, and on CUDA the model
FLOPs utilisation against --peak-tflops.

FLOP count (analytic, multiply-add = 2 FLOPs). A transformer block of width D on N tokens costs
2 * (12 N D^2 + 2 N^2 D) forward: qkv 3ND^2, output projection ND^2, MLP 8ND^2 (ratio 4), and
QK^T + AV 2N^2D. Patch embedding of n patches: 2 n (3 p^2) D, every patch embedded (masked ones
are dropped after it). A trained pass costs 3x its forward (backward = 2x), except the patch
embedding: 2x, since the image needs no gradient; a no-grad (EMA target / teacher) pass 1x. Heads,
projectors, decoder linears, MSN's prototypes, CAN's noise-level MLP and the losses' logits
(ConMIM's patch-to-patch, the InfoNCE over the batch) are counted as matrix products on the rows
they see (a decoder's input projection on the visible tokens); the optimizer and the EMA are not.
tests/test_benchmarks.py checks the count against torch's FlopCounterMode running each step.

MFU is MODEL-FLOP utilisation: the FLOPs above, what one step of the method computes, over the step's time and
--peak-tflops, whatever the step runs to get there. Under --micro-batch, MSN, CMAE and CAN run the gradient cache:
a no-grad forward of what feeds the batch-coupled loss (MSN's anchor views through the encoder and head; CMAE's
encoder, feature decoder, projector and predictor; CAN's encoder and projector) before the passes with gradient,
the price of the official global batch on one GPU. That work is in the HARDWARE count, printed beside it with its
utilisation (HFU); without micro-batches the two are equal (ConMIM and SiamMAE: always).
"""
import argparse
import copy
import importlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402
import harness as H  # noqa: E402
import recipes  # noqa: E402
import gpu_aug as GA  # noqa: E402


def blocks(D, depth, N, mlp=4):
    """Forward FLOPs of `depth` transformer blocks of width D on N tokens."""
    return 2 * depth * ((4 + 2 * mlp) * N * D * D + 2 * N * N * D)


def embed(D, n, p):
    """Forward FLOPs of the patch embedding of n patches of p x p x 3 pixels."""
    return 2 * n * 3 * p * p * D


def lin(*dims):
    return 2 * sum(a * b for a, b in zip(dims[:-1], dims[1:]))


def setup(method, a, dev):
    """Returns (step(), images per step, model FLOPs per step, hardware FLOPs per step) for the method's default
    recipe; the step is the method's own train_step (forward + backward, micro-batches, checkpointing) + AdamW +
    EMA. Hardware = model + the gradient cache's no-grad embedding pass where micro-batches run it."""
    import importlib
    mod = importlib.import_module(method)
    if getattr(a, "preset", None):                     # a small recipe's model, sizes and views (e.g. --preset gpu)
        args = H.parse_args(mod.Args, ["--data", "none", "--preset", a.preset, "--batch-size", str(a.batch_size)])
        args.grad_ckpt, a.model = a.grad_ckpt, args.model
    else:
        args = mod.Args(data="synthetic", model=a.model, batch_size=a.batch_size, grad_ckpt=a.grad_ckpt)
    B, S, p = a.batch_size, args.img_size, args.patch_size
    micro = a.micro_batch or B
    g = S // p
    D, depth, _ = mod.SIZES[a.model]
    N = g * g
    x = lambda *n, s=S: torch.randn(*n, 3, s, s, device=dev)                     # noqa: E731
    amp = torch.autocast(dev.type, torch.bfloat16) if a.precision == "bf16" else torch.autocast(dev.type, enabled=False)
    comp = (lambda m: torch.compile(m)) if a.compile else (lambda m: m)
    aug = GA.color_augmenter(a.compile or dev.type == "cuda")         # as train() applies it (compiled on CUDA)
    u8 = lambda n, s=S: torch.randint(0, 256, (n, 3, s, s), dtype=torch.uint8, device=dev)   # noqa: E731  uint8 views
    ema, extra = None, 0                                 # extra: the gradient cache's embedding pass (forward)
    if method == "msn":
        model = mod.MSN(args).to(dev)
        target = copy.deepcopy(model.net).requires_grad_(False)
        fm, ft = comp(model), comp(target)
        R, F_ = args.rand_views, args.focal_views
        xt, xr, xf = x(B), x(R, B), x(F_, B, s=args.focal_size)
        nk = int(N * (1 - args.mask_ratio))
        nf = (args.focal_size // p) ** 2
        head = lin(D, args.head_hidden, args.head_hidden, args.head_dim) + lin(args.head_dim, args.num_prototypes)
        flops = (B * R * (3 * (blocks(D, depth, nk + 1) + head) + 2 * embed(D, N, p))             # masked views
                 + B * F_ * (3 * (blocks(D, depth, nf + 1) + head) + 2 * embed(D, nf, p))         # focal views
                 + B * (blocks(D, depth, N + 1) + embed(D, N, p) + head))                         # target
        z = lin(D, args.head_hidden, args.head_hidden, args.head_dim)                    # the anchors' z, no logits
        extra = B * R * (blocks(D, depth, nk + 1) + z + embed(D, N, p)) + B * F_ * (blocks(D, depth, nf + 1) + z
                                                                                  + embed(D, nf, p))
        big, focal = u8((1 + R) * B), u8(F_ * B, s=args.focal_size)   # --gpu-aug: as the loader hands them over

        def train_step():
            nonlocal xt, xr, xf
            if a.gpu_aug:                                            # the loop's calls: one per view size
                v = aug(big, normalize=True).unflatten(0, (1 + R, B))
                xt, xr, xf = v[0], v[1:], aug(focal, normalize=True).unflatten(0, (F_, B))
            ids = mod.random_masking(R * B, g, args.mask_ratio, device=dev)
            mod.train_step(fm, ft, xt, xr, xf, ids.view(R, B, -1), args, micro, amp)
        ema = lambda: mod.ema_update(target, model.net, 0.996)        # noqa: E731
    elif method == "cmae":
        model = mod.CMAE(args).to(dev)
        target = mod.Target(model).to(dev)
        fm, ft = comp(model), comp(target)
        xs, xt = x(B), x(B)
        nk = int((g // args.mask_unit) ** 2 * (1 - args.mask_ratio)) * args.mask_unit ** 2
        dd = args.decoder_dim
        proj = lin(D, args.proj_hidden, args.proj_dim)
        flops = (3 * B * (blocks(D, depth, nk + 1) + blocks(dd, args.decoder_depth + args.feature_decoder_depth, N + 1)
                          + 2 * (nk + 1) * lin(D, dd) + (N + 1) * (lin(dd, p * p * 3) + lin(dd, D))
                          + proj + lin(args.proj_dim, args.proj_hidden, args.proj_dim)) + 2 * B * embed(D, N, p)
                 + B * (blocks(D, depth, N + 1) + embed(D, N, p) + proj)                           # target
                 + 2 * 2 * B * B * args.proj_dim)               # InfoNCE logits (B, B): the target side has no grad
        extra = B * (blocks(D, depth, nk + 1) + embed(D, N, p) + blocks(dd, args.feature_decoder_depth, N + 1)
                     + (nk + 1) * lin(D, dd) + (N + 1) * lin(dd, D) + proj + lin(args.proj_dim, args.proj_hidden,
                                                                                 args.proj_dim))   # no pixel decoder

        ut = u8(B)

        def train_step():
            nonlocal xt
            if a.gpu_aug:                                            # the target view's colour ops
                xt = aug(ut, normalize=True)
            ids, rest, mask = mod.random_masking(B, g, args.mask_ratio, args.mask_unit, dev)
            mod.train_step(fm, ft, xs, xt, ids, rest, mask, args, micro, amp)
        ema = lambda: mod.ema_update(target, target.online_params(model), 0.996)   # noqa: E731
    elif method == "conmim":
        model = mod.Net(args).to(dev)
        teacher = mod.make_teacher(model)
        fm, ft = comp(model), comp(teacher)
        xw, xs = x(B), x(B)
        proj = (N + 1) * lin(D, args.proj_hidden, args.proj_hidden, args.proj_dim)
        logits = 2 * N * N * args.proj_dim                      # each image's patch-to-patch similarities
        flops = (3 * B * (blocks(D, depth, N + 1) + proj) + 2 * B * embed(D, N, p) + 2 * B * logits
                 + B * (blocks(D, depth, N + 1) + embed(D, N, p) + proj))   # teacher; `sym`: log steps only

        us = u8(B)

        def train_step():
            nonlocal xs
            if a.gpu_aug:                                            # the strong (teacher) view's colour ops
                xs = aug(us, **mod.STRONG, normalize=True)
            mask = mod.random_masking(B, g, args.mask_ratio, args.mask_unit, dev)
            mod.train_step(fm, ft, xw, xs, mask, args, micro, amp)
        ema = lambda: mod.ema_update(teacher, model, 0.996)            # noqa: E731
    elif method == "can":
        model = mod.CAN(args).to(dev)
        fm = comp(model)
        xx = x(2, B)
        nk = int(N * (1 - args.mask_ratio))
        dd = args.decoder_dim
        flops = 2 * B * (3 * (blocks(D, depth, nk + 1) + blocks(dd, args.decoder_depth, N + 1)
                              + (nk + 1) * lin(D, dd) + (N + 1) * lin(dd, p * p * 3) + lin(D, args.proj_hidden,
                                                                                           args.proj_dim))
                         + 2 * embed(D, N, p) + (2 + 3) * lin(dd, dd))    # two views; sigma's MLP (its input: no grad)
        flops += 3 * 2 * (2 * B) ** 2 * args.proj_dim                                    # InfoNCE logits (2B, 2B)
        extra = 2 * B * (blocks(D, depth, nk + 1) + embed(D, N, p) + lin(D, args.proj_hidden, args.proj_dim))

        uu = u8(2 * B)

        def train_step():
            nonlocal xx
            if a.gpu_aug:                                            # both views in one call
                xx = aug(uu, normalize=True).unflatten(0, (2, B))
            sig = torch.rand(2, B, device=dev) * args.sigma_max
            noise = sig.view(2, B, 1, 1, 1) * torch.randn_like(xx)
            ids, rest, mask = (t.view(2, B, -1) for t in mod.random_masking(2 * B, g, args.mask_ratio, device=dev))
            mod.train_step(fm, xx, sig, noise, ids, rest, mask, args, micro, amp)
    else:                                                                            # siammae: B pairs
        model = mod.SiamMAE(args).to(dev)
        fm = comp(model)
        f1, f2 = x(B), x(B)
        nk = int(N * (1 - args.mask_ratio))
        dd, L = args.decoder_dim, args.decoder_depth
        cross = 2 * L * (N + 1) * (4 * dd * dd) + 2 * L * 2 * (N + 1) * (N + 1) * dd          # q, kv, proj + attention
        flops = (3 * B * (blocks(D, depth, N + 1) + blocks(D, depth, nk + 1) + blocks(dd, L, N + 1)
                          + cross + (N + 1 + nk + 1) * lin(D, dd) + (N + 1) * lin(dd, p * p * 3))
                 + 2 * B * 2 * embed(D, N, p))                                                     # both frames

        def train_step():
            ids, rest, mask = mod.random_masking(B, g, args.mask_ratio, device=dev)
            mod.train_step(fm, f1, f2, ids, rest, mask, args, micro, amp)

    C.set_grad_checkpointing(model, a.grad_ckpt)
    opt = C.make_optimizer(model, 1e-4, 0.05, (0.9, 0.95), dev)

    def step():
        opt.zero_grad(set_to_none=True)
        train_step()
        opt.step()
        if ema:
            ema()
    return step, B, flops, flops + (extra if micro < B else 0)


KERNEL_CLASSES = [("attention", r"flash|fmha|attention|sdpa|scaled_dot"),          # first: fmha names hold "cutlass"
                  ("GEMM", r"gemm|xmma|cutlass|nvjet|::mm$|addmm|bmm|matmul|triton_tem"),
                  ("norm", r"norm"),                                   # a fused norm with its casts is a norm
                  ("casts", r"to_copy|convert|cast|copy")]            # everything else: elementwise (and reductions)


def kernel_class(name):
    """GEMM / attention / norm / casts / elementwise of a CUDA kernel's (or, on CPU, an aten op's) name."""
    import re
    return next((c for c, pattern in KERNEL_CLASSES if re.search(pattern, name)), "elementwise")


def kernel_profile(step, steps, dev):
    """torch.profiler over `steps` calls of step(): {class: (ms per step, {name: ms per step})} of the device's
    kernels on CUDA (their own intervals), of the aten ops' self time on CPU (the dry run)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    cuda = dev.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    out = {}
    for e in prof.events():
        if cuda and (e.device_type != DeviceType.CUDA or e.is_user_annotation):
            continue
        if not cuda and (e.device_type != DeviceType.CPU or not e.name.startswith("aten::")):
            continue
        ms = (e.time_range.elapsed_us() if cuda else e.self_cpu_time_total) / 1000 / steps
        total, names = out.setdefault(kernel_class(e.name), [0.0, {}])
        out[kernel_class(e.name)][0] = total + ms
        names[e.name] = names.get(e.name, 0.0) + ms
    return out


def print_profile(classes):
    whole = sum(ms for ms, _ in classes.values()) or 1.0
    print("| kernel class | ms / step | share | top kernels (ms / step) |\n|---|---|---|---|")
    for c, (ms, names) in sorted(classes.items(), key=lambda kv: -kv[1][0]):
        top = sorted(names.items(), key=lambda kv: -kv[1])[:3]
        print(f"| {c} | {ms:.2f} | {ms / whole:.2f} | " + "; ".join(f"{n[:60]} ({t:.2f})" for n, t in top) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="all", help="msn|cmae|conmim|can|siammae|all")
    ap.add_argument("--model", default="small")
    ap.add_argument("--preset", default=None, help="time a preset's recipe (e.g. gpu: ViT-Tiny at 32 px) instead of "
                                                   "the ImageNet one; --model is then the preset's")
    ap.add_argument("--batch-size", type=int, default=64, help="images (pairs for siammae) per step")
    ap.add_argument("--micro-batch", type=int, default=0, help="images per forward/backward (0 = the batch)")
    ap.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing of every block")
    ap.add_argument("--precision", default=None, help="bf16|fp32 (default bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--gpu-aug", action="store_true", help="include the loop's batched colour augmentation (uint8 "
                                                           "views in, one call per view size, compiled on CUDA as "
                                                           "train() runs it) in the step (not siammae: it has none)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", type=int, default=0, help="then N steps under torch.profiler: time per kernel "
                                                                "class (GEMM, attention, norm, casts, elementwise)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100 SXM: 989)")
    ap.add_argument("--device", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    a.precision = a.precision or ("bf16" if dev.type == "cuda" else "fp32")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    methods = ["msn", "cmae", "conmim", "can", "siammae"] if a.method == "all" else [a.method]
    name = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    recipe = f"--preset {a.preset}" if a.preset else f"model {a.model}"
    print(f"device: {name}, torch {torch.__version__}, {recipe}, batch {a.batch_size}"
          f"{f' (micro {a.micro_batch})' if a.micro_batch else ''}, {a.precision}{', compile' if a.compile else ''}"
          f"{', grad-ckpt' if a.grad_ckpt else ''}{', gpu-aug' if a.gpu_aug else ''}")
    print("| method | img/s (pairs/s siammae) | step ms | peak mem GB | model TFLOP/step | MFU (model) | hardware "
          "TFLOP/step | HFU |")
    print("|---|---|---|---|---|---|---|---|")
    profiles = {}
    for m in methods:
        if a.preset and a.preset not in recipes.presets(importlib.import_module(m).Args):
            print(f"| {m} | no --preset {a.preset} | | | | | | |")
            continue
        torch.manual_seed(0)
        step, n, flops, hw = setup(m, a, dev)
        for _ in range(a.warmup):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for _ in range(a.steps):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / a.steps
        mem = f"{torch.cuda.max_memory_allocated() / 2**30:.1f}" if dev.type == "cuda" else "n/a"
        use = [f"{100 * f / dt / (a.peak_tflops * 1e12):.1f}%" if dev.type == "cuda" else "n/a" for f in (flops, hw)]
        print(f"| {m} | {n / dt:.1f} | {1000 * dt:.0f} | {mem} | {flops / 1e12:.3f} | {use[0]} | {hw / 1e12:.3f} | "
              f"{use[1]} |", flush=True)
        if a.profile:
            profiles[m] = kernel_profile(step, a.profile, dev)
    for m, classes in profiles.items():
        print(f"\n{m}: {a.profile} steps by kernel class ({'CUDA kernels' if dev.type == 'cuda' else 'CPU aten ops'})")
        print_profile(classes)


if __name__ == "__main__":
    main()
