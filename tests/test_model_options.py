"""TPModel's options around the layer boundary, on CPU ranks: sequence_parallel (prefill with
the residual stream split over the ranks) and fp8 (e4m3 projections, the boundary quantizing
in its kernel). A file of their own, so that the CI's two workers share the model tests."""

import pytest
import torch
import torch.distributed as dist

from tests.multiproc import run_ranks
from tests.test_models import TINY, _assert_ranks_agree, _digest, _hf_model
from tpfuse import reference
from tpfuse.comm import Communicator
from tpfuse.models import ModelConfig, TPModel

transformers = pytest.importorskip("transformers")


def _sequence_parallel_prefill(seed):
    """bf16: the sequence-parallel model's prefill logits, log-probs and generated tokens
    equal the all-reduce model's, for prompts whose rows divide over the ranks and (the
    all-reduce boundary then) prompts whose rows do not."""
    failures = []
    hf = _hf_model("qwen3", seed, torch.bfloat16)
    world = dist.get_world_size()
    with Communicator(max_bytes=1 << 18) as comm:
        plain = TPModel.from_hf(hf, comm)
        sp = TPModel.from_hf(hf, comm, sequence_parallel=True)
        for batch, tokens in ((3, 4), (2, 2 * world + 1)):
            ids = torch.randint(0, TINY["vocab_size"], (batch, tokens), generator=torch.Generator().manual_seed(seed))
            for what, a, b in (("prefill logits", sp(ids), plain(ids)),
                               ("log-probs", sp.log_probs(ids), plain.log_probs(ids)),
                               ("generated logits", sp.generate(ids, 3, return_logits=True)[1],
                                plain.generate(ids, 3, return_logits=True)[1])):
                if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                    failures.append(f"{batch} x {tokens}: {what} differ from the all-reduce model's")
        try:
            sp.set_boundary("torch")
            failures.append("a sequence-parallel model took boundary 'torch'")
        except ValueError:
            pass
    # A workspace of 2 KiB slots: 2 x 16 rows of 64 bf16 fit (sequence parallel), 3 x 16 do not
    # (the all-reduce boundary): the same bits either way, and no error.
    with Communicator(max_bytes=4096) as comm:
        plain, sp = TPModel.from_hf(hf, comm), TPModel.from_hf(hf, comm, sequence_parallel=True)
        for batch in (2, 3):
            ids = torch.randint(0, TINY["vocab_size"], (batch, 16), generator=torch.Generator().manual_seed(batch))
            if not torch.equal(sp(ids).view(torch.uint8), plain(ids).view(torch.uint8)):
                failures.append(f"{batch} x 16 with a small workspace: logits differ from the all-reduce model's")
    return failures, _digest(a)


FP8_REL_TOL = 0.25
"""Normwise relative error of an fp8 model's logits against the same model in bf16 (e4m3 keeps
3 mantissa bits: about 3% per value, weights and activations both); measured 0.10 here."""


def _fp8_model(seed):
    """fp8 projections: "fused" (the fp8 output in the boundary's kernel) == "split" (then
    quant_fp8), prefill and decode; the logits near the bf16 model's."""
    failures = []
    hf = _hf_model("llama", seed, torch.bfloat16)
    ids = torch.randint(0, TINY["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(seed))
    with Communicator(max_bytes=1 << 18) as comm:
        model = TPModel.from_hf(hf, comm, fp8=True)
        fused = model(ids), model.generate(ids, 3, return_logits=True)[1]
        model.set_boundary("split")
        split = model(ids), model.generate(ids, 3, return_logits=True)[1]
        bf16 = TPModel.from_hf(hf, comm)(ids)
    for what, a, b in zip(("prefill", "decode"), fused, split):
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            failures.append(f"fp8 {what} logits: fused differ from split")
    if not reference.rel_err(fused[0], bf16) < FP8_REL_TOL:
        failures.append(f"fp8 prefill logits {reference.rel_err(fused[0], bf16):.3f} off the bf16 model's")
    return failures, _digest(*fused)


def test_sequence_parallel_prefill_gives_the_all_reduce_models_bits():
    """TP=2 (W=4 adds 40 s of CI for a kernel tests/test_sequence_parallel.py runs at W=4)."""
    _assert_ranks_agree(run_ranks(2, _sequence_parallel_prefill, 8, timeout_s=600))


def test_sequence_parallel_and_fp8_refuse_what_they_cannot_keep():
    config = ModelConfig.from_hf(transformers.LlamaConfig(**TINY))
    for changes in (dict(boundary="torch"), dict(boundary="split"), dict(invariant=True)):
        with pytest.raises(ValueError, match="sequence_parallel needs boundary='fused' and invariant=False"):
            TPModel.random(config, sequence_parallel=True, **changes)
    for changes in (dict(invariant=True), dict(dtype=torch.float16)):
        with pytest.raises(ValueError, match="fp8 runs bf16 activations, without invariant=True"):
            TPModel.random(config, fp8=True, **changes)


def test_fp8_model_fused_equals_split_near_bf16():
    _assert_ranks_agree(run_ranks(2, _fp8_model, 9, timeout_s=600))
