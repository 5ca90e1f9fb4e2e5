"""Bad input as a new user gives it: every case is a one-line error at start, or handled right, never a
traceback and never silently wrong training or evaluation."""
import importlib
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch

import can
import common as C
import harness as H
import synthetic as S
import eval_linear as E
import weights as W
from helpers import one_line_error, run_cli
from test_can import tiny_args
from test_faults import CAN_CLI


def _png(path, i, split="train"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    S.synthetic_image(i, split=split)[0].save(path)


def _timm_ckpt(path):
    torch.manual_seed(0)
    torch.save(W.ViT(16, 4, 192, 1, 3).state_dict(), path)        # a timm-layout ViT-Ti-width file
    return str(path)


def _eval(tmp_path, data, **kw):
    return E.evaluate(E.Args(ckpt=_timm_ckpt(tmp_path / "w.pth"), data=str(data), mode="knn", workers=0,
                             device="cpu", cache=False, **kw))


def test_eval_matches_val_classes_to_train_by_name(tmp_path):
    """val/ without class a: its b images are exact copies of train/b's, so 1-NN must be 100%
    (matched by position, b took a's index 0 and scored 0.0)."""
    for c, idx in (("a", range(0, 4)), ("b", range(4, 8))):
        for i in idx:
            _png(tmp_path / "d" / "train" / c / f"{i}.png", i)
    os.makedirs(tmp_path / "d" / "val" / "b")
    for i in range(4, 8):
        shutil.copy(tmp_path / "d" / "train" / "b" / f"{i}.png", tmp_path / "d" / "val" / "b")
    res = _eval(tmp_path, tmp_path / "d", k=1)
    assert res["knn_top1"] == 100.0 and res["train_classes"] == 2 and res["val_classes"] == 1
    enc, _ = W.load_encoder(_timm_ckpt(tmp_path / "w.pth"))         # the training scripts' k-NN monitor too
    from helpers import knn_monitor
    assert knn_monitor(enc, str(tmp_path / "d"), 16)[0](1)["knn_top1"] == _eval(tmp_path, tmp_path / "d",
                                                                               pool="mean")["knn_top1"]
    _png(tmp_path / "d" / "val" / "c" / "0.png", 0)               # a class train does not have
    with pytest.raises(C.UserError, match="val/ has 1 class.*that train/ lacks.*'c'"):
        _eval(tmp_path, tmp_path / "d")


def test_eval_checks_the_layout_before_extracting_features(tmp_path):
    for i in range(4):
        _png(tmp_path / "d" / "train" / "a" / f"{i}.png", i)
    with pytest.raises(C.UserError, match="expected train/ and val/"):
        E.evaluate(E.Args(ckpt=_timm_ckpt(tmp_path / "w.pth"), data=str(tmp_path / "d"), workers=0, device="cpu"))
    assert not os.path.exists(tmp_path / "features")             # nothing was extracted or cached


@pytest.mark.parametrize("kw,msg", [(dict(k=0), "--k must be positive"), (dict(img_size=30), "--img-size 30 is not"),
                                    (dict(temperature=-1.0), "--temperature must be positive"),
                                    (dict(lambd=float("nan")), "--lambd"), (dict(percent=float("nan")), "--percent"),
                                    (dict(linear_lr=float("inf")), "--linear-lr must be a finite number, got inf"),
                                    (dict(lambd=float("inf")), "--lambd must be a finite number, got inf"),
                                    (dict(percent=101.0), r"--percent must be in \[0, 100\], got 101")])
def test_eval_flags_are_validated(kw, msg, tmp_path):
    """(--lambd nan passed and every low-shot score came out 0.0; --linear-lr inf and --lambd inf reported 0.0.)"""
    with pytest.raises(C.UserError, match=msg):
        _eval(tmp_path, "synthetic", **kw)


def test_max_unreadable_counts_distinct_files_not_retries(tmp_path):
    """4 bad files of 20, 3 of them adjacent: reading every index once meets 4 distinct bad files
    (counting retries gave 7, and stopped a run at --max-unreadable 0.3)."""
    for i in range(20):
        _png(tmp_path / "d" / "a" / f"{i:02d}.png", i)
    for i in (3, 4, 5, 12):
        (tmp_path / "d" / "a" / f"{i:02d}.png").write_bytes(b"not an image")
    ds = C.image_dataset(str(tmp_path / "d"), skip_unreadable=True)
    for i in range(len(ds)):
        ds.load(i)
    assert C.bad_reads(ds) == 4
    C.check_unreadable(ds, 20, 0, 0.3, final=True)               # 4 / 20 <= 0.3: no stop


def test_resuming_with_another_batch_size_is_refused(tmp_path):
    """The batch is part of the recipe (steps per epoch, the lr where it scales with the batch, every per-step
    schedule): a rerun with another --batch-size is another experiment."""
    can.train(tiny_args(tmp_path, epochs=2, steps_per_epoch=2, stop_epoch=1))
    with pytest.raises(C.UserError, match=r"trained with other settings \(--batch-size 8 -> 4\).*--no-resume"):
        can.train(tiny_args(tmp_path, batch_size=4, epochs=2, steps_per_epoch=4))


def test_a_rerun_resumes_only_the_same_experiment_and_says_when_nothing_is_left_to_train(tmp_path, capsys):
    """Rerunning a command resumes it (preemption needs that); --epochs may grow (said: the schedules follow);
    run-control flags change silently; any other flag (here --weight-decay, --mask-ratio) is another
    experiment: refused in one line naming the flags and the two ways out, and --no-resume starts over.
    A rerun past the end trains nothing and says so."""
    can.train(tiny_args(tmp_path, epochs=2, steps_per_epoch=2, stop_epoch=1))
    capsys.readouterr()
    wd = can.Args.weight_decay
    for kw, flags in ((dict(weight_decay=2 * wd), f"--weight-decay {wd} -> {2 * wd}"),
                      (dict(mask_ratio=0.75, epochs=3), f"--mask-ratio {can.Args.mask_ratio} -> 0.75")):
        with pytest.raises(C.UserError, match="was trained with other settings") as e:
            can.train(tiny_args(tmp_path, **{"epochs": 2, "steps_per_epoch": 2, **kw}))
        assert flags in str(e.value) and "--no-resume" in str(e.value) and "--output-dir" in str(e.value)
        assert "--epochs" not in str(e.value)
    assert C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")["step"] == 2      # untouched
    can.train(tiny_args(tmp_path, epochs=3, steps_per_epoch=2, log_every=5, workers=1))
    said = capsys.readouterr().out
    assert "resuming with --epochs 2 -> 3: the schedules follow" in said
    assert "--log-every" not in said and "--workers" not in said     # run-only flags change without a word
    assert C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")["step"] == 6
    can.train(tiny_args(tmp_path, epochs=3, steps_per_epoch=2))
    said = capsys.readouterr().out
    assert "resuming with" not in said
    assert "the checkpoint is at step 6 and this run ends at step 6 (--epochs 3)" in said
    can.train(tiny_args(tmp_path, epochs=1, steps_per_epoch=2, weight_decay=2 * wd, resume=False))
    assert C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")["step"] == 2      # --no-resume: a new run


def test_a_rerun_after_stop_step_trains_nothing(tmp_path, capsys):
    """--stop-step N, then the same command again: the checkpoint stays at N and the run says so (it
    trained one more step per rerun: 'stopping after step 31 (--stop-step 31)')."""
    for _ in range(3):
        can.train(tiny_args(tmp_path, epochs=2, steps_per_epoch=3, stop_step=2))
        assert C.load_checkpoint(str(tmp_path / "checkpoint.pth"), "can")["step"] == 2
    said = capsys.readouterr().out
    assert said.count("stopping after step 2 (--stop-step 2)") == 1
    assert "the checkpoint is at step 2 and this run ends at step 2 (--stop-step 2): nothing to train" in said


@pytest.mark.parametrize("kw,msg", [
    (dict(device="tpu"), "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    (dict(lr=float("nan")), "--lr must be a finite number, got nan"),
    (dict(output_dir="/proc/foo"), "--output-dir /proc/foo is not a writable directory"),
])
def test_train_flags_are_one_line_errors_at_start(kw, msg, tmp_path):
    with pytest.raises(C.UserError, match=msg.replace("(", r"\(")):
        can.train(tiny_args(tmp_path, **kw))


def test_knn_without_a_val_split_or_with_a_val_class_train_lacks_is_refused_at_start(tmp_path):
    """--knn reads DATA/val/ (else test/) at step 0 and after the last epoch: a folder without it, or whose val/ has
    a class that train/ lacks, or an unreadable val/ image, is refused before any step (each failed at the end of the
    run once)."""
    for i in range(8):
        _png(tmp_path / "d" / "train" / f"c{i % 2}" / f"{i}.png", i)
    with pytest.raises(C.UserError, match=r"--knn / --eval-every: --data .*: expected train/ and val/ class folders"):
        can.train(tiny_args(tmp_path / "o", data=str(tmp_path / "d"), knn=True))
    assert not os.path.exists(tmp_path / "o" / "log.jsonl")
    _png(tmp_path / "d" / "val" / "c9" / "0.png", 0, "val")                          # a class train/ lacks
    with pytest.raises(C.UserError, match=r"--knn / --eval-every: .*val/ has 1 class\(es\) that train/ lacks, e.g. "
                                          r"'c9'"):
        can.train(tiny_args(tmp_path / "o", data=str(tmp_path / "d"), eval_every=1))
    assert not os.path.exists(tmp_path / "o" / "log.jsonl")                           # refused before any step
    shutil.move(tmp_path / "d" / "val" / "c9", tmp_path / "d" / "val" / "c0")
    (tmp_path / "d" / "val" / "c0" / "broken.png").write_bytes(b"not an image")
    with pytest.raises(C.UserError, match=r"cannot read image .*broken.png"):
        can.train(tiny_args(tmp_path / "o", data=str(tmp_path / "d"), knn=True))
    assert not os.path.exists(tmp_path / "o" / "log.jsonl")
    os.remove(tmp_path / "d" / "val" / "c0" / "broken.png")
    can.train(tiny_args(tmp_path / "o", data=str(tmp_path / "d"), knn=True))          # with val/: trains, reports
    assert [json.loads(r)["step"] for r in open(tmp_path / "o" / "log.jsonl") if "knn_top1" in r] == [0, 2]


@pytest.mark.parametrize("method,kw,msg", [
    ("can", dict(betas=(1.5, 0.9)), "--betas must be two numbers in [0, 1) (AdamW's beta1 beta2), got (1.5, 0.9)"),
    ("can", dict(seed=-1), "--seed must be >= 0, got -1"),
    ("can", dict(weights=(-1.0, 0.5, 0.5)), "--weights (loss weights) must be >= 0 and not all 0"),
    ("can", dict(weights=(0.0, 0.0, 0.0)), "--weights (loss weights) must be >= 0 and not all 0"),
    ("msn", dict(rand_views=0), "--rand-views must be positive, got 0"),
    ("msn", dict(num_prototypes=1), "--num-prototypes must be >= 2 (a softmax over one prototype is constant"),
    ("cmae", dict(decoder_dim=16, decoder_heads=3), "--decoder-dim 16 is not divisible by --decoder-heads 3"),
    ("can", dict(decoder_dim=16, decoder_heads=3), "--decoder-dim 16 is not divisible by --decoder-heads 3"),
    ("siammae", dict(decoder_dim=16, decoder_heads=3), "--decoder-dim 16 is not divisible by --decoder-heads 3"),
    ("siammae", dict(gap=(0, 3)), "--gap must be 1 <= min <= max frames (0 pairs a frame with itself), got (0, 3)"),
    ("siammae", dict(gap=(5, 3)), "--gap must be 1 <= min <= max frames"),
    ("cmae", dict(decoder_depth=0), "--decoder-depth must be >= 1 (a masked patch sees the visible ones only through "
                                    "them), got 0"),
    ("can", dict(decoder_depth=0), "--decoder-depth must be >= 1"),
    ("siammae", dict(decoder_depth=-1), "--decoder-depth must be >= 1"),
    ("msn", dict(ipe_scale=0.5), "--ipe-scale must be >= 1 (the schedules span ipe-scale x the run"),
    ("msn", dict(ema=(0.996, 1.5)), "--ema momentum must be in [0, 1], got (0.996, 1.5)"),
    ("cmae", dict(ema=-0.1), "--ema momentum must be in [0, 1], got -0.1"),
    ("cmae", dict(master_size=200), "--master-size 200 is smaller than --img-size 224"),
    ("can", dict(drop_path=1.0), "--drop-path must be in [0, 1), got 1.0"),
    ("conmim", dict(max_unreadable=1.0), "--max-unreadable must be in [0, 1), got 1.0"),
])
def test_flags_torch_or_numpy_would_reject_late_or_never(method, kw, msg):
    """Found by passing each Args field a bad value: AdamW's ValueError and numpy's for a negative seed
    were tracebacks, negative CAN loss weights and a SiamMAE gap of 0 (a frame paired with itself)
    trained silently, a reversed gap failed in a DataLoader worker, MSN without a random view and decoder widths
    that the heads do not divide failed in the step, MSN with one prototype trained on a constant loss."""
    args = importlib.import_module(method).Args(data="synthetic", **kw)
    with pytest.raises(C.UserError, match=re.escape(msg)):
        H.validate(args)
    H.validate(importlib.import_module(method).Args(data="synthetic"))        # the defaults pass


@pytest.mark.parametrize("method, ratio, msg", [(m, 0.0, "masks no "
                                                         "patch") for m in ("cmae", "can", "conmim", "siammae")]
                         + [(m, 0.999, "masks all") for m in ("msn", "cmae", "can", "conmim")])
def test_a_mask_ratio_that_masks_no_patch_or_every_patch_is_a_one_line_error(method, ratio, msg, tmp_path):
    """The reconstruction / masked-patch losses average over masked patches: with none (--mask-ratio 0)
    the first step's loss was NaN, reported as 'lower --lr'. A ratio below 1 whose int() rounding keeps
    no patch (0.999 of a small grid, or of 196) left the encoder none of the image: CAN's pooled feature
    was NaN, the others trained silently on position embeddings alone. MSN's --mask-ratio 0 (no patch
    drop) stays valid, and so does SiamMAE's f2 masked whole (the decoder still reads f1 through its
    cross-attention: predicting the next frame from the last)."""
    tiny = importlib.import_module(f"test_{method}").tiny_args
    with pytest.raises(C.UserError, match=f"--mask-ratio {ratio} {msg}"):
        importlib.import_module(method).train(tiny(tmp_path, mask_ratio=ratio))


@pytest.mark.parametrize("method, ratio", [("msn", 0.0), ("siammae", 0.999)])
def test_msn_without_patch_drop_and_siammae_with_all_of_f2_masked_train(method, ratio, tmp_path):
    """The two ratios the check above must let through: MSN's anchors without patch drop (its loss needs
    no masked patch) and SiamMAE's second frame masked whole (the decoder reads f1)."""
    tiny = importlib.import_module(f"test_{method}").tiny_args
    importlib.import_module(method).train(tiny(tmp_path, mask_ratio=ratio, stop_step=1))
    assert os.path.isfile(tmp_path / "checkpoint.pth")


def test_the_mask_ratio_check_leaves_the_seeded_random_stream_alone():
    """The check draws the method's masking once, right after setup seeded the run: without fork_rng the
    initial weights (and the README's synthetic results) would move."""
    torch.manual_seed(0)
    state = torch.get_rng_state()
    H.check_mask_ratio(0.75, lambda: can.random_masking(1, 4, 0.75)[2].sum(), 16)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_warm_up_may_start_from_zero():
    """MSN's --start-lr 0 (a warm-up from 0, as MAE's) is valid; a negative one is not."""
    import msn
    H.validate(msn.Args(data="synthetic", start_lr=0.0))
    with pytest.raises(C.UserError, match="--start-lr must be >= 0, got -0.1"):
        H.validate(msn.Args(data="synthetic", start_lr=-0.1))


def test_a_schedule_end_or_start_above_the_peak_lr_is_a_one_line_error():
    """--min-lr / --start-lr / --warmup-lr above the peak lr (absolute, or blr x batch / 256) made the
    'cosine decay' rise or the 'warm-up' fall, silently."""
    import cmae
    import msn
    import eval_finetune
    with pytest.raises(C.UserError, match="--min-lr 0.001 is above the peak lr 0.0006"):
        H.validate(cmae.Args(data="synthetic", blr=1.5e-4, batch_size=1024, min_lr=1e-3))
    H.validate(cmae.Args(data="synthetic", blr=1.5e-4, batch_size=1024, min_lr=6e-4))       # equal: flat
    with pytest.raises(C.UserError, match="--start-lr 0.01 is above the peak lr 0.001"):
        H.validate(msn.Args(data="synthetic", lr=1e-3, start_lr=1e-2))
    with pytest.raises(C.UserError, match="--warmup-lr 0.1 is above the peak lr 0.004"):
        H.validate(eval_finetune.Args(data="synthetic", lr=4e-3, warmup_lr=0.1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_device_cuda_without_a_gpu_is_a_one_line_error(tmp_path):
    one_line_error(run_cli(*CAN_CLI, "--data", "synthetic", "--device", "cuda", "--output-dir", str(tmp_path)),
                   "--device cuda: no CUDA GPU is available here")


def test_unusable_output_dirs_are_one_line_errors_at_start(tmp_path):
    (tmp_path / "a_file").write_text("")
    one_line_error(run_cli(*CAN_CLI, "--data", "synthetic", "--output-dir", str(tmp_path / "a_file")),
                   "is not a writable directory")
    with pytest.raises(C.UserError, match="is not a writable directory"):
        can.train(tiny_args(tmp_path / "a_file" / "sub"))
    if os.geteuid() != 0:                                         # root writes into read-only directories
        os.makedirs(tmp_path / "ro")
        os.chmod(tmp_path / "ro", 0o500)
        with pytest.raises(C.UserError, match="is not a writable directory"):
            can.train(tiny_args(tmp_path / "ro" / "out"))


@pytest.mark.parametrize("how", ["full disk", "not writable"])
def test_a_log_that_cannot_be_written_is_a_one_line_error(how, tmp_path, monkeypatch):
    if how == "full disk" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    real = C.Logger.__init__

    def started(self, *a, **kw):                                 # the disk fills once the run has started
        real(self, *a, **kw)
        if how == "full disk":
            os.symlink("/dev/full", self.path)                   # every write: ENOSPC
        else:
            os.makedirs(self.path)                               # open(..., "a") fails
    monkeypatch.setattr(C.Logger, "__init__", started)
    with pytest.raises(C.UserError, match="cannot write the log .*log.jsonl"):
        can.train(tiny_args(tmp_path))


def test_a_missing_data_dir_is_the_only_line_and_a_run_writes_its_args(tmp_path):
    """--data /nonexistent: one line on stderr and nothing printed before it (the batch plan came first);
    a run writes <output-dir>/args.json with every flag; --workers defaults to min(10, usable CPUs)."""
    import json
    from helpers import run_cli
    r = run_cli("can.py", "--data", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "o"))
    one_line_error(r, "no such directory")
    assert r.stdout == ""
    can.train(tiny_args(tmp_path / "run", epochs=1, steps_per_epoch=1))
    saved = json.load(open(tmp_path / "run" / "args.json"))
    assert saved["mask_ratio"] == can.Args.mask_ratio and saved["output_dir"] == str(tmp_path / "run")
    assert H.RunArgs().workers == min(10, len(os.sched_getaffinity(0)))


def test_a_checkpoint_with_a_non_finite_weight_is_one_line_naming_the_tensor(tmp_path, monkeypatch):
    """A corrupted or diverged file: eval_linear scored 0.0 on every metric with exit 0, eval_finetune stopped
    advising "lower --lr". Both now name the tensor; and features that overflow are refused, not scored."""
    import eval_finetune as FT
    from helpers import vit_checkpoint
    from test_eval_linear import tiny_folder
    data = tiny_folder(tmp_path / "d")
    ck = vit_checkpoint(tmp_path / "c.pth", "cmae")
    c = torch.load(ck, weights_only=True)
    c["encoder"]["blocks.0.attn.qkv.weight"][3, 1] = float("nan")
    torch.save(c, ck)
    with pytest.raises(C.UserError, match=r"c.pth: the encoder's blocks.0.attn.qkv.weight holds NaN or infinite"):
        E.evaluate(E.Args(ckpt=ck, data=data, workers=0, device="cpu", cache=False))
    with pytest.raises(C.UserError, match=r"the encoder's blocks.0.attn.qkv.weight holds NaN"):
        FT.finetune(FT.Args(ckpt=ck, data=data, output_dir=str(tmp_path / "o")))
    E.evaluate(E.Args(ckpt=ck, data=data, workers=0, device="cpu", cache=False, random_init=True))   # not read
    monkeypatch.setattr(E, "features_of", lambda enc, x, how, tokens=False: torch.full((len(x), 4), float("inf")))
    with pytest.raises(C.UserError, match="the encoder gave NaN or infinite features for 18 of 18 images"):
        E.evaluate(E.Args(ckpt=vit_checkpoint(tmp_path / "ok.pth", "cmae"), data=data, workers=0, device="cpu",
                          cache=False))


def test_a_16_bit_greyscale_png_is_scaled_to_8_bits_not_clipped_to_white(tmp_path):
    """Pillow opens a 16-bit greyscale PNG as mode I;16 and its convert("RGB") clips every value above 255 (99.7% of
    the pixels white): the readers scale it to 8 bits instead; a 32-bit float image is refused in one line."""
    from PIL import Image
    g = (np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16)          # 0 .. 65520
    Image.fromarray(g).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    for x in (np.asarray(C.read_image(tmp_path / "g16.png")),
              C.to_uint8(Image.open(tmp_path / "g16.png")).permute(1, 2, 0).numpy()):
        assert x.shape == (64, 64, 3) and (x == (g >> 8)[..., None]).all()
    Image.fromarray(g.astype(np.float32)).save(tmp_path / "f.tif")
    os.makedirs(tmp_path / "d" / "a")
    os.rename(tmp_path / "f.tif", tmp_path / "d" / "a" / "f.tif")
    with pytest.raises(C.UserError, match=r"cannot read image .*f.tif: F \(32-bit\) pixels: save the image with 8"):
        C.ImageFiles(str(tmp_path / "d")).load(0)


def test_a_fine_tuned_checkpoint_is_pooled_as_fine_tuning_trained_it(tmp_path):
    """eval_finetune trains its head on the mean patch token: eval_linear pools its checkpoints by the mean token,
    not by CLS (the default for a method it does not know)."""
    from helpers import vit_checkpoint
    from test_eval_linear import tiny_folder
    ck = vit_checkpoint(tmp_path / "f.pth", "finetune")
    res = E.evaluate(E.Args(ckpt=ck, data=tiny_folder(tmp_path / "d"), workers=0, device="cpu", cache=False))
    assert res["pool"] == "mean"


@pytest.mark.parametrize("script,kw,msg", [
    ("eval_video", dict(data="synthetic", temperature=float("inf")), "--temperature must be a finite number, got inf"),
    ("eval_video", dict(data="synthetic", topk=0), "--topk must be positive, got 0"),
    ("eval_video", dict(data="synthetic", n_context=-1), "--n-context must be >= 0, got -1"),
    ("eval_correspondence", dict(pairs=0), "--pairs must be positive, got 0")])
def test_every_evaluation_checks_its_flags_by_the_training_scripts_rules(script, kw, msg):
    """Each evaluation runs harness.validate's rules (ranges from each field's metadata, finite numbers) before it
    reads anything: infinite numbers are one-line errors in every script."""
    mod = importlib.import_module(script)
    with pytest.raises(C.UserError, match=msg):
        mod.evaluate(mod.Args(ckpt="absent.pth", **kw))


def test_the_k_nn_bank_skips_an_unreadable_training_image_as_training_does(tmp_path):
    """--max-unreadable 0.2 trains past an unreadable train/ image; the k-NN monitor's bank (train/) reads it the same
    way (it read train/ strictly: the run trained, then stopped at its first evaluation, losing the steps since its
    last checkpoint). The queries (val/) stay strict, checked at the start."""
    for i in range(8):
        _png(tmp_path / "d" / "train" / f"c{i % 2}" / f"{i}.png", i)
    for i in range(2):
        _png(tmp_path / "d" / "val" / f"c{i}" / f"{i}.png", i, "val")
    (tmp_path / "d" / "train" / "c0" / "broken.png").write_bytes(b"not an image")
    can.train(tiny_args(tmp_path / "o", data=str(tmp_path / "d"), eval_every=2, max_unreadable=0.2, batch_size=4))
    assert [json.loads(r)["step"] for r in open(tmp_path / "o" / "log.jsonl") if "knn_top1" in r] == [0, 2, 4]


# ----------------------------------------------------------------------------------------------
# Slips a test let through once (one line each, made by hand): each of these fails on its slip
# ----------------------------------------------------------------------------------------------
def test_a_tuple_flag_is_checked_finite_element_by_element():
    """--weights 0.03 inf 0.3: a tuple flag's elements pass the same finite check as a number flag's."""
    with pytest.raises(C.UserError, match=r"--weights must be a finite number, got \(0.03, inf, 0.3\)"):
        H.validate(tiny_args("/tmp/unused", weights=(0.03, float("inf"), 0.3)))


def test_features_with_one_non_finite_row_are_refused():
    """One NaN image among finite ones is refused (a check of "none finite" let it through, scoring it)."""
    enc = W.ViT(16, 4, 32, 1, 2).eval()
    x = torch.randn(3, 3, 16, 16)
    x[1, 0, 0, 0] = float("nan")
    loader = [(x, torch.zeros(3, dtype=torch.long))]
    with pytest.raises(C.UserError, match="NaN or infinite features for 1 of 3 images"):
        E.extract_features(enc, loader, torch.device("cpu"), lambda e, v: E.features_of(e, v, "mean"))


def test_a_big_endian_16_bit_image_is_scaled_as_the_little_endian_one(tmp_path):
    """Mode I;16B (big-endian 16-bit greyscale, as some TIFF writers save it) is scaled to 8 bits like I;16."""
    from PIL import Image
    g = (np.arange(32 * 32).reshape(32, 32) * 64).astype(np.uint16)
    img = Image.frombytes("I;16B", (32, 32), g.astype(">u2").tobytes())
    x = np.asarray(C.to_rgb(img))
    assert x.shape == (32, 32, 3) and (x == (g >> 8)[..., None]).all()


def test_embed_refuses_an_unreadable_image_rather_than_giving_it_anothers_features(tmp_path):
    """--mode embed reads each image as it is: an unreadable one is a one-line error naming it (a reader that skipped
    it gave that row the next image's features)."""
    from helpers import vit_checkpoint
    for i in range(3):
        _png(tmp_path / "d" / f"{i}.png", i)
    (tmp_path / "d" / "1b.png").write_bytes(b"not an image")
    with pytest.raises(C.UserError, match=r"cannot read image .*1b.png"):
        E.evaluate(E.Args(ckpt=vit_checkpoint(tmp_path / "c.pth", "msn"), data=str(tmp_path / "d"), mode="embed",
                          output=str(tmp_path / "out"), workers=0))


def test_the_lock_file_names_its_holder_alone(tmp_path):
    """<output-dir>/.lock holds this process's name only (a stale holder's text left in it was reported as the holder
    of a later, unrelated refusal)."""
    os.makedirs(tmp_path / "o")
    (tmp_path / "o" / ".lock").write_text("pid 99999 on a-dead-node and more text")
    f = H.claim_dir(str(tmp_path / "o"), "--output-dir")
    f.seek(0)
    assert f.read() == f"pid {os.getpid()} on {os.uname().nodename}"
    f.close()
