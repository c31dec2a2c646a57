#!/usr/bin/env bash
# Builds, on a machine without a GPU, the FlashInfer bundle that `tpfuse bench allreduce` and
# `tpfuse bench fused` measure as a peer on the GPU machine (benchmarks/NOTES.md, 2026-11-25):
#   scripts/flashinfer_bundle.sh          -> .whl/flashinfer-<version>-trtllm_comm-sm90a.tgz
# FlashInfer compiles its all-reduce kernels with nvcc at first use, minutes that a device call
# cannot spare. This compiles them here instead (CUDA 13's nvcc from PyPI, FlashInfer's own
# flags, sm_90a: H100/H200), only the two translation units that the "trtllm" workspace and
# allreduce_fusion call, and puts the module where FlashInfer looks before any JIT
# (flashinfer/data/aot/trtllm_comm/trtllm_comm.so). About 15 minutes on 2 cores. The bundle
# is a site/ folder (flashinfer, tvm_ffi for CPython 3.12) that scripts/device_check.sh
# unpacks into /tmp/site (carry .whl), with FLASHINFER_DISABLE_JIT=1 set so that a missing
# module is an error rather than a compile.
set -Eeuo pipefail
FLASHINFER=${FLASHINFER:-0.7.2.post1} TVM_FFI=${TVM_FFI:-0.1.15.post2}
CUDA=13.0.88  # the nvcc the module is built with; its files are under nvidia/cu13 below
work=$(mktemp -d) repo=$(cd "$(dirname "$0")/.." && pwd)
trap 'echo "flashinfer_bundle: stopped; the build is kept in $work" >&2' ERR
get() {  # get DIR SPEC...: the wheels for CPython 3.12 on x86-64 Linux, without dependencies
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$@"
}
get "$work/whl" "flashinfer-python==$FLASHINFER" "apache-tvm-ffi==$TVM_FFI"
get "$work/cuda" "nvidia-cuda-nvcc==$CUDA" "nvidia-cuda-crt==$CUDA" "nvidia-nvvm==$CUDA" \
  "nvidia-cuda-runtime~=13.0.0"
site=$work/site
for w in "$work"/whl/*.whl; do python3 -m zipfile -e "$w" "$site"; done
for w in "$work"/cuda/*.whl; do python3 -m zipfile -e "$w" "$work/cuda"; done
cu=$work/cuda/nvidia/cu13
chmod +x "$cu"/bin/* "$cu"/nvvm/bin/*
data=$site/flashinfer/data
flags=(-DPy_LIMITED_API=0x03090000 -D_GLIBCXX_USE_CXX11_ABI=1 -I"$data/cccl/cub" -I"$data/cccl/libcudacxx/include"
  -I"$data/cccl/thrust" -isystem "$cu/include" -isystem "$site/tvm_ffi/include" -isystem "$data/include"
  -isystem "$data/csrc" -isystem "$data/cutlass/include" -isystem "$data/cutlass/tools/util/include"
  -isystem "$data/spdlog/include" --compiler-options=-fPIC --expt-relaxed-constexpr
  -static-global-template-stub=false -std=c++17 --threads=1 -use_fast_math -Xfatbin=-compress-all
  --compress-mode=size -DFLASHINFER_ENABLE_F16 -DFLASHINFER_ENABLE_BF16 -DFLASHINFER_ENABLE_FP8_E4M3
  -DFLASHINFER_ENABLE_FP8_E5M2 -DFLASHINFER_ENABLE_FP8_E8M0 -DFLASHINFER_ENABLE_FP4_E2M1 -DNDEBUG -O3
  -gencode=arch=compute_90a,code=sm_90a)
# trtllm_allreduce.cu: trtllm_lamport_initialize (the workspace); trtllm_allreduce_fusion.cu:
# allreduce_fusion. The MoE unit is left out (FlashInfer looks a function up only when called).
pids=()
for unit in trtllm_allreduce trtllm_allreduce_fusion; do
  "$cu/bin/nvcc" "${flags[@]}" -c "$data/csrc/$unit.cu" -o "$work/$unit.o" & pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || { kill "${pids[@]}" 2>/dev/null; exit 1; }; done
mkdir -p "$data/aot/trtllm_comm"
# The runtime wheel ships libcudart.so.13 only (no unversioned link), so it is named.
c++ "$work"/trtllm_allreduce.o "$work"/trtllm_allreduce_fusion.o -shared -L"$cu/lib" -l:libcudart.so.13 \
  -o "$data/aot/trtllm_comm/trtllm_comm.so"
# The module needs no sources to run: keep of data/csrc (258 MB) what FlashInfer's module
# specification names, so the bundle fits a device call (64 MiB).
find "$data/csrc" -mindepth 1 -maxdepth 1 ! -name 'trtllm_*allreduce*.cu' ! -name tvm_ffi_utils.h -exec rm -rf {} +
mkdir -p "$repo/.whl"
out=$repo/.whl/flashinfer-$FLASHINFER-trtllm_comm-sm90a.tgz
tar -czf "$out" -C "$work" site
rm -rf "$work"
echo "wrote $out ($(du -h "$out" | cut -f1))"
