#!/usr/bin/env bash
# One-shot check of the Triton paged-attention kernels on a CUDA machine (a lent H200).
#
# Needs only python3 with torch (CUDA), triton, numpy and pytest: the test module and
# what it imports (executor.attention) use nothing else, and --noconftest keeps the
# suite's conftest files (telemetry, model files) out. Writes to $OUT (default
# /tmp/out): nvidia-smi.txt, pytest.log, engine.log, tensor_parallel.log, nvml.log, kernels.log,
# kernels.json, cuda_graphs.log, cuda_graphs.json. Runs every part even if one fails; exits non-zero
# if any failed. Budget: ~6 minutes (each part is capped with `timeout`; first-time Triton compiles
# dominate the tests); the caps add up to 570 s, under the 600 s a lent machine gives one command.
# The CUDA graph part, the one not yet seen on a GPU, runs first, so that a run cut short still
# holds it. GPU_CHECK_PARTS picks parts, in its order (default: all; an unknown one: exit 2, nothing run):
#
#   bash tests/gpu_check.sh
#   GPU_CHECK_PARTS="graphs engine" bash tests/gpu_check.sh

set -x
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=$PWD
export PYTHONUNBUFFERED=1
PARTS=${GPU_CHECK_PARTS:-graphs triton engine tensor_parallel nvml kernels}
for part in $PARTS; do  # all checked before any runs: a typo costs no lent minutes
    case $part in
    graphs | triton | engine | tensor_parallel | nvml | kernels) ;;
    *) echo "gpu_check: unknown part $part (graphs triton engine tensor_parallel nvml kernels)" >&2; exit 2 ;;
    esac
done
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
status=0

nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'numpy', numpy.__version__, 'device', torch.cuda.get_device_name())"

set -o pipefail

# bench SECONDS MODULE ARGS...: python -m meshserve.bench.MODULE ARGS under `timeout`. `-m` imports
# the meshserve.bench package first; should that package ever need more than this image has, the
# module's file runs directly instead.
bench() {
    local seconds=$1 module=$2
    shift 2
    if python3 -c "import meshserve.bench" 2>/dev/null; then
        timeout "$seconds" python3 -m "meshserve.bench.$module" "$@"
    else
        timeout "$seconds" python3 -c "import runpy, sys; sys.argv[0] = 'meshserve.bench.$module'; \
runpy.run_path('meshserve/bench/$module.py', run_name='__main__')" "$@"
    fi
}

# decode steps replayed from CUDA graphs: the engine with graphs on gives the tokens of graphs
# off (tiny random Llama, needs transformers), then decode step times with graphs on vs off
graphs() {
    timeout 150 python3 -m pytest -v -rs -p no:cacheprovider --noconftest \
        tests/executor/test_cuda_graphs.py 2>&1 | tee "$OUT/cuda_graphs.log" || status=1
    bench 130 decode_graphs --json "$OUT/cuda_graphs.json" 2>&1 | tee -a "$OUT/cuda_graphs.log" || status=1
}

# the Triton kernel tests natively
triton() {
    timeout 120 python3 -m pytest -v -p no:cacheprovider --noconftest --durations=10 \
        tests/executor/test_triton_attention.py 2>&1 | tee "$OUT/pytest.log" || status=1
}

# the whole engine on CUDA with the triton backend (tiny random Llama; needs transformers)
engine() {
    timeout 60 python3 -m pytest -v -p no:cacheprovider --noconftest \
        tests/executor/test_cuda_engine.py 2>&1 | tee "$OUT/engine.log" || status=1
}

# tensor parallel over NCCL: 2 ranks on cuda:0 and cuda:1 (tiny random Llama) equal to one
# rank; with fewer than 2 GPUs the test is skipped and the log says why
tensor_parallel() {
    timeout 60 python3 -m pytest -v -rs -p no:cacheprovider --noconftest \
        tests/executor/test_cuda_tensor_parallel.py 2>&1 | tee "$OUT/tensor_parallel.log" || status=1
}

# device metrics through the real NVML (needs prometheus_client and nvidia-ml-py, both
# pure Python: where the image lacks them, put them on PYTHONPATH)
nvml() {
    timeout 20 python3 -m pytest -v -p no:cacheprovider --noconftest \
        tests/meshserve/test_device_metrics_cuda.py 2>&1 | tee "$OUT/nvml.log" || status=1
}

kernels() {
    bench 30 kernels --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" || status=1
}

for part in $PARTS; do
    "$part"
done

exit $status
