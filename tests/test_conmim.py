"""conmim.py: the loss against a per-image, per-patch loop (varying masked counts), stop-gradient
on the teacher, [MASK] token gradient, masks, DDP equivalence, end to end + resume."""
import copy
import json
import os
import sys

import pytest
import torch

import common as C
import conmim
import recipes
from ddp import spawn
from helpers import ROOT, exact_resume, one_line_error, run_cli


def naive_conmim(student, teacher, mask, tau):
    """L = mean over (b, j masked) of -log exp(<s_bj, t_bj>/tau) / sum_i exp(<s_bj, t_bi>/tau)."""
    total, count = 0.0, 0
    B, N, _ = student.shape
    for b in range(B):
        for j in range(N):
            if mask[b, j] != 1:
                continue
            s = student[b, j] / student[b, j].norm()
            sims = [torch.dot(s, teacher[b, i] / teacher[b, i].norm()) / tau for i in range(N)]
            total = total - torch.log(torch.exp(sims[j]) / sum(torch.exp(x) for x in sims))
            count += 1
    return total / count


@pytest.mark.parametrize("B,N,d,tau", [(2, 4, 3, 0.1), (3, 9, 5, 0.2), (1, 6, 4, 1.0)])
def test_conmim_loss_matches_naive_with_varying_mask_counts(B, N, d, tau):
    g = torch.Generator().manual_seed(N)
    s = torch.randn(B, N, d, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(B, N, d, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(B, N, dtype=torch.float64)
    for b in range(B):                                   # b + 1 masked patches in image b
        mask[b, torch.randperm(N, generator=g)[:b + 1]] = 1
    loss = conmim.conmim_loss(s, t, mask, tau)
    ref = naive_conmim(s, t.detach(), mask, tau)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss, s, retain_graph=True)[0], torch.autograd.grad(ref, s)[0])
    loss.backward()
    assert t.grad is None                                # teacher: stop-gradient


def test_negatives_are_only_patches_of_the_same_image():
    s, t = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    mask = torch.ones(2, 4)
    t2 = t.clone()
    t2[1] = torch.randn(4, 3)                            # changing image 1 leaves image 0's terms alone
    l_a = conmim.conmim_loss(s[:1], t[:1], mask[:1])
    assert torch.allclose(l_a, conmim.conmim_loss(s[:1], t2[:1], mask[:1]))
    assert not torch.allclose(conmim.conmim_loss(s, t, mask), conmim.conmim_loss(s, t2, mask))


def tiny_args(tmp, **kw):
    base = dict(data="synthetic", output_dir=str(tmp), model="nano", patch_size=4, img_size=16, epochs=2,
                steps_per_epoch=2, batch_size=8, warmup_epochs=1, proj_hidden=32, proj_dim=16, workers=0,
                log_every=1, knn=False)
    base.update(kw)
    return conmim.Args(**base)


def test_weak_view_is_the_crop_alone_and_the_strong_view_adds_colour():
    """Official data pipeline: one flip + crop shared by both views; the student's weak view has no
    photometric op, the teacher's strong view gets STRONG (jitter, blur, solarize) on that crop."""
    import synthetic as S
    views = conmim.WeakStrongViews(tiny_args("/tmp/unused", gpu_aug=False))
    changed = []
    for seed, img in enumerate(S.SyntheticImages().load(i)[0] for i in range(6)):
        torch.manual_seed(seed)
        weak, strong = views(img)
        torch.manual_seed(seed)
        assert torch.equal(weak, C.to_uint8(views.crop(img)))
        changed.append(not torch.equal(strong, weak))
    assert sum(changed) >= 3                          # jitter alone is applied with p = 0.8


def test_student_gradients_mask_token_and_teacher_stop_gradient():
    a = tiny_args("/tmp/unused", drop_path=0.0)
    model = conmim.Net(a)
    teacher = copy.deepcopy(model).requires_grad_(False)
    x_w, x_s = torch.randn(8, 3, 16, 16), torch.randn(8, 3, 16, 16)
    mask = conmim.random_masking(8, 4, 0.75, 2)
    assert (mask.sum(1) == 12).all()                     # 3 of 4 2x2 blocks
    s = model(x_w, mask)
    assert s.shape == (8, 16, 16)
    loss = conmim.conmim_loss(s, teacher(x_s), mask)
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
    assert model.mask_token.grad.abs().sum() > 0
    assert all(p.grad is None for p in teacher.parameters())


def test_the_logged_symmetry_measures_read_the_students_outputs_and_table():
    """`rpb` is the max |b| of the STUDENT's bias table (the one trained at --rel-pos-lr; the teacher's lags it by the
    EMA horizon) and `sym` the masked_symmetry of the student's outputs, as train_step returns them on a log step
    (diagnose=True: the loop's log.due); on the others the step computes neither (its time is the objective's)."""
    a = tiny_args("/tmp/unused", drop_path=0.0)
    torch.manual_seed(0)
    student = conmim.Net(a)
    teacher = copy.deepcopy(student).requires_grad_(False)
    with torch.no_grad():
        student.encoder.rel_pos_bias.relative_position_bias_table.normal_(0, 0.5)   # the teacher's stays at 0
    x_w, x_s, mask = torch.randn(8, 3, 16, 16), torch.randn(8, 3, 16, 16), conmim.random_masking(8, 4, 0.75, 1)
    _, parts = conmim.train_step(student, teacher, x_w, x_s, mask, a)
    assert set(parts) == {"loss"}
    _, parts = conmim.train_step(student, teacher, x_w, x_s, mask, a, diagnose=True)
    table = student.encoder.rel_pos_bias.relative_position_bias_table
    assert parts["rpb"].item() == table.abs().max().item() > 0.5
    with torch.no_grad():
        assert parts["sym"].item() == pytest.approx(conmim.masked_symmetry(student(x_w, mask), mask).item(), abs=1e-6)


def test_a_run_logging_every_few_steps_logs_the_symmetry_on_its_log_steps(tmp_path):
    """The loop's steps between log steps report fewer parts (no `sym`, `rpb`): the run goes on (the non-finite
    watch sees the loss and the gradient norm of every step) and each logged record has both."""
    conmim.train(tiny_args(tmp_path, log_every=3, epochs=2, steps_per_epoch=3))
    recs = [json.loads(line) for line in open(tmp_path / "log.jsonl") if '"loss"' in line]
    assert [r["step"] for r in recs] == [3, 6] and all("sym" in r and "rpb" in r for r in recs)


def _ddp_worker(rank, world, s, t, mask):
    b = s.shape[0] // world
    sl = slice(rank * b, (rank + 1) * b)
    s_loc = s[sl].clone().requires_grad_()
    loss = conmim.conmim_loss(s_loc, t[sl], mask[sl])
    loss.backward()
    return loss.detach(), s_loc.grad


def test_ddp_two_processes_equal_one_process():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(4, 16, 5, generator=g, dtype=torch.float64), torch.randn(4, 16, 5, generator=g,
                                                                                dtype=torch.float64)
    mask = conmim.random_masking(4, 4, 0.75, 2)         # equal masked counts per image
    s1 = s.clone().requires_grad_()
    loss1 = conmim.conmim_loss(s1, t, mask.double())
    loss1.backward()
    (l0, g0), (l1, g1) = spawn(_ddp_worker, s, t, mask.double())
    torch.testing.assert_close((l0 + l1) / 2, loss1.detach())
    torch.testing.assert_close(torch.cat([g0, g1]) / 2, s1.grad)


def test_end_to_end_resume_and_teacher_is_evaluated(tmp_path):
    """Resume is exact with the bias table in its own lr group (the short-run presets' rule), and the run logs the
    symmetry measures (sym, rpb) at every log step."""
    full, _ = exact_resume(conmim.train, lambda p, **kw: tiny_args(p, rel_pos_lr=30, **kw), tmp_path, "conmim",
                           ("model", "target", "encoder"))
    for k, v in full["encoder"].items():
        assert torch.equal(v, full["target"]["encoder." + k])
    assert [g.get("lr_scale", 1) for g in full["optimizer"]["param_groups"]] == [1, 1, 30]
    logged = [json.loads(line) for line in open(tmp_path / "full" / "log.jsonl") if '"sym"' in line]
    assert len(logged) == 4 and all(0 < r["sym"] <= 1 + 1e-6 for r in logged)
    assert logged[0]["rpb"] == 0 < logged[-1]["rpb"]                      # the table before each step's update


def test_masked_symmetry_reads_the_masked_positions_of_each_image():
    """1 where an image's masked outputs are alike (the symmetric start), lower as they differ; unmasked rows and
    other images' rows do not enter an image's pairs."""
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.float)
    same = torch.randn(1, 1, 8).expand(2, 4, 8).clone()
    same[0, 3], same[1, 0] = torch.randn(8), -same[1, 1]                  # unmasked rows: anything
    assert conmim.masked_symmetry(same, mask).item() == pytest.approx(1.0, abs=1e-6)
    apart = torch.eye(8)[:4].expand(2, 4, 8)                              # orthogonal outputs: cosine 0
    assert conmim.masked_symmetry(apart, mask).item() == pytest.approx(0.0, abs=1e-6)


def test_the_short_run_presets_give_the_bias_table_300_times_the_lr():
    """The rule for the symmetric start (docs/RESULTS.md): the presets' table lr x 300, in a group of its own that
    keeps the official weight decay; the full recipe keeps one lr (official), with no extra group."""
    named = recipes.presets(conmim.Args)
    assert named["small"]["rel_pos_lr"] == named["gpu"]["rel_pos_lr"] == 300 and conmim.Args().rel_pos_lr == 1
    assert "rel_pos_lr" not in named["synthetic"]
    model = conmim.Net(tiny_args("/tmp/unused"))
    table = model.encoder.rel_pos_bias.relative_position_bias_table
    official = conmim.make_optimizer(model, tiny_args("/tmp/unused"), torch.device("cpu"))
    opt = conmim.make_optimizer(model, tiny_args("/tmp/unused", rel_pos_lr=300), torch.device("cpu"))
    assert len(official.param_groups) == 2 and any(p is table for p in official.param_groups[0]["params"])
    C.set_hparams(opt, 1e-4, 0.05)
    decay, skip, own = opt.param_groups
    assert own["params"] == [table] and own["lr"] == pytest.approx(3e-2) and own["weight_decay"] == 0.05
    assert decay["lr"] == skip["lr"] == 1e-4 and all(p is not table for p in decay["params"] + skip["params"])
    assert sum(len(g["params"]) for g in opt.param_groups) == sum(len(g["params"]) for g in official.param_groups)


def test_the_official_comparison_skips_where_the_official_code_is_not_on_disk(tmp_path, capsys):
    """scripts/conmim_official.py: one line saying how to get the code, exit 0; with it (CONMIM_OFFICIAL=DIR, a
    checkout of TencentARC/ConMIM) the first steps' losses agree within 1e-4."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import conmim_official
    assert conmim_official.main(["--official", str(tmp_path)]) is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("skipped:")
    assert "git clone https://github.com/TencentARC/ConMIM" in out[0]
    official = os.environ.get("CONMIM_OFFICIAL")
    if not official or not os.path.isfile(os.path.join(official, "modeling_pretrain.py")):
        pytest.skip("CONMIM_OFFICIAL is not a checkout of TencentARC/ConMIM")
    rows = conmim_official.main(["--official", official, "--steps", "3", "--batch-size", "8", "--agree", "3"])
    assert max(r["diff"] for r in rows) < 1e-4


def test_bad_input(tmp_path):
    tiny = ["--model", "nano", "--patch-size", "4", "--img-size", "16", "--batch-size", "4", "--epochs", "1",
            "--warmup-epochs", "0",
            "--steps-per-epoch", "1", "--no-knn"]
    one_line_error(run_cli("conmim.py", "--data", str(tmp_path / "nope"), *tiny), "no such directory")
    C.save_checkpoint(str(tmp_path / "checkpoint.pth"), {"method": "cmae", "encoder": {}})
    one_line_error(run_cli("conmim.py", "--data", "synthetic", *tiny, "--output-dir", str(tmp_path)), "cmae checkpoint")


def test_the_probe_script_takes_the_student_from_model_and_the_teacher_from_target(tmp_path):
    """scripts/conmim_probe.py on a checkpoint whose `target` (the EMA teacher) differs from its `model` (the student):
    every probe's keys come from `target` -- the teacher replaced by the student's weights changes them -- and the
    student's measures (sym, max_bias) from `model`."""
    import importlib.util
    from test_eval_linear import tiny_folder
    data = tiny_folder(tmp_path / "data")
    conmim.train(tiny_args(tmp_path / "run", epochs=1, steps_per_epoch=1))
    path = str(tmp_path / "run" / "checkpoint.pth")
    ck = C.load_checkpoint(path, "conmim")
    torch.manual_seed(1)
    other = conmim.Net(conmim.Args(**{k: tuple(v) if isinstance(v, list) else v for k, v in ck["args"].items()}))
    ck["target"] = other.state_dict()                                      # a teacher unlike the student
    C.save_checkpoint(str(tmp_path / "apart.pth"), ck)
    C.save_checkpoint(str(tmp_path / "same.pth"), {**ck, "target": ck["model"]})
    spec = importlib.util.spec_from_file_location("conmim_probe", os.path.join(ROOT, "scripts", "conmim_probe.py"))
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    def run(name):
        return probe.main([str(tmp_path / name), "--data", data, "--split", "val", "--images", "9"])
    apart, same = run("apart.pth"), run("same.pth")
    assert apart["objective"] != same["objective"] and apart["other_image"] != same["other_image"]
    assert apart["sym"] == same["sym"] and apart["max_bias"] == same["max_bias"]    # the student: the same `model`


def test_the_official_comparison_fails_when_one_steps_losses_part(tmp_path, monkeypatch, capsys):
    """scripts/conmim_official.py's verdict without a checkout: the official model stood in for by conmim.Net behind
    the official call and names, so both sides run the same computation through the script (its optimiser groups,
    schedule, EMA and official_loss's transcription) and agree (exit 0); with the official loss moved by 0.01 at ONE
    of the --agree steps it exits non-zero (the largest difference counts, not the smallest)."""
    import importlib.util
    path = os.path.join(ROOT, "scripts", "conmim_official.py")
    spec = importlib.util.spec_from_file_location("conmim_official", path)
    off = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(off)

    class Official(conmim.Net):                         # the official interface over our network
        rel_pos_bias = property(lambda self: self.encoder.rel_pos_bias)

        def no_weight_decay(self):
            return {"encoder.cls_token"}

        def forward(self, x, bool_masked_pos, **kw):
            return super().forward(x, bool_masked_pos.float() if bool_masked_pos.any() else None)
    monkeypatch.setattr(off, "official_model", lambda official, a: Official(a))
    monkeypatch.setattr(off, "official_name", lambda k: k)
    (tmp_path / "modeling_pretrain.py").write_text("")                 # what marks a checkout
    argv = ["--official", str(tmp_path), "--steps", "3", "--agree", "3", "--batch-size", "8"]
    assert len(off.main(argv)) == 3
    real, calls = off.official_loss, []

    def moved(*a):
        calls.append(1)
        return real(*a) + (0.01 if len(calls) == 2 else 0.0)
    monkeypatch.setattr(off, "official_loss", moved)
    with pytest.raises(SystemExit, match="the losses differ by 1.00e-02 within the first 3 steps"):
        off.main(argv)
