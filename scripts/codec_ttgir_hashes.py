"""Hashes of the codec kernels' TTGIR for sm_90, every codec, compiled on any machine (no GPU).

A refactor of tpfuse/kernels/codecs.py that should not change the generated code proves it:
run this before and after and compare (source locations are left out of the hash).

    python scripts/codec_ttgir_hashes.py > before.json   # ... change ..., then again and diff
"""

import hashlib
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]
sys.argv = sys.argv[:1] + ["[]"]  # sm90_layouts reads its cases from argv
import sm90_layouts  # noqa: E402  (imports tpfuse in its GPU mode and intercepts launches)
import torch  # noqa: E402

from tpfuse import reference  # noqa: E402
from tpfuse.kernels import codecs  # noqa: E402


def _hash(ttgir: str) -> str:
    ttgir = re.sub(r"\s*loc\(#loc\d*\)", "", ttgir)
    return hashlib.sha1("\n".join(line for line in ttgir.splitlines() if not line.startswith("#loc")).encode()).hexdigest()


def main() -> None:
    hashes = {}
    for codec in reference.QUANT_CODECS:
        x = torch.randn(4096, dtype=torch.bfloat16)
        packed = torch.empty(1 << 16, dtype=torch.uint8)
        sm90_layouts._launches.clear()
        codecs.quantize_into(x, packed, codec)  # intercepted: nothing runs
        codecs.dequantize_into(packed, codec, torch.empty_like(x))
        for kernel, kwargs in sm90_layouts._launches:
            hashes[f"{codec}:{kernel.fn.__name__}"] = _hash(sm90_layouts._ttgir(kernel, kwargs))
    print(json.dumps(hashes, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
