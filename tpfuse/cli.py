"""The ``tpfuse`` command: ``tpfuse bench [NAME] [options]``."""

from __future__ import annotations

import importlib
import sys

# bench name -> module with main(argv) -> exit code
BENCHES = {
    "norm": "tpfuse.bench.norm",
    "allreduce": "tpfuse.bench.allreduce",
    "fused": "tpfuse.bench.fused",
}

USAGE = f"""usage: tpfuse bench [NAME [options]]

Runs the benchmarks: {", ".join(BENCHES)}; all of them when no NAME is given.
On a machine without a GPU each runs a CPU correctness check (emulated ranks for
collectives) instead of timings. `tpfuse bench NAME --help` lists NAME's options."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "bench" or argv[1:2] in (["-h"], ["--help"]):
        print(USAGE)
        return 0 if argv[1:2] in (["-h"], ["--help"]) else 2
    rest = argv[1:]
    if rest and rest[0] not in BENCHES:
        print(f"tpfuse bench: unknown benchmark {rest[0]!r}; choose from {', '.join(BENCHES)}\n\n{USAGE}")
        return 2
    names = [rest[0]] if rest else list(BENCHES)
    status = 0
    for name in names:
        print(f"== tpfuse bench {name}", flush=True)
        status |= importlib.import_module(BENCHES[name]).main(rest[1:])
    return status


if __name__ == "__main__":
    sys.exit(main())
