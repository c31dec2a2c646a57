"""tpfuse's collective ops and tpfuse.models on GPUs: one process per GPU, NCCL group.

Run on a machine with >= 2 GPUs:  python -m pytest -m multigpu tests/test_models_gpu.py

- The collective ops under ``torch.compile(fullgraph=True, dynamic=True)`` with inductor give
  eager's bits over changing batch sizes, and the compiled function captured in a CUDA graph
  replays them (new inputs copied in before each replay).
- ``TPModel`` at TP=2 matches Hugging Face's own model (fp32, tolerance as on CPU), and in
  bf16: "fused" gives "split"'s logits bit for bit at every step, eagerly, under CUDA graphs,
  compiled, and in a second decode session (a new capture); every boundary's greedy decode repeats
  bit for bit in new processes (run-to-run determinism) at batch 1, 8 and 32; at TP=2 and at
  TP = every GPU.
- The teardown after a graph-captured ``generate`` (close, destroy_process_group) returns.
"""

import hashlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from tests.multiproc import capture_graph, run_ranks

pytestmark = pytest.mark.multigpu

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
if NGPU < 2:
    pytest.skip("needs at least 2 CUDA GPUs", allow_module_level=True)

WORLDS = sorted({2, NGPU})
HIDDEN = 4096


@pytest.mark.parametrize("world", WORLDS)
def test_teardown_after_generate_returns(world):
    """examples/tp_model.py (graph-captured generate, then the Communicator closed and the
    process group destroyed) exits on every rank well inside the limit. NCCL does not destroy
    a group while a CUDA graph that captured one of its collectives (the decode step's logits
    all-gather) exists: at a841eb3 this teardown waited for ever, until the model dropped its
    graphs when its Communicator closes (``Communicator.on_close``). First in the file, so that
    a suite cut short still says whether it returns. The ranks are started here, each in a
    session of its own and writing to a file (torchrun's workers outlive a kill of torchrun and
    hold its pipes), so that a hang ends in a failure, with every rank killed."""
    pytest.importorskip("transformers")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(world)]
    start = time.monotonic()
    ranks = [subprocess.Popen([sys.executable, os.path.join(root, "examples", "tp_model.py")], cwd=root,
                              env=env | {"RANK": str(r), "LOCAL_RANK": str(r)}, stdout=logs[r],
                              stderr=subprocess.STDOUT, start_new_session=True) for r in range(world)]
    hung = []
    for r, proc in enumerate(ranks):
        try:
            proc.wait(timeout=max(1.0, 180 - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            hung.append(r)
    for proc in ranks:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    took = time.monotonic() - start
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
    assert not hung, f"ranks {hung} did not return within 180 s: {[o[-1500:] for o in outs]}"
    assert all(p.returncode == 0 for p in ranks), [o[-3000:] for o in outs]
    assert "prefill logits (1, 8, 128)" in outs[0]
    assert took < 120, f"the example took {took:.0f} s"


def _same(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _layer(comm, x, residual, w):
    r = comm.all_reduce(x * 2)
    y, residual = comm.all_reduce_add_rms_norm(r, residual, w, 1e-6)
    y2, reduced = comm.all_reduce_rms_norm(y, w, 1e-5, weight_offset=1.0)
    return y + y2, residual, reduced, comm.all_reduce(x, quant="int4", quant_min_bytes=0)


def _compiled_ops(seed):
    import tpfuse

    failures, rank = [], dist.get_rank()
    torch._dynamo.reset()
    with tpfuse.Communicator() as comm:
        w = (torch.rand(HIDDEN, device="cuda") + 0.5).to(torch.bfloat16)
        f = torch.compile(lambda x, res: _layer(comm, x, res, w), fullgraph=True, dynamic=True)
        g = torch.Generator(device="cuda").manual_seed(seed + rank)
        for tokens in (1, 7, 64, 300):
            x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
            res = torch.randn(tokens, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
            for k, (a, b) in enumerate(zip(f(x, res), _layer(comm, x, res, w))):
                if not _same(a, b):
                    failures.append(f"{tokens} tokens: compiled output {k} differs from eager")
        # The compiled function in a CUDA graph, replayed on new inputs.
        x_in = torch.empty(16, HIDDEN, device="cuda", dtype=torch.bfloat16)
        res_in = torch.empty_like(x_in)
        x_in.normal_(generator=g)
        res_in.normal_(generator=g)
        graph, outs = capture_graph(lambda: f(x_in, res_in))
        for i in range(3):
            x_in.normal_(generator=g)
            res_in.normal_(generator=g)
            graph.replay()
            for k, (a, b) in enumerate(zip(outs, _layer(comm, x_in, res_in, w))):
                if not _same(a, b):
                    failures.append(f"replay {i}: graphed compiled output {k} differs from eager")
    return failures


def test_collective_ops_compile_with_inductor_and_replay_in_cuda_graphs():
    failures = run_ranks(2, _compiled_ops, 5, backend="nccl", timeout_s=600)
    assert not any(failures), failures


def _config():
    from tpfuse.models import PRESETS

    return PRESETS["llama3-8b"].replace(num_layers=4, vocab_size=32000)


def _decode_digests(batches, steps, boundaries):
    """Per (boundary, batch): a digest of the greedy decode's logits; and bit failures of
    fused against split (eager graph, no graph, compiled, a second capture)."""
    import tpfuse
    from tpfuse.models import TPModel

    failures, digests = [], {}
    with tpfuse.Communicator() as comm:
        model = TPModel.random(_config(), comm, seed=1, boundary="split")
        for batch in batches:
            ids = torch.randint(0, 32000, (batch, 16), device="cuda",
                                generator=torch.Generator(device="cuda").manual_seed(batch))
            runs = {}
            for boundary in boundaries:
                model.set_boundary(boundary)
                runs[boundary] = model.generate(ids, steps, return_logits=True)[1]
                digests[f"{boundary} b{batch}"] = hashlib.sha1(
                    runs[boundary].view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
            if "fused" in boundaries:
                model.set_boundary("fused")
                variants = {"fused, second capture": model.generate(ids, steps, return_logits=True)[1],
                            "fused without a graph": model.generate(ids, steps, cuda_graph=False,
                                                                    return_logits=True)[1],
                            "fused compiled": model.generate(ids, steps, compile=True, return_logits=True)[1]}
                for what, logits in [("fused", runs["fused"])] + list(variants.items()):
                    if not _same(logits, runs["split"]):
                        bad = (logits != runs["split"]).any(-1).nonzero()[:3].tolist()
                        failures.append(f"batch {batch}: {what} differs from split at (step, row) {bad}")
    return failures, digests


@pytest.mark.parametrize("world", WORLDS)
def test_fused_equals_split_every_way_and_decode_repeats_across_processes(world):
    boundaries = ["split", "fused", "torch", "symm_mem"]
    first = run_ranks(world, _decode_digests, [1, 8, 32], 24, boundaries, backend="nccl", timeout_s=900, fresh=True)
    assert not any(f for f, _ in first), [f for f, _ in first]
    second = run_ranks(world, _decode_digests, [1, 8, 32], 24, boundaries, backend="nccl", timeout_s=900, fresh=True)
    assert all(f[1] == first[0][1] for f in first), "the ranks' logits differ"
    differ = sorted(k for k in first[0][1] if first[0][1][k] != second[0][1][k])
    assert not differ, f"run to run, in new processes, the decode's logits differ for {differ}"


def _against_hf(seed):
    import transformers

    import tpfuse
    from tests.test_models import HF_REL_TOL, TINY, _hf_greedy
    from tpfuse import reference
    from tpfuse.models import TPModel

    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval().cuda()
    ids = torch.randint(0, TINY["vocab_size"], (2, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    want_tokens, want_logits = _hf_greedy(hf, ids, 6)
    failures = []
    with tpfuse.Communicator() as comm:
        for boundary in ("fused", "torch"):
            tokens, logits = TPModel.from_hf(hf, comm, boundary=boundary).generate(ids, 6, return_logits=True)
            err = reference.rel_err(logits, want_logits)
            if not torch.equal(tokens, want_tokens) or not err < HF_REL_TOL:
                failures.append(f"{boundary}: tokens equal {torch.equal(tokens, want_tokens)}, rel err {err:.2e}")
    return failures


def test_tp2_model_matches_hugging_face_on_gpus():
    pytest.importorskip("transformers")
    failures = run_ranks(2, _against_hf, 3, backend="nccl", timeout_s=600)
    assert not any(failures), failures


def _sequence_parallel_and_fp8(seed):
    """The sequence-parallel model's prefill and decode logits equal the all-reduce model's
    (rows that divide over the ranks, and rows that do not); the fp8 model's "fused" logits
    equal "split"'s, eager, graph-replayed and compiled."""
    import tpfuse
    from tpfuse.models import TPModel

    failures, world = [], dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with tpfuse.Communicator() as comm:
        plain = TPModel.random(_config(), comm, seed=seed)
        sp = TPModel.random(_config(), comm, seed=seed, sequence_parallel=True)
        for batch, tokens in ((4, 512), (3, 2 * world + 1)):
            ids = torch.randint(0, 32000, (batch, tokens), device="cuda", generator=gen)
            for what, a, b in (("prefill", sp(ids), plain(ids)),
                               ("decode", sp.generate(ids, 4, return_logits=True)[1],
                                plain.generate(ids, 4, return_logits=True)[1])):
                if not _same(a, b):
                    failures.append(f"sequence parallel {batch} x {tokens}: {what} logits differ from the plain model's")
        del plain, sp
        fp8 = TPModel.random(_config(), comm, seed=seed, fp8=True)
        ids = torch.randint(0, 32000, (8, 16), device="cuda", generator=gen)
        fused = {"prefill": fp8(ids), "decode": fp8.generate(ids, 8, return_logits=True)[1],
                 "compiled decode": fp8.generate(ids, 8, compile=True, return_logits=True)[1]}
        fp8.set_boundary("split")
        split = fp8(ids), fp8.generate(ids, 8, return_logits=True)[1]
        for (what, a), b in zip(fused.items(), (split[0], split[1], split[1])):
            if not _same(a, b):
                failures.append(f"fp8 {what}: fused logits differ from split's")
    return failures


def test_sequence_parallel_and_fp8_models_keep_the_bits():
    failures = run_ranks(NGPU, _sequence_parallel_and_fp8, 11, backend="nccl", timeout_s=600)
    assert not any(failures), failures
