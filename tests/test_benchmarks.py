"""benchmarks/: the scripts run and print their tables (smoke only; speed is never asserted)."""
from helpers import run_cli


def test_throughput_and_data_scripts_run():
    r = run_cli("benchmarks/throughput.py", "--method", "msn", "--model", "nano", "--batch-size", "2",
                "--warmup", "1", "--steps", "1", "--gpu-aug")
    assert r.returncode == 0, r.stderr
    assert "| msn |" in r.stdout and "gpu-aug" in r.stdout
    r = run_cli("benchmarks/data.py", "--method", "msn", "--gpu-aug", "--n-images", "16", "--images", "2",
                "--workers", "0", "--batch-size", "4", "--batches", "2")
    assert r.returncode == 0, r.stderr
    row = [l for l in r.stdout.splitlines() if l.startswith("| msn |")][0].split("|")
    assert row[2].strip() == "12" and float(row[3]) > 0 and float(row[4]) > 0 and "(cpu)" in row[5]
