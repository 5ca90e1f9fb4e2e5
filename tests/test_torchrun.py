"""`torchrun --nproc_per_node=2 <method>.py --data synthetic` runs on CPU (gloo) for every method,
writes a checkpoint of the global step count, and resumes (the loss-level DDP equivalence of each
method is tested in its own test file)."""
import pytest

import common as C
from helpers import torchrun
TINY = ["--model", "nano", "--patch-size", "4", "--img-size", "16", "--batch-size", "4", "--steps-per-epoch", "2",
        "--workers", "0", "--warmup-epochs", "0"]
EXTRA = {"cmae": ["--master-size", "20", "--decoder-dim", "32", "--decoder-depth", "1", "--decoder-heads", "2",
                  "--proj-hidden", "32", "--proj-dim", "16", "--no-knn"],
         "conmim": ["--proj-hidden", "32", "--proj-dim", "16", "--no-knn"],
         "can": ["--decoder-dim", "32", "--decoder-depth", "1", "--decoder-heads", "2", "--proj-hidden", "32",
                 "--proj-dim", "16", "--no-knn"],
         "siammae": ["--decoder-dim", "32", "--decoder-depth", "1", "--decoder-heads", "2", "--gap", "1", "4",
                     "--repeated-sampling", "1"]}


@pytest.mark.parametrize("method", sorted(EXTRA))
def test_torchrun_two_processes_and_resume(method, tmp_path):
    def run(epochs):
        return torchrun(f"{method}.py", "--data", "synthetic", *TINY, *EXTRA[method], "--epochs", str(epochs),
                        "--output-dir", str(tmp_path))
    r = run(1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 process(es)" in r.stdout
    assert C.load_checkpoint(str(tmp_path / "checkpoint.pth"), method)["step"] == 2
    r = run(2)                                                     # same flags, more epochs: resumes
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    assert C.load_checkpoint(str(tmp_path / "checkpoint.pth"), method)["step"] == 4
