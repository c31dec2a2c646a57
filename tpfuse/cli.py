"""The ``tpfuse`` command: ``tpfuse bench [NAME] [options]``."""

from __future__ import annotations

import argparse
import importlib
import sys

# bench name -> module with main(argv) -> exit code
BENCHES = {
    "norm": "tpfuse.bench.norm",
    "allreduce": "tpfuse.bench.allreduce",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="tpfuse", description="tpfuse benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run benchmarks: " + ", ".join(BENCHES) + " (all when none is named)",
                           add_help=False)
    bench.add_argument("name", nargs="?", choices=list(BENCHES))
    args, rest = parser.parse_known_args(argv)
    names = [args.name] if args.name else list(BENCHES)
    if rest and not args.name:
        parser.error("options after `tpfuse bench` need a benchmark name, e.g. `tpfuse bench norm --plot`")
    status = 0
    for name in names:
        print(f"== tpfuse bench {name}", flush=True)
        status |= importlib.import_module(BENCHES[name]).main(rest)
    return status


if __name__ == "__main__":
    sys.exit(main())
