"""Draw docs/siammae_curve.png from eval_correspondence.py / eval_video.py outputs (PIL only, no plotting
library): SiamMAE's measures against the training step, gap 8.

  python docs/siammae_curve.py STEP:corr.jsonl:JF[:MIOU:PCK] ... --out docs/siammae_curve.png

Each argument: a step, the --output file of eval_correspondence.py for that checkpoint (step 0: run
with --random-init), its eval_video.py J&F, and optionally its --task vip mIoU and --task jhmdb
PCK@0.2 (synthetic clips).
"""
import argparse
import json

from PIL import Image, ImageDraw

SERIES = [  # (key, label, colour); accuracies in %, losses x 100
    ("acc_enc_obj", "(a) encoder NN, objects %", (31, 119, 180)),
    ("acc_attn_obj", "(b) decoder attention, objects %", (255, 127, 14)),
    ("acc_zero_obj", "no-motion baseline, objects %", (127, 127, 127)),
    ("acc_enc_moved", "(a) encoder NN, patches moved > 1 %", (23, 190, 207)),
    ("acc_attn_moved", "(b) attention, patches moved > 1 %", (188, 189, 34)),
    ("jf", "J&F (DAVIS protocol) %", (44, 160, 44)),
    ("miou", "mIoU (VIP protocol, shape classes) %", (0, 100, 0)),
    ("pck", "PCK@0.2 (JHMDB protocol, keypoints) %", (227, 119, 194)),
    ("loss_model_obj", "(c) loss, objects x100", (214, 39, 40)),
    ("loss_other_f1_obj", "(c) loss with another clip's f1 x100", (148, 103, 189)),
    ("loss_copy_obj", "copy-f1 predictor x100", (140, 86, 75)),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("points", nargs="+")
    p.add_argument("--out", default="docs/siammae_curve.png")
    p.add_argument("--gap", type=int, default=8)
    p.add_argument("--title", default="SiamMAE on the synthetic clips, frame gap {gap} (CPU nano config)")
    a = p.parse_args()
    pts = []
    for arg in a.points:
        step, path, jf, *more = arg.split(":")
        row = next(r for r in map(json.loads, open(path)) if r["gap"] == a.gap)
        row["jf"] = float(jf)
        row.update(zip(("miou", "pck"), map(float, more)))
        for k in row:
            if k.startswith("loss_"):
                row[k] = 100 * row[k]
        pts.append((int(step), row))
    pts.sort()
    W, H, L, R, T, B = 960, 520, 60, 390, 30, 50
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    xmax = max(s for s, _ in pts) or 1
    ymax = 130
    X = lambda s: L + (W - L - R) * s / xmax                                  # noqa: E731
    Y = lambda v: H - B - (H - T - B) * min(v, ymax) / ymax                    # noqa: E731  (clipped at the top)
    d.line([(L, T), (L, H - B), (W - R, H - B)], fill="black")
    for v in range(0, ymax + 1, 20):
        d.line([(L - 4, Y(v)), (L, Y(v))], fill="black")
        d.text((L - 30, Y(v) - 6), str(v), fill="black")
    for s, _ in pts:
        d.line([(X(s), H - B), (X(s), H - B + 4)], fill="black")
        d.text((X(s) - 10, H - B + 8), str(s), fill="black")
    d.text(((W - R) // 2 - 40, H - 20), "training step", fill="black")
    d.text((L, 8), a.title.format(gap=a.gap), fill="black")
    for i, (key, label, colour) in enumerate(SERIES):
        xy = [(X(s), Y(r[key])) for s, r in pts if r.get(key) is not None]
        if len(xy) > 1:
            d.line(xy, fill=colour, width=2)
        for x, y in xy:
            d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        d.line([(W - R + 15, T + 20 * i + 6), (W - R + 40, T + 20 * i + 6)], fill=colour, width=3)
        d.text((W - R + 45, T + 20 * i), label, fill="black")
    img.save(a.out)


if __name__ == "__main__":
    main()
