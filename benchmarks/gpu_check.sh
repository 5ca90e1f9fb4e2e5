#!/usr/bin/env bash
# What only a GPU host can check or measure, in parts that each fit a 10-minute command (run from
# the repository root; each part's log goes to $OUT/<part>.log, or gpu_check_out/<part>.log):
#   bash benchmarks/gpu_check.sh tests     # tests/test_cuda.py, then the whole suite on the GPU host (-n 8)
#   bash benchmarks/gpu_check.sh step      # throughput.py eager: each method at its recipe model, one
#                                          # forward/backward of its default --micro-batch; MSN also with --gpu-aug
#   bash benchmarks/gpu_check.sh compiled  # the same with --compile (the CUDA default of train())
#   bash benchmarks/gpu_check.sh data      # data.py on the device: eager and compiled colour ops, --gpu-decode
#   bash benchmarks/gpu_check.sh aug       # data.py --aug-against 3f25bd5: the colour ops against the version
#                                          # before issue #51's rewrite, per MSN step of 256, eager and compiled
#   bash benchmarks/gpu_check.sh e2e       # e2e.py (the real train(), compiled): MSN without and with --gpu-decode
#   bash benchmarks/gpu_check.sh e2e-rest  # e2e.py: CMAE, ConMIM, CAN, SiamMAE
# SMALL=1 shrinks every size (nano models, a few steps) for a dry run on a CPU. PYTHON picks the interpreter.
# Numbers go to BENCHMARKS.md with the device line each log starts with.
set -uo pipefail
part=${1:?usage: bash benchmarks/gpu_check.sh tests|step|compiled|data|aug|e2e|e2e-rest}
out=${OUT:-gpu_check_out}
mkdir -p "$out"
log="$out/$part.log"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ -n "${SMALL:-}" ]; then            # dry run: model, micro-batches (msn cmae conmim can siammae), steps, images
    S=nano; B=nano; MB=(4 4 4 4 2); STEPS=(--warmup 1 --steps 1); E2E=(--steps 4 --log-every 2 --n-images 16 --batch-size 8
        --model nano --img-size 32 --patch-size 16 --workers 2); DATA=(--n-images 16 --images 2 --workers 2 --batches 2)
else                                    # the recipes (README) and their default micro-batches
    S=small; B=base; MB=(512 512 512 256 512); STEPS=(); E2E=(--n-images 1024 --workers 15); DATA=(--workers 15)
fi
dev=$($py -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
{
    echo "gpu_check $part: $(date -u +%FT%TZ), commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    $py -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__, '$dev')"
} 2>&1 | tee "$log"
say() { echo "+ $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log"; }

steps() {   # $@: extra throughput.py flags
    say $py benchmarks/throughput.py --method msn --model $S --batch-size "${MB[0]}" "${STEPS[@]}" "$@"
    say $py benchmarks/throughput.py --method msn --model $S --batch-size "${MB[0]}" --gpu-aug "${STEPS[@]}" "$@"
    say $py benchmarks/throughput.py --method cmae --model $B --batch-size "${MB[1]}" "${STEPS[@]}" "$@"
    say $py benchmarks/throughput.py --method conmim --model $B --batch-size "${MB[2]}" "${STEPS[@]}" "$@"
    say $py benchmarks/throughput.py --method can --model $B --batch-size "${MB[3]}" "${STEPS[@]}" "$@"
    say $py benchmarks/throughput.py --method siammae --model $S --batch-size "${MB[4]}" "${STEPS[@]}" "$@"
}

case $part in
    tests)
        say $py -m pytest -q tests/test_cuda.py
        say $py -m pytest -q -n 8 tests --ignore=tests/test_cuda.py ;;
    step) steps ;;
    compiled) steps --compile ;;
    data)
        say $py benchmarks/data.py --method all --device "$dev" --device-aug "${DATA[@]}"
        say $py benchmarks/data.py --method msn --device "$dev" --device-aug --compile "${DATA[@]}" ;;
    aug)
        AB=256; [ -n "${SMALL:-}" ] && AB=2
        say $py benchmarks/data.py --aug-against 3f25bd5 --device "$dev" --batch-size $AB
        say $py benchmarks/data.py --aug-against 3f25bd5 --device "$dev" --batch-size $AB --method msn --compile ;;
    e2e)
        say $py benchmarks/e2e.py --method msn --gpu-aug "${E2E[@]}"
        say $py benchmarks/e2e.py --method msn --gpu-aug --gpu-decode "${E2E[@]}" ;;
    e2e-rest)
        for m in cmae conmim can siammae; do say $py benchmarks/e2e.py --method $m "${E2E[@]}"; done ;;
    *) echo "unknown part $part: tests|step|compiled|data|aug|e2e|e2e-rest" >&2; exit 2 ;;
esac
