"""The training step of every method under the global-batch machinery: k accumulated micro-batches
give the loss and every parameter's gradient of one step at the whole batch (batch-coupled terms
included, via the gradient cache), activation checkpointing changes nothing (drop path included),
and 2 processes x k micro-batches equal 1 process. BatchNorm layers are put in eval mode, where
their output does not depend on how the batch is split (in training their statistics are per
micro-batch, as each docstring says)."""
import copy

import pytest
import torch
import torch.nn as nn

import can
import cmae
import common as C
import conmim
import msn
import siammae
from ddp import spawn
from test_can import tiny_args as can_args
from test_cmae import tiny_args as cmae_args
from test_conmim import tiny_args as conmim_args
from test_msn import tiny_args as msn_args
from test_siammae import tiny_args as siammae_args

METHODS = ["msn", "cmae", "conmim", "can", "siammae"]
B = 8


def bn_eval(*modules):
    for mod in modules:
        for m in mod.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()


def case(method, drop_path=0.0, grad_ckpt=False, device="cpu", autocast=None, scale=None, hp=None):
    """(online model, step(net, rows, micro, ddp) -> (loss, parts)) on fixed random inputs of B samples;
    rows: which samples this process holds. device / autocast: where the step runs and in which precision
    (the CUDA tests); inputs are drawn on the CPU, so they are the same on every device. scale: the
    step's loss scaling (GradScaler.scale under fp16). hp: other Args values (flags) for the step."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = lambda *s: torch.randn(*s, generator=g).to(device)                     # noqa: E731
    ac = {} if autocast is None else {"autocast": autocast}
    ac.update({} if scale is None else {"scale": scale})
    if method == "msn":
        a = msn_args("/tmp/unused", drop_path=drop_path, **(hp or {}))
        model = msn.MSN(a).to(device)
        target = copy.deepcopy(model.net).requires_grad_(False)
        bn_eval(model, target)
        xt, xr, xf = x(B, 3, 16, 16), x(1, B, 3, 16, 16), x(2, B, 3, 8, 8)
        ids = msn.random_masking(B, 4, 0.15).view(1, B, -1).to(device)
        def step(net, r, micro, ddp):
            return msn.train_step(net, target, xt[r], xr[:, r], xf[:, r], ids[:, r], a, micro, ddp=ddp, **ac)
    elif method == "cmae":
        a = cmae_args("/tmp/unused", drop_path=drop_path, **(hp or {}))
        model = cmae.CMAE(a).to(device)
        target = cmae.Target(model)
        bn_eval(model, target)
        xs, xt = x(B, 3, 16, 16), x(B, 3, 16, 16)
        ids, rest, mask = (t.to(device) for t in cmae.random_masking(B, 4, 0.5, 2))
        def step(net, r, micro, ddp):
            return cmae.train_step(net, target, xs[r], xt[r], ids[r], rest[r], mask[r], a, micro, ddp=ddp, **ac)
    elif method == "conmim":
        a = conmim_args("/tmp/unused", drop_path=drop_path, **(hp or {}))
        model = conmim.Net(a).to(device)
        teacher = conmim.make_teacher(model)
        bn_eval(model, teacher)
        xw, xs = x(B, 3, 16, 16), x(B, 3, 16, 16)
        mask = conmim.random_masking(B, 4, 0.75, 2).to(device)
        def step(net, r, micro, ddp):
            return conmim.train_step(net, teacher, xw[r], xs[r], mask[r], a, micro, ddp=ddp, **ac)
    elif method == "can":
        a = can_args("/tmp/unused", drop_path=drop_path, **(hp or {}))
        model = can.CAN(a).to(device)
        bn_eval(model)
        xx, sigma = x(2, B, 3, 16, 16), (0.05 * torch.rand(2, B, generator=g)).to(device)
        noise = sigma.view(2, B, 1, 1, 1) * x(2, B, 3, 16, 16)
        ids, rest, mask = (t.view(2, B, -1).to(device) for t in can.random_masking(2 * B, 4, 0.5))
        def step(net, r, micro, ddp):
            return can.train_step(net, xx[:, r], sigma[:, r], noise[:, r], ids[:, r], rest[:, r], mask[:, r], a, micro,
                                  ddp=ddp, **ac)
    else:
        a = siammae_args(drop_path=drop_path, **(hp or {}))
        model = siammae.SiamMAE(a).to(device)
        f1, f2 = x(B, 3, 16, 16), x(B, 3, 16, 16)
        ids, rest, mask = (t.to(device) for t in siammae.random_masking(B, 4, 0.95))
        def step(net, r, micro, ddp):
            return siammae.train_step(net, f1[r], f2[r], ids[r], rest[r], mask[r], a, micro, ddp=ddp, **ac)
    C.set_grad_checkpointing(model, grad_ckpt)
    return model, step


def close(a, b, rtol, name):
    """Gradients equal up to float32 rounding: rtol per element, plus an absolute slack of rtol/100 of the
    tensor's largest entry (sums in another order leave ~1e-7 x max on entries near zero)."""
    torch.testing.assert_close(a, b, rtol=rtol, atol=max(1e-7, rtol * 1e-2 * float(b.abs().max())), msg=name)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run(method, micro, seed=0, **kw):
    model, step = case(method, **kw)
    torch.manual_seed(seed)                                  # drop-path draws
    loss, parts = step(model, slice(None), micro, None)
    return loss, parts, grads(model)


@pytest.mark.parametrize("method", METHODS)
def test_k_micro_batches_equal_one_step(method):
    loss1, parts1, g1 = run(method, B)
    loss2, parts2, g2 = run(method, B // 4)                  # 4 micro-batches of 2
    torch.testing.assert_close(loss2, loss1, rtol=1e-5, atol=1e-6)
    assert set(parts1) == set(parts2)
    for k in parts1:
        torch.testing.assert_close(torch.as_tensor(parts2[k]).float(), torch.as_tensor(parts1[k]).float(), rtol=1e-5,
                                   atol=1e-6)
    assert set(g1) == set(g2) and len(g1) > 0
    for n in g1:
        close(g2[n], g1[n], 1e-4, n)


@pytest.mark.parametrize("method", METHODS)
def test_the_step_backpropagates_the_scaled_loss_and_returns_it_unscaled(method):
    """fp16's GradScaler seam: every term's backward goes through scale (one pass, and both passes of the
    gradient cache), the returned loss and parts are not scaled. Scale 8 -> gradients x 8 exactly."""
    for micro in (B, B // 2):
        loss1, parts1, g1 = run(method, micro)
        loss8, parts8, g8 = run(method, micro, scale=lambda t: 8 * t)
        torch.testing.assert_close(loss8, loss1, rtol=0, atol=0)
        for k in parts1:
            torch.testing.assert_close(torch.as_tensor(parts8[k]), torch.as_tensor(parts1[k]), rtol=0, atol=0)
        assert set(g8) == set(g1)
        for n in g1:
            close(g8[n], 8 * g1[n], 1e-5, n)


@pytest.mark.parametrize("method", METHODS)
def test_the_step_returns_detached_fp32_losses_under_bf16_autocast(method):
    """Each loss is computed in fp32 from the networks' bf16 outputs (CPU autocast here; tests/test_cuda.py
    compares bf16 with fp32 on a GPU), and what the step returns is detached: the parts stay on the
    device until a log step and the non-finite guard keeps them, so a graph left attached would be kept."""
    for micro in (B, B // 2):
        loss, parts, _ = run(method, micro, autocast=torch.autocast("cpu", torch.bfloat16))
        for name, v in [("returned loss", loss), *parts.items()]:
            v = torch.as_tensor(v)
            assert v.dtype == torch.float32 and not v.requires_grad, (name, v.dtype, v.requires_grad)


@pytest.mark.parametrize("method", METHODS)
def test_the_online_network_sees_micro_batches_of_the_given_size(method):
    """--micro-batch exists to bound memory: no online forward may take more than micro samples per
    view (CAN stacks its 2 views, MSN its focal views, 2 in case(): 2 micro), and without it the whole
    batch goes in at once."""
    views = 2 if method in ("can", "msn") else 1
    for micro in (B, B // 4):
        model, step = case(method)
        sizes = []
        for m in model.modules():
            if type(m).__name__ == "PatchEmbed":
                m.register_forward_pre_hook(lambda mod, inp: sizes.append(inp[0].shape[0]))
        step(model, slice(None), micro, None)
        assert sizes and max(sizes) == views * micro, (micro, sizes)


LOSS_FLAGS = {"msn": {"tau": 0.2, "tau_plus": 0.05, "me_max_weight": 0.5, "sinkhorn_iters": 0},
              "cmae": {"tau": 0.2, "lambda_c": 0.5}, "conmim": {"tau": 0.2},
              "can": {"tau": 0.2, "weights": (0.1, 0.5, 0.4), "norm_pix": True}}


@pytest.mark.parametrize("method,flag", [(m, f) for m, flags in LOSS_FLAGS.items() for f in flags])
def test_each_loss_flag_reaches_the_loss(method, flag):
    """A step that passed the loss its default instead of the flag would pass every test run at the
    defaults and silently ignore the user's --tau / --me-max-weight / ...: each flag moves the loss (one
    pass and micro-batches)."""
    for micro in (B, B // 2):
        base = run(method, micro)[0]
        moved = run(method, micro, hp={flag: LOSS_FLAGS[method][flag]})[0]
        assert not torch.allclose(moved, base), (flag, float(moved), float(base))


@pytest.mark.parametrize("method", METHODS)
def test_activation_checkpointing_changes_nothing_with_drop_path(method):
    for micro in (B, B // 2):                                # also inside the gradient cache's replay
        loss1, _, g1 = run(method, micro, drop_path=0.3)
        loss2, _, g2 = run(method, micro, drop_path=0.3, grad_ckpt=True)
        torch.testing.assert_close(loss2, loss1, rtol=1e-6, atol=1e-7)
        for n in g1:
            torch.testing.assert_close(g2[n], g1[n], rtol=1e-5, atol=1e-7, msg=n)
    loss3, _, _ = run(method, B, seed=1, drop_path=0.3)      # drop path is active: another draw differs
    assert not torch.allclose(loss3, loss1)


@pytest.mark.parametrize("method", METHODS)
def test_activation_checkpointing_runs_only_with_grad_ckpt_and_then_on_every_block(method, monkeypatch):
    """Without --grad-ckpt no block is recomputed (checkpointing always on gives the same gradients,
    so only a third more compute would show it); with it, every block of every network that runs
    blocks (encoders and decoders) is checkpointed."""
    seen = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda blk, *a, **kw: (seen.append(blk), real(blk, *a,
                                                                                                            **kw))[1])
    run(method, B)
    assert seen == []
    model, step = case(method, grad_ckpt=True)
    step(model, slice(None), B, None)
    blocks = {id(b) for m in model.modules() if hasattr(m, "grad_ckpt")
              for lst in (getattr(m, "blocks", None), getattr(m, "decoder", None))
              if isinstance(lst, nn.ModuleList) for b in lst}
    assert blocks and {id(b) for b in seen} == blocks


def _ddp_worker(rank, world, method):
    model, step = case(method)
    ddp = nn.parallel.DistributedDataParallel(model)
    b = B // world
    loss, _ = step(ddp, slice(rank * b, (rank + 1) * b), b // 2, ddp)   # 2 micro-batches per process
    return loss, grads(model)


@pytest.mark.parametrize("method", METHODS)
def test_two_processes_with_micro_batches_equal_one_process(method):
    loss1, _, g1 = run(method, B)
    res = spawn(_ddp_worker, method)
    torch.testing.assert_close(sum(r[0] for r in res) / len(res), loss1, rtol=1e-5, atol=1e-6)
    for n in g1:
        close(res[0][1][n], g1[n], 1e-4, n)
        close(res[1][1][n], g1[n], 1e-4, n)


def test_gradient_cache_computes_the_coupled_term_on_fp32_embeddings():
    """Under bf16 autocast the embeddings come out in bf16; the batch-coupled term (Sinkhorn, ME-MAX,
    InfoNCE over the whole batch) and its gradient G are computed on an fp32 copy, as the one-pass
    steps compute their losses in fp32."""
    lin, x, seen = nn.Linear(4, 3), torch.randn(6, 4), []

    def forward(sl, local):
        return None, lin(x[sl]).bfloat16(), {}

    def coupled(E):
        seen.append(E.dtype)
        return (E.sum(0) ** 2).sum(), {}
    loss, _ = C.gradient_cache(forward, coupled, 6, 2)
    assert seen == [torch.float32] and loss.dtype == torch.float32 and lin.weight.grad is not None


def test_gradient_cache_replays_each_micro_batch_random_draws():
    """A random draw inside forward (like drop path): the replayed micro-batches must see the draws of
    the embedding pass, so loss and gradient equal one pass over the same draws."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    x = torch.randn(8, 4)

    def forward(sl, local):
        keep = (torch.rand(len(x[sl]), 1) > 0.5).float()          # one draw per micro-batch
        e = lin(x[sl]) * keep
        return (e ** 2).sum() / 8, e, {}

    def coupled(E):                                                  # couples all rows
        return (E.sum(0) ** 2).sum(), {}

    torch.manual_seed(1)
    loss, _ = C.gradient_cache(forward, coupled, 8, 2)
    g = lin.weight.grad.clone()
    lin.zero_grad()
    torch.manual_seed(1)                                             # the same draws, one pass
    outs = [forward(slice(i, i + 2), True) for i in range(0, 8, 2)]
    ref = sum(o[0] for o in outs) + coupled(torch.cat([o[1] for o in outs]))[0]
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(g, lin.weight.grad)


@pytest.mark.parametrize("method", ["cmae", "can"])
def test_the_gradient_caches_embedding_pass_runs_no_decoder(method):
    """Under micro-batches the no-grad pass embeds every micro-batch for the coupled loss and keeps the embeddings
    alone: CMAE's pixel decoder and CAN's decoder run once a micro-batch (the pass with gradient), never in it (CAN's
    ran there and was thrown away: 9.6% of its cached step). The step stays the one-pass step (the test above)."""
    model, step = case(method)
    decoder = model.pixel_decoder if method == "cmae" else model.decoder[0]
    calls = []
    decoder.register_forward_hook(lambda m, i, o: calls.append(torch.is_grad_enabled()))
    step(model, slice(None), B // 4, None)                   # 4 micro-batches
    assert calls == [True] * 4, calls
