"""can.py: InfoNCE against a double loop over the 2n embeddings, reconstruction / denoising on the
right patches, the noise-level embedding, gradients, DDP equivalence (negatives with gradient)."""
import os
import sys

import numpy as np
import pytest
import torch

import can
import common as C
from ddp import spawn
from helpers import exact_resume, one_line_error, run_cli


def naive_info_nce(u1, u2, tau):
    z = [x / x.norm() for x in torch.cat([u1, u2])]
    n = u1.shape[0]
    total = 0.0
    for a in range(2 * n):
        pos = (a + n) % (2 * n)
        den = sum(torch.exp(torch.dot(z[a], z[k]) / tau) for k in range(2 * n) if k != a)
        total = total - torch.log(torch.exp(torch.dot(z[a], z[pos]) / tau) / den)
    return total / (2 * n)


@pytest.mark.parametrize("n,r,tau", [(3, 4, 0.1), (5, 2, 0.5), (2, 6, 1.0)])
def test_info_nce_matches_double_loop(n, r, tau):
    g = torch.Generator().manual_seed(n)
    u1 = torch.randn(n, r, generator=g, dtype=torch.float64, requires_grad=True)
    u2 = torch.randn(n, r, generator=g, dtype=torch.float64, requires_grad=True)
    loss, ref = can.info_nce(u1, u2, tau), naive_info_nce(u1, u2, tau)
    torch.testing.assert_close(loss, ref)
    for a, b in zip(torch.autograd.grad(loss, (u1, u2)), torch.autograd.grad(ref, (u1, u2))):
        torch.testing.assert_close(a, b)


def test_reconstruction_and_denoising_use_masked_and_visible_patches():
    B, N, P = 3, 4, 6
    g = torch.Generator().manual_seed(0)
    pred, x, noise = (torch.randn(B, N, P, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[1, 0, 1, 0], [0, 0, 1, 1], [1, 1, 0, 0]], dtype=torch.float64)
    rec = sum(((pred[b, j] - x[b, j]) ** 2).sum() for b in range(B) for j in range(N) if mask[b, j]) / (mask.sum() * P)
    den = sum(((pred[b, j] - noise[b, j]) ** 2).sum() for b in range(B) for j in range(N)
              if not mask[b, j]) / ((1 - mask).sum() * P)
    torch.testing.assert_close(can.reconstruction_loss(pred, x, mask), rec)
    torch.testing.assert_close(can.denoising_loss(pred, noise, mask), den)
    u1, u2 = torch.randn(B, 5, dtype=torch.float64), torch.randn(B, 5, dtype=torch.float64)
    loss, parts = can.can_loss(u1, u2, pred, x, noise, mask)
    torch.testing.assert_close(loss, 0.03 * can.info_nce(u1, u2) + 0.67 * rec + 0.3 * den)


def tiny_args(tmp, **kw):
    base = dict(data="synthetic", output_dir=str(tmp), model="nano", patch_size=4, img_size=16, epochs=2,
                steps_per_epoch=2, batch_size=8, warmup_epochs=1, decoder_dim=32, decoder_depth=1, decoder_heads=2,
                proj_hidden=32, proj_dim=16, workers=0, log_every=1, knn=False)
    base.update(kw)
    return can.Args(**base)


def test_noise_embedding_changes_decoder_output_and_gradients_reach_everything():
    model = can.CAN(tiny_args("/tmp/unused")).eval()
    x = torch.randn(4, 3, 16, 16)
    ids_keep, ids_restore, mask = can.random_masking(4, 4, 0.5)
    p0, u0 = model(x, torch.zeros(4), ids_keep, ids_restore)
    p1, u1 = model(x, torch.full((4,), 0.05), ids_keep, ids_restore)
    assert not torch.allclose(p0, p1)                      # decoder knows sigma, at every token
    assert not torch.allclose(p0[mask.bool()], p1[mask.bool()]) and not torch.allclose(p0[~mask.bool()],
                                                                                       p1[~mask.bool()])
    torch.testing.assert_close(u0, u1)                     # the encoder does not see sigma
    model.train()
    x = torch.randn(8, 3, 16, 16)
    sigma = torch.rand(8) * 0.05
    noise = sigma.view(-1, 1, 1, 1) * torch.randn_like(x)
    ids_keep, ids_restore, mask = can.random_masking(8, 4, 0.5)
    pred, u = model(x + noise, sigma, ids_keep, ids_restore)
    loss, _ = can.can_loss(u[:4], u[4:], pred, can.patchify(x, 4), can.patchify(noise, 4), mask)
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n


def _ddp_worker(rank, world, u1, u2):
    b = u1.shape[0] // world
    a = u1[rank * b:(rank + 1) * b].clone().requires_grad_()
    c = u2[rank * b:(rank + 1) * b].clone().requires_grad_()
    loss = can.info_nce(a, c)
    loss.backward()
    return loss.detach(), a.grad, c.grad


def test_ddp_two_processes_equal_one_process():
    g = torch.Generator().manual_seed(0)
    u1, u2 = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)
    a, c = u1.clone().requires_grad_(), u2.clone().requires_grad_()
    loss1 = can.info_nce(a, c)
    loss1.backward()
    res = spawn(_ddp_worker, u1, u2)
    torch.testing.assert_close(sum(r[0] for r in res) / 2, loss1.detach())
    torch.testing.assert_close(torch.cat([r[1] for r in res]) / 2, a.grad)    # needs grads through gathered keys
    torch.testing.assert_close(torch.cat([r[2] for r in res]) / 2, c.grad)


def test_end_to_end_resume_and_png(tmp_path):
    full, _ = exact_resume(can.train, tiny_args, tmp_path, "can", ("model", "encoder"))
    assert (tmp_path / "full" / "recon_ep0001_step000004.png").exists()              # the log's ep 1, step 4


def test_bad_input(tmp_path):
    tiny = ["--model", "nano", "--patch-size", "4", "--img-size", "16", "--batch-size", "4", "--epochs", "1",
            "--warmup-epochs", "0",
            "--steps-per-epoch", "1", "--no-knn"]
    one_line_error(run_cli("can.py", "--data", str(tmp_path / "nope"), *tiny), "no such directory")
    C.save_checkpoint(str(tmp_path / "checkpoint.pth"), {"method": "msn", "encoder": {}})
    one_line_error(run_cli("can.py", "--data", "synthetic", *tiny, "--output-dir", str(tmp_path)), "msn checkpoint")


def test_pictures_are_labelled_upscaled_and_named_by_the_logged_epoch_and_step(tmp_path):
    """CAN's reconstruction PNG: 4 labelled rows (view, masked + noise, reconstruction, predicted noise),
    16 px tiles upscaled to 64 px, named by the log's 0-based epoch and the step it was taken at."""
    from PIL import Image
    can.train(tiny_args(tmp_path, epochs=1))
    img = Image.open(tmp_path / "recon_ep0000_step000002.png")
    B = min(8, 8)
    assert img.size[1] == 2 + 4 * (64 + 2) and img.size[0] >= 200 + B * (64 + 2)
    left = np.asarray(img.convert("L"))[:, :200]
    assert (left < 128).sum() > 50                                     # the row labels are drawn


def test_tensorboard_gets_every_scalar_and_the_pictures(tmp_path, monkeypatch):
    """--tensorboard: the logged scalars (loss parts, lr, img/s, the k-NN) and the reconstruction
    pictures, read back from the event file as soon as the run returns: whatever is added is flushed before
    (the writer's thread writes later otherwise, and on a loaded machine the last picture was missing), which
    the order of the writer's calls shows whatever the machine's load; without the package, a one-line error."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter
    calls = []
    for name in ("add_scalar", "add_image", "flush"):
        real = getattr(SummaryWriter, name)
        monkeypatch.setattr(SummaryWriter, name, lambda self, *a, _r=real, _n=name, **kw: (calls.append(_n), _r(self,
                                                                                                                *a,
                                                                                                                **kw))[1])
    can.train(tiny_args(tmp_path, epochs=1, tensorboard=True))
    assert "add_image" in calls and calls[-1] == "flush", calls[-6:]
    ev = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    ev.Reload()
    tags = ev.Tags()
    assert {"loss", "infonce", "rec", "denoise", "lr", "img_s"} <= set(tags["scalars"])
    assert [e.step for e in ev.Scalars("loss")] == [1, 2]
    assert tags["images"] == ["recon"]


def test_the_tensorboard_writer_flushes_each_record_and_each_picture_as_written(tmp_path, monkeypatch):
    """Runs without the tensorboard package (a stand-in SummaryWriter records the calls): between two flushes the
    writer gets one log record's scalars or one picture, so whatever a run logged is on disk when it returns (with
    the scalars left to the writer's thread, the loss of the last steps was missing from the event file read at
    once). The writer opens its folder at the first write, after a run from step 0 moved an earlier one aside."""
    import types
    calls = []

    class Writer:
        def __init__(self, logdir):
            calls.append(("open", os.path.relpath(logdir, tmp_path)))

        def add_scalar(self, tag, value, step):
            calls.append(("scalar", step))

        def add_image(self, tag, img, step):
            calls.append(("image", tag))

        def flush(self):
            calls.append(("flush",))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    can.train(tiny_args(tmp_path, epochs=1, tensorboard=True))
    assert calls[0] == ("open", "tensorboard")
    flushed, pending = [], set()                                     # what each flush wrote
    for c in calls[1:]:
        if c == ("flush",):
            flushed.append(pending)
            pending = set()
        else:
            pending.add(c)
    assert flushed == [{("scalar", 1)}, {("scalar", 2)}, {("image", "recon")}] and not pending, calls


def test_tensorboard_without_the_package_is_a_one_line_error(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(C.UserError, match="--tensorboard needs the tensorboard package"):
        can.train(tiny_args(tmp_path, epochs=1, tensorboard=True))
