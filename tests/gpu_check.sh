#!/usr/bin/env bash
# One-shot check of the Triton paged-attention kernels on a CUDA machine (a lent H200).
#
# Needs only python3 with torch (CUDA), triton, numpy and pytest: the test module and
# what it imports (executor.attention) use nothing else, and --noconftest keeps the
# suite's conftest files (telemetry, model files) out. Writes to $OUT (default
# /tmp/out): nvidia-smi.txt, pytest.log, engine.log, tensor_parallel.log, nvml.log, kernels.log,
# kernels.json, cuda_graphs.log, cuda_graphs.json. Runs every part even if one fails; exits non-zero
# if any failed. Budget: ~6 minutes (each part is capped with `timeout`; first-time Triton compiles
# dominate the tests).
#
#   bash tests/gpu_check.sh

set -x
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=$PWD
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
status=0

nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'numpy', numpy.__version__, 'device', torch.cuda.get_device_name())"

set -o pipefail
timeout 170 python3 -m pytest -v -p no:cacheprovider --noconftest --durations=10 \
    tests/executor/test_triton_attention.py 2>&1 | tee "$OUT/pytest.log" || status=1

# the whole engine on CUDA with the triton backend (tiny random Llama; needs transformers)
timeout 120 python3 -m pytest -v -p no:cacheprovider --noconftest \
    tests/executor/test_cuda_engine.py 2>&1 | tee "$OUT/engine.log" || status=1

# tensor parallel over NCCL: 2 ranks on cuda:0 and cuda:1 (tiny random Llama) equal to one
# rank; with fewer than 2 GPUs the test is skipped and the log says why
timeout 180 python3 -m pytest -v -rs -p no:cacheprovider --noconftest \
    tests/executor/test_cuda_tensor_parallel.py 2>&1 | tee "$OUT/tensor_parallel.log" || status=1

# device metrics through the real NVML (needs prometheus_client and nvidia-ml-py, both
# pure Python: where the image lacks them, put them on PYTHONPATH)
timeout 60 python3 -m pytest -v -p no:cacheprovider --noconftest \
    tests/meshserve/test_device_metrics_cuda.py 2>&1 | tee "$OUT/nvml.log" || status=1

# `-m meshserve.bench.kernels` imports the meshserve.bench package first; should that
# package ever need more than this image has, run the module's file directly instead.
if python3 -c "import meshserve.bench" 2>/dev/null; then
    bench=(python3 -m meshserve.bench.kernels)
else
    bench=(python3 -c "import runpy, sys; sys.argv[0] = 'meshserve.bench.kernels'; \
runpy.run_path('meshserve/bench/kernels.py', run_name='__main__')")
fi
timeout 90 "${bench[@]}" --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" || status=1

# decode steps replayed from CUDA graphs: the engine with graphs on gives the tokens of graphs
# off (tiny random Llama, needs transformers), then decode step times with graphs on vs off
timeout 150 python3 -m pytest -v -rs -p no:cacheprovider --noconftest \
    tests/executor/test_cuda_graphs.py 2>&1 | tee "$OUT/cuda_graphs.log" || status=1
if python3 -c "import meshserve.bench" 2>/dev/null; then
    graphs_bench=(python3 -m meshserve.bench.decode_graphs)
else
    graphs_bench=(python3 -c "import runpy, sys; sys.argv[0] = 'meshserve.bench.decode_graphs'; \
runpy.run_path('meshserve/bench/decode_graphs.py', run_name='__main__')")
fi
timeout 110 "${graphs_bench[@]}" --json "$OUT/cuda_graphs.json" 2>&1 | tee -a "$OUT/cuda_graphs.log" || status=1

exit $status
