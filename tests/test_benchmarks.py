"""benchmarks/: the scripts run and print their tables (speed is never asserted), and the FLOP count behind
the MFU column is the step's."""
import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

import common as C

from helpers import ROOT, run_cli, vit_checkpoint

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))          # throughput, e2e, data: the scripts' functions


def test_throughput_and_data_scripts_run():
    r = run_cli("benchmarks/throughput.py", "--method", "msn", "--model", "nano", "--batch-size", "2",
                "--warmup", "1", "--steps", "1", "--gpu-aug")
    assert r.returncode == 0, r.stderr
    assert "| msn |" in r.stdout and "gpu-aug" in r.stdout
    r = run_cli("benchmarks/data.py", "--method", "conmim", "--device-aug", "--n-images", "16", "--images", "2",
                "--workers", "0", "--batch-size", "4", "--batches", "2")
    assert r.returncode == 0, r.stderr
    row = [c.strip() for c in [ln for ln in r.stdout.splitlines() if ln.startswith("| conmim |")][0].split("|")]
    assert row[2] == "2" and all(float(row[i]) > 0 for i in (3, 4, 5, 6,
                                                             7)) and ("(cpu)" in row[8] or "(cuda)" in row[8])


def test_data_script_times_the_augmentation_against_a_git_revision():
    """--aug-against REV: this checkout's gpu_aug against the file at REV, a row per method with the
    recipe's view sizes; a revision git does not know is one line."""
    r = run_cli("benchmarks/data.py", "--aug-against", "HEAD", "--method", "cmae", "--batch-size", "2",
                "--device", "cpu")
    assert r.returncode == 0, r.stderr
    row = [c.strip() for c in [ln for ln in r.stdout.splitlines() if ln.startswith("| cmae |")][0].split("|")]
    assert row[2] == "224 px" and all(float(row[i]) > 0 for i in (3, 4, 5))
    r = run_cli("benchmarks/data.py", "--aug-against", "no-such-rev", "--method", "cmae", "--device", "cpu")
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith("error: --aug-against no-such-rev")


def test_data_script_times_gpu_decode():
    """MSN's --gpu-decode table: its workers next to the gpu-aug workers, and the device side, all > 0."""
    r = run_cli("benchmarks/data.py", "--method", "msn", "--device-aug", "--n-images", "8", "--images", "1",
                "--workers", "0", "--batch-size", "2", "--batches", "1")
    assert r.returncode == 0, r.stderr
    row = [c.strip() for c in [ln for ln in r.stdout.splitlines() if ln.startswith("| msn |")][1].split("|")]
    assert all(float(row[i]) > 0 for i in (2, 3, 4)) and ("(cpu)" in row[5] or "(cuda)" in row[5])


def test_end_to_end_benchmark_runs_the_real_loop():
    r = run_cli("benchmarks/e2e.py", "--method", "conmim", "--device", "cpu", "--model", "nano", "--img-size", "16",
                "--patch-size", "4", "--batch-size", "4", "--workers", "0", "--steps", "3", "--log-every", "1",
                "--n-images", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    row = [c.strip() for c in [ln for ln in r.stdout.splitlines() if ln.startswith("| conmim |")][0].split("|")]
    assert row[2] == "4" and float(row[3]) > 0 and 0 <= float(row[5]) <= 1


@pytest.mark.parametrize("method, preset", [(m, None) for m in ("msn", "cmae", "conmim", "can", "siammae")] +
                         [(m, "gpu") for m in ("msn", "cmae")])
def test_the_flop_count_behind_mfu_is_what_the_step_computes(method, preset):
    """benchmarks/throughput.py's analytic FLOPs per step (the numerator of its MFU column) equal what torch's
    FlopCounterMode counts while the method's own step runs, forward and backward (attention through the math
    kernel, whose matmuls the counter sees). nano: the heads, decoders and patch embedding weigh most there."""
    import throughput
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    a = argparse.Namespace(model="nano", batch_size=2, micro_batch=0, grad_ckpt=False, precision="fp32",
                           compile=False, gpu_aug=False, preset=preset)      # gpu: the realstep part's recipe
    step, _, analytic, hardware = throughput.setup(method, a, torch.device("cpu"))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        step()
    assert analytic == hardware == counter.get_total_flops()                      # integers: exactly


@pytest.mark.parametrize("method", ["msn", "cmae", "can", "conmim"])
def test_under_micro_batches_the_hardware_count_adds_the_gradient_caches_embedding_pass(method):
    """MFU is model-FLOP: under --micro-batch the model count stays the one-pass step's, and the hardware count adds
    what the step really runs (the gradient cache's no-grad forward: MSN, CMAE, CAN), as FlopCounterMode counts it."""
    import throughput
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    a = argparse.Namespace(model="nano", batch_size=4, micro_batch=0, grad_ckpt=False, precision="fp32",
                           compile=False, gpu_aug=False, preset=None)
    one = throughput.setup(method, a, torch.device("cpu"))[2]
    a.micro_batch = 2                                                  # (BatchNorm needs 2 rows a micro-batch)
    step, _, model, hardware = throughput.setup(method, a, torch.device("cpu"))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        step()
    assert model == one and hardware == counter.get_total_flops()
    assert (hardware > model) == (method in ("msn", "cmae", "can")), (hardware, model)


def test_end_to_end_speed_is_images_over_time_not_the_mean_of_the_rates():
    """benchmarks/e2e.py's summary of a log: 10 steps of 8 images at 100 img/s then 10 at 300 img/s take
    0.8 + 0.267 s for 160 images: 150 img/s (the mean of the rates would say 200); the data-wait share is
    time-weighted too; the records up to the warm-up step and the first record (start-up) never count."""
    import e2e
    recs = [{"step": 10, "img_s": 5.0, "data_wait": 1.0}, {"step": 20, "img_s": 100.0, "data_wait": 0.5},
            {"step": 30, "img_s": 300.0, "data_wait": 0.0}]
    ips, wait = e2e.summary(recs, 8, warm=10)
    assert ips == pytest.approx(150.0) and wait == pytest.approx(0.5 * 0.8 / (0.8 + 80 / 300))
    recs.append({"step": 35, "img_s": 40.0, "data_wait": 0.0})         # a shorter last window (5 steps: 1 s)
    assert e2e.summary(recs, 8, warm=10)[0] == pytest.approx(200 / (0.8 + 80 / 300 + 1.0))
    assert e2e.summary(recs, 8, warm=0)[0] == e2e.summary(recs, 8, warm=10)[0]
    assert e2e.summary(recs, 8, warm=20)[0] == pytest.approx(120 / (80 / 300 + 1.0))     # step 20 is warm-up
    with pytest.raises(SystemExit, match="raise --steps"):
        e2e.summary(recs[:1], 8, warm=0)


def test_the_data_benchmark_times_the_same_views_for_ours_and_the_official_recipe(tmp_path):
    """benchmarks/data.py's ratio compares like with like: for each method with an official recipe, the
    reference pipeline written from it makes as many image views, of the same sizes, as ours (MSN: 2 at 224 +
    10 focal at 96; CMAE, ConMIM, CAN: 2 at 224)."""
    import data
    data.write_folder(str(tmp_path), 2, clips=False)
    shapes = lambda out: [tuple(t.shape) for t in out if getattr(t, "ndim", 0) == 3]   # noqa: E731 (not CMAE's shift)
    for m, n in (("msn", 12), ("cmae", 2), ("conmim", 2), ("can", 2)):
        _, views, _ = data.pipeline(m, str(tmp_path / "images"), False)
        ours, ref = shapes(views[(0, 0)][0]), shapes(data.reference(m)(views.dataset.load(0)[0]))
        assert ours == ref and len(ours) == n, (m, ours, ref)


def test_the_gpu_check_runs_as_a_dry_run_on_the_cpu(tmp_path):
    """SMALL=1 benchmarks/gpu_check.sh: the real-data tier on a generated fixture (packed as a .tar.gz, unpacked
    as on the GPU host), each image method's --preset gpu trained with its k-NN monitor, and the step of that
    preset, with the loop's augmentation; the recipe part (MSN's step by kernel class, CAN's cached step at
    c898b5c and now); the augmentation against a git revision; the data path's items (the loop
    probe's sections, each with its table, none cut at its cap); every part under its cap (cuda-* and tests only
    run pytest; probe runs the loop probe's sections as datapath does). A GPU call can then fail for GPU reasons
    only."""
    out = tmp_path / "out"
    parts = ["datapath", "recipe", "realstep", "aug", "cifar"]   # the calls' other parts run pytest or the probe
    r = subprocess.run(["bash", "benchmarks/gpu_check.sh", *parts], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "SMALL": "1", "OUT": str(out),
                                                    "PYTHON": sys.executable})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = (out / "summary.log").read_text().splitlines()
    assert [ln.split(":")[0] for ln in summary] == parts and all("rc 0" in ln for ln in summary)
    res = json.loads((out / "gpu_cifar.json").read_text())
    assert set(res["methods"]) == {"msn", "cmae", "conmim", "can"} and 0 <= res["pixels"] <= 100
    for m, run in res["methods"].items():
        assert run["steps"] == run["planned_steps"] == 3 and not run["capped"], m         # 3 classes x 8 / batch 8
        assert [n for n, _ in run["knn"]] == [0, 8, 16, 24] and run["model"] == "nano", m   # the monitor: 0 .. 3
        assert (out / f"{m}.log.jsonl").exists(), m                                          # the run's log kept
        assert run["init"] == run["knn"][0][1] and ("online" in run) == (m in ("msn", "conmim")), m
    assert "| CAN (online) | 3 x 8 |" in (out / "cifar.log").read_text()
    recipe = (out / "recipe.log").read_text()
    assert "item rc" not in recipe and recipe.count("| attention | ") == 1, recipe[-2000:]     # MSN's by class
    assert recipe.count("| can | ") == 2 and "/benchmarks/throughput.py --method can" in recipe    # before, after
    rows = [ln for ln in (out / "realstep.log").read_text().splitlines() if ln.startswith("| ") and "img/s" not in ln]
    assert [ln.split("|")[1].strip() for ln in rows] == ["msn", "cmae", "conmim", "can", "siammae"]   # eager only
    assert "no --preset gpu" in rows[-1] and all(float(r.split("|")[2]) > 0 for r in rows[:4])
    assert "| conmim | 224 px |" in (out / "aug.log").read_text()
    probe = (out / "datapath.log").read_text()
    assert "FAILED" not in probe and "item rc" not in probe, probe[-2000:]              # no item failed or ran over
    assert all(f"## {section}" in probe for section in ("loop", "step", "profile", "ops", "aug"))
    for row in ("| cmae | resident | ", "| cmae | workers 0 | ", "| cmae | fixed batch | "):
        assert row in probe, row


def test_the_gpu_tiers_knn_is_eval_linears(tmp_path):
    """benchmarks/gpu_cifar.py decodes the evaluation images once and runs every encoder on them: its k-NN of a
    checkpoint, and of raw pixels, equal eval_linear.py --mode knn's on the same folder."""
    import eval_linear as E
    import weights as W
    import gpu_cifar
    from PIL import Image
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 10), ("test", 5)):
        for c, colour in enumerate(((200, 40, 40), (40, 200, 40), (40, 40, 200))):
            os.makedirs(tmp_path / "d" / split / f"c{c}")
            for i in range(n):                         # a class colour under noise: the k-NN scores are not all equal
                x = (torch.tensor(colour).view(1, 1, 3) + 90 * torch.randn(32, 32, 3, generator=g)).clamp(0, 255)
                Image.fromarray(x.to(torch.uint8).numpy()).save(tmp_path / "d" / split / f"c{c}" / f"{i}.jpg")
    ckpt = vit_checkpoint(tmp_path / "ckpt.pth", "cmae", img_size=32)
    a = argparse.Namespace(data=str(tmp_path / "d"), workers=0, device="cpu")
    images = gpu_cifar.eval_images(a)
    base = dict(data=a.data, mode="knn", workers=0, cache=False, device="cpu")
    assert gpu_cifar.knn(a, images, ckpt) == E.evaluate(E.Args(ckpt=ckpt, **base))["knn_top1"]
    pixels = gpu_cifar.knn(a, images, pixels=True)
    assert pixels == E.evaluate(E.Args(pixels=True, img_size=32, **base))["knn_top1"] and pixels > 100 / 3
    train, test, _ = E.splits(a.data)                  # the features themselves (top-1 alone hides e.g. the pooling)
    for kw, enc in ((dict(ckpt=ckpt), W.load_encoder(ckpt)[0]), (dict(pixels=True), E.Pixels())):
        ea = E.Args(img_size=32, **base, **kw)
        ref = [E.features(ea, enc, {"method": "cmae" if "ckpt" in kw else "pixels", "vit": {"img_size": 32}}, s, ds,
                          torch.device("cpu"))[0] for s, ds in (("train", train), ("val", test))]
        ref = [f - ref[0].mean(0) for f in ref] if "pixels" in kw else ref     # evaluate()'s centring of pixels
        assert all(torch.allclose(g, r, atol=1e-5) for g, r in zip(gpu_cifar.features(a, images, **kw), ref)), kw


def test_the_gpu_tiers_curve_is_its_runs_monitor_and_online_is_the_online_network(tmp_path):
    """gpu_cifar.curve: the points are the run's own k-NN monitor records (images seen = step x batch, top-1), a run
    the time cap cut short gets its last checkpoint scored at its end (eval_linear.py --mode knn of that file), and
    the "online" score is eval_linear.py --online's of the last checkpoint: its `model`'s encoder, not the EMA
    `encoder`."""
    import eval_linear as E
    import weights as W
    import gpu_cifar
    data = str(tmp_path / "d")
    g = torch.Generator().manual_seed(0)
    from PIL import Image
    for split, n in (("train", 12), ("test", 12)):
        for c in range(3):
            os.makedirs(os.path.join(data, split, f"c{c}"))
            for i in range(n):                         # a faint class colour in strong noise: encoders differ in score
                x = torch.full((32, 32, 3), 110.0)
                x[..., c] += 12
                x = (x + 70 * torch.randn(32, 32, 3, generator=g)).clamp(0, 255)
                Image.fromarray(x.to(torch.uint8).numpy()).save(os.path.join(data, split, f"c{c}", f"{i}.png"))
    vit = dict(img_size=32, patch_size=8, dim=32, depth=1, heads=2)
    torch.manual_seed(1)                                # an msn-style checkpoint: encoder = EMA target, model = online
    enc, online = W.ViT(**vit).state_dict(), W.ViT(**vit).state_dict()
    path = str(tmp_path / "run" / "checkpoint.pth")
    os.makedirs(tmp_path / "run")
    C.save_checkpoint(path, {"method": "msn", "vit": vit, "encoder": enc, "args": {"seed": 0}, "epoch": 0, "step": 9,
                             "model": {f"net.encoder.{n}": v for n, v in online.items()}})
    log = [{"step": 0, "knn_top1": 30.0}, {"step": 1, "loss": 2.0}, {"step": 5, "knn_top1": 40.0}]   # capped at 9
    a = argparse.Namespace(data=data, workers=0, device="cpu")
    images = gpu_cifar.eval_images(a)
    points, on = gpu_cifar.curve(a, images, "msn", log, str(tmp_path / "run"), 8)
    base = dict(data=data, mode="knn", workers=0, cache=False, device="cpu")
    last = E.evaluate(E.Args(ckpt=path, **base))["knn_top1"]
    assert points == [[0, 30.0], [40, 40.0], [72, last]]
    assert on == E.evaluate(E.Args(ckpt=path, online=True, **base))["knn_top1"] != last
    whole = log + [{"step": 9, "knn_top1": 50.0}]                    # not capped: the monitor's end, nothing rescored
    points, on = gpu_cifar.curve(a, images, "msn", whole, str(tmp_path / "run"), 8)
    assert points == [[0, 30.0], [40, 40.0], [72, 50.0]]


def test_the_gpu_tiers_record_takes_init_from_the_first_point_and_the_rest_from_the_run():
    """gpu_cifar.record: init is the step-0 score (the run's initial encoder), the end the last point, speed from the
    steps the curve reached, losses from the training records only (a slip reading the end's score as init passed
    the dry run, whose nano encoders score alike before and after 3 steps)."""
    import gpu_cifar
    log = [{"step": 0, "knn_top1": 30.0}, {"step": 1, "loss": 2.0, "img_s": 5.0, "data_wait": 0.1},
           {"step": 2, "loss": 1.5, "img_s": 9.0, "data_wait": 0.3}, {"step": 3, "loss": 1.0, "img_s": 7.0,
                                                                         "data_wait": 0.2},
           {"step": 3, "knn_top1": 45.0}]
    args = argparse.Namespace(batch_size=8, model="nano")
    r = gpu_cifar.record("can", log, [[0, 30.0], [24, 45.0]], None, 12.0, 4, args, True)
    assert (r["init"], r["knn"][-1][1], r["steps"], r["planned_steps"], r["capped"]) == (30.0, 45.0, 3, 4, True)
    assert (r["images_per_second"], r["logged_img_s"], r["first_loss"], r["last_loss"], r["data_wait"]) == (
        2, 9.0, 2.0, 1.0, 0.2) and "online" not in r
    assert gpu_cifar.record("msn", log, [[0, 30.0], [24, 45.0]], 40.0, 12.0, 4, args, False)["online"] == {
        "knn_top1": 40.0}


def test_the_revision_compared_against_can_be_imported_by_name(capsys):
    """--aug-against REV --compile: torch.compile (2.11, on an H100) re-imports the module of a function it traces by
    name, and the old gpu_aug.py, executed from `git show`, was not importable: gpu_check.sh aug failed at 2ec86d5
    with "No module named 'gpu_aug_old'" (torch 2.14 here does not re-import it). The module must be registered."""
    import importlib
    import data
    data.aug_against("HEAD", ["cmae"], 2, torch.device("cpu"), compiled=False, rounds=1)
    assert "| cmae |" in capsys.readouterr().out
    assert callable(importlib.import_module("gpu_aug_old").color_augmenter)


def test_the_recipe_profiles_kernel_classes():
    """throughput.py --profile's classes, on kernel names a compiled H100 / H200 step runs (cuBLAS, CUTLASS, the SDPA
    kernels, Triton's fused ones) and on the CPU's aten ops: a fused norm with its casts is a norm, a flash kernel
    is attention although its name holds "cutlass"; the classes sum to the step on CPU."""
    import throughput as T
    names = {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "GEMM", "nvjet_hsh_128x256_64x4": "GEMM",
             "triton_tem_fused_mm_0": "GEMM", "aten::addmm": "GEMM", "aten::mm": "GEMM",
             "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>": "attention",
             "fmha_cutlassB_bf16_aligned_64x64_k64_sm80": "attention",
             "aten::_efficient_attention_backward": "attention",
             "cudnn_generated_fort_native_sdpa_sm90_flash_fprop": "attention",
             "triton_per_fused__to_copy_native_layer_norm_1": "norm", "aten::native_batch_norm_backward": "norm",
             "triton_poi_fused__to_copy_2": "casts", "aten::copy_": "casts",
             "triton_poi_fused_add_gelu_3": "elementwise",
             "void at::native::vectorized_elementwise_kernel<4>": "elementwise",
             "aten::lerp_": "elementwise"}
    assert {n: T.kernel_class(n) for n in names} == names
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    classes = T.kernel_profile(lambda: model(torch.randn(4, 8)).sum().backward(), 2, torch.device("cpu"))
    assert {"GEMM", "norm"} <= set(classes) and all(ms >= 0 for ms, _ in classes.values())


def test_the_probes_gpu_busy_counts_each_kernel_once():
    """loop_probe's busy time is the union of the device events' intervals: not the CPU op that launched a kernel
    (the profiler charges the kernel's time to it too: a sum counted it twice), not a user annotation, two
    overlapping kernels (streams) once together, whatever the order the profiler lists them in."""
    import loop_probe as P
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent as E
    cuda = dict(device_type=DeviceType.CUDA)
    events = [E(0, "aten::mm", 1, 0, 100), E(1, "gemm", 1, 10, 60, **cuda), E(2, "add", 1, 50, 80, **cuda),
              E(3, "## step ##", 1, 0, 500, is_user_annotation=True, **cuda), E(4, "copy", 1, 100, 110, **cuda)]
    assert P.busy_ms(P.device_intervals(events)) == pytest.approx((70 + 10) / 1000)
    assert P.busy_ms(P.device_intervals(events[::-1])) == pytest.approx((70 + 10) / 1000)   # in any order
    assert P.busy_ms([]) == 0


def test_the_probes_fixed_batch_shuts_the_loaders_workers_down():
    """The `fixed batch` row times the loop without its loader: after the first batch no worker lives on."""
    import multiprocessing

    import loop_probe as P
    class Indices(torch.utils.data.Dataset):                     # the sampler's (index, epoch) -> index
        def __len__(self):
            return 64

        def __getitem__(self, pair):
            return pair[0]
    loader = C.make_loader(Indices(), 4, 2, 0)
    it = iter(P.Fixed(loader))
    first = next(it)
    assert not multiprocessing.active_children()
    assert torch.equal(next(it), first)
