"""The ``tpfuse`` command: help and version everywhere, one header and one verdict, CPU
options honoured or named."""

import subprocess
import sys

import pytest

from tpfuse import cli
from tpfuse._runtime import INTERPRETER

cpu_only = pytest.mark.skipif(not INTERPRETER, reason="the benchmarks' CPU checks run without CUDA only")




def _run(capsys, *argv):
    """(exit code, stdout) of ``tpfuse argv...`` in this process."""
    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse's --help, --version and usage errors
        code = e.code
    return code, capsys.readouterr().out


@pytest.mark.smoke
@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["bench", "--help"], ["tune", "--help"], ["verify", "--help"]])
def test_help_exits_zero(capsys, argv):
    code, out = _run(capsys, *argv)
    assert code == 0 and out.startswith("usage: tpfuse")


@pytest.mark.smoke
def test_version_and_the_list_of_benchmarks(capsys):
    code, out = _run(capsys, "--version")
    assert code == 0 and out.strip().startswith("tpfuse ")
    code, out = _run(capsys, "bench", "--help")
    assert all(name in out for name in cli.BENCHES)


@pytest.mark.smoke
def test_a_benchmarks_help_has_no_banner_and_documents_every_option(capsys):
    code, out = _run(capsys, "bench", "norm", "--help")
    assert code == 0 and out.startswith("usage: tpfuse bench norm")
    flat = " ".join(out.split())
    for option, text in (("--dtype", "input dtypes"), ("--m", "rows (tokens) per call"),
                         ("--n", "row length (hidden size)"), ("--ops", "forward, residual add")):
        assert text in flat, f"{option}: no help text {text!r}"
    code, out = _run(capsys, "bench", "fused", "--help")
    assert "--max-tokens" in out and "leave out the shapes" in out
    code, out = _run(capsys, "bench", "allreduce", "--help")
    assert "the messages' dtype" in " ".join(out.split())


@pytest.mark.smoke
@pytest.mark.parametrize("argv", [[], ["bench", "nope"], ["bench", "--m", "3"]])
def test_usage_errors_exit_two(capsys, argv):
    code, _ = _run(capsys, *argv)
    assert code == 2


@pytest.mark.smoke
@cpu_only
def test_bench_on_cpu_honours_its_options_and_names_the_gpu_only_ones(capsys):
    code, out = _run(capsys, "bench", "norm", "--m", "2", "--n", "48", "--ops", "fwd", "--dtype", "fp32", "--plot")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("tpfuse ") and "torch" in lines[0]
    assert "2x48 (fp32)" in out and "--plot apply to GPU runs only" in out
    rows = [line for line in lines if line.startswith("fwd ")]
    assert len(rows) == 1 and " 48 " in rows[0]  # one op, one shape, one dtype
    assert "== tpfuse bench norm: PASS" in out


def test_the_module_runs_as_a_command_and_exits_zero_on_help():
    proc = subprocess.run([sys.executable, "-m", "tpfuse.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "bench" in proc.stdout


@cpu_only
@pytest.mark.parametrize("argv, checked", [
    (["allreduce", "--max-bytes", "4096"], "| 4 KiB | auto | yes |"),
    (["allreduce", "--quant", "--dtype", "bf16"], "| 64 KiB | int4 | yes |"),
    (["fused", "--max-tokens", "1"], "| 1 x 4096 | auto | yes |"),
    (["decode", "--batch", "1", "--steps", "2", "--boundaries", "fused,symm_mem"], "batch 1 fused compiled: logits bitwise"),
])
def test_each_collective_benchmark_passes_its_cpu_check(argv, checked):
    """In a process of its own, as a user runs it (the ranks are spawned processes)."""
    proc = subprocess.run([sys.executable, "-m", "tpfuse.cli", "bench", *argv], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert checked in proc.stdout and "all checks passed" in proc.stdout
    assert "leaked" not in proc.stderr, proc.stderr[-2000:]


@cpu_only
def test_verify_shows_the_invariant_model_equal_across_tp_sizes():
    """``tpfuse verify`` as a user runs it: its table and verdict (the plain model's prefill
    at TP=2 differs, which the table says too)."""
    proc = subprocess.run([sys.executable, "-m", "tpfuse.cli", "verify", "--tp", "1", "2", "--batch", "2", "--prompt",
                           "3", "--steps", "1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 1, proc.stdout
    cells = rows[0]  # TP, prefill, = TP=1, decode, = TP=1, alone = in batch, plain prefill, = TP=1
    assert cells[2] == cells[4] == cells[5] == "equal" and cells[7] == "NOT equal", proc.stdout
    assert "the same at every TP size" in proc.stdout
