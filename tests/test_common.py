"""common.py (schedules, optimiser groups, data, augmentation, checkpoints, log) and harness.py (CLI, presets,
resume, run control) (each method's ViT, masking and EMA: test_vits.py)."""
import argparse
import dataclasses
import itertools
import math
import os

import numpy as np
import pytest
import torch

import common as C
import harness as H
import recipes
import msn
import synthetic as S
from ddp import spawn
from test_msn import tiny_args as msn_args


def test_schedules():
    assert C.cosine_schedule(0, 100, 1.0, 0.0, warmup=10, start=0.2) == 0.2
    assert math.isclose(C.cosine_schedule(5, 100, 1.0, 0.0, warmup=10, start=0.2), 0.6)
    assert C.cosine_schedule(10, 100, 1.0, 0.1, warmup=10) == 1.0
    assert math.isclose(C.cosine_schedule(55, 100, 1.0, 0.1, warmup=10), 0.55)
    assert math.isclose(C.cosine_schedule(100, 100, 1.0, 0.1, warmup=10), 0.1)
    assert math.isclose(C.cosine_schedule(0, 100, 0.04, 0.4), 0.04)          # increasing wd schedule
    assert math.isclose(msn.linear_schedule(50, 100, 0.996, 1.0), 0.998)          # MSN momentum
    assert msn.linear_schedule(200, 100, 0.996, 1.0) == 1.0


def test_optimizer_groups():
    """Default rule (timm add_weight_decay): biases and 1-d tensors exempt, tokens decayed."""
    vit = msn.ViT(16, 8, 16, 1, 2)                      # learned pos_embed: a decayed parameter
    opt = C.make_optimizer(vit, 1e-3, 0.05, (0.9, 0.95), torch.device("cpu"))
    names = {id(p): n for n, p in vit.named_parameters()}
    decay = {names[id(p)] for p in opt.param_groups[0]["params"]}
    no_decay = {names[id(p)] for p in opt.param_groups[1]["params"]}
    assert {"norm.weight", "norm.bias", "blocks.0.attn.qkv.bias"} <= no_decay
    assert {"pos_embed", "cls_token", "blocks.0.attn.qkv.weight", "patch_embed.proj.weight"} <= decay
    assert all(n.endswith(".bias") or "norm" in n for n in no_decay)
    C.set_hparams(opt, 0.5, 0.3)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.5]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]


def test_synthetic_dataset_deterministic_and_labelled():
    ds = S.SyntheticImages("train")
    a, la = ds.load(7)
    b, lb = ds.load(7)
    assert la == lb == 7 % 10 and a.size == (64, 64) and a.tobytes() == b.tobytes()
    assert ds.load(8)[0].tobytes() != a.tobytes()
    assert S.SyntheticImages("val").load(7)[0].tobytes() != a.tobytes()        # held-out split
    assert len(ds) == 8000 and len(S.SyntheticImages("val")) == 1000


def test_compile_and_gpu_aug_are_on_by_default_with_cuda_only():
    """--compile and --gpu-aug default to on with CUDA and off on CPU; given flags win (--no-compile). Only a
    compile that is on by default falls back to eager when torch cannot compile (a failing backend here)."""
    import torch._dynamo
    with torch._dynamo.config.patch(suppress_errors=False, disable=False):
        for dev, on in (("cpu", False), ("cuda", True)):
            a = msn.Args(data="synthetic")
            assert a.compile is None and a.gpu_aug is None and not torch._dynamo.config.suppress_errors
            H.device_defaults(a, torch.device(dev))
            assert a.compile is on and a.gpu_aug is on and torch._dynamo.config.suppress_errors is on

        def broken(gm, example_inputs):
            raise RuntimeError("cannot compile")
        torch._dynamo.reset()
        assert torch.compile(lambda x: x * 2, backend=broken)(torch.ones(2)).tolist() == [2.0, 2.0]   # eager
        torch._dynamo.config.suppress_errors = False
        a = H.parse_args(msn.Args, ["--data", "synthetic", "--no-compile", "--no-gpu-aug"])
        H.device_defaults(a, torch.device("cuda"))
        assert a.compile is False and a.gpu_aug is False
        a = H.parse_args(msn.Args, ["--data", "synthetic", "--compile"])
        H.device_defaults(a, torch.device("cuda"))
        assert a.compile is True and a.gpu_aug is True and not torch._dynamo.config.suppress_errors
        torch._dynamo.reset()
        with pytest.raises(Exception, match="cannot compile"):                # asked for: its error shows
            torch.compile(lambda x: x * 3, backend=broken)(torch.ones(2))
    torch._dynamo.reset()


def test_synthetic_classes_are_ten_distinct_shapes_whatever_the_rotation():
    """The README's synthetic results need 10 shapes that differ: each covers 5-50% of its box, and no two
    overlap by more than 85% IoU at any relative rotation (the closest pair, disc and square, is at 0.81)."""
    import numpy as np
    yy, xx = np.mgrid[-1:1:64j, -1:1:64j]
    masks = {n: [S.shape_mask(n, xx, yy, (0, 0), 0.65, r) for r in np.linspace(0, 2 * np.pi, 24, endpoint=False)]
             for n in S.SHAPES}
    assert len(masks) == 10 and all(0.05 < m[0].mean() < 0.5 for m in masks.values())
    assert all((m[0] != m[3]).any() for n, m in masks.items() if n not in ("disc", "ring"))   # turned 45 degrees
    for a, b in itertools.combinations(S.SHAPES, 2):
        iou = max((masks[a][0] & m).sum() / (masks[a][0] | m).sum() for m in masks[b])
        assert iou < 0.85, (a, b, iou)


def test_synthetic_clip_masks_are_the_objects_drawn():
    """eval_video's synthetic DAVIS: mask(t) marks exactly the pixels of each object in frame t (all of its
    colour, the later object on top), every object is in view, the objects move, and val's clips are not train's."""
    import numpy as np
    for i in range(4):
        clip = S.SyntheticClip(i, "val")
        for t in (0, 7, 31):
            frame, ids = np.asarray(clip.load(t)), clip.mask(t)
            assert frame.shape == (64, 64, 3) and ids.shape == (64, 64)
            assert set(np.unique(ids)) == set(range(len(clip.objs) + 1))              # background + every object
            for k, o in enumerate(clip.objs):
                assert (frame[ids == k + 1] == (o["rgb"] * 255).astype(np.uint8)).all()
        assert (clip.mask(0) != clip.mask(31)).any()
    train, val = S.SyntheticVideos("train"), S.SyntheticVideos("val")                 # a held-out val split
    assert len(train) == 2000 and len(val) == 20
    assert val.load(0)[0].load(0).tobytes() != train.load(0)[0].load(0).tobytes()


def test_views_seeded_by_epoch_and_index():
    from torchvision import transforms as T
    tf = T.Compose([T.RandomResizedCrop(16), C.to_uint8])
    v = C.Views(S.SyntheticImages(), tf, seed=3)
    rng = torch.get_rng_state()
    x0, x1 = v[(5, 0)][0], v[(5, 1)][0]
    assert torch.equal(torch.get_rng_state(), rng)                          # caller's RNG untouched
    assert torch.equal(v[(5, 0)][0], x0) and not torch.equal(x0, x1)
    assert x0.dtype == torch.uint8 and x0.shape == (3, 16, 16)
    draws = C.Views(S.SyntheticImages(), lambda img: torch.rand(4), seed=3)   # the random draws themselves:
    d = [draws[(i, 0)][0] for i in range(8)]                                   # each image of an epoch its own
    assert all(not torch.equal(d[i], d[j]) for i in range(8) for j in range(i))
    assert torch.equal(draws[(2, 0)][0], d[2])


def test_gaussian_blur_draws_sigma_uniform_in_the_official_range(monkeypatch):
    """MSN / DINO GaussianBlur: with probability p, PIL's blur with radius sigma ~ U[0.1, 2]."""
    from PIL import ImageFilter
    radii = []
    monkeypatch.setattr(ImageFilter, "GaussianBlur", lambda radius: radii.append(radius) or ImageFilter.BLUR)
    img = S.SyntheticImages().load(0)[0]
    torch.manual_seed(0)
    blur = C.GaussianBlur(p=0.5)
    for _ in range(400):
        blur(img)
    assert 150 < len(radii) < 250                                            # applied with p = 0.5
    assert 0.1 <= min(radii) < 0.15 and 1.95 < max(radii) <= 2.0
    assert 0.9 < sum(radii) / len(radii) < 1.2                                # mean of U[0.1, 2]: 1.05


def test_image_files_layouts(tmp_path):
    from PIL import Image
    for c in ("cat", "dog"):
        os.makedirs(tmp_path / "train" / c)
        for i in range(3):
            Image.new("RGB", (8, 8), (i, 0, 0)).save(tmp_path / "train" / c / f"{i}.png")
    ds = C.image_dataset(str(tmp_path))                                     # picks DIR/train
    assert len(ds) == 6 and ds.classes == ["cat", "dog"] and ds.load(4)[1] == 1
    assert C.image_dataset(str(tmp_path), "val") is None
    flat = C.ImageFiles(str(tmp_path / "train" / "cat"))                     # flat folder: one class
    assert len(flat) == 3 and flat.classes == ["all"]
    os.makedirs(tmp_path / "elsewhere")                                      # symlinked class and sub-folder
    os.symlink(tmp_path / "train" / "dog", tmp_path / "elsewhere" / "more")  # (a dataset assembled from links)
    os.symlink(tmp_path / "elsewhere", tmp_path / "train" / "cat" / "linked")
    ds = C.image_dataset(str(tmp_path))
    assert len(ds) == 9 and [label for _, label in ds.samples].count(0) == 6
    os.makedirs(tmp_path / "empty" / "sub")
    with pytest.raises(C.UserError, match="no images"):
        C.ImageFiles(str(tmp_path / "empty"))
    with pytest.raises(C.UserError, match="no such directory"):
        C.ImageFiles(str(tmp_path / "missing"))


def test_parse_args_synthetic_overrides():
    import msn
    a = H.parse_args(msn.Args, ["--data", "synthetic", "--epochs", "3", "--betas", "0.8", "0.9", "--no-resume"])
    assert a.model == "micro" and a.epochs == 3 and a.betas == (0.8, 0.9) and a.resume is False
    b = H.parse_args(msn.Args, ["--data", "/x"])
    assert b.model == "small" and b.epochs == 800 and b.img_size == 224 and b.focal_views == 10


def _gather_worker(rank, world):
    x = (torch.arange(6.0).view(3, 2) + 10 * rank).requires_grad_()
    y = C.all_gather(x)                                                    # (6, 2)
    w = torch.arange(12.0).view(6, 2) * (rank + 1)                          # rank-specific loss
    (y * w).sum().backward()
    m = C.all_gather(x.sum(0)[None]).mean(0)                              # MSN's mean over ranks
    z = C.all_gather(x, grad=False)                                        # CMAE's targets: no autograd
    return y.detach(), x.grad, m.detach(), (z, z.requires_grad)


def test_all_gather_autograd_two_processes():
    (y0, g0, m0, (z0, r0)), (y1, g1, m1, (z1, r1)) = spawn(_gather_worker)
    assert torch.equal(y0, y1) and torch.equal(y0[3:], torch.arange(6.0).view(3, 2) + 10)
    assert torch.equal(z0, y0) and torch.equal(z1, y0) and not (r0 or r1)
    # d(sum_r loss_r)/dx_r = sum over ranks of w_r restricted to rank r's rows = 3 * w_base rows
    w = torch.arange(12.0).view(6, 2)
    assert torch.equal(g0, 3 * w[:3]) and torch.equal(g1, 3 * w[3:])
    # rank 0: x.sum(0) = [6, 9]; rank 1: [36, 39]; mean [21, 24]
    assert torch.equal(m0, m1) and torch.equal(m0, torch.tensor([21.0, 24.0]))


@pytest.mark.parametrize("script", ["msn.py", "cmae.py", "conmim.py", "can.py", "siammae.py", "eval_linear.py",
                                    "eval_video.py", "eval_finetune.py", "benchmarks/data.py", "benchmarks/e2e.py"])
def test_help_of_every_script(script):
    from helpers import run_cli
    r = run_cli(script, "--help")
    assert r.returncode == 0 and "--data" in r.stdout, r.stderr[-500:]


@pytest.mark.parametrize("max_norm", [0.0, 0.5])
def test_optimizer_step_unscales_then_clips_and_returns_the_norm_before_clipping(max_norm):
    """fp16 path on CPU: gradients of a loss scaled by 1024 are unscaled before the norm and the
    clipping; the returned norm is the true one, before clipping; the step uses the clipped gradient."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    x = torch.randn(5, 4)
    loss = (lin(x) ** 2).sum()
    gw, gb = torch.autograd.grad(loss, (lin.weight, lin.bias))
    true = torch.cat([gw.flatten(), gb]).norm()
    run = argparse.Namespace(scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    run.scaler.scale((lin(x) ** 2).sum()).backward()
    norm = C.optimizer_step(run, opt, lin.parameters(), max_norm)
    torch.testing.assert_close(norm, true)
    k = min(1.0, max_norm / (float(true) + 1e-6)) if max_norm else 1.0                 # torch's clip coefficient
    torch.testing.assert_close(lin.weight.detach(), w0 - k * gw)
    torch.testing.assert_close(lin.bias.detach(), b0 - k * gb)


def test_epoch_sampler_reshuffles_every_epoch_and_skips_only_the_resumed_one():
    """One iterator serves the run: each epoch is a new permutation labelled with its epoch; a resume's
    skip applies to its first epoch only."""
    s = C.EpochSampler(range(12), num_replicas=1, rank=0, shuffle=True, seed=0)
    s.batch, s.ipe = 3, 4
    s.set_epoch(0)
    got = list(itertools.islice(iter(s), 36))
    epochs = [[i for i, e in got if e == k] for k in range(3)]
    assert [len(x) for x in epochs] == [12, 12, 12] and all(sorted(x) == list(range(12)) for x in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    s.set_epoch(1)
    s.skip = 5                                                         # resumed after 5 images of epoch 1
    got = list(itertools.islice(iter(s), 7 + 12))
    assert got[:7] == [(i, 1) for i in epochs[1][5:]] and [i for i, _ in got[7:]] == epochs[2]



def test_the_training_loader_needs_one_full_batch_per_process():
    """A dataset of exactly one batch trains (one batch an epoch, shuffled, labelled with its epoch);
    one image fewer is a one-line error naming the sizes, not an epoch of zero steps."""
    class Keys(torch.utils.data.Dataset):
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, key):
            return torch.tensor(key)
    loader = C.make_loader(Keys(8), 8, workers=0, seed=0)
    batches = list(loader)
    assert len(batches) == 1 and sorted(batches[0][:, 0].tolist()) == list(range(8)) and (batches[0][:, 1] == 0).all()
    with pytest.raises(C.UserError, match="dataset has 7 images: too few for --batch-size 8 x 1 process"):
        C.make_loader(Keys(7), 8, workers=0, seed=0)
    order = torch.cat([b[:, 0] for b in C.make_loader(Keys(64), 8, workers=0, seed=0)])   # an image folder
    assert sorted(order.tolist()) == list(range(64)) and order.tolist() != list(range(64))  # is class-sorted


def test_frame_order_compares_digit_runs_as_numbers():
    names = ["f_10.jpg", "f_2.jpg", "f_1.jpg", "f_02b.jpg", "g.jpg", "f_1\u00b23.jpg", "9.jpg", "10.jpg"]
    assert sorted(names, key=C.frame_order) == ["9.jpg", "10.jpg", "f_1.jpg", "f_1\u00b23.jpg", "f_2.jpg", "f_02b.jpg",
                                                "f_10.jpg", "g.jpg"]   # a superscript 2 is text: int() of it raised


def test_to_uint8_gives_three_channels_for_any_pil_mode():
    from PIL import Image
    for mode in ("L", "RGBA", "P", "CMYK", "RGB"):
        x = C.to_uint8(Image.new(mode, (5, 4)))
        assert x.shape == (3, 4, 5) and x.dtype == torch.uint8

# ---------------------------------------------------------------------------------------------
# Run plumbing, one rule at a time (each broken on purpose once: every test below failed then)
# ---------------------------------------------------------------------------------------------
def test_normalize_and_micro_batches():
    x = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    mean, std = torch.tensor(C.IMAGENET_MEAN).view(3, 1, 1), torch.tensor(C.IMAGENET_STD).view(3, 1, 1)
    torch.testing.assert_close(C.normalize(x), (x.float() / 255 - mean) / std)
    torch.testing.assert_close(C.normalize(x.float() / 255), (x.float() / 255 - mean) / std)
    assert list(C.micro_batches(10, 4)) == [slice(0, 4), slice(4, 8), slice(8, 10)]     # the tail is a slice too


def test_unreadable_images_stop_the_run_above_max_unreadable(monkeypatch):
    monkeypatch.setattr(C, "bad_reads", lambda dataset: 11)
    with pytest.raises(C.UserError, match="11 of 1000 images read in this epoch were unreadable"):
        C.check_unreadable(None, 1000, 0, 0.01)
    assert C.check_unreadable(None, 1000, 1, 0.01) == 10                            # 10 of 1000: on
    assert C.check_unreadable(None, 999, 0, 0.01) == 11                             # judged from 1000 reads
    with pytest.raises(C.UserError):
        C.check_unreadable(None, 999, 0, 0.01, final=True)                          # and at the epoch's end


def test_control_saves_after_save_every_minutes():
    """Half a minute: not due at 29 s, due at 31 s (minutes, not seconds), then the clock restarts; --keep-every 2:
    the encoder kept at even steps."""
    args = argparse.Namespace(save_every=0, stop_step=0, save_every_minutes=0.5, keep_every=2)
    ctl = H.Control(args, torch.device("cpu"))
    ctl.t -= 29
    assert ctl.poll(1) == (False, False, False)
    ctl.t -= 2
    assert ctl.poll(2) == (True, True, False)
    assert ctl.poll(3) == (False, False, False)


def _control_worker(rank, world):
    args = argparse.Namespace(save_every=0, stop_step=0, save_every_minutes=0, keep_every=0)
    ctl = H.Control(args, torch.device("cpu"))
    if rank == 0:
        ctl.stop("signal SIGTERM")                                 # only rank 0 got the signal
    return [ctl.poll(step) for step in (9, 10)]


def test_control_stops_every_rank_when_one_got_the_signal():
    """Signals reach ranks at different times (or one rank only): the stop is agreed at the next multiple
    of sync_every, on every rank at the same step, since saving is collective."""
    assert spawn(_control_worker) == [[(False, False, False), (True, False, True)]] * 2


def test_a_resume_restores_the_fp16_loss_scale(tmp_path):
    """fp16: the GradScaler's scale and growth tracker go into the checkpoint and come back on resume (a
    resumed run restarting at 65536 would skip steps until the scale fell again)."""
    args = msn_args(tmp_path)

    def run_and_model(scale, tracker):
        run = argparse.Namespace(ckpt=str(tmp_path / "checkpoint.pth"), out=str(tmp_path),
                                 scaler=torch.amp.GradScaler("cpu"),
                                 guard=H.Guard(torch.device("cpu"), "fp16", str(tmp_path / "checkpoint.pth")))
        run.scaler.load_state_dict({**run.scaler.state_dict(), "scale": scale, "_growth_tracker": tracker})
        model = torch.nn.Linear(2, 2)
        model.config = {}
        return run, model, torch.optim.AdamW(model.parameters())
    run, model, opt = run_and_model(256.0, 7)
    C.save_run(run, "msn", args, 0, 5, model, model, opt)
    run2, model2, opt2 = run_and_model(65536.0, 0)
    assert H.resume_run(run2, "msn", args, model2, opt2) == 5
    state = run2.scaler.state_dict()
    assert (state["scale"], state["_growth_tracker"]) == (256.0, 7)


def test_control_stops_on_a_signal_of_its_own_run_only():
    """A preemption signal stops the run that got it (save, then stop); a new run in the same process
    (a sweep calling train() again, a notebook after Ctrl-C) starts without it."""
    args = argparse.Namespace(save_every=0, stop_step=0, save_every_minutes=0, keep_every=0)
    ctl = H.Control(args, torch.device("cpu"))
    ctl.stop("signal SIGTERM")                                                      # what the handler does
    ctl.stop("the --minutes cap")                                                   # the first reason stays
    assert ctl.poll(1) == (True, False, True) and ctl.signal == "signal SIGTERM"
    new = H.Control(args, torch.device("cpu"))
    assert new.poll(2) == (False, False, False) and H.Control.current is new


def test_a_second_ctrl_c_a_second_after_the_first_stops_at_once(monkeypatch):
    """Signals are remembered (the run finishes its step and writes), except a second Ctrl-C more than a
    second after an earlier one, which interrupts at once; not under torchrun, whose agent forwards
    its own copy of the signal to every rank."""
    import signal

    def remembered(name):
        try:
            signal.raise_signal(getattr(signal, name))
        except KeyboardInterrupt:
            pytest.fail(f"{name} interrupted at once")
        assert ctl.asked[-1][0] == name and ctl.signal == "signal SIGINT"          # the first one stops the run

    old = {n: signal.getsignal(getattr(signal, n)) for n in C.STOP_SIGNALS}
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    try:
        H.catch_preemption()
        with pytest.raises(H.Preempted):                            # before a run: nothing to save, stop at once
            signal.raise_signal(signal.SIGTERM)
        ctl = H.Control(argparse.Namespace(save_every=0, stop_step=0, save_every_minutes=0), torch.device("cpu"))
        remembered("SIGINT")
        remembered("SIGINT")                                        # a bounce within the second
        ctl.asked[:] = [(n, t - 2) for n, t in ctl.asked]           # two seconds ago
        remembered("SIGTERM")                                       # another signal
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        monkeypatch.setenv("LOCAL_RANK", "0")
        remembered("SIGINT")                                        # torchrun's forwarded copy
    finally:
        for n, h in old.items():
            signal.signal(getattr(signal, n), h)
        H.Control.current = None


def _run(tmp_path):
    ckpt = str(tmp_path / "checkpoint.pth")
    return argparse.Namespace(ckpt=ckpt, out=str(tmp_path), scaler=torch.amp.GradScaler("cpu", enabled=False),
                              guard=H.Guard(torch.device("cpu"), "fp32", ckpt))


class _Payload:
    """Unpickling this calls a function: what a malicious or just foreign pickle can do."""
    calls = []

    def __reduce__(self):
        return (_Payload.calls.append, ("code ran",))


def test_checkpoints_are_read_without_running_pickled_code(tmp_path):
    """torch.load(weights_only=True): a file that would call a function when unpickled (a downloaded
    "checkpoint") is a one-line error, and the function never runs."""
    path = str(tmp_path / "checkpoint.pth")
    torch.save({"method": "can", "encoder": {}, "extra": _Payload()}, path)
    with pytest.raises(C.UserError, match="is not a readable checkpoint"):
        C.load_checkpoint(path, "can")
    assert _Payload.calls == []


def test_save_image_grid_writes_each_row_unnormalised(tmp_path):
    """The reconstruction pictures: one row per tensor, its images side by side (2 px padding), tiles
    upscaled (nearest) to >= 64 px, a 200 px label column on the left, pixels = the ImageNet-normalised
    input mapped back to [0, 1] (clamped), written by rank 0."""
    from PIL import Image
    g = torch.Generator().manual_seed(0)
    imgs = [torch.rand(3, 3, 4, 4, generator=g) for _ in range(2)]              # 2 rows of 3 images
    imgs[1][0, 0, 0, 0] = 1.5                                                   # out of range: clamped
    rows = [C.normalize(x).requires_grad_() for x in imgs]
    C.save_image_grid(str(tmp_path / "grid.png"), rows, ["first", "second"])
    png = torch.from_numpy(np.array(Image.open(tmp_path / "grid.png").convert("RGB"))).permute(2, 0, 1).float() / 255
    k, t = 16, 64 + 2                                                           # 4 px -> 64 px, tile pitch
    assert png.shape == (3, 2 * t + 2, 200 + 3 * t + 2)
    for r in range(2):
        for c in range(3):
            cell = png[:, 2 + t * r:2 + t * r + 64, 200 + 2 + t * c:200 + 2 + t * c + 64]
            want = imgs[r][c].clamp(0, 1).repeat_interleave(k, 1).repeat_interleave(k, 2)
            torch.testing.assert_close(cell, want, atol=1 / 255, rtol=0)
    assert (png[:, :, :200] < 0.5).any()                                        # the labels are drawn


def test_save_run_never_writes_non_finite_weights(tmp_path):
    run, model = _run(tmp_path), torch.nn.Linear(2, 2)
    args = H.RunArgs()
    model.config = {}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    C.save_run(run, "can", args, 0, 1, model, model, opt)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(C.UserError, match="non-finite weights at step 2: not written"):
        C.save_run(run, "can", args, 0, 2, model, model, opt)
    assert C.load_checkpoint(run.ckpt)["step"] == 1


def test_resume_restores_this_ranks_rng(tmp_path, monkeypatch):
    run, model = _run(tmp_path), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    states = []
    for seed in (1, 2):                                                             # rank 0's, rank 1's
        torch.manual_seed(seed)
        states.append(C.rng_state())
    C.save_checkpoint(run.ckpt, {"method": "can", "encoder": {}, "args": {"batch_size": 8}, "epoch": 0, "step": 10,
                                 "model": model.state_dict(), "optimizer": opt.state_dict(),
                                 "scaler": run.scaler.state_dict(), "rng": states})
    monkeypatch.setattr(C, "rank", lambda: 1)
    args = argparse.Namespace(resume=True, batch_size=8)
    assert H.resume_run(run, "can", args, model, opt) == 10
    drawn = torch.rand(3)
    torch.manual_seed(2)
    assert torch.equal(drawn, torch.rand(3))


def _init_worker(rank, world, out):
    os.environ["WORLD_SIZE"] = str(world)                                           # as torchrun sets it
    args = msn_args(f"{out}/{rank}", seed=3, device="cpu")   # gloo ranks on CPU, also on a 1-GPU host
    H.setup(args, "msn")
    return torch.cat([p.flatten() for p in msn.MSN(args).parameters()])


def test_setup_seeds_every_rank_alike_for_the_same_initial_weights(tmp_path):
    """DDP broadcasts the online network from rank 0, but not what is built beside it (MSN's EMA target
    is a copy made before DDP): every rank must build the same weights."""
    w0, w1 = spawn(_init_worker, str(tmp_path))
    assert torch.equal(w0, w1)


def test_each_log_line_reports_the_data_wait_of_its_own_interval(tmp_path):
    run = _run(tmp_path)
    args = argparse.Namespace(batch_size=4, log_every=2, epochs=1, stop_epoch=0, stop_step=0)
    log = C.Logger(run, args, total_steps=10, start_step=0, ipe=10)
    log.step(2, 0, {"loss": torch.tensor(1.0)})
    assert log.step(3, 0, {"loss": torch.tensor(1.0)}, wait=1e9) is None           # a long wait at step 3
    assert log.step(4, 0, {"loss": torch.tensor(1.0)})["data_wait"] == 1.0          # capped at the interval
    assert log.step(6, 0, {"loss": torch.tensor(1.0)})["data_wait"] == 0.0          # not carried over


@pytest.mark.parametrize("script", ["msn", "cmae", "conmim", "can", "siammae", "eval_linear", "eval_finetune",
                                    "eval_video", "eval_correspondence"])
def test_every_flag_has_help_with_its_default_in_a_group(script, capsys):
    """--help: every flag has a help line that states its default (or says what decides it), flags are
    grouped (data first), and a method's help ends with the values --data synthetic swaps in."""
    import importlib
    cls = importlib.import_module(script).Args
    with pytest.raises(SystemExit):
        H.parse_args(cls, ["--help"])
    out = capsys.readouterr().out
    assert "\ndata:\n" in out and "run control" in out or script.startswith("eval_")
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        block = out.split("\n  " + flag, 1)[1].split("\n  --", 1)[0]
        assert "default" in block or "required" in block, (flag, block)
        assert len(block.replace("(default:", "").split()) > 3, (flag, block)          # more than a bare default
    if hasattr(cls, "SYNTHETIC"):
        assert "--data synthetic: a CPU-sized config replaces these defaults" in out


def test_progress_lines_and_the_first_training_step_and_the_closing_line(tmp_path, capsys):
    """A long phase says i/total with an ETA and its time (every=0: every step); a run's first step is a
    console line before --log-every is reached, not a log.jsonl record; `python method.py` ends with
    'done in N s' and the files it wrote."""
    import json
    import can
    from helpers import run_cli
    from test_can import tiny_args
    import eval_linear as E
    p = E.Progress("things", 3, every=0)
    for _ in range(3):
        p.step()
    p.done()
    out = capsys.readouterr().out
    assert "things: 1/3 (33%)" in out and "things: 2/3 (67%)" in out and "things: done in" in out
    can.train(tiny_args(tmp_path / "run", epochs=1, steps_per_epoch=3, log_every=50))
    out = capsys.readouterr().out
    assert "ep 0 step 1/3 " in out and "ep 0 step 3/3 " in out and "step 2/3" not in out
    assert [json.loads(ln)["step"] for ln in open(tmp_path / "run" / "log.jsonl")] == [3]
    r = run_cli("can.py", "--data", "synthetic", "--model", "nano", "--patch-size", "4", "--img-size", "16",
                "--batch-size", "8", "--epochs", "1", "--steps-per-epoch", "1", "--warmup-epochs", "0",
                "--decoder-dim", "32", "--decoder-depth", "1", "--decoder-heads", "2", "--proj-hidden", "32",
                "--proj-dim", "16", "--no-knn", "--workers", "0", "--output-dir", str(tmp_path / "cli"))
    last = r.stdout.strip().splitlines()[-1]
    assert r.returncode == 0 and last.startswith("done "
                                                 "in ") and "checkpoint.pth" in last and str(tmp_path / "cli") in last


@pytest.mark.parametrize("method", ["msn", "cmae", "conmim", "can", "siammae"])
def test_small_recipes_follow_the_stated_rules_from_the_official_defaults(method):
    """--preset NAME / --data synthetic: lr linear in the batch per image (blr recipes keep blr) times the
    preset's swept lr_factor, warm-up the same fraction of the run, the EMA horizon capped at SHORT_EMA of
    the run, MSN's prototypes in their official ratio to the batch, view geometry x img / 224, weight-decay
    schedules untouched; a flag given on the command line wins and enters the rules (--epochs keeps the
    warm-up's share); an unknown preset is refused."""
    import importlib
    M = importlib.import_module(method)
    d = {f.name: f.default for f in dataclasses.fields(M.Args)}
    for name, p in recipes.presets(M.Args).items():
        raw = {**M.Args.PRESETS, "synthetic": M.Args.SYNTHETIC}[name]
        k, f = p["batch_size"] / d["batch_size"], raw.get("lr_factor", 1.0)
        assert "lr_factor" not in p                                          # a rule's input, not a flag
        if d.get("lr") is not None:
            assert p["lr"] == pytest.approx(d["lr"] * k * f, rel=1e-3) and "blr" not in p
            assert p["min_lr"] == pytest.approx(d["min_lr"] * k * f, rel=1e-3)
        else:
            assert "lr" not in p and p["blr"] == pytest.approx(d["blr"] * f, rel=1e-3)   # lr = blr x batch / 256
        if d.get("start_lr"):
            assert p["start_lr"] == pytest.approx(d["start_lr"] * k * f, rel=1e-3)
        assert p["warmup_epochs"] == pytest.approx(d["warmup_epochs"] * p["epochs"] / d["epochs"], rel=1e-3)
        assert p.get("ema_horizon") == (recipes.SHORT_EMA if "ema" in d else None)
        if "num_prototypes" in d and "num_prototypes" not in raw:
            assert p["num_prototypes"] == d["num_prototypes"] * k                # 1024 at 1024 -> 256 at 256
        for g in ("ema", "weight_decay", "final_weight_decay", "mask_ratio", "tau"):
            assert g not in raw, f"{name} overrides {g}: the rules keep it"
        if "focal_size" in d:
            assert p["focal_size"] == 12                                  # 96 x 32 / 224 = 13.7 -> patch 4 multiple
        if "master_size" in d:
            assert p["master_size"] == 37                                 # 256 x 32 / 224 = 36.6
        if "mask_unit" in d:
            assert p["mask_unit"] == 1                                    # 2 x 16 px = 32 px -> 4.6 px: 1 patch of 4
        argv = ["--data", "x", "--preset", name] if name != "synthetic" else ["--data", "synthetic"]
        args = H.parse_args(M.Args, argv)
        assert all(getattr(args, g) == (tuple(v) if isinstance(v, list) else v) for g, v in p.items())
        assert args.preset == name
    for name in M.Args.PRESETS:
        args = H.parse_args(M.Args, ["--data", "x", "--preset", name, "--batch-size", "7", "--warmup-epochs", "0"])
        assert args.batch_size == 7 and args.warmup_epochs == 0
        p = recipes.presets(M.Args)[name]
        args = H.parse_args(M.Args, ["--data", "x", "--preset", name, "--epochs", str(2 * p["epochs"])])
        assert args.warmup_epochs == pytest.approx(2 * p["warmup_epochs"], rel=1e-3)   # the same share of the run
        if d.get("lr") is not None:                                             # --batch-size enters the lr rule
            args = H.parse_args(M.Args, ["--data", "x", "--preset", name, "--batch-size", str(2 * p["batch_size"])])
            assert args.lr == pytest.approx(2 * p["lr"], rel=1e-3)
    with pytest.raises(SystemExit):
        H.parse_args(M.Args, ["--data", "x", "--preset", "nope"])


@pytest.mark.parametrize("method", ["msn", "cmae", "conmim"])
def test_ema_start_caps_the_horizon_at_a_share_of_the_run(method):
    """1 / (1 - m) <= horizon x steps: official 0.996 (250 steps) kept in a run of 1M steps, lowered in 700. Each EMA
    method has its own copy beside its EMA schedule: the three copies give the same numbers."""
    import importlib
    ema_start = importlib.import_module(method).ema_start
    assert ema_start(0.996, 10 ** 6, 0.02) == 0.996 and ema_start(0.996, 700, 0.0) == 0.996
    m = ema_start(0.996, 700, 0.02)
    assert 1 / (1 - m) == pytest.approx(14) and ema_start(0.996, 10, 0.02) == 0.0   # below one step: the online net
    import msn
    for m0, steps, h in ((0.996, 780, 0.02), (0.99, 5000, 0.02), (0.9, 100, 0.5), (0.996, 3, 0.0)):
        assert ema_start(m0, steps, h) == msn.ema_start(m0, steps, h)


@pytest.mark.parametrize("method, preset, images, steps, first", [
    ("msn", "small", 50_000, 780, 0.9359), ("cmae", "small", 50_000, 1755, 0.9715), ("conmim", "small", 50_000, 1170,
                                                                                     0.9573),
    ("msn", "gpu", 50_000, 485, 0.8969), ("cmae", "gpu", 50_000, 1552, 0.9678), ("conmim", "gpu", 50_000, 1552,
                                                                                 0.9678)])
def test_the_short_run_ema_horizon_is_two_percent_of_the_run_as_numbers(method, preset, images, steps, first):
    """The EMA rule's values written out, not read back from the constant they come from: the horizon 1 / (1 - m)
    is 2% of the run, so each preset's first momentum on CIFAR-10's 50,000 training images (full batches a pass)
    is the number docs/RESULTS.md states (MSN 0.936, CMAE 0.9715, ConMIM 0.957 at --preset small)."""
    import importlib
    cls = importlib.import_module(method).Args
    a = H.parse_args(cls, ["--data", "cifar10", "--preset", preset])
    assert a.ema_horizon == 0.02 and a.epochs * (images // a.batch_size) == steps
    official = cls.ema[0] if isinstance(cls.ema, tuple) else cls.ema
    assert official == 0.996 and importlib.import_module(method).ema_start(official, steps, a.ema_horizon) == \
        pytest.approx(first, abs=5e-5)


@pytest.mark.parametrize("method, preset, peak, start, end", [
    ("msn", "small", 1e-3, 2e-4, 1e-6), ("msn", "gpu", 2e-3, 4e-4, 2e-6),             # 1e-3 @ 1024 x batch x 4
    ("cmae", "small", 6e-4, None, 0.0), ("cmae", "gpu", 1.2e-3, None, 0.0),           # blr 1.5e-4 x 4 x batch / 256
    ("conmim", "small", 9.375e-5, None, 1.25e-6), ("conmim", "gpu", 1.875e-4, None, 2.5e-6),   # 7.5e-4 @ 2048 x batch
    ("can", "small", 6e-4, None, 0.0), ("can", "gpu", 1.2e-3, None, 0.0),             # blr 1.5e-4 x 4 x batch / 256
    ("siammae", "davis", 1e-3, None, 0.0)])                                            # blr 1.5e-4 x 213.33 x 8 / 256
def test_each_presets_lr_as_numbers(method, preset, peak, start, end):
    """The lr each preset trains at, written out (not re-derived from the rules' own constants): a slipped sweep factor
    (SiamMAE's 213.33 as 21.333, MSN's gpu x4 as x1) changes the number docs/RESULTS.md and the README state.
    ConMIM's bias table trains at 300x its lr in both short-run presets."""
    import importlib
    a = H.parse_args(importlib.import_module(method).Args, ["--data", "x", "--preset", preset])
    assert (a.lr if a.lr else a.blr * a.batch_size / 256) == pytest.approx(peak, rel=1e-6)
    assert getattr(a, "start_lr", None) == (None if start is None else pytest.approx(start, rel=1e-6))
    assert a.min_lr == pytest.approx(end, rel=1e-6, abs=1e-12)
    assert getattr(a, "rel_pos_lr", None) == (300 if method == "conmim" else None)
