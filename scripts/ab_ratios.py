"""New / old time per method from ``scripts/device_check.sh bench_ab`` runs (their bench_ab.tgz
unpacked), pooled over rounds: the median, least and largest ratio of matching points.

    python scripts/ab_ratios.py DIR:NEW:OLD [DIR:NEW:OLD ...] > ab_ratios.md

DIR holds bench_ab/; NEW and OLD are the trees' tags in it (t1, t2: their order in AB_TREES),
so calls that swapped the trees' order pool correctly. Allreduce points match by size, fused
ones by (tokens, hidden).
"""

from __future__ import annotations

import glob
import json
import statistics
import sys

KEYS = {"allreduce": ("size_bytes",), "fused": ("tokens", "hidden")}


def _times(path: str, key: tuple[str, ...]) -> dict:
    records = json.load(open(path))["records"]
    return {(tuple(r[k] for k in key), r["method"]): r["us"] for r in records if r.get("us")}


def main(runs: list[str]) -> None:
    for bench, key in KEYS.items():
        ratios: dict[str, list[float]] = {}
        for run in runs:
            folder, new_tag, old_tag = run.split(":")
            new, old = ([_times(p, key) for p in glob.glob(f"{folder}/bench_ab/{bench}_r*_{tag}/*.json")]
                        for tag in (new_tag, old_tag))
            for n, o in zip(new, old):
                for point, us in n.items():
                    if point in o:
                        ratios.setdefault(point[1], []).append(us / o[point])
        print(f"\n## {bench}: new / old time\n\n| method | median | min | max | points |\n|---|---|---|---|---|")
        for method, values in sorted(ratios.items()):
            print(f"| {method} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} | "
                  f"{len(values)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
