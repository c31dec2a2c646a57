#!/usr/bin/env bash
# Installs the wheels that travel with device calls into /tmp/site (scripts/device_check.sh runs
# it). To use them by hand: PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages (python
# reads no .pth file on PYTHONPATH, and the CuTe DSL's .pth adds that folder).
#   scripts/join_wheels.sh               on the GPU machine, from the repository root
#   scripts/join_wheels.sh split WHEEL   here: cut WHEEL into .whlparts/<i>/NAME.part<i>of<n>
# .whl/*.whl travel whole (carry .whl). A call carries at most 64 MiB, so a larger wheel travels
# as 50 MiB parts, one .whlparts/<i> folder carried per call. Wheels and parts collect in
# /tmp/wheels (kept while the machine stays warm); a wheel is joined once all its parts are
# there. All of /tmp/wheels is installed in one pip call, when the list changed and no part is
# missing: pip --target --upgrade replaces whole top-level folders, and the nvidia_cutlass_dsl
# wheels share one.
set -euo pipefail
shopt -s nullglob
if [ "${1:-}" = split ]; then
  name=$(basename "$2") n=$(( ($(stat -c %s "$2") + 52428799) / 52428800 ))
  for ((i = 1; i <= n; i++)); do
    mkdir -p .whlparts/$i
    dd if="$2" of=".whlparts/$i/$name.part${i}of$n" bs=1M skip=$(( (i - 1) * 50 )) count=50 status=none
  done
  exit 0
fi
W=/tmp/wheels
mkdir -p $W
whole=(.whl/*.whl)
[ ${#whole[@]} -eq 0 ] || cp "${whole[@]}" $W/
parts=(.whlparts/*.part*of* .whlparts/*/*.part*of*)
[ ${#parts[@]} -eq 0 ] || mv "${parts[@]}" $W/
missing=0
for first in $W/*.part1of*; do
  wheel=${first%.part1of*} n=${first##*of}
  have=("$wheel".part*of"$n")
  if [ ${#have[@]} -lt "$n" ]; then
    echo "join_wheels: $(basename "$wheel"): ${#have[@]} of $n parts here"; missing=1; continue
  fi
  for ((i = 1; i <= n; i++)); do cat "$wheel.part${i}of$n"; done > "$wheel.tmp"
  mv "$wheel.tmp" "$wheel" && rm "${have[@]}"
done
wheels=($W/*.whl)
{ [ $missing = 0 ] && [ ${#wheels[@]} -gt 0 ] && [ "$(ls $W)" != "$(cat /tmp/site/.wheels 2>/dev/null)" ]; } || exit 0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}"
ls $W > /tmp/site/.wheels
echo "join_wheels: installed ${#wheels[@]} wheels to /tmp/site"
