"""Draw the README's learning curves from the measured numbers in docs/results.json (matplotlib, a docs-only
requirement: pip install -r docs/requirements.txt).

  python docs/plot_results.py   # -> docs/cifar10_curves.png, cifar10_gpu_curves.png, davis_curve.png, ...

cifar10_curves.png: k-NN top-1 (%) on the 10,000 CIFAR-10 test images against the images seen in
pre-training, one line per method (the encoder each paper evaluates; an open square: the online encoder
of an EMA method at the end; dotted: a method's earlier recipe), each method's own initial encoder as a
dashed line of its colour and raw pixels as a black line; cifar10_gpu_curves.png the same for the GPU tier
(benchmarks/gpu_cifar.py). davis_curve.png: SiamMAE's J&F (%) on
the 20 DAVIS-2016 val videos against the training step, with its initial encoder, raw pixels and the
first mask copied as horizontal lines. cifar10_finetune.png: top-1 on CIFAR-10 test against the fine-tuning epoch,
each method's pre-trained encoder and its initial encoder (eval_finetune.py --preset small). docs/results.json
holds every number and where it comes from.
"""
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
COLOURS = {"msn": "tab:blue", "cmae": "tab:orange", "conmim": "tab:green", "can": "tab:red", "siammae": "tab:purple"}


def finish(fig, ax, xlabel, ylabel, title, legend_loc, out):
    """One quantity per axis, labelled with its unit; a light grid; the legend; written to `out`."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc=legend_loc)
    fig.tight_layout()
    fig.savefig(out)


def cifar10(res, out, legend_loc="lower right"):
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for m, r in res["methods"].items():
        x, y = zip(*[(n / 1000, acc) for n, acc in r["knn"]])
        ax.plot(x, y, "o-", color=COLOURS[m], label=r["label"])
        ax.axhline(r["init"], color=COLOURS[m], ls="--", lw=1)
        if "before" in r:                                   # the same method's earlier recipe, dotted
            bx, by = zip(*[(n / 1000, acc) for n, acc in r["before"]["knn"]])
            ax.plot(bx, by, ".:", color=COLOURS[m], label=r["before"]["label"])
        if "online" in r:                                   # an EMA method's online encoder at the end
            ax.plot([x[-1]], [r["online"]["knn_top1"]], "s", mfc="none", color=COLOURS[m],
                    label=f"{r['label'].split(' (')[0]}: its online encoder at the end")
    ax.axhline(res["pixels"], color="black", lw=1.5, label=f"raw pixels ({res['pixels']:.1f})")
    ax.plot([], [], "k--", lw=1, label="dashed: each method's initial encoder")
    finish(fig, ax, "images seen in pre-training (thousands)", "k-NN top-1 on CIFAR-10 test (%)", res["title"],
           legend_loc, out)


def davis(res, out):
    """J&F against the step beside the baselines; with an `f1_gap` curve, a second panel: how much the decoder reads
    f1 (the loss with another video's f1 minus with the true f1, siammae.f1_probe), where correspondence is learned."""
    gap = res.get("f1_gap")
    fig, axes = plt.subplots(1, 2 if gap else 1, figsize=(11 if gap else 7.5, 4.2), dpi=120)
    ax = axes[0] if gap else axes
    x, y = zip(*res["jf"])
    ax.plot(x, y, "o-", color=COLOURS["siammae"], label=res["label"])
    for key, style, text in (("init", "--", "its initial encoder"), ("pixels", ":", "raw pixels"),
                             ("copy_first", "-.", "first mask copied")):
        ax.axhline(res[key], color="black", ls=style, lw=1, label=f"{text} ({res[key]:.1f})")
    if gap:
        finish(fig, ax, "training step", "J&F on DAVIS-2016 val (%)", res["title"], "center right", out)
        gx, gy = zip(*gap)
        axes[1].plot(gx, gy, "o-", color=COLOURS["siammae"], label="f1 gap of the same run")
        if "f1_gap_before" in res:
            bx, by = zip(*res["f1_gap_before"])
            axes[1].plot(bx, by, "s--", color="grey", label=res.get("before_label", "the earlier preset"))
        axes[1].axhline(0, color="black", lw=1)
        finish(fig, axes[1], "training step", "loss(another video's f1) - loss(true f1)",
               "f1 gap on fixed train pairs: the decoder reads f1", "center right", out)
    else:
        finish(fig, ax, "training step", "J&F on DAVIS-2016 val (%)", res["title"], "center right", out)


def finetune(res, out):
    """Top-1 on CIFAR-10 test against the fine-tuning epoch: each method's pre-trained encoder (solid) and its own
    initial encoder (dashed) through the same recipe, seed and labels; further seeds as fainter lines."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for m, r in res["methods"].items():
        for i, run in enumerate(r["seeds"]):
            for key, style in (("pre", "o-"), ("init", "s--")):
                x, y = zip(*run[key])
                label = (f"{r['label']}" if key == "pre" else f"{r['label'].split(' (')[0]}: initial encoder") \
                    + (f" (seed {run['seed']})" if len(r["seeds"]) > 1 else "")
                ax.plot(x, y, style, color=COLOURS[m], alpha=1.0 if i == 0 else 0.45, ms=4, label=label)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi + 0.8 * (hi - lo))                            # room for the legend above the curves
    finish(fig, ax, "fine-tuning epoch", "top-1 on CIFAR-10 test (%)", res["title"], "upper left", out)


def main():
    res = json.load(open(os.path.join(HERE, "results.json")))
    cifar10(res["cifar10"], os.path.join(HERE, "cifar10_curves.png"), "center right")
    cifar10(res["cifar10_gpu"], os.path.join(HERE, "cifar10_gpu_curves.png"), "center right")
    davis(res["davis"], os.path.join(HERE, "davis_curve.png"))
    if "cifar10_finetune" in res:
        finetune(res["cifar10_finetune"], os.path.join(HERE, "cifar10_finetune.png"))


if __name__ == "__main__":
    main()
