"""The house's floors: common.py (the training kit) imports nothing of the repository but, for --data synthetic,
synthetic.py; harness.py (the run harness) imports common.py and, for --preset / --help, recipes.py (which imports
nothing of the repository); nothing above them; neither imports a method file, an evaluation script or another
optional helper (gpu_aug.py, gpu_decode.py, weights.py, eval_linear.py are read by the files that use them, for their
flag); weights.py (every weights file read and written) imports common.py alone, and the evaluations import it;
the evaluation scripts import no method file (scripts/ may: eval_correspondence.py reads SiamMAE's decoder); and
neither shared module names a method's own flag."""
import ast
import os

import pytest

from helpers import ROOT

HIGHER = {"msn", "cmae", "conmim", "can", "siammae", "eval_linear", "eval_finetune", "eval_video", "gpu_aug",
          "gpu_decode", "weights"}


def imported(path):
    names = set()
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and (getattr(node.func, "attr", "") in ("import_module", "optional") or
                                             getattr(node.func, "id", "") == "optional") and node.args and \
                isinstance(node.args[0], ast.Constant):
            names.add(node.args[0].value)
    return names


def test_common_imports_nothing_above_it():
    assert imported("common.py") & (HIGHER | {"harness", "synthetic"}) == {"synthetic"}, imported("common.py")


def test_the_weights_module_imports_only_common_and_every_reader_of_weights_imports_it():
    """One module reads and writes weights: it stands on common.py alone (no evaluation, no method file), and every
    tool that takes a weights file reaches it (the evaluations, visualize, the methods' --init)."""
    repo = HIGHER | {"harness", "common", "synthetic", "recipes"}
    assert imported("weights.py") & repo == {"common"}, imported("weights.py") & repo
    for path in ("eval_linear.py", "eval_finetune.py", "eval_video.py", "scripts/visualize.py", "msn.py", "cmae.py",
                 "conmim.py", "can.py", "siammae.py"):
        assert "weights" in imported(path), path


def test_the_harness_imports_only_common_below_it():
    """One way: method files -> harness -> common, never back (no circle, no arrow up)."""
    assert "common" in imported("harness.py") and not imported("harness.py") & HIGHER, imported("harness.py") & HIGHER
    repo = HIGHER | {"harness", "common", "synthetic", "recipes"}
    assert imported("harness.py") & repo == {"common", "recipes"} and not imported("recipes.py") & repo


@pytest.mark.parametrize("path", ["gpu_aug.py", "gpu_decode.py", "synthetic.py", "recipes.py", "eval_linear.py",
                                  "eval_finetune.py", "eval_video.py"])
def test_helpers_and_evaluations_import_no_method_file(path):
    assert not imported(path) & {"msn", "cmae", "conmim", "can", "siammae"}


def test_the_shared_modules_name_no_field_that_only_one_method_has():
    """A method's flags live beside their fields in its file (help, group, range: harness.arg; its own checks:
    Args.check; its preset rules: Args.preset_rules): common.py and harness.py name no field that exactly one
    method's Args has -- as a name, an attribute, a keyword or a string ("--flag-name" too) -- so adding a flag to one
    method never edits them, and a copied method file carries no other method's vocabulary. Comments and docstrings
    may say what a method does; code may not key on its flags."""
    import collections
    import dataclasses
    import importlib
    import harness as H
    count = collections.Counter()
    for m in ("msn", "cmae", "conmim", "can", "siammae"):
        count.update({f.name for f in dataclasses.fields(importlib.import_module(m).Args)}
                     - {f.name for f in dataclasses.fields(H.RunArgs)})
    own = {n for n, c in count.items() if c == 1}
    assert {"num_prototypes", "master_size", "rel_pos_lr", "sigma_max", "gap", "start_lr"} <= own
    for path in ("common.py", "harness.py"):
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef,
                                                                              ast.ClassDef))
                and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        named = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                named.add(node.id)
            elif isinstance(node, ast.Attribute):
                named.add(node.attr)
            elif isinstance(node, ast.keyword):
                named.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                named |= {node.value, node.value.lstrip("-").replace("-", "_")}
        assert not named & own, (path, sorted(named & own))


def test_a_flag_that_several_scripts_declare_has_one_group_and_range_in_all():
    """No central table holds the shared flags' --help group and range: each script writes them beside its own copy
    of the field (arg(group=, positive=, min=)), so the copies must agree: a name every script that declares it
    gives the same group, positivity and lower bound (RunArgs' fields are one copy, inherited)."""
    import collections
    import dataclasses
    import importlib
    seen = collections.defaultdict(dict)
    for m in ("msn", "cmae", "conmim", "can", "siammae", "eval_finetune", "eval_linear", "eval_video",
              "eval_correspondence"):
        for f in dataclasses.fields(importlib.import_module(m).Args):
            seen[f.name][m] = tuple(f.metadata.get(k) for k in ("group", "positive", "min"))
    shared = {k: v for k, v in seen.items() if len(v) > 1}
    assert {"batch_size", "patch_size", "weight_decay", "mask_ratio", "ckpt"} <= set(shared)
    for name, copies in shared.items():
        assert len(set(copies.values())) == 1, (name, copies)


@pytest.mark.parametrize("path", sorted(f for f in os.listdir(ROOT) if f.endswith(".py")))
def test_every_files_code_keeps_within_100_columns(path):
    """One style in every file of the repository's root (the method files, read beside their papers, and what
    they import and the evaluations): a line's code (all before its trailing comment, docstrings included) at
    most 100 columns; ruff's 120 leave room for a shape comment beside it (ruff.toml)."""
    import io
    import tokenize
    src = open(os.path.join(ROOT, path)).read()
    comment = {t.start[0]: t.start[1] for t in tokenize.generate_tokens(io.StringIO(src).readline)
               if t.type == tokenize.COMMENT}
    wide = [(i, len(line[:comment.get(i)].rstrip())) for i, line in enumerate(src.splitlines(), 1)
            if len(line[:comment.get(i)].rstrip()) > 100]
    assert not wide, wide
