"""The house's floors: common.py (the training kit) imports nothing of the repository; harness.py (the run
harness) imports common.py and nothing above it; neither imports a method file, an evaluation script or an
optional helper (gpu_aug.py, gpu_decode.py, synthetic.py are imported by the files that use them, for
their flag); the evaluation scripts import no method file except eval_correspondence (SiamMAE's
decoder is what it measures)."""
import ast
import os

import pytest

from helpers import ROOT

HIGHER = {"msn", "cmae", "conmim", "can", "siammae", "eval_linear", "eval_finetune", "eval_video",
          "eval_correspondence", "gpu_aug", "gpu_decode"}


def imported(path):
    names = set()
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args \
                and isinstance(node.args[0], ast.Constant):
            names.add(node.args[0].value)
    return names


def test_common_imports_nothing_above_it():
    assert not imported("common.py") & (HIGHER | {"harness"}), imported("common.py") & (HIGHER | {"harness"})


def test_the_harness_imports_only_common_below_it():
    """One way: method files -> harness -> common, never back (no circle, no arrow up)."""
    assert "common" in imported("harness.py") and not imported("harness.py") & HIGHER, imported("harness.py") & HIGHER


@pytest.mark.parametrize("path", ["gpu_aug.py", "gpu_decode.py", "synthetic.py", "eval_linear.py", "eval_finetune.py",
                                  "eval_video.py"])
def test_helpers_and_evaluations_import_no_method_file(path):
    assert not imported(path) & {"msn", "cmae", "conmim", "can", "siammae"}
