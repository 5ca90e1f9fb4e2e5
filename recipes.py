"""The small recipes (`--preset NAME`, and `--data synthetic`'s): each derived from a method's
official recipe (its Args defaults) by the stated short-run rules of scale_recipe; a method adds its
own in `Args.preset_rules`. harness.py imports this module only for --preset, --data synthetic or
--help: a method file copied without it trains its official recipe as before. It imports nothing of
the repository."""
import dataclasses

OFFICIAL_IMG = 224                  # the image size every official recipe here trains at
SHORT_EMA = 0.02                    # a short run's EMA horizon 1/(1 - m): at most this fraction of its steps


def scale_recipe(cls, preset):
    """A small recipe: the official one (cls's defaults) at the preset's batch, length and image
    size, completed by these rules (a value the preset sets wins; a method's own rules are its
    `preset_rules`, which calls this; reasons in docs/RESULTS.md): lr per image (lr and end lr x
    batch / official batch; blr kept) x the preset's lr_factor (chosen by scripts/lr_sweep.py on
    held-out images); warm-up the same share of the run; weight-decay schedules as official; EMA
    horizon 1/(1 - m) at most SHORT_EMA of the run; masking blocks x img_size / 224; crop scales
    unchanged."""
    d = {f.name: f.default for f in dataclasses.fields(cls)}
    out = dict(preset)
    factor, ratio = out.pop("lr_factor", 1.0), preset["batch_size"] / d["batch_size"]
    if d.get("lr") is not None:                                   # an absolute lr for the official batch
        for k in ("lr", "min_lr"):
            if d.get(k):
                out.setdefault(k, float(f"{d[k] * ratio * factor:.4g}"))
    elif d.get("blr"):
        out.setdefault("blr", float(f"{d['blr'] * factor:.4g}"))
    warmup = d["warmup_epochs"] * preset["epochs"] / d["epochs"]
    out.setdefault("warmup_epochs", float(f"{warmup:.4g}"))
    if "ema_horizon" in d:
        out.setdefault("ema_horizon", SHORT_EMA)
    if "mask_unit" in d:                                          # official 2 x 16 px blocks: 32 px
        p = preset.get("patch_size", d["patch_size"])
        px = d["mask_unit"] * d["patch_size"] * preset["img_size"] / OFFICIAL_IMG   # the block's side
        out.setdefault("mask_unit", max(1, round(px / p)))
    return out


def presets(cls, given=None):
    """{name: derived values} of cls's small recipes, 'synthetic' among them, by cls.preset_rules
    (default scale_recipe); `given` flags enter the rules (--epochs)."""
    synthetic = {"synthetic": cls.SYNTHETIC} if hasattr(cls, "SYNTHETIC") else {}
    named = {**synthetic, **getattr(cls, "PRESETS", {})}
    rules = getattr(cls, "preset_rules", scale_recipe)
    return {k: rules(cls, {**v, **(given or {})}) if hasattr(cls, "PRESETS") else v
            for k, v in named.items()}


def apply(cls, given, name, error):
    """The flags `given` completed by preset `name`'s values (flags given win); error(message) for
    an unknown name."""
    named = presets(cls, given)
    if name not in named:
        error(f"--preset {name}: this script has {', '.join(named) or 'no presets'}")
    return {**named[name], **given, "preset": name}


def explain(cls, name, args):
    """The run's plan for --preset `name`: one line per flag the preset sets, its value in this run
    and the rule behind it (a flag given on the command line wins, said so). The rules:
    scale_recipe's, and the method's own (its Args.RULES)."""
    literal = cls.SYNTHETIC if name == "synthetic" else getattr(cls, "PRESETS", {}).get(name, {})
    d = {f.name: f.default for f in dataclasses.fields(cls)}
    inputs = {k: getattr(args, k) for k in ("epochs", "batch_size", "img_size", "patch_size")
              if getattr(args, k, None) is not None}
    derived = presets(cls, inputs).get(name, {})
    factor, batch = literal.get("lr_factor", 1.0), inputs.get("batch_size")
    rules = {"lr": f"the official {d.get('lr')} for {d['batch_size']} images, per image (x {batch} "
                   f"/ {d['batch_size']}) x lr_factor {factor:g} (scripts/lr_sweep.py, held-out "
                   "images)",
             "blr": f"the official blr {d.get('blr')} (per image already) x lr_factor {factor:g}",
             "warmup_epochs": f"the official warm-up's share of the run ({d.get('warmup_epochs')} "
                              f"of {d.get('epochs')} epochs)",
             "ema_horizon": f"the EMA horizon 1 / (1 - m) at most {SHORT_EMA:g} of the run's steps",
             "mask_unit": f"the official {d.get('mask_unit')} x {d.get('patch_size')} px mask "
                          f"blocks x img / {OFFICIAL_IMG}, in patches"}
    rules["min_lr"] = rules["lr"].replace(f"the official {d.get('lr')}",
                                          f"the official end {d.get('min_lr')}")
    rules |= getattr(cls, "RULES", {})
    lines = [f"--preset {name} (recipes.py) sets:"]
    own = "the synthetic config's" if name == "synthetic" else "the preset's (its budget)"
    for k, v in derived.items():
        if k == "preset" or not hasattr(args, k):
            continue
        why = rules.get(k) if k in rules else own if k in literal else "scale_recipe"
        now = getattr(args, k)
        v = literal.get(k, v)                                        # a given flag: not the preset's
        if now != v:
            why = f"given on the command line (the preset's: {v})"
        lines.append(f"  --{k.replace('_', '-')} "
                     f"{' '.join(map(str, now)) if isinstance(now, tuple) else now}: {why}")
    return "\n".join(lines)


def describe(cls):
    """--help's closing lines: every preset's values."""
    def show(d):
        return ", ".join(f"--{k.replace('_', '-')} "
                         f"{' '.join(map(str, v)) if isinstance(v, tuple) else v}"
                         for k, v in d.items())
    def head(k):
        if k == "synthetic":
            return ("--data synthetic: a CPU-sized config replaces these defaults for every flag "
                    "not given: ")
        return f"--preset {k}: "
    return " | ".join(head(k) + show(v) for k, v in presets(cls).items()) or None
