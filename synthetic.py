"""The built-in `--data synthetic` datasets: procedural images and clips, generated on the fly and
deterministic per index and seed (nothing downloaded, nothing written). Imported only for
`--data synthetic`: a method file plus common.py trains on an image folder without this file.

Images: 10 shape classes (label = index % 10), grey shapes of random intensity, scale, position and
rotation over a random grey textured background, with a held-out val split, so a k-NN or linear
probe shows whether pre-training learned something. Clips: 1-3 coloured shapes moving and turning
over a drifting tinted background, with per-object masks (eval_video.py's synthetic DAVIS). Colour,
because with ImageNet's per-channel normalisation every flat grey patch has one and the same
norm-pix target, which a SiamMAE decoder could predict everywhere without reading either frame.
"""
import numpy as np
import torch
from PIL import Image


SHAPES = ("disc", "square", "triangle", "plus", "ring", "star", "crescent", "bar", "ell", "dots")


def shape_mask(name, xx, yy, center, s, rot):
    """Boolean mask of shape `name` on the coordinate grids xx, yy in [-1, 1], scaled by s,
    rotated by rot (radians) and centred at center = (cx, cy)."""
    x0, y0 = (xx - center[0]) / s, (yy - center[1]) / s
    u, v = x0 * np.cos(rot) + y0 * np.sin(rot), -x0 * np.sin(rot) + y0 * np.cos(rot)
    r, a = np.hypot(u, v), np.arctan2(v, u)
    return {
        "disc": r < 0.9,
        "square": np.maximum(abs(u), abs(v)) < 0.75,
        "triangle": (v > -0.5) & (v < 1 - 1.732 * abs(u) - 0.0) & (v < 1.0),
        "plus": ((abs(u) < 0.3) & (abs(v) < 1)) | ((abs(v) < 0.3) & (abs(u) < 1)),
        "ring": (r < 0.95) & (r > 0.6),
        "star": r < 0.55 + 0.4 * np.cos(5 * a),
        "crescent": (r < 0.95) & (np.hypot(u - 0.45, v) > 0.75),
        "bar": (abs(u) < 1.0) & (abs(v) < 0.3),
        "ell": (((abs(u + 0.35) < 0.25) & (abs(v) < 0.9))
                | ((abs(v - 0.65) < 0.25) & (abs(u) < 0.6))),
        "dots": (np.hypot(u - 0.5, v) < 0.38) | (np.hypot(u + 0.5, v) < 0.38),
    }[name]


def synthetic_image(idx, seed=0, split="train", size=64, mask=False):
    """Procedural image of one of 10 shape classes (label = idx % 10), deterministic per index;
    mask=True: (image, label, the shape's (size, size) boolean mask) (eval_dense.py's labels).

    Grey images: random shape intensity, scale, position and rotation over a random grey textured
    background. No colour and no class-specific intensity: only the outline identifies the class,
    and the outline is also what two crops of one image share most (colour would otherwise be the
    easiest instance cue for a siamese method, and tell nothing about the class).
    """
    rng = np.random.default_rng([seed, {"train": 0, "val": 1}[split], idx])
    label = idx % len(SHAPES)
    yy, xx = np.mgrid[-1:1:size * 1j, -1:1:size * 1j]
    # background: a grey level with a faint gradient, grating and pixel noise
    g = rng.uniform(0.25, 0.75)
    th = rng.uniform(0, 2 * np.pi)
    t = 0.08 * (xx * np.cos(th) + yy * np.sin(th)) + 0.05 * np.sin(
        rng.uniform(3, 9) * np.pi * (xx * np.sin(th) - yy * np.cos(th)))
    img = (g + t + rng.normal(0, 0.03, (size, size)))[..., None].repeat(3, -1)
    # shape in its own frame (u, v): scaled, rotated, translated; brighter or darker than the bg
    s, rot = rng.uniform(0.5, 0.8), rng.uniform(0, 2 * np.pi)
    cx, cy = rng.uniform(-0.25, 0.25, 2)
    m = shape_mask(SHAPES[label], xx, yy, (cx, cy), s, rot)
    fg = g + rng.choice([-1, 1]) * rng.uniform(0.25, 0.45)                     # contrast >= 0.25
    u = ((xx - cx) * np.cos(rot) + (yy - cy) * np.sin(rot)) / s                # shape-frame x
    fg = (fg * (1 + 0.1 * np.sin(6 * u)))[..., None].repeat(3, -1)             # faintly textured fill
    img = np.where(m[..., None], fg, img)
    img = Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8))
    return (img, label, m) if mask else (img, label)


class SyntheticImages(torch.utils.data.Dataset):
    """The built-in `--data synthetic` dataset: generated on the fly, nothing on disk."""

    def __init__(self, split="train", n=None, seed=0, size=64):
        self.split, self.seed, self.size = split, seed, size
        self.n = n or (8000 if split == "train" else 1000)
        self.classes = list(SHAPES)

    def __len__(self):
        return self.n

    def load(self, i):
        return synthetic_image(i, self.seed, self.split, self.size)


class SyntheticClip:
    """Procedural clip: 1-3 coloured shapes moving (and turning) over a drifting tinted texture.
    load(t) -> PIL frame; mask(t) -> (H, W) uint8 object ids (0 = background, later objects on
    top)."""

    def __init__(self, idx, split="train", n_frames=32, size=64):
        rng = np.random.default_rng([11, {"train": 0, "val": 1}[split], idx])
        self.n = n_frames
        self.size = size
        self.bg = (rng.uniform(0.3, 0.7), rng.uniform(2, 6), rng.uniform(0, np.pi),
                   rng.uniform(-0.02, 0.02, 2))
        self.objs = []
        for _ in range(rng.integers(1, 4)):                          # each one's draws in this order
            self.objs.append(dict(shape=rng.integers(len(SHAPES)), s=rng.uniform(0.25, 0.4),
                                  p0=rng.uniform(-0.6, 0.6, 2), vel=rng.uniform(-0.04, 0.04, 2),
                                  rot0=rng.uniform(0, 2 * np.pi), w=rng.uniform(-0.1, 0.1),
                                  level=rng.uniform(0, 1)))
        self.tint = rng.uniform(0.3, 0.7, 3)                     # drawn last: the geometry is as before
        for o in self.objs:
            o["rgb"] = rng.uniform(0, 1, 3)

    def __len__(self):
        return self.n

    def _render(self, t):
        size = self.size
        yy, xx = np.mgrid[-1:1:size * 1j, -1:1:size * 1j]
        g, f, th, drift = self.bg
        bx = xx + drift[0] * t
        by = yy + drift[1] * t
        pattern = 0.15 * np.sin(f * np.pi * (bx * np.cos(th) + by * np.sin(th)))
        pattern = pattern * np.sin(f * np.pi * by)
        img = self.tint + pattern[..., None]                                        # (H, W, 3)
        ids = np.zeros((size, size), np.uint8)
        for k, o in enumerate(self.objs):
            c, r = self._pose(o, t)
            m = shape_mask(SHAPES[o["shape"]], xx, yy, c, o["s"], r)
            img = np.where(m[..., None], o["rgb"], img)
            ids[m] = k + 1
        return img, ids

    def load(self, t):
        img = np.clip(self._render(t)[0], 0, 1)
        return Image.fromarray((img * 255).astype(np.uint8))

    def mask(self, t):
        return self._render(t)[1]

    @staticmethod
    def _pose(o, t):
        """Object o's centre (x, y) in [-1, 1] and its rotation (radians) at frame t."""
        return np.clip(o["p0"] + o["vel"] * t, -0.8, 0.8), o["rot0"] + o["w"] * t

    def _place(self, o, t, u, v):
        """Object o's own-frame point (u, v) (before scaling) -> its (x, y) in [-1, 1] at frame
        t."""
        c, r = self._pose(o, t)
        x = c[0] + o["s"] * (u * np.cos(r) - v * np.sin(r))
        y = c[1] + o["s"] * (u * np.sin(r) + v * np.cos(r))
        return x, y

    def _to_px(self, z):                                                       # [-1, 1] -> pixels
        return (z + 1) * (self.size - 1) / 2

    # keypoints of each object, in its own frame (u, v) before scaling: the centre and four points on its axes
    KEYPOINTS = ((0.0, 0.0), (0.6, 0.0), (-0.6, 0.0), (0.0, 0.6), (0.0, -0.6))

    def keypoints(self, t):
        """(J, 2) pixel positions (x, y) in frame t of every object's KEYPOINTS (J = 5 x objects),
        moving with the object (translation + rotation, as source()); occlusion is not modelled
        (eval_video's synthetic JHMDB: the 'joints' it propagates)."""
        points = [self._place(o, t, u, v) for o in self.objs for u, v in self.KEYPOINTS]
        return self._to_px(np.array(points))

    def source(self, t1, t2):
        """Ground-truth motion: for every pixel of frame t2, (H, W, 2) its (x, y) position in frame
        t1 in pixels (float, may lie outside the frame), and frame t2's object ids (H, W). An object
        pixel keeps its place in its object's own frame (translation of the centre + rotation about
        it); a background pixel moves with the texture's drift. Occlusion is not modelled: the
        source of a point that is hidden in t1 is where it would be."""
        size = self.size
        yy, xx = np.mgrid[-1:1:size * 1j, -1:1:size * 1j]
        drift = self.bg[3]
        x1, y1 = xx + drift[0] * (t2 - t1), yy + drift[1] * (t2 - t1)           # texture at x + d t is fixed
        ids = self.mask(t2)
        for k, o in enumerate(self.objs):
            c2, r2 = self._pose(o, t2)
            x0, y0 = (xx - c2[0]) / o["s"], (yy - c2[1]) / o["s"]
            u, v = x0 * np.cos(r2) + y0 * np.sin(r2), -x0 * np.sin(r2) + y0 * np.cos(r2)   # object frame
            on = ids == k + 1
            px, py = self._place(o, t1, u, v)                                   # the same point in frame t1
            x1, y1 = np.where(on, px, x1), np.where(on, py, y1)
        return np.stack([self._to_px(x1), self._to_px(y1)], -1), ids


class SyntheticVideos(torch.utils.data.Dataset):
    def __init__(self, split="train", n=None):
        self.split, self.n = split, n or (2000 if split == "train" else 20)

    def __len__(self):
        return self.n

    def load(self, i):
        return SyntheticClip(i, self.split), 0
