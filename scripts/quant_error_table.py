"""The measured-error table of README's "Quantized all-reduce" section, on CPU.

Relative RMS error ||out - sum|| / ||sum|| of ``tpfuse.reference.quantized_all_reduce``
(which the kernels match bit for bit) against the float64 sum, bf16 inputs, 2**20 values per
rank. Inputs: Gaussian; heavy-tailed (Student's t, 3 degrees of freedom); Gaussian with one
value per group of 32 scaled by 100 (at the same position on every rank, like an outlier
channel), where the error is also given on the other 31 values of each group alone.

    python scripts/quant_error_table.py
"""

import torch

from tpfuse import reference as R

N = 1 << 20
WORLDS = (2, 4, 8)


def _inputs(kind, world, g):
    outliers = torch.randint(0, 32, (N // 32,), generator=g) + torch.arange(0, N, 32)
    xs = []
    for _ in range(world):
        x = torch.randn(N, generator=g)
        if kind == "heavy-tailed (t3)":
            x = x / (torch.randn(N, 3, generator=g).pow(2).sum(1) / 3).sqrt()
        elif kind == "outlier x100 per group":
            x[outliers] *= 100
        xs.append(x.to(torch.bfloat16))
    ordinary = torch.ones(N, dtype=torch.bool)
    ordinary[outliers] = False
    return xs, ordinary


def main():
    print("| inputs | W | exact path | " + " | ".join(R.QUANT_CODECS) + " |")
    print("|---" * (3 + len(R.QUANT_CODECS)) + "|")
    for kind in ("Gaussian", "heavy-tailed (t3)", "outlier x100 per group"):
        for world in WORLDS:
            xs, ordinary = _inputs(kind, world, torch.Generator().manual_seed(world))
            exact = sum(x.double() for x in xs)
            cells = [f"{100 * R.rel_err(R.all_reduce(xs), exact):.2f}%"]
            for codec in R.QUANT_CODECS:
                out = R.quantized_all_reduce(xs, codec)
                cell = f"{100 * R.rel_err(out, exact):.2f}%"
                if kind.startswith("outlier"):
                    cell += f" ({100 * R.rel_err(out[ordinary], exact[ordinary]):.1f}%)"
                cells.append(cell)
            print(f"| {kind} | {world} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
