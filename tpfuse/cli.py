"""The ``tpfuse`` command: ``tpfuse bench [NAME] [options]`` and ``tpfuse tune [options]``."""

from __future__ import annotations

import importlib
import sys

# bench name -> module with main(argv) -> exit code
BENCHES = {
    "norm": "tpfuse.bench.norm",
    "allreduce": "tpfuse.bench.allreduce",
    "fused": "tpfuse.bench.fused",
    "decode": "tpfuse.bench.decode",
}
TUNE = "tpfuse.bench.tune"

USAGE = f"""usage: tpfuse bench [NAME [options]] | tpfuse bench [--out DIR]
       tpfuse tune [--out DIR] [--write-table [--table-dir DIR]] [--budget-s S] [--sizes SIZE ...]

bench: runs the benchmarks: {", ".join(BENCHES)}; all of them when no NAME is given
(on GPUs each writes its JSON and markdown under DIR, default bench_out).
On a machine without a GPU each runs a CPU correctness check (emulated ranks for
collectives) instead of timings. `tpfuse bench NAME --help` lists NAME's options.

tune: on a multi-GPU machine, times the algorithms that "auto" picks between (all-reduce,
fused all-reduce + RMSNorm, quantized all-reduce) at its world size W, writes the sweep
under DIR (default tune_out) and, with --write-table, the plan table w{{W}}.json into
tpfuse/comm/tables/ (or --table-dir), which the plans read for that W. Without GPUs it
runs the sweep on 2 CPU ranks as a check and writes no table into the package.
`tpfuse tune --help` lists its options."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["tune"]:
        return importlib.import_module(TUNE).main(argv[1:])
    if not argv or argv[0] != "bench" or argv[1:2] in (["-h"], ["--help"]):
        print(USAGE)
        return 0 if argv[1:2] in (["-h"], ["--help"]) else 2
    rest = argv[1:]
    if rest and rest[0] in BENCHES:
        names, options = [rest[0]], rest[1:]
    elif not rest or (len(rest) == 2 and rest[0] == "--out"):  # every benchmark
        names, options = list(BENCHES), rest
    else:
        print(f"tpfuse bench: unknown benchmark or option {rest[0]!r}; choose from {', '.join(BENCHES)}\n\n{USAGE}")
        return 2
    status = 0
    for name in names:
        print(f"== tpfuse bench {name}", flush=True)
        status |= importlib.import_module(BENCHES[name]).main(options)
    return status


if __name__ == "__main__":
    sys.exit(main())
