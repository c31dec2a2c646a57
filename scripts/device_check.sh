#!/usr/bin/env bash
# One call on the GPU machine: GPU tests and benchmarks, results under $OUT.
#   scripts/device_check.sh [STEP|GROUP ...]   (default: all)
# Steps: test_norm bench_norm test_allreduce bench_allreduce test_fused (with the sequence-parallel
#        and fp8 fused tests) bench_fused bench_fused_fp8 (FP8_MODES, default "tensor token group")
#        bench_sp
#        test_quant bench_quant test_codecs test_fp8 bench_codecs test_models bench_decode bench_decode_tp1 verify tune
#        tune_allreduce; groups: norm,
#        allreduce, fused, quant, codecs (one GPU: the codec kernels alone, and tpfuse.quant_fp8), models (test_models
#        and bench_decode; TEST_MODELS_ARGS passes pytest arguments, e.g. -k NAME), linear (one GPU: tpfuse.invariant_matmul's,
#        tpfuse.invariant_attention's, tpfuse.sample's, tpfuse.rope_and_cache's and tpfuse.silu_and_mul's tests, and scripts/bench_linear.py), all. DECODE_ARGS passes arguments to bench_decode. A device call may run 600 s, so "all" needs the largest machines' patience:
#        pick steps per call. BENCH_ARGS passes extra arguments to every benchmark.
#        tune (2+ GPUs; not in "all"): `tpfuse tune` at W = every GPU, the sweep under $OUT and
#        the plan table $OUT/w{W}-{gpu model}.json (never into the package: copy it into
#        tpfuse/comm/tables/ after review). TUNE_ARGS passes arguments to it (e.g. --sizes).
#        tune_allreduce (2+ GPUs; not in "all"): scripts/tune_allreduce.py, the launch knobs'
#        sweep, with TUNE_ALLREDUCE_ARGS (e.g. --algos oneshot --knobs '{...}').
#        fused_ab (2+ GPUs; not in "all"): scripts/fused_ab.py, one process group per variant of
#        FUSED_AB_VARIANTS (default "base"), each timed with split beside it, in FUSED_AB_ROUNDS
#        rounds (default 1), at FUSED_AB_WORLD ranks (default 2).
#        ll_ablation (2 GPUs; not in "all"): scripts/ll_ablation.py once per VARIANT:MAX_BYTES item
#        of LL_ABLATION_RUNS (default "base:16777216"), in that order, with LL_ABLATION_ARGS
#        (e.g. --sizes 4096 1048576).
#        bench_ab (2+ GPUs; not in "all"): see below.
#        fp8_ab (2+ GPUs; not in "all"): scripts/fp8_epilogue_ab.py per variant of FP8_AB_VARIANTS (default
#        all); fp8_ab_ncu (not in "all"): the norm kernel alone under ncu, with and without the fp8
#        output (the report, its details and its SASS with stalls).
#        tune_linear (one GPU; not in "all"): scripts/tune_linear.py, tpfuse.invariant_matmul's launch
#        configurations checked bit for bit and timed, with TUNE_LINEAR_ARGS (e.g. --batches 1 16).
#        nvlink_probe (2+ GPUs; not in "all"): scripts/nvlink_probe.py, the copy engines' and
#        SM kernels' rates between GPUs 0 and 1.
#        AB_TREES (fused_ab, ll_ablation): the package trees to time side by side, each item
#        DIR[:COMMIT], default ".": DIR holds a tpfuse package put first on PYTHONPATH (an older
#        one: `mkdir ab && git archive <commit> tpfuse | tar -x -C ab`, untracked, so it
#        travels; DIR relative to the repository root), COMMIT its id for the results'
#        headers ("." without one: TPFUSE_COMMIT; another DIR without one: unknown). Every
#        run is repeated per tree, in the order given, and its log and results tagged _t1,
#        _t2, ... The scripts come from the working tree, so across trees only the variants
#        that swap nothing in the package compare (ll_ablation's base and copy, fused_ab's
#        base and rows ones): the others assume this tree's device functions.
# Run from the repository root (the device tool does). Wheels missing on the machine
# (liger-kernel, quack-kernels and its CuTe DSL) and bundles (.whl/*.tgz) travel in .whl/
# (carry it), wheels over a call's 64 MiB as parts in .whlparts/ over several calls, and are
# installed to /tmp/site: scripts/join_wheels.sh says how.
set -uo pipefail
steps=" ${*:-all} "
for group in norm allreduce fused quant codecs; do
  steps=${steps/ $group / test_$group bench_$group }
done
steps=${steps/ models / test_models bench_decode }
steps=${steps/ linear / test_linear bench_linear }
steps=${steps/ all / test_norm bench_norm test_allreduce bench_allreduce test_fused bench_fused test_quant bench_quant test_codecs bench_codecs test_models bench_decode }
steps=${steps/ test_codecs / test_codecs test_fp8 }
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
# NVLink multicast stays off everywhere (it can take a shared host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Bundles (.whl/*.tgz, each a site/ folder: packages that are not wheels, such as FlashInfer
# with its all-reduce module prebuilt, benchmarks/NOTES.md) unpack into /tmp/site beside them.
for bundle in .whl/*.tgz; do [ -e "$bundle" ] && tar -xzf "$bundle" -C /tmp; done
# A FlashInfer module missing from its bundle is an error, not an nvcc build inside a timed step.
export FLASHINFER_DISABLE_JIT=1
# Python reads no .pth file on PYTHONPATH: the CuTe DSL's folder is added by hand.
scripts/join_wheels.sh && [ -d /tmp/site ] \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
# The commit under test must be passed in (TPFUSE_COMMIT=<id> scripts/device_check.sh ..., the id
# read on the machine that sends the tree): the device copy's git history can be stale (on
# 2026-11-25 it named the last landed commit, not the tree sent), so it is never read here.
export TPFUSE_COMMIT=${TPFUSE_COMMIT:-unknown}
nvidia-smi -L | tee "$OUT/gpus.txt"
nvidia-smi topo -m >> "$OUT/gpus.txt" 2>&1  # the links, for the results' headers and plan tables
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
want() { [[ "$steps" == *" $1 "* ]]; }
tree_commit() {  # an AB_TREES item's commit
  if [[ "$1" == *:* ]]; then echo "${1##*:}"; elif [ "$1" = . ]; then echo "$TPFUSE_COMMIT"; else echo unknown; fi
}
multi() { [ "$ngpu" -ge 2 ] || { echo "== $1: needs 2+ GPUs, skipped"; return 1; }; }
want test_norm && run test_norm 400 python3 -m pytest -q -x tests/test_rms_norm.py tests/test_rms_norm_module.py \
  tests/test_fused_layouts.py
want bench_norm && run bench_norm 540 python3 -m tpfuse.cli bench norm --out "$OUT" --plot ${BENCH_ARGS:-}
want test_allreduce && multi test_allreduce && run test_allreduce 270 python3 -m pytest -q -x -m multigpu tests/test_allreduce_gpu.py
want bench_allreduce && multi bench_allreduce && run bench_allreduce 290 python3 -m tpfuse.cli bench allreduce --out "$OUT" --plot ${BENCH_ARGS:-}
want test_fused && multi test_fused && run test_fused 420 python3 -m pytest -q -x -m multigpu tests/test_fused_gpu.py tests/test_sequence_parallel_gpu.py
want bench_fused && multi bench_fused && run bench_fused 240 python3 -m tpfuse.cli bench fused --out "$OUT" ${BENCH_ARGS:-}
for mode in ${FP8_MODES:-tensor token group}; do
  want bench_fused_fp8 && multi bench_fused_fp8 && run "bench_fused_fp8_$mode" 240 \
    python3 -m tpfuse.cli bench fused --quant "$mode" --out "$OUT" ${BENCH_ARGS:-}
done
want bench_sp && multi bench_sp && run bench_sp 240 python3 -m tpfuse.cli bench sp --out "$OUT" ${BENCH_ARGS:-}
want test_quant && multi test_quant && run test_quant 420 python3 -m pytest -q -x -m "gpu or multigpu" tests/test_quant_gpu.py
want bench_quant && multi bench_quant && run bench_quant 270 python3 -m tpfuse.cli bench allreduce --quant --out "$OUT" ${BENCH_ARGS:-}
want test_codecs && run test_codecs 240 python3 -m pytest -q -x -m gpu tests/test_quant_gpu.py
want test_fp8 && run test_fp8 240 python3 -m pytest -q -x tests/test_quant_fp8.py
want test_linear && run test_linear 300 python3 -m pytest -q -x tests/test_invariant_matmul.py tests/test_invariant_attention.py \
  tests/test_sampling.py tests/test_rope.py tests/test_activation.py
want bench_linear && run bench_linear 300 python3 scripts/bench_linear.py --out "$OUT"
want tune_linear && run tune_linear 540 python3 scripts/tune_linear.py --out "$OUT" ${TUNE_LINEAR_ARGS:-}
want bench_codecs && run bench_codecs 120 python3 scripts/bench_codecs.py --out "$OUT"
want test_models && multi test_models && run test_models 560 python3 -m pytest -q -x -m multigpu tests/test_models_gpu.py ${TEST_MODELS_ARGS:-}
want tune_allreduce && multi tune_allreduce && run tune_allreduce 420 python3 scripts/tune_allreduce.py --out "$OUT" --budget-s 360 ${TUNE_ALLREDUCE_ARGS:-}
if want fused_ab && multi fused_ab && { [ "$ngpu" -ge "${FUSED_AB_WORLD:-2}" ] \
    || { echo "== fused_ab: FUSED_AB_WORLD=${FUSED_AB_WORLD} needs as many GPUs, skipped"; status=1; false; }; }; then
  for round in $(seq "${FUSED_AB_ROUNDS:-1}"); do
    for variant in ${FUSED_AB_VARIANTS:-base}; do
      t=0
      for tree in ${AB_TREES:-.}; do
        t=$((t + 1))
        run "fused_ab_${variant}_r${round}_t$t" 150 env "PYTHONPATH=$PWD/${tree%%:*}:$PYTHONPATH" \
          "TPFUSE_COMMIT=$(tree_commit "$tree")" torchrun --nproc-per-node "${FUSED_AB_WORLD:-2}" \
          scripts/fused_ab.py --variant "$variant" --tag "_r${round}_t$t" --out "$OUT"
      done
    done
  done
fi
if want fp8_ab && multi fp8_ab; then
  for variant in ${FP8_AB_VARIANTS:-base approx_reciprocal truncate bytes_only}; do
    run "fp8_ab_$variant" 150 torchrun --nproc-per-node 2 scripts/fp8_epilogue_ab.py --variant "$variant" --out "$OUT"
  done
fi
if want fp8_ab_ncu; then
  # The norm kernel alone, with and without the fp8 epilogue, through Nsight Compute's
  # counters (instruction-level stalls; --clock-control none leaves the clocks alone).
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
  if [ -z "$ncu" ]; then
    echo "== fp8_ab_ncu: no ncu on this machine"; status=1
  else
    run fp8_ab_ncu 240 "$ncu" --clock-control none --set full --import-source yes -k regex:rms_norm_fwd_kernel \
      --launch-skip 4 --launch-count 11 -f -o "$OUT/fp8_norm" python3 scripts/fp8_epilogue_ab.py --ncu
    "$ncu" -i "$OUT/fp8_norm.ncu-rep" --page details > "$OUT/fp8_norm_details.txt" 2>&1
    "$ncu" -i "$OUT/fp8_norm.ncu-rep" --page source --print-source sass --csv > "$OUT/fp8_norm_sass.csv" 2>&1
  fi
fi
if want ll_ablation && multi ll_ablation; then
  i=0
  for item in ${LL_ABLATION_RUNS:-base:16777216}; do
    i=$((i + 1)); t=0
    for tree in ${AB_TREES:-.}; do
      t=$((t + 1))
      run "ll_ablation_${i}_t$t" 150 env "PYTHONPATH=$PWD/${tree%%:*}:$PYTHONPATH" \
        "TPFUSE_COMMIT=$(tree_commit "$tree")" torchrun --nproc-per-node 2 scripts/ll_ablation.py \
        --variant "${item%%:*}" --max-bytes "${item##*:}" ${LL_ABLATION_ARGS:-} --tag "_${item##*:}_${i}_t$t" \
        --out "$OUT"
    done
  done
fi
# bench_ab (2+ GPUs; not in "all"): `tpfuse bench allreduce` and `tpfuse bench fused` of each
# AB_TREES tree (the tree's own bench code, run from /tmp so that PYTHONPATH picks the tree),
# interleaved over AB_ROUNDS rounds (default 2; fused in the first only), with AB_BENCH_ARGS
# for allreduce; logs and markdown tables in one file, $OUT/bench_ab.tgz.
if want bench_ab && multi bench_ab; then
  mkdir -p /tmp/bench_ab; repo=$PWD
  for round in $(seq "${AB_ROUNDS:-2}"); do
    t=0
    for tree in ${AB_TREES:-.}; do
      t=$((t + 1))
      for bench in allreduce fused; do
        [ "$bench" = fused ] && [ "$round" -gt 1 ] && continue
        name="${bench}_r${round}_t$t"
        echo "== bench_ab $name: tree ${tree%%:*}"
        (cd /tmp && PYTHONPATH="$repo/${tree%%:*}:$PYTHONPATH" TPFUSE_COMMIT="$(tree_commit "$tree")" timeout 200 \
          python3 -m tpfuse.cli bench "$bench" --out "/tmp/bench_ab/$name" \
          $([ "$bench" = allreduce ] && echo "${AB_BENCH_ARGS:-}")) > "/tmp/bench_ab/$name.log" 2>&1 \
          || { status=1; tail -n 20 "/tmp/bench_ab/$name.log"; }
      done
    done
  done
  tar -czf "$OUT/bench_ab.tgz" -C /tmp bench_ab
fi
want nvlink_probe && multi nvlink_probe && run nvlink_probe 300 python3 scripts/nvlink_probe.py --out "$OUT"
want tune && multi tune && run tune 540 python3 -m tpfuse.cli tune --out "$OUT" --write-table --table-dir "$OUT" --budget-s 480 ${TUNE_ARGS:-}
# Every visible GPU is one rank: TP=2 on two GPUs; bench_decode_tp1 (not in "all"), the TP=1
# baseline on GPU 0 of the same machine.
want bench_decode && run bench_decode 540 python3 -m tpfuse.cli bench decode --out "$OUT" --plot ${DECODE_ARGS:-}
# verify (not in "all"): `tpfuse verify` at every TP size the GPUs allow, VERIFY_ARGS passed on.
want verify && run verify 400 python3 -m tpfuse.cli verify ${VERIFY_ARGS:-}
want bench_decode_tp1 && run bench_decode_tp1 400 env CUDA_VISIBLE_DEVICES=0 python3 -m tpfuse.cli bench decode \
  --out "$OUT" ${DECODE_ARGS:-}
exit $status
