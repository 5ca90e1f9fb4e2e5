"""Position-embedding interpolation on non-square inputs, for every ViT copy that interpolates its
table (weights.py's, which the evaluations use, and MSN's, for its focal views).
Every DAVIS / VIP / JHMDB frame is non-square: a height / width swap would scramble every
propagation silently. The reference is independent of torch's F.interpolate: a loop-based bicubic
(Keys' cubic convolution, a = -0.75, half-pixel centres, edge clamped, as PyTorch's and timm's
align_corners=False), and timm's resample_abs_pos_embed where timm is installed. The table's
values encode (row, col), so a transposition changes the numbers."""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn


import weights as W
import msn

COPIES = {"weights": lambda g, p, d: W.ViT(g * p, p, d, 1, 2),
          "msn": lambda g, p, d: msn.ViT(g * p, p, d, 1, 2)}


def cubic(t, a=-0.75):
    t = abs(t)
    if t <= 1:
        return (a + 2) * t ** 3 - (a + 3) * t ** 2 + 1
    return a * t ** 3 - 5 * a * t ** 2 + 8 * a * t - 4 * a if t < 2 else 0.0


def resize_1d(v, n_out):
    """(n_in, D) -> (n_out, D), bicubic with half-pixel centres and clamped edges, by loops."""
    n_in = v.shape[0]
    out = np.zeros((n_out, v.shape[1]))
    for i in range(n_out):
        src = (i + 0.5) * n_in / n_out - 0.5
        f = math.floor(src)
        for k in range(f - 1, f + 3):
            out[i] += cubic(src - k) * v[min(max(k, 0), n_in - 1)]
    return out


def reference(table, g, gh, gw):
    """(g*g, D) row-major table -> (gh*gw, D): rows resized to gh, then columns to gw."""
    t = table.reshape(g, g, -1)
    rows = np.stack([resize_1d(t[:, c], gh) for c in range(g)], 1)          # (gh, g, D)
    return np.stack([resize_1d(rows[r], gw) for r in range(gh)], 0).reshape(gh * gw, -1)


def coded_table(g, d):
    """Each position's embedding says where it is: dims 0.. = row, 1.. = col, plus a few smooth
    functions of both, so any transposition or flip is visible."""
    r, c = np.meshgrid(np.arange(g), np.arange(g), indexing="ij")
    feats = [r, c, r * c, np.sin(r + 2 * c), r ** 2 - c]
    return np.stack([feats[i % len(feats)] * (1 + i // len(feats)) for i in range(d)], -1).reshape(g * g,
                                                                                                   d).astype(np.float64)


def interpolated(vit, table, gh, gw):
    """The position embedding the ViT's forward adds on a (gh x gw)-patch input, read through forward
    itself: patch embedding zeroed, no blocks, no norm, so the output patch tokens are the table."""
    with torch.no_grad():
        vit.pos_embed[0, 1:] = torch.tensor(table, dtype=torch.float32)
        vit.patch_embed.proj.weight.zero_()
        vit.patch_embed.proj.bias.zero_()
    vit.blocks, vit.norm = nn.ModuleList(), nn.Identity()
    p = vit.patch_size
    with torch.no_grad():
        return vit.eval()(torch.zeros(1, 3, gh * p, gw * p))[0, 1:].double().numpy()


@pytest.mark.parametrize("copy", COPIES)
@pytest.mark.parametrize("g,gh,gw", [(2, 3, 4), (14, 30, 53), (4, 6, 3)],
                         ids=["2x2->3x4", "davis-landscape", "portrait"])
def test_pos_embed_interpolation_on_non_square_grids(copy, g, gh, gw):
    d = 10
    table = coded_table(g, d)
    got = interpolated(COPIES[copy](g, 2, d), table, gh, gw)
    np.testing.assert_allclose(got, reference(table, g, gh, gw), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("copy", COPIES)
def test_pos_embed_interpolation_matches_timm(copy):
    timm_pe = pytest.importorskip("timm.layers").resample_abs_pos_embed
    g, gh, gw, d = 4, 5, 7, 8
    table = coded_table(g, d)
    ref = timm_pe(torch.tensor(table, dtype=torch.float32)[None], (gh, gw), (g, g), num_prefix_tokens=0,
                  antialias=False)[0]                                   # as MAE / DINO interpolate (timm default: True)
    np.testing.assert_allclose(interpolated(COPIES[copy](g, 2, d), table, gh, gw), ref.double().numpy(),
                               atol=1e-4, rtol=1e-4)


def test_reference_is_the_identity_at_the_same_size_and_sees_a_transposition():
    table = coded_table(3, 6)
    np.testing.assert_allclose(reference(table, 3, 3, 3), table, atol=1e-12)
    t = table.reshape(3, 3, -1).transpose(1, 0, 2).reshape(9, -1)         # (row, col) swapped
    assert not np.allclose(reference(t, 3, 3, 5), reference(table, 3, 3, 5)[:], atol=1e-3)
