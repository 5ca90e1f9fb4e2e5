"""siammae.py: loss, mask count, f1 gets gradient but no loss, decoder variants, cross-attention
vs a written-out attention, model-level DDP equivalence, video folders, frame pairs, end to end."""
import json
import math
import os

import numpy as np
import pytest
import torch

import common as C
import synthetic as S
import siammae
from ddp import spawn
from helpers import ROOT, exact_resume, one_line_error, run_cli


def tiny_args(tmp="/tmp/unused", **kw):
    base = dict(data="synthetic", output_dir=str(tmp), model="nano", patch_size=4, img_size=16, epochs=4,
                steps_per_epoch=2, batch_size=4, repeated_sampling=2, warmup_epochs=1, decoder_dim=32,
                decoder_depth=2, decoder_heads=2, gap=(2, 8), workers=0, log_every=1)
    base.update(kw)
    return siammae.Args(**base)


def test_loss_matches_naive():
    B, N, P = 2, 5, 4
    pred, tgt = torch.randn(B, N, P, dtype=torch.float64), torch.randn(B, N, P, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.float64)
    ref = sum(((pred[b, n] - tgt[b, n]) ** 2).mean() for b in range(B) for n in range(N) if mask[b, n]) / mask.sum()
    torch.testing.assert_close(siammae.siammae_loss(pred, tgt, mask), ref)


@pytest.mark.parametrize("grid,masked", [(14, 187), (8, 61), (4, 16)])
def test_exact_95_percent_mask_count(grid, masked):
    _, _, mask = siammae.random_masking(3, grid, 0.95)
    assert (mask.sum(1) == masked).all() and masked == grid * grid - int(grid * grid * 0.05)


@pytest.mark.parametrize("kind", ["cross-self", "cross", "joint"])
def test_decoder_variants_shapes_and_f1_gets_gradient_without_loss(kind):
    model = siammae.SiamMAE(tiny_args(decoder=kind))
    f1 = torch.randn(3, 3, 16, 16, requires_grad=True)
    f2 = torch.randn(3, 3, 16, 16)
    ids_keep, ids_restore, mask = siammae.random_masking(3, 4, 0.75)
    pred = model(f1, f2, ids_keep, ids_restore)
    assert pred.shape == (3, 16, 48)                             # f2's patches only: f1 has no loss term
    loss = siammae.siammae_loss(pred, siammae.norm_pix(siammae.patchify(f2, 4)), mask)
    loss.backward()
    assert f1.grad.abs().sum() > 0                               # f1 shapes the prediction (cross-attention)
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
    if kind == "cross":
        assert all(b.attn is None for b in model.blocks)


def test_cross_attention_matches_written_out_attention():
    ca = siammae.CrossAttention(8, 2)
    x, ctx = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    out = ca(x, ctx)
    q = x @ ca.q.weight.T + ca.q.bias
    kv = ctx @ ca.kv.weight.T + ca.kv.bias
    k, v = kv[..., :8], kv[..., 8:]
    heads = []
    for h in range(2):
        sl = slice(4 * h, 4 * h + 4)
        att = torch.softmax(q[..., sl] @ k[..., sl].transpose(1, 2) / math.sqrt(4), dim=-1)   # (B, 3, 5)
        heads.append(att @ v[..., sl])
    ref = torch.cat(heads, -1) @ ca.proj.weight.T + ca.proj.bias
    torch.testing.assert_close(out, ref)


def _ddp_worker(rank, world, state, f1, f2, ids_keep, ids_restore, mask):
    model = siammae.SiamMAE(tiny_args())
    model.load_state_dict(state)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    b = f1.shape[0] // world
    sl = slice(rank * b, (rank + 1) * b)
    pred = ddp(f1[sl], f2[sl], ids_keep[sl], ids_restore[sl])
    loss = siammae.siammae_loss(pred, siammae.norm_pix(siammae.patchify(f2[sl], 4)), mask[sl])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_ddp_two_processes_equal_one_process():
    model = siammae.SiamMAE(tiny_args())
    f1, f2 = torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16)
    ids_keep, ids_restore, mask = siammae.random_masking(4, 4, 0.75)
    loss = siammae.siammae_loss(model(f1, f2, ids_keep, ids_restore), siammae.norm_pix(siammae.patchify(f2, 4)), mask)
    loss.backward()
    (l0, g0), (l1, g1) = spawn(_ddp_worker, model.state_dict(), f1, f2, ids_keep, ids_restore, mask)
    torch.testing.assert_close((l0 + l1) / 2, loss.detach())
    for n, p in model.named_parameters():                        # DDP averaged grads == full-batch grads
        torch.testing.assert_close(g0[n], p.grad, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(g1[n], p.grad, atol=1e-6, rtol=1e-4)


def test_video_folders_nested_layout_skips_and_errors(tmp_path, capsys):
    from PIL import Image
    root = tmp_path / "JPEGImages" / "480p"
    for name, n in (("bear", 5), ("car", 2), ("single", 1)):
        os.makedirs(root / name)
        for t in range(n):
            Image.new("RGB", (20, 20), (10 * t, 0, 0)).save(root / name / f"{t:05d}.jpg")
    os.makedirs(root / "broken")                              # first frame: a PNG cut in half (it opens, verify fails)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 20, 3),
                                                      np.uint8)).save(root / "broken" / "00000.png")
    (root / "broken" / "00000.png").write_bytes((root / "broken" / "00000.png").read_bytes()[:600])   # then 2 that
                                                                                                     # do not open
    for t in range(1, 3):
        (root / "broken" / f"{t:05d}.jpg").write_bytes(b"nope")
    os.makedirs(tmp_path / "elsewhere" / "fish")                   # a video folder that is a symlink
    for t in range(4):
        Image.new("RGB", (20, 20)).save(tmp_path / "elsewhere" / "fish" / f"{t:05d}.jpg")
    os.symlink(tmp_path / "elsewhere" / "fish", root / "fish")
    ds = siammae.VideoFolders(str(tmp_path / "JPEGImages"))
    assert [len(v) for v in ds.videos] == [5, 2, 4]              # 2 frames: the fewest a pair needs
    assert "skipped 1 video(s) with < 2 frames and 1 with an unreadable first frame" in capsys.readouterr().out
    assert ds.videos[0].load(4).getpixel((0, 0))[0] == 40        # frames sorted by name
    for t in range(12):                                           # unpadded numbers (ffmpeg's %d): by number
        Image.new("RGB", (20, 20), (10 * t, 0, 0)).save(tmp_path / "elsewhere" / f"frame_{t}.jpg")
    (video,) = siammae.VideoFolders(str(tmp_path / "elsewhere")).videos[:1]
    assert [os.path.basename(p) for p in video.paths] == [f"frame_{t}.jpg" for t in range(12)]
    assert video.load(10).getpixel((0, 0))[0] == 100
    with pytest.raises(C.UserError, match="no usable videos"):
        siammae.VideoFolders(str(root / "single"))
    assert "skipped 1 video(s) with < 2 frames and 0 with" in capsys.readouterr().out


def test_an_unreadable_frame_is_replaced_by_its_nearest_and_its_video_counted(tmp_path, capsys):
    """A frame that cannot be read mid-run is replaced by the nearest readable frame of its video (t+1
    first), warned once, and its video counted once however often it is met; train() stops at the
    epoch's end when more than --max-unreadable of the videos read had one (one line, checkpoint kept)."""
    from PIL import Image

    def videos(root, bad):
        for v in range(4):
            os.makedirs(root / f"v{v}")
            for t in range(6):
                Image.new("RGB", (20, 20), (10 * t, 20 * v, 0)).save(root / f"v{v}" / f"{t:05d}.png")
        for v, t in bad:
            (root / f"v{v}" / f"{t:05d}.png").write_bytes(b"cut off")
        return str(root)
    ds = siammae.VideoFolders(videos(tmp_path / "d", ((1, 2), (1, 4), (2, 5))))
    assert [ds.videos[1].load(t).getpixel((0, 0))[0] for t in range(6)] == [0, 10, 30, 30, 50, 50]
    assert ds.videos[2].load(5).getpixel((0, 0))[0] == 40                   # the last frame: t - 1
    assert C.bad_reads(ds) == 2 and capsys.readouterr().err.count("cannot read frame") == 3
    ds.videos[1].load(2)
    assert C.bad_reads(ds) == 2 and "cannot read frame" not in capsys.readouterr().err
    with pytest.raises(C.UserError, match="cannot read frame"):
        siammae.FrameFolder(ds.videos[1].paths).load(2)                     # outside training: an error
    every_pair_hits_one = [(1, t) for t in range(1, 5)] + [(2, t) for t in range(1, 6)]   # any gap 1-3
    kw = dict(data=videos(tmp_path / "t", every_pair_hits_one), batch_size=4, epochs=4, steps_per_epoch=0,
              repeated_sampling=2, gap=(1, 3))
    siammae.train(tiny_args(tmp_path / "ok", max_unreadable=0.5, **kw))    # 2 of 4 videos: runs on
    with pytest.raises(C.UserError, match=r"2 of 4 videos read in this epoch were unreadable \(> --max-unreadable "
                                          r"0.25\)"):
        siammae.train(tiny_args(tmp_path / "stop", max_unreadable=0.25, **kw))
    assert not (tmp_path / "stop" / "checkpoint.pth").exists()


def test_frame_pair_gap_crop_and_flip(monkeypatch):
    from torchvision import transforms as T
    a = tiny_args(img_size=16, gap=(2, 5), crop_scale=(0.4, 0.9))
    crops, get_params = [], T.RandomResizedCrop.get_params
    monkeypatch.setattr(T.RandomResizedCrop, "get_params", lambda *p: crops.append(p[1:]) or get_params(*p))

    class Static:                                                  # identical frames: f1 must equal f2
        def __len__(self):
            return 10

        def load(self, t):
            return S.SyntheticImages().load(1)[0]

    out = siammae.FramePair(a)(Static())
    assert out.shape == (2, 2, 3, 16, 16) and out.dtype == torch.uint8
    assert torch.equal(out[:, 0], out[:, 1])                      # same crop and flip on both frames
    assert crops == [((0.4, 0.9), (3 / 4, 4 / 3))] * 2             # one crop per pair: --crop-scale, the usual ratios
    monkeypatch.setattr(T.RandomResizedCrop, "get_params", lambda img, *p: (0, 0, img.height, img.width))
    whole = C.to_uint8(Static().load(0).resize((16, 16), resample=2))             # the whole frame, bilinear
    torch.manual_seed(0)
    pairs = torch.cat([siammae.FramePair(a)(Static()) for _ in range(8)])        # (16, 2, 3, 16, 16)
    flipped = [torch.equal(p, torch.stack([whole.flip(-1)] * 2)) for p in pairs]
    assert sum(flipped) + sum(torch.equal(p, torch.stack([whole] * 2)) for p in pairs) == 16
    assert 0 < sum(flipped) < 16                                       # flipped with probability 1/2
    seen = []

    class Counter(Static):
        def load(self, t):
            seen.append(t)
            return super().load(t)

    torch.manual_seed(0)
    for _ in range(30):
        siammae.FramePair(a)(Counter())
    gaps = [seen[i + 1] - seen[i] for i in range(0, len(seen), 2)]
    assert set(gaps) == {2, 3, 4, 5} and max(seen) <= 9                 # U{gap_min..gap_max}, inside the video

    class Short(Counter):                                          # 2 frames: the gap is clipped to 1
        def __len__(self):
            return 2
    seen.clear()
    siammae.FramePair(a)(Short())
    assert seen == [0, 1, 0, 1]
    clip = S.SyntheticClip(0)                               # synthetic clips move, with object masks
    assert clip.load(0).tobytes() != clip.load(5).tobytes() and clip.mask(0).max() >= 1


def test_end_to_end_resume_png(tmp_path):
    full, _ = exact_resume(siammae.train, tiny_args, tmp_path, "siammae", ("model",))
    assert len(list((tmp_path / "full").glob("pairs_ep0001_step*.png"))) == 1             # the log's ep 1


def test_bad_input(tmp_path):
    tiny = ["--model", "nano", "--patch-size", "4", "--img-size", "16", "--batch-size", "2", "--epochs", "2",
            "--warmup-epochs", "0",
            "--steps-per-epoch", "1", "--decoder-dim", "32", "--decoder-heads", "2"]
    one_line_error(run_cli("siammae.py", "--data", str(tmp_path / "nope"), *tiny), "no such directory")
    os.makedirs(tmp_path / "empty" / "v1")
    one_line_error(run_cli("siammae.py", "--data", str(tmp_path / "empty"), *tiny), "no usable videos")
    one_line_error(run_cli("siammae.py", "--data", "synthetic", *tiny, "--decoder", "foo"), "--decoder must be")


def test_epochs_and_stop_epoch_count_in_their_units(tmp_path):
    """--epochs counts effective epochs (passes x --repeated-sampling), --stop-epoch counts passes:
    either out of step with the other is a one-line error before training."""
    with pytest.raises(C.UserError, match="make it a multiple of it"):
        siammae.train(tiny_args(tmp_path, epochs=3))
    with pytest.raises(C.UserError, match="--stop-epoch 3 counts passes: this run has 2"):
        siammae.train(tiny_args(tmp_path, stop_epoch=3))


@pytest.mark.parametrize("edition", ["2016", "2017"])
def test_a_davis_root_trains_on_its_train_videos_only(tmp_path, edition):
    """--data <DAVIS root>: the videos of its train list (2016: "frame mask" lines; 2017: names), never the
    val videos nor the annotation PNGs (a plain walk would take both as videos), the same videos as
    eval_video reads from that list; a listed video without a folder is one line."""
    from PIL import Image
    root = tmp_path / "DAVIS"
    for v in ("a", "b", "c"):
        for sub in ("JPEGImages", "Annotations"):
            os.makedirs(root / sub / "480p" / v)
        for t in range(3):
            Image.new("RGB", (20, 12), (t, 0, 0)).save(root / "JPEGImages/480p" / v / f"{t:05d}.jpg")
            m = Image.new("L", (20, 12))
            m.paste(255 if edition == "2016" else 1, (4, 4, 10, 10))           # the object (2017: id 1)
            m.save(root / "Annotations/480p" / v / f"{t:05d}.png")
    os.makedirs(root / "ImageSets" / ("480p" if edition == "2016" else "2017"))
    lst = root / "ImageSets" / ("480p" if edition == "2016" else "2017") / "train.txt"
    lst.write_text("".join(f"/JPEGImages/480p/{v}/{t:05d}.jpg /Annotations/480p/{v}/{t:05d}.png\n"
                           for v in ("c", "a") for t in range(3)) if edition == "2016" else "c\na\n")
    ds = siammae.video_dataset(str(root))
    assert [os.path.dirname(v.paths[0]) for v in ds.videos] == [str(root / "JPEGImages/480p" / v) for v in ("a", "c")]
    assert all(p.endswith(".jpg") for v in ds.videos for p in v.paths) and len(ds.videos[0]) == 3
    import eval_video                                   # its own parser of the same lists must agree
    assert sorted((v, len(f)) for v, f, _ in eval_video.davis_videos(str(root), "train")) == [("a", 3), ("c", 3)]
    trained = [os.path.basename(os.path.dirname(v.paths[0])) for v in siammae.video_dataset(str(root),
                                                                                            holdout=1).videos]
    held = [v for v, _, _ in eval_video.davis_videos(str(root), "train",
                                                     holdout=1)]   # --holdout 1: what the sweep scores
    assert len(held) == 1 and sorted(trained + held) == ["a", "c"]                    # never a video it trained on
    lst.write_text(lst.read_text().replace("a", "z"))
    with pytest.raises(C.UserError, match="lists z, which has no folder in"):
        siammae.video_dataset(str(root))


def test_the_decoder_learns_to_copy_f1_when_f2_is_f1():
    """The copy check: given f1 = f2 (the answer to every masked patch sits in f1 at the same place), a nano
    SiamMAE trained through train_step brings the loss well below the flat-patch level (predicting 0 in norm-pix
    space), which is all f2's own patches can give (here 16 patches at 95%: none visible). It shows f1's content
    reaches the prediction through the cross-attention; with its keys and values taken from f2's tokens instead
    of f1's the loss stays at the flat level (measured: 0.98 of it, against 0.35 here after 100 steps)."""
    torch.manual_seed(0)
    a = tiny_args(img_size=16, decoder_dim=32, decoder_depth=1, decoder_heads=2)
    model = siammae.SiamMAE(a)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.05)
    losses, flats = [], []
    for _ in range(100):
        f = torch.nn.functional.interpolate(torch.randn(32, 3, 2, 2), size=16,
                                            mode="bilinear") + 0.3 * torch.randn(32, 3, 16, 16)
        ids_keep, ids_restore, mask = siammae.random_masking(32, 4, a.mask_ratio)
        opt.zero_grad()
        loss, _ = siammae.train_step(model, f, f, ids_keep, ids_restore, mask, a)
        opt.step()
        target = siammae.norm_pix(siammae.patchify(f, 4))
        losses.append(loss.item())
        flats.append(siammae.siammae_loss(torch.zeros_like(target), target, mask).item())
    assert np.mean(losses[-10:]) < 0.7 * np.mean(flats[-10:]), (losses[-10:], flats[-10:])


def test_the_f1_probe_measures_reading_f1_and_changes_nothing_in_training(tmp_path):
    """probe_pairs: one fixed pair per video (its own seed: the same pairs every call, the caller's RNG untouched);
    f1_probe: f1_gap = other - true, the losses with another video's f1 and the true f1. A run logs it every
    --probe-every steps and at the end, and training is bit-identical with and without it."""
    a = tiny_args()
    ds = siammae.video_dataset("synthetic")
    state = torch.get_rng_state()
    p, q = siammae.probe_pairs(ds, a, n=6), siammae.probe_pairs(ds, a, n=6)
    assert torch.equal(torch.get_rng_state(), state) and all(torch.equal(x, y) for x, y in zip(p, q))
    assert p[0].shape == (6, 3, 16, 16) and p[0].dtype == torch.uint8 and not torch.equal(p[0], p[1])
    model = siammae.SiamMAE(a)
    out = siammae.f1_probe(model, p, a)
    assert out["f1_gap"] == pytest.approx(out["f1_other"] - out["f1_true"], abs=2e-5) and model.training
    x1, x2 = C.normalize(p[0]), C.normalize(p[1])
    target = siammae.norm_pix(siammae.patchify(x2, 4))
    with torch.no_grad():                                 # each probe's f1, computed here: true, other, grey, self
        for name, ctx in (("true", x1), ("other", x1.roll(1, 0)), ("grey", torch.zeros_like(x1)), ("self", x2)):
            loss = siammae.siammae_loss(model.eval()(ctx, x2, p[2], p[3]), target, p[4]).item()
            assert out[f"f1_{name}"] == pytest.approx(loss, abs=1e-5), name
    model.train()
    assert len({out[f"f1_{n}"] for n in ("true", "other", "grey", "self")}) == 4       # four different contexts
    siammae.train(tiny_args(tmp_path / "on", probe_every=3))
    siammae.train(tiny_args(tmp_path / "off", probe_every=0))
    on, off = (C.load_checkpoint(str(tmp_path / d / "checkpoint.pth"), "siammae") for d in ("on", "off"))
    assert all(torch.equal(v, off["model"][k]) for k, v in on["model"].items())
    logged = [json.loads(ln) for ln in open(tmp_path / "on" / "log.jsonl") if "f1_gap" in ln]
    assert [r["step"] for r in logged] == [3,
                                           4] and not any("f1_gap" in ln for ln in open(tmp_path / "off" / "log.jsonl"))


def test_the_probe_script_equals_the_runs_logged_probe_and_keeps_its_held_out_videos_out(tmp_path):
    """scripts/siammae_probe.py on a run's checkpoint gives, to the digit, the probe the run logged at its end: the
    same pairs from the same training videos, so never from the --holdout videos (probing those too changes the
    pairs, their count and every loss)."""
    import importlib.util
    from PIL import Image
    rng = np.random.default_rng(0)
    for v in range(5):                                    # 5 videos of 8 frames: a drifting noise pattern each
        os.makedirs(tmp_path / "videos" / f"v{v}")
        base = rng.integers(0, 255, (24, 24, 3))
        for t in range(8):
            Image.fromarray(np.roll(base, t,
                                    axis=1).astype(np.uint8)).save(tmp_path / "videos" / f"v{v}" / f"{t:03d}.png")
    data = str(tmp_path / "videos")
    siammae.train(tiny_args(tmp_path / "run", data=data, holdout=2, epochs=2, steps_per_epoch=1, batch_size=3,
                            probe_every=100, device="cpu"))
    logged = [json.loads(ln) for ln in open(tmp_path / "run" / "log.jsonl") if "f1_gap" in ln][-1]
    spec = importlib.util.spec_from_file_location("siammae_probe", os.path.join(ROOT, "scripts", "siammae_probe.py"))
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    out = probe.probe(str(tmp_path / "run" / "checkpoint.pth"), data, device="cpu")
    assert out["pairs"] == 3                              # the 3 training videos, not the 2 held out
    for k in ("f1_true", "f1_other", "f1_grey", "f1_self", "f1_gap"):
        assert out[k] == logged[k], k
