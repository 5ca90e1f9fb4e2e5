"""Each method file's own ViT, masking, patches and EMA target (the copies are deliberate; where they
must agree, test_interop.py cross-loads them)."""
import importlib
import math

import pytest
import torch
import torch.nn.functional as F

import can
import cmae
import conmim
import weights as W
import msn
import siammae

MAE = ["cmae", "can", "siammae"]                   # MAE-style masking with ids_restore and token dropping
ALL = [msn, cmae, conmim, can, siammae]


@pytest.mark.parametrize("method,grid,ratio,unit", [(m, *c) for m in MAE for c in [(8, 0.15, 1), (8, 0.75, 1), (14,
                                                                                                                0.95,
                                                                                                                1)]]
                         + [("cmae", 8, 0.65, 2), ("cmae", 4, 0.5, 2)])     # block masking (--mask-unit): CMAE's only
def test_mae_random_masking_invariants(method, grid, ratio, unit):
    mod = importlib.import_module(method)
    B, N = 5, grid * grid
    ids_keep, ids_restore, mask = mod.random_masking(B, grid, ratio, *(unit,) * (method == "cmae"))
    n_keep = int((grid // unit) ** 2 * (1 - ratio)) * unit * unit
    assert ids_keep.shape == (B, n_keep) and mask.shape == (B, N)
    assert (mask.sum(1) == N - n_keep).all()                                    # exact counts
    for b in range(B):
        assert set(ids_keep[b].tolist()) == set((mask[b] == 0).nonzero().flatten().tolist())   # kept = unmasked
        assert (ids_keep[b].diff() > 0).all()                                   # ascending
        assert sorted(ids_restore[b].tolist()) == list(range(N))               # a permutation
    g = grid // unit
    m = mask.view(B, g, unit, g, unit)
    assert (m == m[:, :, :1, :, :1]).all()                                      # constant per block
    assert torch.equal(ids_restore.argsort(1)[:, :n_keep], ids_keep)           # kept come first
    x = torch.arange(N).float().repeat(B, 1)
    tokens = torch.cat([torch.zeros(B, 1, 1), torch.gather(x, 1, ids_keep)[..., None]], 1)
    r = mod.restore_tokens(tokens, torch.full((1, 1, 1), -1.0), ids_restore)[:, 1:, 0]
    assert torch.equal(r == -1, mask.bool()) and torch.equal(r[~mask.bool()], x[~mask.bool()])


def test_msn_and_conmim_masking_counts():
    ids = msn.random_masking(6, 8, 0.15)                          # patch drop: kept indices only
    assert ids.shape == (6, int(64 * 0.85)) and all((i.diff() > 0).all() for i in ids)
    mask = conmim.random_masking(6, 8, 0.75, 2)                   # [MASK] positions in 2x2 blocks
    assert (mask.sum(1) == 64 - int(16 * 0.25) * 4).all()
    m = mask.view(6, 4, 2, 4, 2)
    assert (m == m[:, :, :1, :, :1]).all()
    freq = cmae.random_masking(4000, 8, 0.5)[2].mean(0)          # uniform over positions
    assert (freq - 0.5).abs().max() < 0.04


@pytest.mark.parametrize("method", MAE)
@pytest.mark.parametrize("p,h", [(4, 16), (8, 32), (2, 6)])
def test_patchify_roundtrip(method, p, h):
    mod = importlib.import_module(method)
    x = torch.randn(2, 3, h, h)
    y = mod.patchify(x, p)
    assert y.shape == (2, (h // p) ** 2, p * p * 3)
    i, j = (h // p) - 1, 0                                        # row-major, (p, p, 3) inside a patch
    assert torch.equal(y[1, i * (h // p) + j], x[1, :, i * p:(i + 1) * p, j * p:(j + 1) * p].permute(1, 2,
                                                                                                     0).reshape(-1))
    assert torch.equal(mod.unpatchify(y, p), x)
    n = mod.norm_pix(y * 3 + 1)
    assert torch.allclose(n.mean(-1), torch.zeros(2, (h // p) ** 2), atol=1e-5)
    assert torch.allclose(mod.unnorm_pix(n, y * 3 + 1), y * 3 + 1, atol=1e-4)


@pytest.mark.parametrize("method", MAE + ["weights"])
def test_sincos_matches_formula(method):
    dim, grid = 16, 3
    pe = importlib.import_module(method).sincos_pos_embed(dim, grid)
    pe = pe[0, 1:] if pe.ndim == 3 else pe                       # method files: [CLS] row 0 first
    for n in range(grid * grid):
        y, x = divmod(n, grid)
        for ax, pos in ((0, x), (1, y)):
            for k in range(dim // 4):
                w = 1 / 10000 ** (k / (dim / 4))
                assert math.isclose(pe[n, ax * dim // 2 + k], math.sin(pos * w), abs_tol=1e-6)
                assert math.isclose(pe[n, ax * dim // 2 + dim // 4 + k], math.cos(pos * w), abs_tol=1e-6)


@pytest.mark.parametrize("method", ["msn"] + MAE)
def test_token_dropping_equals_running_on_kept_patches(method):
    """Encoding with ids_keep == encoding a sequence made only of the kept (embedded) patches."""
    vit = importlib.import_module(method).ViT(32, 8, 32, 2, 2).eval()
    x = torch.randn(2, 3, 32, 32)
    ids_keep = cmae.random_masking(2, 4, 0.5)[0]
    emb = vit.patch_embed(x) + vit.pos_embed[:, 1:]
    kept = torch.stack([emb[b, ids_keep[b]] for b in range(2)])
    seq = torch.cat([(vit.cls_token + vit.pos_embed[:, :1]).expand(2, -1, -1), kept], 1)
    for blk in vit.blocks:
        seq = blk(seq)
    assert vit(x).shape == (2, 17, 32) and vit(x, ids_keep).shape == (2, 9, 32)
    assert torch.allclose(vit(x, ids_keep), vit.norm(seq), atol=1e-5)


def test_msn_interpolates_position_embeddings_for_focal_views():
    vit = msn.ViT(32, 8, 32, 2, 2).eval()
    assert vit(torch.randn(3, 3, 16, 16)).shape == (3, 5, 32)    # 16 px: 2x2 grid
    assert torch.equal(vit.patch_pos_embed(4, 4), vit.pos_embed[:, 1:])
    with torch.no_grad():                                         # a constant table stays constant
        vit.pos_embed[:, 1:] = torch.arange(32.0)
    assert torch.allclose(vit.patch_pos_embed(2, 2), torch.arange(32.0).expand(1, 4, 32), atol=1e-4)
    vit = W.ViT(32, 8, 32, 2, 2).eval()                          # the evaluation's copy too
    assert vit(torch.randn(3, 3, 16, 16)).shape == (3, 5, 32)


def test_msn_focal_position_embeddings_follow_the_official_interpolation():
    """deit.py interpolate_pos_encoding: the patch table resized bicubic with scale_factor sqrt(npatch / N)
    (224 px, grid 14 -> the 96 px focal views' grid 6), [CLS]'s entry unchanged."""
    vit = msn.ViT(224, 16, 32, 1, 2)
    pe = vit.pos_embed[:, 1:].reshape(1, 14, 14, 32).permute(0, 3, 1, 2)
    ref = F.interpolate(pe, scale_factor=math.sqrt(36 / 196), mode="bicubic").permute(0, 2, 3, 1).reshape(1, 36, 32)
    torch.testing.assert_close(vit.patch_pos_embed(6, 6), ref)


@pytest.mark.parametrize("mod", ALL + [W], ids=lambda m: m.__name__)
def test_stochastic_depth_rises_linearly_and_wraps_both_residual_branches(mod, monkeypatch):
    """DeiT / MAE / BEiT: block i drops at rate linspace(0, p, depth)[i], and both the attention and the MLP
    branch go through drop_path: with every branch dropped, each block is the identity."""
    vit = mod.ViT(16, 8, 32, 3, 2, drop_path=0.3).train()
    assert [b.drop_path for b in vit.blocks] == pytest.approx([0.0, 0.15, 0.3])
    monkeypatch.setattr(mod, "drop_path", lambda x, p, training: torch.zeros_like(x))
    x = torch.randn(2, 5, 32)
    for blk in vit.blocks:
        assert torch.equal(blk(x), x)


@pytest.mark.parametrize("mod", ALL + [W], ids=lambda m: m.__name__)
def test_norm_false_returns_the_tokens_before_the_final_norm(mod):
    """norm=False (MSN's evaluations, CMAE's target, the fine-tuning pooling) skips only the final norm."""
    vit = mod.ViT(16, 8, 32, 2, 2).eval()
    x = torch.randn(2, 3, 16, 16)
    raw = vit(x, norm=False)
    torch.testing.assert_close(vit.norm(raw), vit(x))
    assert not torch.allclose(raw, vit(x), atol=1e-2)


def test_conmim_mask_token_replaces_masked_patches():
    vit = conmim.ViT(16, 8, 16, 1, 2).eval()
    tok = torch.randn(1, 1, 16)
    x = torch.randn(2, 3, 16, 16)
    mask = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0]])
    x2 = x.clone()
    x2[0, :, :8, :8] = torch.randn(3, 8, 8)                      # change the masked patch
    assert torch.allclose(vit(x, mask=mask, mask_token=tok), vit(x2, mask=mask, mask_token=tok), atol=1e-6)
    assert not torch.allclose(vit(x, mask=mask, mask_token=tok), vit(x, mask=mask, mask_token=torch.randn(1, 1, 16)))
    assert not torch.allclose(vit(x), vit(x2))
    # BEiT as ConMIM pre-trains it: the [MASK] embedding replaces the patch embedding and nothing is
    # added to any token (no absolute position embedding); position enters only as the shared
    # relative position bias, the same (heads, 1+N, 1+N) bias in every block
    assert not hasattr(vit, "pos_embed") and not any("pos_embed" in k for k in vit.state_dict())
    with torch.no_grad():
        vit.rel_pos_bias.relative_position_bias_table.normal_()
    mask = torch.tensor([[1.0, 0, 1, 0], [0, 1, 1, 0]])
    emb = torch.where(mask.bool()[..., None], tok, vit.patch_embed(x))
    seq = torch.cat([vit.cls_token.expand(2, -1, -1), emb], 1)
    bias = vit.rel_pos_bias()
    assert bias.shape == (2, 5, 5)
    for blk in vit.blocks:
        seq = blk(seq, bias)
    torch.testing.assert_close(vit(x, mask=mask, mask_token=tok), vit.norm(seq))


def test_beit_relative_position_index_against_a_loop():
    """BEiT's index for a gh x gw grid: token (y1, x1) -> (y2, x2) reads row
    (y1 - y2 + gh - 1) (2 gw - 1) + (x1 - x2 + gw - 1); CLS -> token, token -> CLS, CLS -> CLS the last three
    rows (conmim.py and weights.py alike on the square grid; weights.py's on a non-square one too)."""
    def ref(gh, gw):
        n_rel = (2 * gh - 1) * (2 * gw - 1) + 3
        out = torch.zeros(gh * gw + 1, gh * gw + 1, dtype=torch.long)
        for i in range(gh * gw):
            for j in range(gh * gw):
                (y1, x1), (y2, x2) = divmod(i, gw), divmod(j, gw)
                out[1 + i, 1 + j] = (y1 - y2 + gh - 1) * (2 * gw - 1) + (x1 - x2 + gw - 1)
        out[0, 1:], out[1:, 0], out[0, 0] = n_rel - 3, n_rel - 2, n_rel - 1
        return out
    g = 3
    assert torch.equal(conmim.relative_position_index(g), ref(g, g))
    assert torch.equal(W.relative_position_index(g), ref(g, g))
    assert torch.equal(W.relative_position_index(3, 5), ref(3, 5))
    assert torch.equal(W.relative_position_index(4, 2), ref(4, 2))
    assert conmim.ViT(24, 8, 16, 1, 2).rel_pos_bias.relative_position_bias_table.shape == ((2 * g - 1) ** 2 + 3, 2)


@pytest.mark.parametrize("layout", ["shared", "block"])
def test_beit_index_for_another_grid_is_made_once_and_trains_after_inference(layout, monkeypatch):
    """At another patch grid (eval_dense.py, eval_finetune.py --img-size) the index is built once per
    grid and device, not in every block's forward; built first under inference_mode (an evaluation),
    it still serves a training forward and backward afterwards."""
    vit = W.ViT(16, 4, 32, 3, 2, pos_embed="none", init="beit", rel_pos_bias=layout,
                layer_scale=0.1, qkv_bias="qv")
    made = []
    monkeypatch.setattr(W, "relative_position_index",
                        lambda *g, f=W.relative_position_index: made.append(g) or f(*g))
    W.grid_index.cache_clear()
    x = torch.randn(2, 3, 16, 24)                                        # 4 x 6 patches; built for 4 x 4
    with torch.inference_mode():
        vit(x)
        vit(x)
    vit(x).sum().backward()
    assert made == [(4, 6)]
    assert vit.blocks[0].attn.qkv.weight.grad is not None
    W.grid_index.cache_clear()


@pytest.mark.parametrize("model,scale", [("small", 0.1), ("base", 0.1), ("large", 1e-5), ("micro", 0.1)])
def test_conmim_layer_scale_defaults_are_official(model, scale):
    """run_conmim_pretraining.py: --layer_scale_init_value 0.1 ("0.1 for base, 1e-5 for large"; the
    README's ViT-L command passes 1e-5); gammas start there; --layer-scale overrides."""
    from test_conmim import tiny_args
    assert conmim.layer_scale(tiny_args("/tmp/u", model=model)) == scale
    assert conmim.layer_scale(tiny_args("/tmp/u", model=model, layer_scale=0.5)) == 0.5
    vit = conmim.ViT(16, 8, 16, 2, 2, layer_scale=scale)
    assert all(torch.equal(b.gamma_1, torch.full((16,), scale)) and torch.equal(b.gamma_2, torch.full((16,), scale))
               for b in vit.blocks)


@pytest.mark.parametrize("method", ["msn", "cmae", "conmim"])
def test_ema_update(method):
    ema = importlib.import_module(method).ema_update
    online, target = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    t0 = [p.clone() for p in target.parameters()]
    ema(target, online, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), t0))
    ema(target, online, 0.9)
    for a, b, o in zip(target.parameters(), t0, online.parameters()):
        assert torch.allclose(a, 0.9 * b + 0.1 * o)
    ema(target, online, 0.0)
    assert all(torch.equal(a, o) for a, o in zip(target.parameters(), online.parameters()))


def test_each_method_initialises_its_vit_as_its_official_code():
    """MSN trunc-normal Linear + kaiming patch embedding; MAE family xavier; ConMIM BEiT (cut at +-1 std,
    blocks rescaled); the evaluation's --random-init copy draws the same weights for the same seed."""
    for mod in (msn, cmae, conmim, can, siammae):
        torch.manual_seed(0)
        a = mod.ViT(32, 8, 64, 2, 2)
        torch.manual_seed(0)
        b = W.ViT(**a.config)
        for k, v in a.state_dict().items():
            assert torch.equal(v, b.state_dict()[k]), (mod.__name__, k)
    w = conmim.ViT(32, 8, 64, 2, 2).blocks[1].mlp.fc2.weight
    assert w.abs().max() <= 0.02 / math.sqrt(4) + 1e-7               # cut at 1 std, then / sqrt(2 * 2)
