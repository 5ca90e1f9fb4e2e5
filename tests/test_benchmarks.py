"""benchmarks/: the scripts run and print their tables (smoke only; speed is never asserted)."""
from helpers import run_cli


def test_throughput_and_data_scripts_run():
    r = run_cli("benchmarks/throughput.py", "--method", "msn", "--model", "nano", "--batch-size", "2",
                "--warmup", "1", "--steps", "1", "--gpu-aug")
    assert r.returncode == 0, r.stderr
    assert "| msn |" in r.stdout and "gpu-aug" in r.stdout
    r = run_cli("benchmarks/data.py", "--method", "conmim", "--device-aug", "--n-images", "16", "--images", "2",
                "--workers", "0", "--batch-size", "4", "--batches", "2")
    assert r.returncode == 0, r.stderr
    row = [c.strip() for c in [ln for ln in r.stdout.splitlines() if ln.startswith("| conmim |")][0].split("|")]
    assert row[2] == "2" and all(float(row[i]) > 0 for i in (3, 4, 5, 6, 7)) and ("(cpu)" in row[8] or "(cuda)" in row[8])


def test_end_to_end_benchmark_runs_the_real_loop():
    r = run_cli("benchmarks/e2e.py", "--method", "conmim", "--device", "cpu", "--model", "nano", "--img-size", "16",
                "--patch-size", "4", "--batch-size", "4", "--workers", "0", "--steps", "3", "--log-every", "1",
                "--n-images", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    row = [c.strip() for c in [ln for ln in r.stdout.splitlines() if ln.startswith("| conmim |")][0].split("|")]
    assert row[2] == "4" and float(row[3]) > 0 and 0 <= float(row[5]) <= 1
