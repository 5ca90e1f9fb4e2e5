"""What eval_finetune.py starts from, for a checkpoint and for the same ViT at its initialisation: the numbers behind
docs/RESULTS.md's fine-tuning checks (ConMIM's synthetic fine-tune once sat at chance).

  python scripts/finetune_probe.py runs/conmim-cifar/checkpoint.pth --data cifar10          # 250 test images

Prints one JSON line per encoder (pre-trained, then --random-init): whether the fine-tuning encoder holds exactly the
checkpoint's evaluated encoder (BEiT: the shared relative position table copied into every block), the layer-scale
gammas, and on --images evaluation images the patch tokens before the final norm (the fine-tuning input), their mean
(the pooled feature) and, after the fresh fc_norm, the mean pairwise cosine of the images' features (1 = every image
alike: a head could learn nothing from them) and the head's initial logits.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402
import eval_finetune as FT  # noqa: E402
import eval_linear as E  # noqa: E402
import weights  # noqa: E402


@torch.no_grad()
def probe(ckpt, data, images=250, random_init=False, split=None):
    enc, c = weights.load_encoder(ckpt, random_init, per_block_rel_pos=True)
    out = {"ckpt": ckpt, "random_init": random_init, "method": c["method"]}
    if not random_init:
        sd, got = c["encoder"], enc.state_dict()
        shared = sd.get("rel_pos_bias.relative_position_bias_table")
        out["loaded_exactly"] = all(torch.equal(got[k], v) for k, v in sd.items() if k in got) and (
            shared is None or all(torch.equal(b.attn.relative_position_bias_table, shared) for b in enc.blocks))
    gammas = [p for n, p in enc.named_parameters() if "gamma" in n]
    if gammas:
        g = torch.cat(gammas).abs()
        out |= {"gamma_mean": round(g.mean().item(), 4), "gamma_max": round(g.max().item(), 4)}
    _, val, _ = E.splits(data, split=split)
    views = C.Views(val, E.eval_transform(c["vit"]["img_size"], data == "synthetic"))
    x = torch.stack([views[i][0] for i in torch.linspace(0, len(val) - 1, min(images, len(val))).long().tolist()])
    torch.manual_seed(0)
    model = FT.Classifier(enc, len(val.classes)).eval()
    tokens = enc(C.normalize(x), norm=False)[:, 1:]                   # (B, N, D): what fine-tuning pools
    pooled = tokens.mean(1)
    feats = model.fc_norm(pooled)                                     # (B, D): what the head reads
    z = F.normalize(feats, dim=-1)
    cos = z @ z.T
    off = ~torch.eye(len(z), dtype=torch.bool)
    logits = model.head(feats)
    return out | {"token_norm": round(tokens.norm(dim=-1).mean().item(), 4),
                  "pooled_norm": round(pooled.norm(dim=-1).mean().item(), 4),
                  "pooled_std_over_images": round(pooled.std(0).mean().item(), 5),
                  "fc_norm_cosine": round(cos[off].mean().item(), 4),
                  "initial_logit_std": round(logits.std().item(), 7)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    p.add_argument("ckpt")
    p.add_argument("--data", required=True)
    p.add_argument("--split", default=None, help="the evaluated folder (default val/, else test/)")
    p.add_argument("--images", type=int, default=250)
    a = p.parse_args(argv)
    try:
        rows = [probe(a.ckpt, a.data, a.images, r, a.split) for r in (False, True)]
    except C.UserError as e:
        raise SystemExit(f"error: {e}") from None
    for r in rows:
        print(json.dumps(r))
    return rows


if __name__ == "__main__":
    main()
