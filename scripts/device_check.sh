#!/usr/bin/env bash
# One call on the GPU machine: GPU tests and benchmarks, results under $OUT.
#   scripts/device_check.sh [norm|allreduce|all] [extra args for the benchmark]
# Run from the repository root (the device tool does). Wheels missing on the machine
# (liger-kernel) travel in .whl/ (carry it) and are installed to /tmp/site.
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
# NVLink multicast stays off everywhere (it can take a shared host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# A commit passed in wins (the device copy of the tree may have no usable git history);
# --verify prints nothing when HEAD is unborn (plain rev-parse prints "HEAD" and fails).
export TPFUSE_COMMIT=${TPFUSE_COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}
nvidia-smi -L | tee "$OUT/gpus.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())" | tee -a "$OUT/gpus.txt"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
status=0
run() {  # run NAME TIMEOUT CMD...: log to $OUT/NAME.log, remember failures
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name exit $rc"; [ $rc -eq 0 ] || status=1
}
if [ "$what" = norm ] || [ "$what" = all ]; then
  run test_norm 240 python3 -m pytest -q -x tests/test_rms_norm.py tests/test_rms_norm_module.py
  run bench_norm 330 python3 -m tpfuse.cli bench norm --out "$OUT" --plot "$@"
fi
if { [ "$what" = allreduce ] || [ "$what" = all ]; } && [ "$ngpu" -ge 2 ]; then
  run test_allreduce 270 python3 -m pytest -q -x -m multigpu tests/test_allreduce_gpu.py
  run bench_allreduce 290 python3 -m tpfuse.cli bench allreduce --out "$OUT" --plot "$@"
fi
exit $status
