#!/usr/bin/env bash
# One prepared check for a GPU machine (an H200 with torch 2.11 / triton 3.6, no network), within
# 8 minutes: the GPU tests (Triton kernels compiled, the int4 / int8 weight-only kernel among them and
# GPTQ / AWQ checkpoints through it, FP8, CUDA graphs, every slot filled to the context limit with every
# step shape captured at start-up, a 4,000-token prompt through the CUDA path against HF, MoE prefill),
# then benchmarks/gpu_bench.py on a Llama-3.1-8B-shaped random model (decode, prefill attention and a
# whole prefill at 4,000 tokens, the weight-only products against bf16). Writes gpu_check.log,
# gpu_tests.xml and gpu_bench.json to OUTDIR.
#
#   bash benchmarks/gpu_check.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=.
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  timeout 300 python -m pytest -q -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" \
    tests/test_kernels.py tests/test_cuda_graphs.py tests/test_fp8.py tests/test_full_context.py \
    tests/test_long_prompt.py tests/test_moe_prefill.py \
    tests/test_int_checkpoints.py::test_int_checkpoints_run_on_cuda
  echo "tests exit: $?"
  timeout 180 python benchmarks/gpu_bench.py --out "$OUT" --shape 8b
  echo "bench exit: $?"
} 2>&1 | tee "$OUT/gpu_check.log"
