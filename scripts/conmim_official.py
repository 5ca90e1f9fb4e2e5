"""ConMIM beside the official code: the same weights, batches, masks, optimiser groups, lr schedule and teacher
EMA through conmim.py and through TencentARC/ConMIM's model, and the two losses step by step.

  git clone https://github.com/TencentARC/ConMIM /tmp/ConMIM
  python scripts/conmim_official.py --official /tmp/ConMIM                         # generated images, x4 lr
  python scripts/conmim_official.py --official /tmp/ConMIM --data /data/cifar10 --steps 150

Where the official code is not on disk it prints one line saying how to get it and exits 0. Nothing of the official
code is copied here: its modeling_pretrain.py (which imports modeling_finetune.py) is imported from --official; the
few timm helpers those files import (trunc_normal_, drop_path, to_2tuple, register_model) are stood in for by torch's
own when timm is not installed. The loss is computed as its engine_for_pretraining.py does (normalised features,
logits of the masked positions against all teacher patches / temp, cross-entropy with the position as label),
written out here. Both models are the preset's (`--preset small`: 32 px, patch 4, BEiT micro, projector 512 -> 256,
no absolute position, one shared relative position bias table, layer scale 0.1), fp32 on the CPU.

Prints each step's two losses and their difference, the bias table's max |b| in both, and a JSON line; exits 1 when
the first --agree steps differ by more than --tol (docs/RESULTS.md: within 1e-4 for 9 steps at x4, both above chance).
"""
import argparse
import copy
import importlib
import json
import math
import os
import sys
import types

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common as C  # noqa: E402
import conmim  # noqa: E402
import recipes  # noqa: E402


def timm_stand_ins():
    """timm's names that modeling_pretrain.py / modeling_finetune.py import, where timm is absent: torch's own
    trunc-normal and stochastic depth, a 2-tuple, and a registry decorator that registers nothing."""
    try:
        importlib.import_module("timm.models.layers")
        return
    except ImportError:
        pass

    layers = types.ModuleType("timm.models.layers")
    layers.trunc_normal_ = lambda t, mean=0.0, std=1.0, a=-2.0, b=2.0: nn.init.trunc_normal_(t, mean, std, a, b)
    layers.drop_path = conmim.drop_path                      # called as drop_path(x, p, training), as timm's
    layers.to_2tuple = lambda x: x if isinstance(x, tuple) else (x, x)
    registry = types.ModuleType("timm.models.registry")
    registry.register_model = lambda f: f
    models = types.ModuleType("timm.models")
    models.layers, models.registry = layers, registry
    timm = types.ModuleType("timm")
    timm.models = models
    sys.modules.update({"timm": timm, "timm.models": models, "timm.models.layers": layers,
                        "timm.models.registry": registry})


def official_model(official, a):
    """TencentARC/ConMIM's VisionTransformerForMaskedImageModeling at the preset's size, built as its
    run_conmim_pretraining.py does (shared relative position bias, no absolute position, layer scale, projectors)."""
    timm_stand_ins()
    sys.path.insert(0, official)
    mp = importlib.import_module("modeling_pretrain")
    dim, depth, heads = conmim.SIZES[a.model]
    return mp.VisionTransformerForMaskedImageModeling(
        img_size=a.img_size, patch_size=a.patch_size, embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=4,
        qkv_bias=True, norm_layer=lambda d: nn.LayerNorm(d, eps=1e-6), use_abs_pos_emb=False,
        use_shared_rel_pos_bias=True, init_values=conmim.layer_scale(a), drop_path_rate=a.drop_path,
        use_mlp_projectors=True, dim=a.proj_dim, mlp_dim=a.proj_hidden)


def official_name(ours):
    """conmim.Net's state-dict key -> the official model's: the encoder's keys sit at the top level, the projector's
    MLP is `projectors`."""
    return ours.removeprefix("encoder.").replace("projector.mlp.", "projectors.")


def official_loss(model, teacher, x_weak, x_strong, mask, temp):
    """engine_for_pretraining.py's loss: the teacher's features of the whole strong view, the student's of the
    masked weak view, both L2-normalised; logits of the masked positions / temp; cross-entropy against the index
    of the same position."""
    masked = mask.bool()
    with torch.no_grad():
        keys = teacher(x_strong, bool_masked_pos=torch.zeros_like(masked), return_all_tokens=True,
                       only_return_before_head=True, use_mlp_projectors=True)
    feat = model(x_weak, bool_masked_pos=masked, return_all_tokens=True, only_return_before_head=True,
                 use_mlp_projectors=True)
    logits = torch.matmul(nn.functional.normalize(feat, dim=-1), nn.functional.normalize(keys, dim=-1).transpose(1, 2))
    labels = torch.arange(mask.shape[1]).expand_as(masked)[masked]
    return nn.functional.cross_entropy((logits / temp)[masked], labels)


def official_groups(model, weight_decay):
    """BEiT's get_parameter_groups rule on the official names: no decay for 1-d tensors, biases and
    no_weight_decay() (pos_embed, cls_token)."""
    skip = model.no_weight_decay()
    decay, no = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (no if p.ndim == 1 or n.endswith(".bias") or n in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no, "weight_decay": 0.0}]


def batches(a, data, n, steps, seed):
    """`steps` batches of n (weak, strong) views, normalised, and masks: from an image folder (its train/) or from
    generated images (synthetic.py), through conmim.WeakStrongViews."""
    if data:
        ds = C.image_dataset(data, "train")
        load = lambda i: ds.load(i % len(ds))[0]                          # noqa: E731
    else:
        import synthetic as S
        load = lambda i: S.synthetic_image(i, size=a.img_size)[0]         # noqa: E731
    views = conmim.WeakStrongViews(a)
    grid = a.img_size // a.patch_size
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        idx = torch.randint(0, 10 ** 6, (n,), generator=g).tolist()
        torch.manual_seed(seed * 1000 + step)
        pairs = [views(load(i)) for i in idx]
        weak, strong = (C.normalize(torch.stack(v)) for v in zip(*pairs))
        yield weak, strong, conmim.random_masking(n, grid, a.mask_ratio, a.mask_unit)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    p.add_argument("--official", default=os.environ.get("CONMIM_OFFICIAL", "ConMIM"),
                   help="a checkout of github.com/TencentARC/ConMIM (default: $CONMIM_OFFICIAL, else ./ConMIM)")
    p.add_argument("--data", default=None, help="an image folder (default: generated images)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr-factor", type=float, default=4.0, help="lr multiple of the preset's per-image lr")
    p.add_argument("--agree", type=int, default=9, help="steps whose losses must agree within --tol")
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.official, "modeling_pretrain.py")):
        print(f"skipped: the official ConMIM code is not at {args.official!r}: git clone "
              "https://github.com/TencentARC/ConMIM DIR, then --official DIR (or CONMIM_OFFICIAL=DIR)")
        return None
    preset = recipes.presets(conmim.Args, {"batch_size": args.batch_size})["small"]
    preset.pop("rel_pos_lr", None)                   # the official optimiser has one lr for every group
    a = conmim.Args(data="synthetic", **{**preset, "gpu_aug": False})
    lr = a.lr * args.lr_factor
    torch.manual_seed(args.seed)
    ours = conmim.Net(a).train()
    theirs = official_model(args.official, a).train()
    sd = {official_name(k): v for k, v in ours.state_dict().items()}
    missing, unexpected = theirs.load_state_dict(sd, strict=False)
    left = [k for k in missing if not k.startswith("lm_head") and k != "rel_pos_bias.relative_position_index"]
    if left or unexpected:                                            # its unused token head keeps its own init
        raise SystemExit(f"error: the official model's keys do not match ours (missing {left[:5]}, unexpected "
                         f"{unexpected[:5]}): is --official a ConMIM checkout?")
    if not torch.equal(theirs.rel_pos_bias.relative_position_index, ours.encoder.rel_pos_bias.relative_position_index):
        raise SystemExit("error: the relative position index differs from the official one")
    t_ours, t_theirs = conmim.make_teacher(ours).train(), copy.deepcopy(theirs).requires_grad_(False).train()
    opt_ours = C.make_optimizer(ours, lr, a.weight_decay, a.betas, torch.device("cpu"), conmim.no_decay)
    opt_theirs = torch.optim.AdamW(official_groups(theirs, a.weight_decay), lr=lr, betas=a.betas, eps=1e-8)
    total, warm = 1000, a.warmup_epochs / a.epochs * 1000               # the preset's schedule shapes over 1000 steps
    m0 = conmim.ema_start(a.ema[0], total, a.ema_horizon)
    rows, chance = [], math.log((a.img_size // a.patch_size) ** 2)
    print(f"ConMIM vs the official code at {args.official}: preset small, batch {args.batch_size}, lr "
          f"x{args.lr_factor:g} (peak {lr:g}), chance ln N = {chance:.4f}")
    for step, (weak, strong, mask) in enumerate(batches(a, args.data, args.batch_size, args.steps, args.seed)):
        C.set_hparams(opt_ours, C.cosine_schedule(step, total, lr, a.min_lr * args.lr_factor, warm))
        for g in opt_theirs.param_groups:
            g["lr"] = opt_ours.param_groups[0]["lr"]
        m = C.cosine_schedule(step, total, m0, a.ema[1])
        opt_ours.zero_grad(), opt_theirs.zero_grad()
        l_ours, _ = conmim.train_step(ours, t_ours, weak, strong, mask, a)
        l_theirs = official_loss(theirs, t_theirs, weak, strong, mask, a.tau)
        l_theirs.backward()
        l_theirs = l_theirs.detach()
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad)
            opt.step()
        conmim.ema_update(t_ours, ours, m)
        with torch.no_grad():                                          # the official engine's EMA over shared names
            student = dict(theirs.named_parameters())
            for n, pk in t_theirs.named_parameters():
                pk.mul_(m).add_((1 - m) * student[n].detach())
        b_ours = ours.encoder.rel_pos_bias.relative_position_bias_table.abs().max().item()
        b_theirs = theirs.rel_pos_bias.relative_position_bias_table.abs().max().item()
        rows.append({"step": step + 1, "ours": float(l_ours), "official": float(l_theirs),
                     "diff": abs(float(l_ours) - float(l_theirs)), "bias_ours": b_ours, "bias_official": b_theirs})
        print(f"step {step + 1:4d}  ours {float(l_ours):.5f}  official {float(l_theirs):.5f}  |diff| "
              f"{rows[-1]['diff']:.1e}  max|b| {b_ours:.4f} / {b_theirs:.4f}", flush=True)
    first = max(r["diff"] for r in rows[:args.agree])
    result = {"steps": len(rows), "lr_factor": args.lr_factor, "batch_size": args.batch_size, "chance": chance,
              f"max_diff_first_{args.agree}": first, "agree": first <= args.tol,
              "mean_ours": sum(r["ours"] for r in rows) / len(rows),
              "mean_official": sum(r["official"] for r in rows) / len(rows)}
    print(json.dumps(result))
    if first > args.tol:
        raise SystemExit(f"error: the losses differ by {first:.2e} within the first {args.agree} steps "
                         f"(> --tol {args.tol:g})")
    return rows


if __name__ == "__main__":
    main()
