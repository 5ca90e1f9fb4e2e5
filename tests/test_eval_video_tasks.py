"""eval_video.py --task vip / jhmdb: the metrics on hand-computed cases, CRW's keypoint label maps
and read-back, the frame geometry, static clips that must propagate perfectly (mIoU 100, PCK 100)
through each dataset's released layout, bad input as one line, and the synthetic smoke runs."""
import functools
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import common as C
import eval_video as V
import synthetic as S
from helpers import one_line_error, run_cli, vit_checkpoint


def test_mean_iou_hand_case_leaves_out_classes_in_neither_and_ignores_255():
    gt = np.array([[0, 0, 1], [1, 2, 2], [255, 255, 255]])
    pred = np.array([[0, 1, 1], [1, 2, 0], [3, 3, 3]])
    h = V.confusion(gt, pred, 4)
    assert h.sum() == 6                                                # the 255 row is not counted
    # class 0: TP 1, GT 2, predicted 2 -> 1/3; class 1: 2 / (2 + 3 - 2); class 2: 1 / (2 + 1 - 1); 3: neither
    assert V.mean_iou(h) == pytest.approx((1 / 3 + 2 / 3 + 1 / 2) / 3)
    h2 = V.confusion(np.array([0, 1]), np.array([0, 3]), 4)          # 3 predicted, never true: IoU 0 counts
    assert V.mean_iou(h2) == pytest.approx((1 + 0 + 0) / 3)


def test_pck_hand_case_scale_frame_zero_and_pooling():
    nan = np.nan
    # video 1, 3 frames, 3 joints; joint 2 is never propagated (NaN): not scored, not in the box
    gt1 = np.array([[[0, 0], [30, 40], [5, 5]],
                    [[0, 0], [30, 40], [5, 5]],                          # box diagonal 50 -> scale 30
                    [[0, 0], [60, 80], [5, 5]]], float)                  # diagonal 100 -> scale 60
    pr1 = np.array([[[99, 99], [99, 99], [nan, nan]],                    # frame 0: never scored
                    [[2, 0], [30, 45.5], [nan, nan]],                    # 2/30 = 0.067, 5.5/30 = 0.183 (0.22 at 0.5 x)
                    [[0, 9], [60, 80], [nan, nan]]], float)              # 9/60 = 0.15, 0
    assert V.pck([(gt1, pr1)]) == {0.1: pytest.approx(50.0), 0.2: pytest.approx(100.0)}
    gt2 = np.array([[[0, 0], [0, 10], [0, 0]], [[0, 0], [0, 10], [0, 0]]], float)
    pr2 = np.array([[[0, 0], [0, 10], [nan, nan]], [[0, 0], [0, 10], [nan, nan]]], float)
    # pooled per joint over videos: joint 0 [0.067, 0.15, 0], joint 1 [0.183, 0, 0] -> 2/3 each at 0.1
    assert V.pck([(gt1, pr1), (gt2, pr2)]) == {0.1: pytest.approx(200 / 3), 0.2: pytest.approx(100.0)}
    assert V.pck([(gt2[:1], pr2[:1])]) == {0.1: None, 0.2: None}     # one frame: nothing to score


def test_pck_scale_box_leaves_out_a_joint_that_was_not_propagated():
    """CRW's box is over the joints that have a prediction: a far joint that was not propagated (NaN) must
    not widen it. Joint 0 off by 4.5 px in a box of diagonal 50 (scale 30): 0.15, a miss at 0.1; with the
    far joint in the box (scale 300) it would be a hit."""
    nan = np.nan
    gt = np.array([[[0, 0], [30, 40], [300, 400]]] * 2, float)
    pred = np.array([[[0, 0], [30, 40], [nan, nan]], [[4.5, 0], [30, 40], [nan, nan]]], float)
    assert V.pck([(gt, pred)]) == {0.1: pytest.approx(50.0), 0.2: pytest.approx(100.0)}


def test_keypoint_maps_are_crw_gaussians_and_read_back_at_the_joint():
    lab = V.keypoint_maps(np.array([[5.2, 3.4], [20.0, 1.0]]), 8, 10)  # second joint outside the 10-wide grid
    assert lab.shape == (8, 10, 3)
    g = lab[..., 1]
    assert g[3, 5] == 1 and g[3, 4] == pytest.approx(np.exp(-2)) and g[2, 6] == pytest.approx(np.exp(-4))
    assert g[3, 7] == 0 and g[5, 5] == 0 and (g > 0).sum() == 9        # zero beyond 3 sigma = 1.5 cells
    assert (lab[..., 2] == 0).all()                                    # outside: an empty map
    assert torch.equal(lab[..., 0], (g == 0).float())                  # background where no joint reaches
    xy = V.keypoints_from_maps(lab)
    assert torch.isnan(xy[1]).all()
    assert (xy[0] - torch.tensor([5.0, 3.0])).abs().max() < 0.11       # top 3: the peak + 2 tied neighbours
    soft = torch.full((4, 5, 2), 0.05)
    soft[..., 0] = 0
    soft[1, 1, 1], soft[1, 3, 1], soft[2, 1, 1] = 0.6, 0.3, 0.1       # (y, x): the 3 highest cells
    assert torch.allclose(V.keypoints_from_maps(soft)[0], torch.tensor([1.6, 1.1]))   # x = .6+.9+.1, y = .6+.3+.2


def test_task_frame_geometry():
    im = Image.new("RGB", (1280, 720))
    assert V.resize_frame(im, ("long", 880), Image.BILINEAR).size == (880, 448)       # 495 -> floor to 64: 448
    assert V.resize_frame(im.transpose(Image.TRANSPOSE), ("long", 880), Image.BILINEAR).size == (448, 880)
    assert V.resize_frame(Image.new("RGB", (600, 600)), ("long", 880), Image.BILINEAR).size == (832, 880)
    assert V.resize_frame(Image.new("RGB", (320, 240)), ("square", 320), Image.BILINEAR).size == (320, 320)
    assert V.resize_frame(im, ("square", 0), Image.BILINEAR).size == im.size
    assert V.resize_frame(im, 480, Image.BILINEAR).size == (853, 480)                 # DAVIS: short side


def _texture(w, h, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _vip_root(root, T=4, W=48, H=32, p=4, videos=("v1",)):
    """A VIP layout with static videos: textured frames, class ids in patch-aligned bands (a block's
    convex corner would lose pixels to the bilinear upsampling of one-hot labels, as in CRW)."""
    os.makedirs(root / "lists")
    (root / "lists" / "val_videos.txt").write_text("".join(f"{v}\n" for v in videos))
    lab = np.zeros((H, W), np.uint8)
    lab[2 * p:5 * p] = 13                                              # face
    lab[6 * p:] = 2                                                    # hair
    for v in videos:
        os.makedirs(root / "Images" / v)
        os.makedirs(root / "Annotations" / "Category_ids" / v)
        for t in range(T):
            _texture(W, H).save(root / "Images" / v / f"{t:05d}.jpg", quality=100)
            Image.fromarray(lab).save(root / "Annotations" / "Category_ids" / v / f"{t:05d}.png")
    return lab


def test_vip_miou_pools_one_confusion_over_every_frame_of_every_video(tmp_path, monkeypatch):
    """CRW's eval_vip: one histogram over all videos' frames, then IoU per class. Three videos with
    different errors (none, the face lost, half the hair lost) against per-class IoUs counted here from
    the pooled pixels: the last video's or the mean of the videos' mIoUs differ."""
    lab = _vip_root(tmp_path / "vip", videos=("v1", "v2", "v3"))
    wrong = [lab.copy(), np.where(lab == 13, 0, lab), lab.copy()]
    wrong[2][lab.shape[0] - 4:] = 0                                      # the bottom rows of hair -> background
    preds = iter(wrong)
    monkeypatch.setattr(V, "propagate_labels", lambda enc, frames, gt0, a, geom, device:
                        (np.repeat(next(preds)[None], len(frames), 0), []))
    res = V.evaluate(V.Args(copy_first=True, data=str(tmp_path / "vip"), task="vip", size=0))
    gt, pred = np.stack([lab] * 3), np.stack(wrong)                      # each frame of a video is the same
    ious = [((gt == c) & (pred == c)).sum() / ((gt == c) | (pred == c)).sum() for c in (0, 2, 13)]
    assert res["videos"] == 3 and res["mIoU"] == pytest.approx(100 * np.mean(ious))
    per_video = [np.mean([((lab == c) & (w == c)).sum() / ((lab == c) | (w == c)).sum() for c in (0, 2, 13)
                          if ((lab == c) | (w == c)).any()]) for w in wrong]
    assert min(abs(res["mIoU"] - 100 * per_video[-1]), abs(res["mIoU"] - 100 * np.mean(per_video))) > 1


def test_a_static_vip_clip_propagates_perfectly_through_the_released_layout(tmp_path):
    ck = vit_checkpoint(tmp_path / "c.pth", "siammae")
    _vip_root(tmp_path / "vip")
    res = V.evaluate(V.Args(ckpt=ck, data=str(tmp_path / "vip"), task="vip", size=0, topk=1,
                            output=str(tmp_path / "out")))
    assert res["mIoU"] == 100.0 and res["pixel_acc"] == 100.0 and res["videos"] == 1
    assert len(os.listdir(tmp_path / "out" / "v1")) == 4


def test_vip_bad_input_is_one_line(tmp_path):
    ck = vit_checkpoint(tmp_path / "c.pth", "siammae")
    _vip_root(tmp_path / "vip")
    os.remove(tmp_path / "vip" / "Annotations" / "Category_ids" / "v1" / "00002.png")
    one_line_error(run_cli("eval_video.py", "--ckpt", ck, "--data", str(tmp_path / "vip"), "--task", "vip"),
                   "video v1: frame 00002 has no annotation", "1 of 4 missing")
    ann = tmp_path / "vip" / "Annotations" / "Category_ids" / "v1"
    Image.fromarray(np.full((32, 48), 30, np.uint8)).save(ann / "00002.png")
    with pytest.raises(C.UserError, match="not a map of class ids 0..19"):
        V.evaluate(V.Args(ckpt=ck, data=str(tmp_path / "vip"), task="vip"))
    with pytest.raises(C.UserError, match="no lists/test_videos.txt"):
        V.evaluate(V.Args(ckpt=ck, data=str(tmp_path / "vip"), task="vip", split="test"))
    with pytest.raises(C.UserError, match="expected the VIP layout"):
        V.evaluate(V.Args(ckpt=ck, data=str(tmp_path), task="vip"))


def _jhmdb_root(root, joints, T=4, W=48, H=32):
    """A JHMDB layout: action 'walk', test video v1 (static, textured) and train video v0 (no folder:
    reading it would fail). pos_img is what read_joints returns (scipy is not needed for the test)."""
    os.makedirs(root / "Rename_Images" / "walk" / "v1")
    os.makedirs(root / "joint_positions" / "walk" / "v1")
    os.makedirs(root / "splits")
    (root / "splits" / "walk_test_split1.txt").write_text("v0.avi 1\nv1.avi 2\n")
    (root / "joint_positions" / "walk" / "v1" / "joint_positions.mat").write_bytes(b"")
    for t in range(T):
        _texture(W, H).save(root / "Rename_Images" / "walk" / "v1" / f"{t + 1:05d}.png")
    return np.repeat(joints.T[:, :, None] + 1, T, axis=2)              # (2, J, T), 1-based


def test_a_static_jhmdb_clip_propagates_perfectly_and_a_joint_outside_is_one_warning(tmp_path, monkeypatch, capsys):
    ck = vit_checkpoint(tmp_path / "c.pth", "siammae")
    joints = np.array([[8, 8], [40, 8], [24, 28], [60, 10]], float)   # pixels; the last lies outside the 48 px frame
    pos = _jhmdb_root(tmp_path / "jh", joints)
    monkeypatch.setattr(V, "read_joints", lambda path: pos)
    res = V.evaluate(V.Args(ckpt=ck, data=str(tmp_path / "jh"), task="jhmdb", size=0, topk=1,
                            output=str(tmp_path / "out")))
    assert res["videos"] == 1 and res["PCK@0.1"] == 100.0 and res["PCK@0.2"] == 100.0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "v1: joint 4 at (60.0, 10.0) lies outside the first frame" in err[0]
    import json
    xy = np.array(json.load(open(tmp_path / "out" / "v1.json"))["xy"], dtype=float)
    assert xy.shape == (4, 4, 2) and np.isnan(xy[:, 3]).all()
    assert np.abs(xy[1:, :3] - joints[:3]).max() < 0.5                 # within the top-3 read-back's tie bias


def test_jhmdb_bad_input_is_one_line(tmp_path, monkeypatch):
    ck = vit_checkpoint(tmp_path / "c.pth", "siammae")
    pos = _jhmdb_root(tmp_path / "jh", np.array([[8, 8], [40, 8]], float))
    monkeypatch.setattr(V, "read_joints", lambda path: pos[:, :, :3])
    with pytest.raises(C.UserError, match=r"pos_img is \(2, 2, 3\), expected \(2, joints, 4\)"):
        V.evaluate(V.Args(ckpt=ck, data=str(tmp_path / "jh"), task="jhmdb"))
    os.remove(tmp_path / "jh" / "joint_positions" / "walk" / "v1" / "joint_positions.mat")
    with pytest.raises(C.UserError, match="video v1: no joint annotation .*joint_positions.mat"):
        V.evaluate(V.Args(ckpt=ck, data=str(tmp_path / "jh"), task="jhmdb"))
    (tmp_path / "jh" / "splits" / "walk_test_split1.txt").write_text("v1.avi two\n")
    with pytest.raises(C.UserError, match="expected '<video>.avi 1|2' lines"):
        V.evaluate(V.Args(ckpt=ck, data=str(tmp_path / "jh"), task="jhmdb"))
    with pytest.raises(C.UserError, match="expected the JHMDB layout"):
        V.evaluate(V.Args(ckpt=ck, data=str(tmp_path / "vip"), task="jhmdb"))
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "scipy", None)                   # scipy missing: one line saying so
    monkeypatch.setitem(sys.modules, "scipy.io", None)
    with pytest.raises(C.UserError, match="reads joint_positions.mat with scipy: pip install scipy"):
        V.read_joints(str(tmp_path / "x.mat"))


def test_synthetic_keypoints_move_with_the_true_motion():
    """A keypoint of frame t2 that lies on its own object: source(t1, t2) at its pixel is, within the
    pixel rounding, the same keypoint in frame t1."""
    clip = S.SyntheticClip(3, "val")
    t1, t2 = 4, 12
    src, ids = clip.source(t1, t2)
    k1, k2 = clip.keypoints(t1), clip.keypoints(t2)
    assert k1.shape == (5 * len(clip.objs), 2)
    checked = 0
    for j, (x, y) in enumerate(k2):
        xi, yi = int(round(x)), int(round(y))
        if 0 <= xi < 64 and 0 <= yi < 64 and ids[yi, xi] == j // 5 + 1:
            moved = src[yi, xi] + (k2[j] - (xi, yi))                  # the source of the exact point (same object)
            assert np.abs(moved - k1[j]).max() < 0.5, (j, moved, k1[j])   # offset < 0.5 px, turned
            checked += 1
    assert checked >= 3


@pytest.mark.parametrize("task,keys", [("vip", ("mIoU", "pixel_acc")), ("jhmdb", ("PCK@0.1", "PCK@0.2"))])
def test_synthetic_smoke_run(tmp_path, monkeypatch, task, keys, capsys):
    ck = vit_checkpoint(tmp_path / "c.pth", "siammae")
    monkeypatch.setattr(V, "synthetic_videos", functools.partial(V.synthetic_videos, n=2))
    res = V.evaluate(V.Args(ckpt=ck, data="synthetic", task=task))
    assert res["videos"] == 2 and all(0 <= res[k] <= 100 for k in keys)
    assert capsys.readouterr().out.splitlines()[0].startswith("synthetic_000")
