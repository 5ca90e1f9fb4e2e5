"""--resident (gpu_data.py), run here on CPU: the crops are PIL's for the same box (to one level in 255), the boxes
RandomResizedCrop's in law (KS), the order the CPU sampler's (mid-epoch resume, 2 processes), a view a function of
(seed, epoch, image, view) alone, the work per batch independent of its size; in each loop the views keep the
workers' structure and a run resumes exactly."""
import itertools
import math
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

import can
import cmae
import common as C
import conmim
import gpu_data as G
import msn
from ddp import spawn
from helpers import ROOT, exact_resume, one_line_error, run_cli
from test_can import tiny_args as can_args
from test_cmae import tiny_args as cmae_args
from test_conmim import tiny_args as conmim_args
from test_gpu_aug import _ks
from test_msn import tiny_args as msn_args

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from loop_probe import OpCount  # noqa: E402  the probe's op count (a CPU stand-in for launches)

MODES = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}


def smooth_image(rng, H, W):
    """A photo-like test image: a random 4 x 4 colour field enlarged and blurred (PIL)."""
    small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((W, H), Image.BILINEAR).filter(ImageFilter.GaussianBlur(1))


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_a_crop_is_pils_crop_and_resize_of_the_same_box_to_one_level(mode):
    """Boxes that enlarge, shrink (PIL widens its filter: antialias) and do both, one per axis: every pixel within
    1 of 255 of img.crop(box).resize(size, filter), most equal; the whole image at its own size is itself."""
    rng, diffs = np.random.default_rng(0), []
    for _ in range(150):
        H, W = (int(v) for v in rng.integers(8, 70, 2))
        img = smooth_image(rng, H, W)
        h, w = int(rng.integers(1, H + 1)), int(rng.integers(1, W + 1))
        top, left, out = int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1)), int(rng.integers(4, 48))
        ref = torch.from_numpy(np.array(img.crop((left, top, left + w, top + h)).resize((out, out), MODES[mode])))
        x = torch.nn.functional.pad(C.to_uint8(img)[None].float(), (0, 70 - W, 0, 70 - H))   # square, as stored
        got = G.resample(x, torch.tensor([[[top, left, h, w]]], dtype=torch.float), out, mode)[0, 0]
        diffs.append((got - ref.permute(2, 0, 1)).abs().flatten())
    d = torch.cat(diffs)
    assert d.max() <= 1 and (d == 0).float().mean() > 0.8, (d.max(), (d == 0).float().mean())
    x = C.to_uint8(smooth_image(rng, 12, 12))[None].float()
    assert torch.equal(G.resample(x, torch.tensor([[[0.0, 0, 12, 12]]]), 12, mode)[0, 0], x[0])


def box_stats(boxes, H, W):
    """Area share, log aspect, centre row and column of (top, left, h, w) boxes in an H x W image."""
    top, left, h, w = boxes.double().unbind(-1)
    return [h * w / (H * W), torch.log(w / h), (top + h / 2) / H, (left + w / 2) / W]


@pytest.mark.parametrize("H, W, scale", [(32, 32, (0.2, 1.0)), (32, 32, (0.05, 0.3)), (64, 48, (0.08, 1.0)),
                                         (12, 90, (0.5, 1.0))])                 # wide: most draws fall back
def test_the_boxes_are_random_resized_crops_in_law(H, W, scale):
    """4,000 boxes of the vectorised draw against RandomResizedCrop.get_params': two-sample KS below the p = 0.001
    critical value on the area share, the log aspect and the centre (Bonferroni over 4), the flips a fair coin;
    a wrong scale range is caught."""
    from torchvision import transforms as T
    N = 4000
    torch.manual_seed(0)
    img = Image.new("RGB", (W, H))
    ref = torch.tensor([T.RandomResizedCrop.get_params(img, scale, (3 / 4, 4 / 3)) for _ in range(N)])
    gen = torch.Generator().manual_seed(1)
    sizes = torch.tensor([[H, W]] * (N // 4))
    boxes, flips = G.random_resized_boxes(gen, sizes[:, 0], sizes[:, 1], 4, scale)
    crit = math.sqrt(-math.log(0.001 / 4 / 2) / 2) * math.sqrt(2 / N)
    ks = [_ks(a, b) for a, b in zip(box_stats(ref, H, W), box_stats(boxes.reshape(-1, 4), H, W))]
    assert max(ks) < crit, (ks, crit)
    assert abs(flips.float().mean() - 0.5) < 0.03
    wrong, _ = G.random_resized_boxes(gen, sizes[:, 0], sizes[:, 1], 4, (scale[0], (1 + scale[1]) / 2))
    if scale[1] < 1:
        assert _ks(box_stats(ref, H, W)[0], box_stats(wrong.reshape(-1, 4), H, W)[0]) > crit


def image_folder(root, n=12, sizes=((24, 24), (20, 30), (31, 17))):
    """Three classes of n small PNGs each, of three shapes (the store resizes those not S x S)."""
    rng = np.random.default_rng(0)
    for c in range(3):
        os.makedirs(f"{root}/train/c{c}", exist_ok=True)
        for i in range(n):
            h, w = sizes[i % len(sizes)]
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(f"{root}/train/c{c}/{i}.png")
    return str(root)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return image_folder(tmp_path_factory.mktemp("resident"))


def store(root, S=24, seed=0, max_unreadable=1.0):
    ds = C.image_dataset(root, "train", skip_unreadable=True)
    return G.Store(ds, S, torch.device("cpu"), 0, seed, max_unreadable)


def test_a_non_square_images_boxes_are_drawn_in_its_own_height_and_width(folder):
    """The store's boxes of the 20x30 and 31x17 images, scaled back to each image's own pixels: inside it, reaching
    its bottom and right edges, centred on average, the crop's aspect in the law's range (a slip swapping height
    and width passed every test: the boxes of a wide image were drawn in a tall one)."""
    st = store(folder)
    boxes, _ = st.draw(0, 0, 200, (0.08, 1.0))                                  # (N, 200, 4) in store pixels
    own = boxes.double() * torch.cat([st.sizes / st.S, st.sizes / st.S], 1)[:, None, :].double()
    for H, W in ((20, 30), (31, 17)):
        b = own[(st.sizes == torch.tensor([H, W])).all(1)].reshape(-1, 4)
        top, left, h, w = b.unbind(-1)
        assert len(b) and (top >= -1e-6).all() and (left >= -1e-6).all()
        assert (top + h <= H + 1e-4).all() and (left + w <= W + 1e-4).all() and (top + h).max() > H - 0.5
        assert (left + w).max() > W - 0.5
        assert abs(float(((top + h / 2) / H).mean()) - 0.5) < 0.05
        assert abs(float(((left + w / 2) / W).mean()) - 0.5) < 0.05
        assert (torch.log(w / h).abs() <= math.log(4 / 3) + 0.2).float().mean() > 0.9


@pytest.mark.parametrize("method", ["msn", "cmae", "conmim", "can"])
def test_the_ops_of_a_batch_do_not_grow_with_its_size(method, folder, tmp_path):
    """Each method's resident views of a batch of 4 and of 16 images dispatch the same number of ops (a GPU's
    launches: none per image); the epoch's draw is made before, once."""
    mod, args = {"msn": (msn, msn_args), "cmae": (cmae, cmae_args), "conmim": (conmim, conmim_args),
                 "can": (can, can_args)}[method]
    a = args(tmp_path, resident=24, gpu_aug=True)
    s = store(folder)
    make = G.cut(mod.view_specs(a))
    make(s, torch.arange(4), 0)                                                  # the epoch's draw
    counts = []
    for B in (4, 16):
        with OpCount() as c:
            make(s, torch.arange(B), 0)
        counts.append(c.n)
    assert counts[0] == counts[1] and counts[0] < 150 * (2 if method == "msn" else 1), counts


def _order(rank, world, root, seed, skip, ipe, batch):
    """This process's indices of a resident Loader and of the CPU loader's sampler, an epoch cut after `skip` batches
    (a mid-epoch resume, as common.Batches sets it) and run on into the next."""
    ds = C.image_dataset(root, "train")
    loader = G.Loader(store(root), batch, seed, lambda s, idx, epoch: (idx, epoch))
    cpu = C.make_loader(ds, batch, 0, seed).sampler
    for sampler in (loader.sampler, cpu):
        sampler.set_epoch(1)
        sampler.skip, sampler.ipe = skip * batch, ipe
    got = [(i, epoch) for (idx, epoch), _ in itertools.islice(iter(loader), 2 * ipe - skip) for i in idx.tolist()]
    return got, list(itertools.islice(iter(cpu), len(got)))


def test_the_order_is_the_cpu_samplers_mid_epoch_and_in_each_of_two_processes(folder):
    """Indices and epochs, batch by batch, equal those the workers would load: one process, and two (gloo) each
    with its own share; the first epoch resumed after one batch, the next one whole."""
    got, cpu = _order(0, 1, folder, 3, 1, 4, 4)
    assert got == cpu and {e for _, e in got} == {1, 2} and len(got) == 7 * 4
    ranks = spawn(_order, folder, 3, 1, 2, 4)
    for got, cpu in ranks:
        assert got == cpu and len(got) == 3 * 4
    assert not {i for i, _ in ranks[0][0][:4]} & {i for i, _ in ranks[1][0][:4]}    # the shares differ


def _resident_step_images(rank, world, root, out):
    """In a 2-process gloo group: the clean views CAN's first resident step gets on this rank."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    got, real = [], can.train_step
    can.train_step = lambda net, x, *a, **kw: (got.append(x.clone()), real(net, x, *a, **kw))[1]
    can.train(can_args(out, data=root, img_size=16, resident=24, gpu_aug=True, batch_size=8, epochs=1,
                       steps_per_epoch=1, device="cpu"))
    return got[0]


def test_two_resident_processes_each_train_their_share_of_the_global_batch(folder, tmp_path):
    """--resident in 2 processes, --batch-size 8 (global): each step gets 4 images of its own (the loader batching
    the global batch on every process trained 16 images a step: a slip no test caught)."""
    x0, x1 = spawn(_resident_step_images, folder, str(tmp_path))
    assert x0.shape[:2] == x1.shape[:2] == (2, 4)                               # (views, this process's images)
    assert not any(torch.equal(a, b) for a in x0[0] for b in x1[0])


def test_a_view_is_a_function_of_seed_epoch_image_and_view_alone(folder, tmp_path):
    """CAN's two views of an image are the same whichever batch it is in, and change with the epoch and the seed; an
    image of another shape than S x S is resized once and cut in its own coordinates (a box covers the same
    region)."""
    make = G.cut(can.view_specs(can_args(tmp_path, img_size=16, resident=24, gpu_aug=True)))
    s = store(folder)
    a = make(s, torch.tensor([3, 5, 7]), 0)
    b = make(s, torch.tensor([7, 1, 3, 2]), 0)
    assert torch.equal(a[0][0], b[0][2]) and torch.equal(a[1][2], b[1][0])
    assert not torch.equal(a[0][0], a[1][0])                                     # two views, two draws
    assert not torch.equal(a[0][0], make(s, torch.tensor([3]), 1)[0][0])         # another epoch
    assert not torch.equal(a[0][0], make(store(folder, seed=1), torch.tensor([3]), 0)[0][0])
    assert s.pixels.shape == (36, 3, 24, 24) and s.sizes[1].tolist() == [20, 30]
    boxes, flips = s.draw(0, 0, 2, (0.2, 1.0))
    idx = torch.tensor([3, 5, 7])
    assert flips[idx].any() and not flips[idx].all()                             # both kinds in this batch
    mirrored = s.crops(idx, boxes[idx], ~flips[idx], 16, "bicubic")              # each flip the other way
    assert torch.equal(mirrored[0], a[0].flip(-1)) and torch.equal(mirrored[1], a[1].flip(-1))
    assert (boxes[1, :, 2] <= 24).all() and (boxes[1, :, 0] + boxes[1, :, 2] <= 24 + 1e-4).all()


def test_cmaes_windows_are_slices_of_one_master_crop_and_conmims_views_one_crop(folder, tmp_path):
    """CMAE: the source is the master crop's top-left S x S, the target the window at the drawn (dh, dw) of the same
    master crop; ConMIM: the weak and strong views are the same crop before the loop's colour ops."""
    a = cmae_args(tmp_path, resident=24, gpu_aug=True)
    s, idx = store(folder), torch.tensor([0, 4, 9, 13])
    source, target, d = G.cut(cmae.view_specs(a))(s, idx, 0)
    boxes, flips = s.draw(0, 0, 1, (0.2, 1.0))
    m = s.crops(idx, boxes[idx], flips[idx], a.master_size, "bicubic")[0]
    S = a.img_size
    assert torch.equal(source, m[..., :S, :S]) and d.max() < a.master_size - S and d.unique().numel() > 1
    for b, (dh, dw) in enumerate(d.tolist()):
        assert torch.equal(target[b], m[b, :, dh:dh + S, dw:dw + S])
    [crop] = G.cut(conmim.view_specs(conmim_args(tmp_path, resident=24, gpu_aug=True)))(s, idx, 0)
    assert crop.shape == (4, 3, a.img_size, a.img_size)                          # both views, before STRONG


def test_msns_views_keep_the_workers_list_of_sizes(folder, tmp_path):
    a = msn_args(tmp_path, resident=24, gpu_aug=True)
    views = G.cut(msn.view_specs(a))(store(folder), torch.arange(5), 0)
    sizes = [s for s, _, n, _ in msn.view_specs(a) for _ in range(n)]
    assert [tuple(v.shape) for v in views] == [(5, 3, s, s) for s in sizes] and views[0].dtype == torch.uint8


def test_unreadable_images_are_counted_once_when_the_store_is_built(tmp_path):
    root = image_folder(tmp_path / "data", n=4)
    open(f"{root}/train/c1/broken.png", "wb").write(b"not an image")
    s = store(root)
    assert len(s) == 13 and C.bad_reads(s.dataset) == 1
    with pytest.raises(C.UserError, match="unreadable"):
        store(root, max_unreadable=0.01)


def test_a_resident_run_resumes_exactly(folder, tmp_path):
    def make(out, **kw):
        return can_args(out, data=folder, resident=24, gpu_aug=True, **kw)
    exact_resume(can.train, make, tmp_path, "can", ("model", "encoder"))


@pytest.mark.parametrize("method, flags, needle", [("can", ["--no-gpu-aug"], "--resident needs --gpu-aug"),
                                                   ("msn", ["--gpu-aug", "--gpu-decode"], "choose one")])
def test_resident_flag_errors_are_one_line(method, flags, needle, folder, tmp_path):
    r = run_cli(f"{method}.py", "--data", folder, "--resident", "24", *flags, "--output-dir", str(tmp_path),
                "--device", "cpu", "--workers", "0", "--model", "nano", "--img-size", "16", "--patch-size", "4")
    one_line_error(r, needle)


def test_a_resident_store_below_the_images_or_the_view_size_is_said_or_refused(folder, tmp_path, capsys):
    """--resident S stores every image at S x S: below --img-size it is refused (every view would be upsampled; it
    trained silently at the lower resolution); images larger than S are said, with the S that keeps them whole."""
    with pytest.raises(C.UserError, match="--resident 16 is below --img-size 24"):
        can.train(can_args(tmp_path / "a", data=folder, img_size=24, resident=16, gpu_aug=True))
    can.train(can_args(tmp_path / "b", data=folder, img_size=16, resident=24, gpu_aug=True, epochs=1,
                       steps_per_epoch=1))
    assert "warning: 24 of 36 images are larger than --resident 24 (up to 31x30)" in capsys.readouterr().out
