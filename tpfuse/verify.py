"""``tpfuse verify``: do the logits of an invariant model depend on the TP size or the batch?

The same model (``TPModel.random``: each full weight from the seed and its name, so every TP
size holds the same weights) runs at each TP size this machine allows, invariant
(``TPModel(invariant=True)``) and plain, on the same prompts. For sequence 0 of a batch it
hashes the prefill logits and the decode logits of a few greedy steps, the same of the
sequence alone, and its decode beside prompts of other lengths; it prints one table: equal or
not to TP=1's, and alone = in the batch.
Without a GPU the ranks are emulated CPU processes under Triton's interpreter (a tiny model);
on GPUs every TP size that divides the GPU count runs, on the first GPUs.

    tpfuse verify [--preset NAME] [--tp 1 2 4] [--batch 4] [--prompt 12] [--steps 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

import torch

from tpfuse.models.config import PRESETS, ModelConfig

TINY = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8, num_kv_heads=4,
                   head_dim=16, max_position_embeddings=256)
"""The CPU default: Llama-shaped, every projection in chunks the invariant matmul serves at TP 1, 2, 4."""


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:12]


def _rank(rank: int, world: int, port: int, opts: dict) -> None:
    """One rank of one TP size: both models, the hashes (rank 0 writes them to opts["out"])."""
    import torch.distributed as dist

    from tpfuse.bench.common import init_rank
    from tpfuse.comm import Communicator
    from tpfuse.models import TPModel

    gpu = opts["gpu"]
    init_rank(rank, world, port, "nccl" if gpu else "gloo")
    config = TINY if opts["preset"] == "tiny" else PRESETS[opts["preset"]]
    g = torch.Generator().manual_seed(opts["seed"])
    ids = torch.randint(0, config.vocab_size, (opts["batch"], opts["prompt"]), generator=g)
    row = {}
    with Communicator() as comm:
        ids = ids.to(comm.device)
        for name, invariant in (("invariant", True), ("plain", False)):
            model = TPModel.random(config, comm, seed=opts["seed"], boundary="split", invariant=invariant)
            row[f"{name} prefill"] = _digest(model(ids)[0])
            if invariant:
                row["alone"] = _digest(model(ids[:1])[0])
                _, logits = model.generate(ids, opts["steps"], return_logits=True)
                row["invariant decode"] = _digest(logits[0])
                # Sequence 0 decoding alone, and beside prompts of other lengths (right-padded).
                others = [1 + (opts["prompt"] - 1) * i // opts["batch"] for i in range(1, opts["batch"])]
                _, ragged = model.generate(ids, opts["steps"], lengths=[opts["prompt"], *others], return_logits=True)
                _, alone = model.generate(ids[:1], opts["steps"], return_logits=True)
                row["decode alone"], row["decode among other lengths"] = _digest(alone[0]), _digest(ragged[0])
            del model
    if rank == 0:
        with open(opts["out"], "w") as f:
            json.dump(row, f)
    dist.destroy_process_group()


def _run(world: int, opts: dict) -> dict | None:
    """The hashes at TP size ``world`` (None if its ranks failed)."""
    from tpfuse.bench.common import spawn_ranks

    if spawn_ranks(_rank, world, opts) != 0:
        return None
    with open(opts["out"]) as f:
        return json.load(f)


def _table(rows: dict[int, dict | None]) -> tuple[str, bool]:
    base = rows.get(min(rows))
    lines = ["| TP | invariant prefill | = TP=1 | invariant decode | = TP=1 | alone = in batch | plain prefill "
             "| = TP=1 |", "|" + "---|" * 8]
    ok = base is not None
    for tp, r in rows.items():
        if r is None:
            lines.append(f"| {tp} | failed |" + " |" * 7)
            ok = False
            continue
        same = {k: base is not None and r[k] == base[k] for k in r}
        alone = (r["alone"] == r["invariant prefill"]
                 and r["decode alone"] == r["decode among other lengths"] == r["invariant decode"])
        ok = ok and same["invariant prefill"] and same["invariant decode"] and alone
        yes = {True: "equal", False: "NOT equal"}
        lines.append(f"| {tp} | {r['invariant prefill']} | {yes[same['invariant prefill']]} | "
                     f"{r['invariant decode']} | {yes[same['invariant decode']]} | {yes[alone]} | "
                     f"{r['plain prefill']} | {yes[same['plain prefill']]} |")
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpfuse verify", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser.add_argument("--preset", default="tiny" if gpus == 0 else "llama3-8b",
                        choices=["tiny", *PRESETS], help="the model (default: tiny on CPU, llama3-8b on GPUs)")
    parser.add_argument("--tp", type=int, nargs="+", help="TP sizes (default: 1, 2, 4 on CPU; the powers of two "
                        "up to the GPU count on GPUs)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=12, help="prompt length (tokens)")
    parser.add_argument("--steps", type=int, default=3, help="greedy decode steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = args.tp or ([1, 2, 4] if gpus == 0 else [t for t in (1, 2, 4, 8) if t <= gpus and gpus % t == 0])
    if gpus and max(sizes) > gpus:
        parser.error(f"--tp {max(sizes)} needs as many GPUs; this machine has {gpus}")
    from tpfuse.cli import header

    print(header(), flush=True)
    print(f"model {args.preset}, batch {args.batch} x {args.prompt} tokens, {args.steps} decode steps, TP {sizes}; "
          "hashes of sequence 0's logits", flush=True)
    if not gpus:
        os.environ["TRITON_INTERPRET"] = "1"  # the spawned ranks run the kernels on CPU
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tp in sizes:
            opts = dict(vars(args), gpu=bool(gpus), out=os.path.join(tmp, f"tp{tp}.json"))
            rows[tp] = _run(tp, opts)
    table, ok = _table(rows)
    print(table)
    print("\ntpfuse verify: " + ("the invariant model's logits are the same at every TP size and alone or in the "
                                 "batch" if ok else "FAILED: the invariant model's logits differ (table above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
