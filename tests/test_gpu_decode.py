"""--gpu-decode (gpu_decode.py): the workers read bytes and draw the boxes, the device decodes, crops and
flips. Against the CPU path (msn.MultiView with --gpu-aug, PIL): the same views image by image (same
boxes, flips and view order; only the resampling filter differs, by about 1 level of 255), the same
handling of PNG, CMYK, grey and truncated files, a device-undecodable JPEG replaced and counted, and
msn.train's step fed the same tensors. Runs on CPU (decode_jpeg and roi_align have CPU kernels)."""
import io
import os

import numpy as np
import pytest
import torch
from PIL import Image

import common as C
import gpu_aug as GA
import gpu_decode as G
import msn
from test_msn import tiny_args

CPU = torch.device("cpu")


def photo(rng, w, h):
    """Smooth colour field + pixel noise: a view cut from a box shifted by a pixel differs clearly."""
    x = torch.nn.functional.interpolate(torch.rand(1, 3, h // 12 + 2, w // 12 + 2, generator=rng), size=(h, w),
                                        mode="bicubic")[0].permute(1, 2, 0).numpy() * 255
    x = x + torch.randn(h, w, 3, generator=rng).numpy() * 12
    return Image.fromarray(np.clip(x, 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("jpegs")
    rng = torch.Generator().manual_seed(0)
    os.makedirs(d / "a")
    os.makedirs(d / "b")
    for k, (w, h) in enumerate([(500, 375), (375, 500), (131, 97), (640, 480)]):
        photo(rng, w, h).save(d / "a" / f"{k}.jpg", quality=90)
    photo(rng, 200, 150).save(d / "b" / "png.png")                           # decoded in the worker
    photo(rng, 200, 150).convert("CMYK").save(d / "b" / "cmyk.jpg")          # decoded in the worker
    photo(rng, 150, 200).convert("L").save(d / "b" / "grey.jpg")             # on the device
    buf = io.BytesIO()
    photo(rng, 200, 150).save(buf, "JPEG")
    (d / "b" / "truncated.jpg").write_bytes(buf.getvalue()[:-3000])         # no end marker: unreadable, skipped
    return str(d)


def views_pair(data, seed=3, **kw):
    """(CPU path views, --gpu-decode views) datasets over the same files, with msn's default views."""
    a = msn.Args(data=data, gpu_aug=True, **kw)
    cpu = C.Views(C.image_dataset(data, "train", skip_unreadable=True), msn.MultiView(a), seed)
    boxes = G.Boxes(msn.view_specs(a))
    dev = C.Views(G.encoded(C.image_dataset(data, "train", skip_unreadable=True)), boxes, seed)
    return cpu, dev, boxes.sizes


def test_every_view_is_the_cpu_paths_view_of_the_same_box_and_flip(folder):
    """Image by image (two epochs, every file type): each of MSN's 12 views from the device path is the
    CPU path's view up to the resampling filter (mean |difference| <= 2 levels of 255; measured 0.3-1.5),
    while its mirror image is far (> 20 levels): the same box, flip and view order. The truncated file is
    skipped and counted by both paths alike (the next image's views)."""
    cpu, dev, sizes = views_pair(folder)
    n = len(cpu)
    for epoch in (0, 1):
        for i in range(n):
            ref = cpu[(i, epoch)][0]
            batch, _ = G.collate([dev[(i, epoch)]])
            out = G.views(batch, CPU, sizes, dev.dataset)
            assert [o.shape for o in out] == [(1, *r.shape) for r in ref]
            for v, (o, r) in enumerate(zip(out, ref)):
                assert o.dtype == torch.float32 and 0 <= o.min() and o.max() <= 1
                o, r = o[0] * 255, r.float()
                near, mirror = (o - r).abs().mean(), (o.flip(-1) - r).abs().mean()
                assert near <= 2.0 and mirror > 20, (cpu.dataset.samples[i][0], epoch, v, float(near), float(mirror))
    assert C.bad_reads(cpu.dataset) == C.bad_reads(dev.dataset) == 1


def test_workers_send_bytes_only_for_jpegs_the_device_decodes(folder):
    """RGB and grey JPEGs travel encoded (1-d bytes); PNG and CMYK arrive decoded (3, H, W)."""
    _, dev, _ = views_pair(folder)
    kinds = {os.path.basename(p): dev[(i, 0)][0][0].dim() for i, (p, _) in enumerate(dev.dataset.samples)
             if not p.endswith("truncated.jpg")}
    assert kinds == {"0.jpg": 1, "1.jpg": 1, "2.jpg": 1, "3.jpg": 1, "grey.jpg": 1, "png.png": 3, "cmyk.jpg": 3}


def test_a_jpeg_nothing_decodes_is_replaced_by_another_image_of_the_batch_and_counted(folder, capsys):
    """Header fine, end marker present, no scan data: the workers pass it, the device and PIL cannot decode
    it. It takes the views of the next decodable image of the batch, counts as unreadable (once per run), and
    warns (once)."""
    cpu, dev, sizes = views_pair(folder)
    data = open(dev.dataset.samples[0][0], "rb").read()
    broken = data[:data.find(b"\xff\xda")] + b"\xff\xd9"
    items = [dev[(i, 0)][0] for i in range(3)]                        # [image 0, broken, image 2]
    pixels = [items[0][0], torch.frombuffer(bytearray(broken), dtype=torch.uint8), items[2][0]]
    rois, flips = torch.stack([it[1] for it in items]), torch.stack([it[2] for it in items])
    before = C.bad_reads(dev.dataset)
    out = G.views((pixels, rois, flips), CPU, sizes, dev.dataset)
    alone = [G.views(([it[0]], it[1][None], it[2][None]), CPU, sizes) for it in items]
    for v, o in enumerate(out):                                        # the broken one: image 2's views
        for i, j in enumerate((0, 2, 2)):
            torch.testing.assert_close(o[i], alone[j][v][0], rtol=0, atol=0)
    assert C.bad_reads(dev.dataset) == before + 1
    assert "cannot be decoded" in capsys.readouterr().err
    G.views((pixels, rois, flips), CPU, sizes, dev.dataset)           # met again (next epoch): counted once per run,
    assert C.bad_reads(dev.dataset) == before + 1                      # as ImageFiles counts the files it cannot read
    assert "cannot be decoded" not in capsys.readouterr().err


def test_msn_step_gets_the_same_views_with_and_without_gpu_decode(folder, tmp_path, monkeypatch):
    """msn.train, one step, the same seed, colour augmentation and normalisation made the identity: with
    --gpu-decode the step's target view, random anchors and focal anchors are the CPU path's (within the
    resampling difference), and each is far from any other view of the batch."""
    got = []
    real = msn.train_step
    def step(*a, **kw):
        got.append([t.clone() for t in a[2:5]])
        return real(*a, **kw)

    def identity(x, normalize=False, **kw):                            # in [0, 1]; "normalised": x 255
        return (x.float() / 255 if x.dtype == torch.uint8 else x) * (255 if normalize else 1)
    monkeypatch.setattr(msn, "train_step", step)
    monkeypatch.setattr(GA, "color_augment_batch", identity)
    monkeypatch.setattr(C, "normalize", lambda x: x.float() * 255)
    for flag in (False, True):
        msn.train(tiny_args(tmp_path / str(flag), data=folder, img_size=224, focal_size=96, patch_size=16,
                            batch_size=4, epochs=1,
                            steps_per_epoch=1, warmup_epochs=0, gpu_aug=True, gpu_decode=flag, resume=False,
                            max_unreadable=0.5, device="cpu"))   # the wiring; nvJPEG vs libjpeg: test_cuda.py
    (cpu, dev) = got
    for name, c, d in zip(("target", "random anchors", "focal anchors"), cpu, dev):
        assert c.shape == d.shape, name
        diff = (c - d).abs().mean(dim=(-3, -2, -1))                   # per view and image
        assert diff.max() <= 2.0, (name, diff)
        assert (c - d.roll(1, dims=-4)).abs().mean() > 20, name       # another image's view is far


def test_gpu_decode_needs_gpu_aug(folder, tmp_path):
    with pytest.raises(C.UserError, match="--gpu-decode needs --gpu-aug"):
        msn.train(tiny_args(tmp_path, data=folder, gpu_aug=False, gpu_decode=True))


def test_gpu_decode_run_resumes_exactly(folder, tmp_path):
    """Boxes are drawn in the workers under Views' (seed, epoch, index) seed and the device crops are
    deterministic: a run stopped after epoch 1 and resumed ends with the uninterrupted run's weights."""
    from helpers import exact_resume

    def make(out, **kw):
        return tiny_args(out, data=folder, img_size=32, focal_size=16, batch_size=4, gpu_aug=True, gpu_decode=True,
                         max_unreadable=0.5, **kw)
    exact_resume(msn.train, make, tmp_path, "msn", ("model", "target"))
