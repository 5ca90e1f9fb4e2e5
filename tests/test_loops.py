"""The training loops around each train_step (tests/test_step.py and test_wiring.py check the steps):
per step, the lr and weight decay the optimiser actually applies follow the official schedule, the
EMA target is updated once per step, after the optimiser, with the official momentum schedule, the
target/teacher BatchNorm runs in train mode (batch statistics, as the official code), each view of the
loader's batch reaches its train_step argument normalised, the masks and noise the loop draws reach the
step with the configured ratio and scale, new each step, epoch and process, and the fine-tuning loop
applies its warm-up + cosine lr times each layer's scale. Every reference below is written from the
official code (cited), not from this project's helpers. Runs of 1 to 6 steps on the tiny configs."""
import json
import math
import os

import pytest
import torch

import can
import cmae
import common as C
import harness as H
import conmim
import eval_finetune as FT
import gpu_aug as GA
import msn
import siammae
import synthetic as S
from ddp import spawn
from test_can import tiny_args as can_args
from test_cmae import tiny_args as cmae_args
from test_conmim import tiny_args as conmim_args
from test_msn import tiny_args as msn_args
from test_siammae import tiny_args as siammae_args


def mae_lr(k, total, warmup, peak, min_lr):
    """MAE util/lr_sched.adjust_learning_rate at epoch = k / ipe (per iteration)."""
    if k < warmup:
        return peak * k / warmup
    return min_lr + (peak - min_lr) * 0.5 * (1 + math.cos(math.pi * (k - warmup) / (total - warmup)))


def short_ema(m, a, total):
    """A short run's first momentum: 1 / (1 - m) at most ema_horizon x the run's steps (scale_recipe's rule)."""
    return min(m, 1 - 1 / (a.ema_horizon * total)) if a.ema_horizon else m


def msn_reference(k, a, total, ipe):
    """facebookresearch/msn: WarmupCosineSchedule / CosineWDSchedule over T_max = int(1.25 x steps),
    momentum_scheduler 0.996 + i (1 - 0.996) / (ipe x epochs x 1.25). Evaluated at iteration k (the
    official schedulers step before use, so its iteration k uses k + 1: msn.py lists it)."""
    T, W = int(a.ipe_scale * total), a.warmup_epochs * ipe
    if k < W:
        lr = a.start_lr + k / W * (a.lr - a.start_lr)
    else:
        lr = max(a.min_lr, a.min_lr + (a.lr - a.min_lr) * 0.5 * (1 + math.cos(math.pi * (k - W) / (T - W))))
    wd = a.final_weight_decay + (a.weight_decay - a.final_weight_decay) * 0.5 * (1 + math.cos(math.pi * k / T))
    m0 = short_ema(a.ema[0], a, total)
    m = m0 + k * (a.ema[1] - m0) / (ipe * a.epochs * a.ipe_scale)
    return lr, wd, m


def conmim_reference(k, a, total, ipe):
    """TencentARC/ConMIM (BEiT utils.cosine_scheduler, indexed by iteration): lr warm-up then cosine to
    min_lr, weight decay constant (weight_decay_end = weight_decay), teacher momentum cosine 0.996 -> 1
    over all iterations. Warm-up as k / W (official np.linspace: k / (W - 1); conmim.py lists it)."""
    W = a.warmup_epochs * ipe
    lr = a.lr * k / W if k < W else \
        a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * (k - W) / (total - W)))
    m = a.ema[1] + 0.5 * (short_ema(a.ema[0], a, total) - a.ema[1]) * (1 + math.cos(math.pi * k / total))
    return lr, a.weight_decay, m


def mae_reference(k, a, total, ipe):
    """CMAE, CAN (MAE recipe): lr = blr x batch / 256, warm-up + cosine per iteration, constant weight
    decay; CMAE's EMA momentum is constant (official)."""
    lr = mae_lr(k, total, a.warmup_epochs * ipe, a.blr * a.batch_size / 256, a.min_lr)
    return lr, a.weight_decay, short_ema(a.ema, a, total) if hasattr(a, "ema") else None


def siammae_reference(k, a, total, ipe):
    """MAE-ST convention: --epochs and --warmup-epochs count effective epochs (passes x repeated sampling
    R); lr = blr x videos / 256."""
    lr = mae_lr(k, total, round(a.warmup_epochs / a.repeated_sampling * ipe), a.blr * a.batch_size / 256, a.min_lr)
    return lr, a.weight_decay, None


# module, tiny args, reference(k, args, total steps, ipe) -> (lr, wd, EMA momentum or None)
CASES = {"msn": (msn, msn_args, msn_reference), "cmae": (cmae, cmae_args, mae_reference),
         "conmim": (conmim, conmim_args, conmim_reference), "can": (can, can_args, mae_reference),
         "siammae": (siammae, siammae_args, siammae_reference)}
MASK_ARG = {"msn": 5, "cmae": 6, "conmim": 4, "can": 6, "siammae": 5}   # train_step's mask (MSN: ids_keep)


def epochs(method, passes):
    """--epochs for `passes` passes over the data: SiamMAE counts effective epochs (x repeated sampling)."""
    return passes * (siammae_args().repeated_sampling if method == "siammae" else 1)


def _record(monkeypatch, mod):
    """Spies on the optimiser step, the EMA update, the step's inputs and every BatchNorm call."""
    events, steps, bn_modes = [], [], []
    real_opt = C.optimizer_step

    def opt_spy(run, opt, params, max_norm=0.0):
        events.append(("opt", [(g["lr"], g["weight_decay"], g.get("apply_wd", True)) for g in opt.param_groups]))
        return real_opt(run, opt, params, max_norm)
    monkeypatch.setattr(C, "optimizer_step", opt_spy)
    if hasattr(mod, "ema_update"):
        real_ema = mod.ema_update
        monkeypatch.setattr(mod, "ema_update", lambda t, o, m: (events.append(("ema", m)), real_ema(t, o, m))[1])
    real_step, inside = mod.train_step, []

    def step_spy(*a, **kw):
        assert a[0].training                                           # the online network trains in train mode
        steps.append(a)
        inside.append(1)
        try:
            return real_step(*a, **kw)
        finally:
            inside.pop()
    monkeypatch.setattr(mod, "train_step", step_spy)
    real_bn = torch.nn.modules.batchnorm._BatchNorm.forward            # BatchNorm mode inside the steps
    monkeypatch.setattr(torch.nn.modules.batchnorm._BatchNorm, "forward",
                        lambda self, x: (inside and bn_modes.append(self.training), real_bn(self, x))[1])
    return events, steps, bn_modes


@pytest.mark.parametrize("method,horizon", [(m, 0.0) for m in sorted(CASES)]
                         + [(m, 0.5) for m in ("msn", "cmae", "conmim")])
def test_loop_applies_the_official_schedules_and_updates_the_target_after_each_step(method, horizon, tmp_path,
                                                                                    monkeypatch):
    """Each step's lr, weight decay and EMA momentum are the official schedules' (horizon 0.5: the short-run
    EMA rule, the first momentum lowered so that its horizon is half the run)."""
    mod, make, reference = CASES[method]
    a = make(tmp_path)
    if horizon:
        a.ema_horizon = horizon
    events, steps, bn_modes = _record(monkeypatch, mod)
    mod.train(a)
    ipe = a.steps_per_epoch
    total = ipe * (a.epochs // a.repeated_sampling if method == "siammae" else a.epochs)
    has_ema = hasattr(mod, "ema_update")
    assert [e[0] for e in events] == (["opt", "ema"] if has_ema else ["opt"]) * total   # EMA after each step
    opts, emas = [e[1] for e in events if e[0] == "opt"], [e[1] for e in events if e[0] == "ema"]
    for k in range(total):
        lr, wd, m = reference(k, a, total, ipe)
        for g_lr, g_wd, decayed in opts[k]:
            assert g_lr == pytest.approx(lr, rel=1e-9), (k, g_lr, lr)
            assert g_wd == (pytest.approx(wd, rel=1e-9) if decayed else 0.0), (k, g_wd, wd)
        if has_ema:
            assert emas[k] == pytest.approx(m, rel=1e-12), (k, emas[k], m)
    assert len(steps) == total
    if method in ("msn", "cmae", "conmim"):                          # online and target heads: batch statistics
        assert bn_modes and all(bn_modes)


@pytest.mark.parametrize("method", sorted(CASES))
def test_loop_masks_with_the_configured_ratio_fresh_each_step(method, tmp_path, monkeypatch):
    """The mask the loop draws reaches the step with --mask-ratio (and --mask-unit), a new draw each
    step, epoch and image; SiamMAE masks f2 only (f1 is passed whole); CAN draws one mask, one noise
    level sigma ~ U[0, sigma_max] and one noise e ~ N(0, 1) per view and image."""
    mod, make, _ = CASES[method]
    kw = dict(img_size=32) if method == "siammae" else {}             # SiamMAE: 3 of 64 patches kept
    a = make(tmp_path, epochs=epochs(method, 2), steps_per_epoch=2, warmup_epochs=0, **kw)   # 2 passes of 2 steps
    _, steps, _ = _record(monkeypatch, mod)
    mod.train(a)
    grid = a.img_size // a.patch_size
    N = grid * grid
    masks = []
    for s in steps:
        mask = s[MASK_ARG[method]]
        if method == "msn":                                            # ids_keep (R, B, n_keep) of kept patches
            ids_keep = mask
            assert ids_keep.shape[:2] == s[3].shape[:2]                # one per random anchor (R, B) of the step
            assert ids_keep.shape[-1] == int(N * (1 - a.mask_ratio))
            mask = torch.ones(ids_keep.shape[:-1] + (N,)).scatter_(-1, ids_keep, 0.0).flatten(0, 1)
        elif method in ("cmae", "conmim"):                            # masked in unit x unit blocks
            mask = mask.flatten(1).float()
            assert mask.shape == (s[2].shape[0], N)                    # one per image of the step
            u, g = a.mask_unit, grid // a.mask_unit
            assert u > 1 and (mask.sum(1) == (g * g - int(g * g * (1 - a.mask_ratio))) * u * u).all()
            blocks = mask.view(-1, g, u, g, u)
            assert (blocks == blocks[:, :, :1, :, :1]).all()           # constant within each block
        elif method == "can":
            x, sigma, noise = s[1], s[2], s[3]                         # (2, B, ...) view-major
            B = x.shape[1]
            assert sigma.shape == (2, B) and (sigma >= 0).all() and (sigma <= a.sigma_max).all()
            assert sigma.max() > 0.5 * a.sigma_max                     # U[0, sigma_max], not a narrower range
            assert not torch.equal(sigma[0], sigma[1])                 # a level per view and image
            e = noise / sigma.view(2, B, 1, 1, 1)                      # noise = sigma e, e ~ N(0, 1)
            assert abs(e.std().item() - 1) < 0.1 and abs(e.mean().item()) < 0.1
            assert not torch.allclose(e[0], e[1])                      # independent per view
            assert mask.shape == (2, B, N)                             # one per view of each image of the step
            assert (mask.sum(-1) == N - int(N * (1 - a.mask_ratio))).all()
            assert not torch.equal(mask[0], mask[1])                   # a mask per view
            mask = mask.flatten(0, 1)
        else:                                                          # siammae: f2's mask only
            f1, f2 = s[1], s[2]
            assert mask.shape == (f2.shape[0], N) and (mask.sum(1) == N - int(N * (1 - a.mask_ratio))).all()
            assert f1.shape == f2.shape                                # f1 enters whole (0% masked)
        assert 0 < mask.mean() < 1
        assert len({tuple(r.tolist()) for r in mask}) > 1              # per image
        masks.append(mask)
    # per step and per epoch (each epoch reseeds from (seed, epoch, rank): epoch 1 must not replay epoch 0)
    assert len(masks) == 4 and all(not torch.equal(masks[i], masks[j]) for i in range(4) for j in range(i))


def test_finetune_loop_applies_warmup_cosine_times_each_layer_scale(tmp_path, monkeypatch):
    """eval_finetune: every group's lr = MAE's per-iteration warm-up + cosine value x its layer-decay
    scale, each step (the scales themselves: tests/test_finetune.py); drop path 0.1 reaches the ViT."""
    can.train(can.Args(data="synthetic", output_dir=str(tmp_path / "pre"), model="nano", patch_size=4, img_size=16,
                       epochs=1, steps_per_epoch=1, batch_size=16, warmup_epochs=0, decoder_dim=16, decoder_depth=1,
                       decoder_heads=2, proj_hidden=16, proj_dim=8, workers=0, knn=False, device="cpu"))
    ckpt = str(tmp_path / "pre" / "checkpoint.pth")
    events, real_opt = [], C.optimizer_step
    monkeypatch.setattr(C, "optimizer_step", lambda run, opt, params, max_norm=0.0: (
        events.append([(g["lr"], g["lr_scale"], g["weight_decay"]) for g in opt.param_groups]),
        real_opt(run, opt, params, max_norm))[1])
    a = FT.Args(ckpt=ckpt, data="synthetic", output_dir=str(tmp_path / "ft"), epochs=3, steps_per_epoch=2, batch_size=8,
                micro_batch=0, warmup_epochs=1, blr=1e-3, min_lr=1e-5, workers=0, eval_batch=500, device="cpu")
    models = []

    class Recorded(FT.Classifier):
        def __init__(self, *args):
            super().__init__(*args)
            models.append(self)
    monkeypatch.setattr(FT, "Classifier", Recorded)
    FT.finetune(a)
    rates = [b.drop_path for b in models[0].encoder.blocks]           # stochastic depth 0 -> --drop-path
    assert rates == pytest.approx(torch.linspace(0, a.drop_path, len(rates)).tolist()) and a.drop_path == 0.1
    assert len(events) == 6
    scales = set()
    for k, groups in enumerate(events):
        lr = mae_lr(k, 6, 2, 1e-3 * 8 / 256, 1e-5)
        for g_lr, scale, wd in groups:
            assert g_lr == pytest.approx(lr * scale, rel=1e-9) and wd in (0.0, 0.05)
            scales.add(scale)
    assert len(scales) > 2                                             # layer-wise decay is in force


# where each view of a loader batch must arrive in train_step's arguments (after C.normalize)
ROUTES = {
    "msn": lambda b, a: {2: b[0][0], 3: torch.stack(b[0][1:1 + a.rand_views]),     # target view; random
                         4: torch.stack(b[0][1 + a.rand_views:])},                   # and focal anchors
    "cmae": lambda b, a: {2: b[0][0], 3: b[0][1]},                                 # x_s (online), x_t (target)
    "conmim": lambda b, a: {2: b[0][0], 3: b[0][1]},                               # weak (student), strong (teacher)
    "can": lambda b, a: {1: torch.stack(b[0])},                                    # (2, B, ...) both views
    "siammae": lambda b, a: {1: b[0].flatten(0, 1)[:, 0], 2: b[0].flatten(0, 1)[:, 1]},   # f1 earlier, f2 later
}


@pytest.mark.parametrize("method", sorted(CASES))
def test_each_view_of_the_batch_reaches_its_argument_normalised(method, tmp_path, monkeypatch):
    """Loader batch -> train_step: every view goes through C.normalize (replaced here by a recognisable
    shift) and lands in the argument the method's step reads it from (MSN's target vs anchors, CMAE's
    source vs target, ConMIM's weak vs strong, CAN's two views, SiamMAE's f1 vs f2)."""
    mod, make, _ = CASES[method]
    batches, real_epoch = [], C.Batches.epoch

    def batches_spy(self, *a, **kw):
        for it, batch in real_epoch(self, *a, **kw):
            batches.append(batch)
            yield it, batch
    monkeypatch.setattr(C.Batches, "epoch", batches_spy)
    monkeypatch.setattr(C, "normalize", lambda x: x.float() + 1000)   # "normalised" = shifted by 1000
    _, steps, _ = _record(monkeypatch, mod)
    mod.train(make(tmp_path, epochs=epochs(method, 1), steps_per_epoch=1, warmup_epochs=0))
    assert len(steps) == len(batches) == 1
    for i, view in ROUTES[method](batches[0], make(tmp_path)).items():
        assert view.dtype == torch.uint8
        torch.testing.assert_close(steps[0][i], view.float() + 1000, rtol=0, atol=0, msg=f"argument {i}")



def _rank_mask(rank, world, method, out):
    """In a 2-process gloo group: the mask this rank's first training step gets."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    mod, make, _ = CASES[method]
    got, real = [], mod.train_step
    mod.train_step = lambda *a, **kw: (got.append(a[MASK_ARG[method]].clone()), real(*a, **kw))[1]
    mod.train(make(out, epochs=epochs(method, 1), steps_per_epoch=1, warmup_epochs=0, stop_step=1,
                   device="cpu", **({"img_size": 32} if method == "siammae" else {})))
    return got[0]


@pytest.mark.parametrize("method,how", [("msn", "cls-prenorm"), ("cmae", "mean"), ("conmim", "mean"),
                                        ("can", "mean")])
def test_the_knn_monitor_reads_the_encoder_the_checkpoint_exports(method, how, tmp_path, monkeypatch):
    """The k-NN monitor (--knn) scores the encoder saved as the checkpoint's "encoder" (MSN's target, ConMIM's
    teacher, the online one otherwise) with the pooling eval_linear.py gives the method: at step 0 the initial
    weights, at the end the final ones, the latter after the final checkpoint (a stop signal then ends the
    program at once)."""
    import eval_linear
    mod, args, _ = CASES[method]
    seen = []
    real = eval_linear.share_features
    monkeypatch.setattr(eval_linear, "share_features", lambda enc, ds, size, pool, *a, **kw: (seen.append(
        (pool, {k: v.clone() for k, v in C.unwrap(enc).state_dict().items()}, H.Control.current.trained)),
        real(enc, ds, size, pool, *a, **kw))[1])
    monkeypatch.setattr(eval_linear, "splits", lambda *a, **kw: (S.SyntheticImages("train", n=40),
                                                                 S.SyntheticImages("val", n=20),
                                                                 torch.arange(len(S.SHAPES))))
    mod.train(args(tmp_path, knn=True, epochs=1))
    saved = C.load_checkpoint(str(tmp_path / "checkpoint.pth"))["encoder"]
    assert [(p, t) for p, _, t in seen] == [(how, None)] * 2 + [(how, str(tmp_path / "checkpoint.pth"))] * 2
    first, last = seen[0][1], seen[-1][1]
    assert first.keys() == last.keys() == saved.keys() and all(torch.equal(last[k], saved[k]) for k in saved)
    assert not all(torch.equal(first[k], saved[k]) for k in saved)                      # step 0: the initial one
    recs = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    knn = [r["step"] for r in recs if "knn_top1" in r]
    assert knn == [0, max(r["step"] for r in recs)]


@pytest.mark.parametrize("method", sorted(CASES))
def test_each_process_draws_its_own_masks(method, tmp_path):
    """The per-epoch reseed includes the rank: two processes must not mask their images alike."""
    m0, m1 = spawn(_rank_mask, method, str(tmp_path))
    assert m0.shape == m1.shape and not torch.equal(m0, m1)


def _stopped_at_first_call(monkeypatch, mod, a, name):
    """mod.train(a), stopped where it first calls common.<name> or harness.<name>: that call's positional arguments."""
    seen = []

    def stop(*args, **kw):
        seen.append(args)
        raise C.UserError("stop")
    monkeypatch.setattr(H if hasattr(H, name) else C, name, stop)
    with pytest.raises(C.UserError, match="stop"):
        mod.train(a)
    return seen[0]


@pytest.mark.parametrize("method", sorted(CASES))
def test_the_small_batch_warning_is_measured_against_the_official_global_batch(tmp_path, monkeypatch, method):
    """Each loop's batch plan warns below the official recipe's global batch, which is its Args default
    (MSN 1024, CMAE 4096, ConMIM 2048, CAN 4096, SiamMAE 1024 videos x 2 repeated samples)."""
    mod, make, _ = CASES[method]
    a = make(tmp_path)
    _, _, recipe, weakens = _stopped_at_first_call(monkeypatch, mod, a, "batch_plan")   # (args, run, recipe, weakens)
    assert recipe == mod.Args.batch_size == {"msn": 1024, "cmae": 4096, "conmim": 2048, "can": 4096,
                                             "siammae": 1024}[method]
    B = a.batch_size                                   # the counts it names: this run's and the recipe's
    count = {"cmae": [f"{B - 1} negatives per image", "of 4095"],      # InfoNCE over the batch: B - 1
             "can": [f"{2 * B - 2} negatives per view", "of 8190"],    # 2B views: all but itself and its pair
             "msn": [f"{B} images against"]}.get(method, [])
    assert all(c in weakens for c in count), weakens


@pytest.mark.parametrize("method", sorted(CASES))
def test_each_loop_logs_throughput_in_the_samples_of_its_global_step(tmp_path, monkeypatch, method):
    """The log's img_s counts what one step trains on, over all processes: the global batch of images,
    SiamMAE's batch x --repeated-sampling frame pairs."""
    mod, make, _ = CASES[method]
    a = make(tmp_path)
    seen, real = [], C.Logger

    def stop(*args, **kw):                                           # the run's Logger, then stopped
        seen.append(real(*args, **kw).batch)
        raise C.UserError("stop")
    monkeypatch.setattr(C, "Logger", stop)
    with pytest.raises(C.UserError, match="stop"):
        mod.train(a)
    assert seen == [a.batch_size * (a.repeated_sampling if method == "siammae" else 1)]


@pytest.mark.parametrize("method", sorted(CASES))
def test_each_loop_passes_grad_ckpt_and_logs_the_last_step_of_stop_epoch(tmp_path, monkeypatch, method):
    """Run plumbing each loop repeats: --grad-ckpt reaches the model (its blocks run under activation
    checkpointing) and a --stop-epoch run logs its last step even off the --log-every grid and before
    the schedule's end (SiamMAE: 2 passes of --repeated-sampling effective epochs each)."""
    mod, make, _ = CASES[method]
    calls, real = [], torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    mod.train(make(tmp_path, grad_ckpt=True, epochs=epochs(method, 2), steps_per_epoch=3, stop_epoch=1, log_every=100,
                   warmup_epochs=0))
    assert calls
    steps = [json.loads(line)["step"] for line in open(tmp_path / "log.jsonl") if '"step"' in line]
    assert steps == [3]


@pytest.mark.parametrize("method", sorted(CASES))
def test_each_loop_ends_step_k_with_its_global_step_and_the_epoch_reads_so_far(tmp_path, monkeypatch, method):
    """After the k-th optimiser step of an epoch the loop hands end_step the global step (log, mid-epoch
    checkpoint, --stop-step), and the epoch's batches have counted the images (SiamMAE: videos) read so far, k x the
    per-process batch (--max-unreadable's denominator), and all of them at the epoch's end; a stopped run's
    checkpoint is at that step."""
    mod, make, _ = CASES[method]
    seen, reads, real_end, real_check = [], [], C.end_step, C.check_unreadable

    def end_step(run, log, save, batches, step, epoch, parts, **kw):
        seen.append((step, epoch))
        return real_end(run, log, save, batches, step, epoch, parts, **kw)

    def check(data, n, bad0, frac, final=False):
        reads.append((n, final))
        return real_check(data, n, bad0, frac, final)
    monkeypatch.setattr(C, "end_step", end_step)
    monkeypatch.setattr(C, "check_unreadable", check)
    a = make(tmp_path, epochs=epochs(method, 2), steps_per_epoch=2, stop_step=3)
    mod.train(a)
    b = a.batch_size
    assert seen == [(1, 0), (2, 0), (3, 1)]
    assert reads == [(b, False), (2 * b, False), (2 * b, True), (b, False)]
    assert torch.load(tmp_path / "checkpoint.pth", weights_only=True)["step"] == 3


@pytest.mark.parametrize("gpu_aug", [False, True])
@pytest.mark.parametrize("method", ["cmae", "conmim"])
def test_the_colour_augmentation_reaches_the_target_view_only(tmp_path, monkeypatch, method, gpu_aug):
    """CMAE's EMA target view and ConMIM's teacher (strong) view are the colour-augmented ones, in the
    workers or batched on the device (--gpu-aug); the online / student view never is. The augmentation
    is replaced by one that blacks the image out (and, batched, records which batch it was given)."""
    from PIL import Image
    given = []
    monkeypatch.setattr(C, "color_augment", lambda **kw: (lambda im: Image.new("RGB", im.size)))
    def black_out(x, normalize=False, **kw):                          # uint8 in; normalised out, as the loops ask
        given.append(x)
        black = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        return C.normalize(black) if normalize else black
    monkeypatch.setattr(GA, "color_augmenter", lambda compile=False: black_out)
    mod, make, _ = CASES[method]
    _, steps, _ = _record(monkeypatch, mod)
    mod.train(make(tmp_path, gpu_aug=gpu_aug, stop_step=1))
    online, target = steps[0][2:4]                                     # train_step's (online, target) views
    black = C.normalize(torch.zeros(3, 1, 1, dtype=torch.uint8))
    assert torch.equal(target, black.expand_as(target).contiguous())
    assert (online != black).flatten(1).any(1).all()                   # every online image has content
    if gpu_aug:                       # the batch it blacked out: CMAE's shifted target view, not the online one;
        assert len(given) == 1        # ConMIM's strong view, which before its colour ops IS the weak one (one crop)
        assert torch.equal(C.normalize(given[0]), online) == (method == "conmim")


@pytest.mark.parametrize("method,norm_pix", [("cmae", True), ("can", False), ("can", True), ("siammae", True)])
def test_the_reconstruction_picture_shows_the_last_batch_through_the_trained_model(tmp_path, monkeypatch, method,
                                                                                   norm_pix):
    """recon_ep / pairs_ep PNG after each epoch: rows of up to 8 images of the epoch's last batch (CAN: its
    first view; SiamMAE: its pairs) = the input, the input with masked patches blanked (CAN: the noisy input
    the encoder saw), the trained model's prediction pasted into the masked patches (the visible ones are
    the input), and CAN's noise prediction sigma_max-scaled on the visible patches."""
    mod, make, _ = CASES[method]
    kw = dict(batch_size=6, img_size=32) if method == "siammae" else dict(batch_size=12, knn=False)   # > 8 images
    kw.update(dict(norm_pix=norm_pix) if method == "can" else {})     # CMAE, SiamMAE: always norm-pix targets
    a = make(tmp_path, epochs=epochs(method, 1), steps_per_epoch=1, warmup_epochs=0, **kw)
    _, steps, _ = _record(monkeypatch, mod)
    grids = []
    monkeypatch.setattr(C, "save_image_grid", lambda path, rows, labels, step, tb=None:
                        grids.append((os.path.basename(path), list(rows))))
    mod.train(a)
    s, p = steps[-1], a.patch_size
    (name, rows), = grids
    assert name == ("pairs" if method == "siammae" else "recon") + "_ep0000_step000001.png"     # the log's ep, step
    net = s[0].eval()
    patches = lambda t: mod.patchify(t, p)                                # noqa: E731
    with torch.no_grad():
        if method == "can":
            x, sigma, noise, keep, restore, mask = (t[0, :8] for t in s[1:7])   # the first view
            inp, shown = x, x + noise
            pred, _ = net(x + noise, sigma, keep, restore)
        elif method == "cmae":
            x, keep, restore, mask = s[2][:8], s[4][:8], s[5][:8], s[6][:8]
            inp = shown = x
            pred = net(x, keep, restore)[0]
        else:
            f1, x, keep, restore, mask = (t[:8] for t in s[1:6])
            inp, shown = f1, x
            pred = net(f1, x, keep, restore)
    assert len(x) == 8 and 0 < mask.float().mean() < 1
    m = mask[:, :, None].bool()
    torch.testing.assert_close(rows[0], inp)
    if method == "siammae":                                               # SiamMAE shows the real f2 next
        torch.testing.assert_close(rows.pop(1), x)
    torch.testing.assert_close(patches(rows[1]), torch.where(m, 0.0, patches(shown)))
    xp = patches(x)
    filled = mod.unnorm_pix(pred, xp) if norm_pix else pred
    torch.testing.assert_close(patches(rows[2]), torch.where(m, filled, xp))
    if method == "can":
        torch.testing.assert_close(patches(rows[3]), torch.where(m, 0.0, pred / a.sigma_max))
    assert len(rows) == (4 if method == "can" else 3)


@pytest.mark.parametrize("method,says", [("msn", "EMA momentum 0."), ("cmae", "EMA momentum 0."),
                                         ("conmim", "teacher momentum 0.")])
@pytest.mark.parametrize("preset", [False, True])
def test_the_printed_plan_names_the_ema_momentum_with_or_without_a_preset(method, says, preset, tmp_path, capsys,
                                                                           monkeypatch):
    """Each EMA method's plan line says the momentum schedule it trains with; under a preset too (MSN's line lost it
    there: the conditional expression that chose the lr's wording swallowed the rest). A preset's run also prints
    one block of what the preset set and the rule behind each value."""
    import harness as H
    mod, make, _ = CASES[method]
    monkeypatch.setattr(mod, "train_step", lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt))
    args = H.parse_args(mod.Args, ["--data", "synthetic", "--output-dir", str(tmp_path), "--no-knn", "--workers",
                                   "0", "--model", "nano", "--img-size", "16", "--batch-size", "8"]) if preset \
        else make(tmp_path)
    with pytest.raises(KeyboardInterrupt):                            # the plan is printed before the first step
        mod.train(args)
    out = capsys.readouterr().out
    plan = [line for line in out.splitlines() if " steps/epoch, " in line]
    assert len(plan) == 1 and says in plan[0], plan
    block = "--preset synthetic (recipes.py) sets:" in out
    assert block == preset
    if preset:
        assert "  --model nano: given on the command line (the preset's: micro)" in out
        assert "  --ema-horizon 0.02: the EMA horizon 1 / (1 - m) at most 0.02 of the run's steps" in out
