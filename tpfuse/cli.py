"""The ``tpfuse`` command: ``tpfuse bench [NAME] [options]``, ``tpfuse tune [options]``,
``tpfuse verify [options]``."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

# bench name -> (module with main(argv) -> exit code, what it measures)
BENCHES = {
    "norm": ("tpfuse.bench.norm", "RMSNorm forward, add + norm and backward against torch, Liger, quack"),
    "allreduce": ("tpfuse.bench.allreduce", "all-reduce against NCCL and torch symmetric memory (--quant: codecs)"),
    "fused": ("tpfuse.bench.fused", "fused all-reduce + residual add + RMSNorm against the split path "
                                    "(--quant: with an fp8 output)"),
    "sp": ("tpfuse.bench.sp", "the sequence-parallel boundary (reduce-scatter + norm, all-gather) against NCCL"),
    "decode": ("tpfuse.bench.decode", "decode steps of a tensor-parallel model, per layer boundary"),
}
TUNE = "tpfuse.bench.tune"
VERIFY = "tpfuse.verify"

DESCRIPTION = """\
Exact, fast kernels for the tensor-parallel layer boundary. On a machine without a GPU
every benchmark runs as a CPU correctness check (Triton's interpreter, emulated ranks)."""

BENCH_EPILOG = "benchmarks:\n" + "\n".join(f"  {name:10s} {what}" for name, (_, what) in BENCHES.items()) + """

Without NAME every benchmark runs, each with --out DIR if given, and the run ends with one
verdict. `tpfuse bench NAME --help` lists NAME's own options."""


def _version() -> str:
    import tpfuse

    return tpfuse.__version__


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``tpfuse`` parser and its ``bench`` subparser."""
    p = argparse.ArgumentParser(prog="tpfuse", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"tpfuse {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench = sub.add_parser("bench", help="run the benchmarks (CPU checks without a GPU)", description=(
        "Run one benchmark, or all of them. On GPUs each writes JSON and markdown under --out; "
        "without a GPU each runs its CPU correctness check."), epilog=BENCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    bench.add_argument("-h", "--help", action="store_true", help="show this help (or NAME's) and exit")
    bench.add_argument("name", nargs="?", choices=list(BENCHES), metavar="NAME", help="one of: " + ", ".join(BENCHES))
    bench.add_argument("--out", metavar="DIR", help="where GPU runs write their results (default bench_out)")
    bench.add_argument("--version", action="version", version=f"tpfuse {_version()}")
    tune = sub.add_parser("tune", add_help=False, help="measure the plan thresholds of \"auto\" on this machine "
                          "(`tpfuse tune --help`)")
    tune.add_argument("-h", "--help", action="store_true")
    tune.add_argument("--version", action="version", version=f"tpfuse {_version()}")
    verify = sub.add_parser("verify", add_help=False, help="the invariant model's logits across TP sizes and "
                            "batches, as a table of hashes (`tpfuse verify --help`)")
    verify.add_argument("-h", "--help", action="store_true")
    return p, bench


def header() -> str:
    """One line naming the package, its versions and where the kernels run."""
    import torch
    import triton

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        where = f"{n} x {torch.cuda.get_device_name()}"
    else:
        where = "no CUDA GPU: CPU checks under Triton's interpreter, emulated ranks; timings need GPUs"
    return f"tpfuse {_version()}, torch {torch.__version__}, triton {triton.__version__}; {where}"


def run_benches(names: list[str], options: list[str]) -> int:
    """Run the benchmarks ``names`` in order with ``options``; one verdict line each and, for
    more than one, an overall verdict. Returns 0 when every one passed."""
    print(header(), flush=True)
    results = []
    for i, name in enumerate(names, 1):
        print(f"\n== [{i}/{len(names)}] tpfuse bench {name}: {BENCHES[name][1]}", flush=True)
        start = time.monotonic()
        try:
            rc = importlib.import_module(BENCHES[name][0]).main(options)
        except SystemExit as e:  # argparse's exit inside a bench (None: success)
            rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 2
        seconds = time.monotonic() - start
        results.append((name, rc, seconds))
        print(f"== tpfuse bench {name}: {'PASS' if rc == 0 else 'FAIL'} ({seconds:.0f} s)", flush=True)
    if len(results) > 1:
        failed = [name for name, rc, _ in results if rc != 0]
        total = sum(s for *_, s in results)
        verdict = "all passed" if not failed else f"FAILED: {', '.join(failed)}"
        print(f"\ntpfuse bench: {len(results) - len(failed)} of {len(results)} passed ({total:.0f} s); {verdict}")
    return max((rc for _, rc, _ in results), default=0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, bench = _parsers()
    args, rest = parser.parse_known_args(argv)
    if args.command in ("tune", "verify"):
        module = TUNE if args.command == "tune" else VERIFY
        return importlib.import_module(module).main(rest + (["--help"] if args.help else []))
    options = rest + (["--out", args.out] if args.out else [])
    if args.help:  # the bench's own options after its name, else the list of benchmarks
        if args.name:
            return importlib.import_module(BENCHES[args.name][0]).main(["--help"] + options)
        bench.print_help()
        return 0
    if args.name is None and rest:
        bench.error(f"without NAME only --out DIR is accepted, got: {' '.join(rest)}")
    return run_benches([args.name] if args.name else list(BENCHES), options)


if __name__ == "__main__":
    sys.exit(main())
