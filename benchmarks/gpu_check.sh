#!/usr/bin/env bash
# What only a GPU host can check or measure, in parts, each under its own time cap (seconds: CAP_<part>=N), so that
# one part's failure or overrun never costs the others. Run from the repository root; each part's log goes to
# $OUT/<part>.log (or gpu_check_out/<part>.log). Several parts in one call run in the order given. Every cap fits
# one 600-s call; a 15-minute device window is three calls, cheapest and most decisive first (BENCHMARKS.md):
#   bash benchmarks/gpu_check.sh probe                          # call 1: where the real loop loses time (cap 420)
#   bash benchmarks/gpu_check.sh cuda-eager cuda-compiled       # call 2: tests/test_cuda.py, eager tests first
#   bash benchmarks/gpu_check.sh realstep aug                   # call 3 (or later windows: tests, cifar, step, ...)
#   bash benchmarks/gpu_check.sh datapath                       # one call: the data path (gpu_data.py, the probe)
#   bash benchmarks/gpu_check.sh recipe                         # one call: the official recipes' step vs ideal
#   probe      benchmarks/loop_probe.py on CIFAR-10 at --preset gpu: the step with and without the loop's colour
#              augmentation, the augmentation per view / per size / compiled (at 32 px and at 224 / 96 px), the
#              real loop resident / with its workers / on a fixed batch, aten ops and host syncs per step, the GPU's
#              busy time by its kernels (cap 420)
#   datapath   the data path, decisive items first, each capped: the host (cores, memory); the loop of each image
#              method at --preset gpu with its images on the device (--resident 32) against its PIL workers (15)
#              (the step with and without the augmentation; the GPU's busy time by its kernels alone); CMAE
#              compiled; CAN's CIFAR-10 k-NN after MINUTES (default 2) of the resident preset; the worker count swept
#              for CAN; MSN's augmentation at 224 px; aten ops per step (cap 580)
#   recipe     the official recipes' step (224 px, bf16, batch = micro-batch), decisive items first, each capped: MSN
#              ViT-S compiled at 512 with its kernels by class (GEMM / attention / norm / casts / elementwise); CAN's
#              gradient-cache step (micro-batch 128 of 512, eager) before (c898b5c: its embedding pass ran the decoder)
#              and after; ConMIM ViT-B compiled with its kernels (which SDPA kernel runs BEiT's bias, gradient and
#              all); CMAE, CAN, SiamMAE compiled; MFU (model) is the fraction of ideal (cap 500)
#   cuda-eager     tests/test_cuda.py without the tests that compile (cap 120)
#   cuda-compiled  tests/test_cuda.py's compiling tests: compiled step and augmentation, the sync-free steps (cap 300)
#   realstep   throughput.py --preset gpu --gpu-aug: the step WITH the loop's augmentation that the cifar part's
#              real runs are set against, eager networks (cap 240)
#   aug        data.py --aug-against 3f25bd5: the colour ops per MSN step of 256 at 224 px, old file vs this one,
#              eager and compiled (cap 150)
#   tests      the whole suite on the GPU host (-n 8; cap 400)
#   cifar      the real-data tier, last (learning, not speed): benchmarks/gpu_cifar.py on CIFAR-10 (CIFAR=a .tar.gz
#              of the README's JPEG folders, or the folder; default .gpu/cifar10.tar.gz): each image method ~2 min
#              with --preset gpu, k-NN of its checkpoints against its initial encoder and raw pixels (cap 560;
#              MINUTES=N caps each method's training, default 2)
#   step       throughput.py eager: each method at its ImageNet recipe model and default --micro-batch (+ --gpu-aug)
#   compiled   the same with --compile (the CUDA default of train())
#   data       data.py on the device: eager and compiled colour ops, --gpu-decode
#   e2e        e2e.py (the real train(), compiled): MSN without and with --gpu-decode
#   e2e-rest   e2e.py: CMAE, ConMIM, CAN, SiamMAE
# SMALL=1 shrinks every size (nano models, a few steps, a generated 3-class fixture for cifar and probe, aug on
# ConMIM's view only; no compiled variant of realstep, aug and datapath, and the suite is not run) for a dry run on a CPU
# (tests/test_benchmarks.py runs it). PYTHON picks the interpreter. Numbers go to BENCHMARKS.md and docs/RESULTS.md
# with the device line each log starts with.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: bash benchmarks/gpu_check.sh PART [PART ...] (datapath recipe probe cuda-eager cuda-compiled realstep aug tests cifar step compiled data e2e e2e-rest)" >&2; exit 2; }
out=${OUT:-gpu_check_out}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
declare -A CAP=([datapath]=580 [recipe]=500 [probe]=420 [cuda-eager]=120 [cuda-compiled]=300 [realstep]=240 [aug]=150 [tests]=400 [cifar]=560
                [step]=540 [compiled]=540 [data]=540 [e2e]=540 [e2e-rest]=540)

if [ "${1}" != _one ]; then                      # each part under its own cap, then a summary line per part
    status=0
    for part in "$@"; do
        [ -n "${CAP[$part]:-}" ] || { echo "unknown part $part: ${!CAP[*]}" >&2; exit 2; }
        var="CAP_${part//-/_}"; cap=${!var:-${CAP[$part]}}
        t0=$(date +%s)
        timeout -k 10 "$cap" bash "$0" _one "$part"; rc=$?
        summary+=("$part: rc $rc in $(( $(date +%s) - t0 )) s (cap $cap)$([ $rc = 124 ] && echo ', CUT at the cap')")
        [ $rc = 0 ] || status=1
    done
    printf '%s\n' "${summary[@]}" | tee -a "$out/summary.log"
    exit $status
fi
part=$2
log="$out/$part.log"
if [ -n "${SMALL:-}" ]; then            # dry run: model, micro-batches (msn cmae conmim can siammae), steps, images
    S=nano; B=nano; MB=(4 4 4 4 2); STEPS=(--warmup 1 --steps 1); E2E=(--steps 4 --log-every 2 --n-images 16 --batch-size 8
        --model nano --img-size 32 --patch-size 16 --workers 2); DATA=(--n-images 16 --images 2 --workers 2 --batches 2)
    PB=8; CIFAR_FLAGS=(--small --workers 0); COMPILED=(); PM=(all)   # eager only (a CPU compile takes minutes), one process
    PROBE=(--small --methods cmae --sections step loop syncs)
    LP=(benchmarks/loop_probe.py --small); M4=(cmae); WS=(0); CV=(fixed); ITEM=(90 30 10 60 0 0 60)   # 0: the
    RI=(150 300 0 0 0 0); RS=(--warmup 1 --steps 1 --profile 1); CB=(2 1)   # recipe: caps, wide (a loaded CPU);
    # 0: realstep's dry run has them
    # other parts' dry runs cover it (cifar: gpu_cifar.py; the loop's workers rows)
else                                    # the recipes (README) and their default micro-batches
    S=small; B=base; MB=(512 512 512 256 512); STEPS=(); E2E=(--n-images 1024 --workers 15); DATA=(--workers 15)
    PB=512; CIFAR_FLAGS=(--workers 15 --minutes "${MINUTES:-2}"); COMPILED=(--compile); PM=(msn cmae conmim can)
    PROBE=(--workers 15)
    LP=(benchmarks/loop_probe.py --workers 15 --warm 8 --steps 40)             # + --data (the unpacked folder)
    M4=(msn cmae conmim can); WS=(4 8 15); CV=(compiled); ITEM=(220 90 70 80 110 40 40)
    RI=(100 70 100 80 80 60); RS=(--warmup 10 --steps 20 --profile 3); CB=(512 128)   # CB: CAN's cached step
fi
dev=$($py -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
{
    echo "gpu_check $part: $(date -u +%FT%TZ), commit $COMMIT"
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

cifar_data() {   # the folder the cifar part trains on: $CIFAR unpacked (or as it is), SMALL: a generated fixture
    local tmp; tmp=$(mktemp -d)
    if [ -n "${SMALL:-}" ] && [ -z "${CIFAR:-}" ]; then
        $py -c "
import os, sys, numpy as np
from PIL import Image
rng = np.random.default_rng(0)
for split, n in (('train', 8), ('test', 2)):
    for c in ('cat', 'dog', 'ship'):
        os.makedirs(f'{sys.argv[1]}/cifar10/{split}/{c}', exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(f'{sys.argv[1]}/cifar10/{split}/{c}/{i}.jpg')
" "$tmp/src" && tar -czf "$tmp/cifar10.tar.gz" -C "$tmp/src" cifar10 && CIFAR=$tmp/cifar10.tar.gz
    fi
    local src=${CIFAR:-.gpu/cifar10.tar.gz}
    if [ -d "$src" ]; then echo "$src"; return; fi
    [ -f "$src" ] || { echo "CIFAR=$src: no such file (carry the README's CIFAR-10 folders as a .tar.gz)" >&2; return 1; }
    tar -xzf "$src" -C "$tmp" || return 1
    dirname "$(find "$tmp" -mindepth 2 -maxdepth 3 -type d -name train -not -path "$tmp/src/*" | head -1)"
}

case $part in
    datapath)                          # each item under its own cap (ITEM), the decisive ones first
        data=$(cifar_data) || { echo "no CIFAR-10 folder" | tee -a "$log"; exit 1; }
        [ -n "${SMALL:-}" ] || LP+=(--data "$data")
        item() { local cap=$1; shift; [ "$cap" = 0 ] && return; say timeout -k 5 "$cap" "$@" || echo "item rc $? (cap $cap s)" | tee -a "$log"; }
        say bash -c "nproc; lscpu | grep -E '^(Model name|Socket|Core|Thread)'; free -g | head -2"
        item "${ITEM[0]}" $py "${LP[@]}" --sections loop --methods "${M4[@]}" --variants resident workers
        item "${ITEM[1]}" $py "${LP[@]}" --sections step --methods "${M4[@]}"
        item "${ITEM[2]}" $py "${LP[@]}" --sections profile --methods "${M4[@]:1}" "${M4[0]}"
        item "${ITEM[3]}" $py "${LP[@]}" --sections loop --methods cmae --variants "${CV[@]}"
        item "${ITEM[4]}" $py benchmarks/gpu_cifar.py --data "$data" --out "$out" --methods can "${CIFAR_FLAGS[@]}"
        item "${ITEM[5]}" $py "${LP[@]}" --sections loop --methods can --variants workers --workers "${WS[@]}"
        item "${ITEM[6]}" $py "${LP[@]}" --sections aug ops --methods "${M4[-1]}" ;;
    recipe)                            # each item under its own cap (RI), the decisive ones first
        item() { local cap=$1; shift; [ "$cap" = 0 ] && return; say timeout -k 5 "$cap" "$@" || echo "item rc $? (cap $cap s)" | tee -a "$log"; }
        tp=(benchmarks/throughput.py "${COMPILED[@]}" "${RS[@]}")
        item "${RI[0]}" $py "${tp[@]}" --method msn --model $S --batch-size "${MB[0]}"
        before=$(mktemp -d)                # c898b5c: CAN's embedding pass before issue 93 (it ran the decoder)
        cached=(--method can --model $B --batch-size "${CB[0]}" --micro-batch "${CB[1]}" "${STEPS[@]}")
        if git archive c898b5c '*.py' | tar -x -C "$before"; then
            item "$(( ${RI[1]} / 2 ))" $py "$before/benchmarks/throughput.py" "${cached[@]}"
        else echo "no git history here: CAN's step before c898b5c not timed" | tee -a "$log"; fi
        item "$(( ${RI[1]} / 2 ))" $py benchmarks/throughput.py "${cached[@]}"
        item "${RI[2]}" $py "${tp[@]}" --method conmim --model $B --batch-size "${MB[2]}"
        item "${RI[3]}" $py "${tp[@]}" --method cmae --model $B --batch-size "${MB[1]}" --profile 0
        item "${RI[4]}" $py "${tp[@]}" --method can --model $B --batch-size "${MB[3]}" --profile 0
        item "${RI[5]}" $py "${tp[@]}" --method siammae --model $S --batch-size "${MB[4]}" --profile 0 ;;
    cifar)
        data=$(cifar_data) || { echo "no CIFAR-10 folder" | tee -a "$log"; exit 1; }
        echo "data: $data ($(find "$data/train" -type f | wc -l) train images)" | tee -a "$log"
        say $py benchmarks/gpu_cifar.py --data "$data" --out "$out" "${CIFAR_FLAGS[@]}" ;;
    probe)
        if [ -n "${SMALL:-}" ]; then say $py benchmarks/loop_probe.py "${PROBE[@]}"
        else
            data=$(cifar_data) || { echo "no CIFAR-10 folder" | tee -a "$log"; exit 1; }
            say $py benchmarks/loop_probe.py --data "$data" "${PROBE[@]}"
        fi ;;
    realstep)                            # eager networks, the loop's colour augmentation (compiled on CUDA, as train())
        for m in "${PM[@]}"; do
            say $py benchmarks/throughput.py --method $m --preset gpu --batch-size $PB --gpu-aug "${STEPS[@]}"
        done ;;
    cuda-eager) say $py -m pytest -q tests/test_cuda.py -m "not compiles" ;;
    cuda-compiled) say $py -m pytest -q tests/test_cuda.py -m compiles ;;
    tests)
        if [ -n "${SMALL:-}" ]; then echo "SMALL: the suite itself is not run" | tee -a "$log"
        else say $py -m pytest -q -n 8 tests --ignore=tests/test_cuda.py; fi ;;
    step) steps ;;
    compiled) steps --compile ;;
    data)
        say $py benchmarks/data.py --method all --device "$dev" --device-aug "${DATA[@]}"
        say $py benchmarks/data.py --method msn --device "$dev" --device-aug --compile "${DATA[@]}" ;;
    aug)
        AB=(--batch-size 256); [ -n "${SMALL:-}" ] && AB=(--batch-size 2 --method conmim)
        say $py benchmarks/data.py --aug-against 3f25bd5 --device "$dev" "${AB[@]}"
        [ -n "${SMALL:-}" ] || say $py benchmarks/data.py --aug-against 3f25bd5 --device "$dev" "${AB[@]}" --method msn --compile ;;
    e2e)
        say $py benchmarks/e2e.py --method msn --gpu-aug "${E2E[@]}"
        say $py benchmarks/e2e.py --method msn --gpu-aug --gpu-decode "${E2E[@]}" ;;
    e2e-rest)
        for m in cmae conmim can siammae; do say $py benchmarks/e2e.py --method $m "${E2E[@]}"; done ;;
esac
# a command inside `say` that failed fails the part (tee hides its status otherwise)
! grep -qE "^(Traceback|error:)|^FAILED|[0-9]+ failed" "$log"
