"""tpfuse: exact, fast kernels for the layer boundary of tensor-parallel transformers.

The layer boundary is the all-reduce that closes an attention or MLP block, then the residual
add and RMSNorm. tpfuse's promise: the bits never depend on the path (fused or not, algorithm,
message size, batch around a row), checked against ``tpfuse.reference`` bit for bit.

Where to start:

- ``tpfuse.rms_norm(x, weight)`` and ``tpfuse.add_rms_norm(x, residual, weight)``, or the
  module ``tpfuse.RMSNorm``: one GPU (or CPU), differentiable.
- ``tpfuse.Communicator()``: every rank of a single-node process group makes one, then calls
  ``comm.all_reduce(x)`` or the fused ``comm.all_reduce_add_rms_norm(x, residual, weight)``
  (``..._fp8``: its output quantized for an fp8 GEMM; ``reduce_scatter_add_rms_norm`` and
  ``all_gather``: the sequence-parallel boundary, differentiable).
- ``tpfuse.models.TPModel``: a tensor-parallel Llama-family model that uses them
  (``TPModel.from_hf(hf_model, comm)``; ``invariant=True``: the same logits at any batch and
  TP size; ``sequence_parallel=True``, ``fp8=True``).
- ``tpfuse.quant_fp8(y, mode)``: activations to fp8 (e4m3) for fp8 GEMMs, per tensor, token
  or group of 128.
- ``tpfuse.reference``: the contract in plain torch.
- On the command line: ``tpfuse bench`` (CPU checks without a GPU), ``tpfuse tune``,
  ``tpfuse verify``.

Without CUDA, the kernels run on CPU tensors under Triton's interpreter (set up on import).
"""

from tpfuse import _runtime  # noqa: F401  (first: selects Triton's interpreter when CUDA is absent)
from tpfuse import reference
from tpfuse.activation_ops import silu_and_mul
from tpfuse.attention_ops import invariant_attention
from tpfuse.comm import CallMismatchError, CommError, CommTimeoutError, Communicator
from tpfuse.fp8_ops import quant_fp8
from tpfuse.kernels.codecs import dequantize, quantize
from tpfuse.linear_ops import invariant_matmul
from tpfuse.nn import RMSNorm
from tpfuse.norm_ops import add_rms_norm, rms_norm
from tpfuse.rope_ops import rope_and_cache
from tpfuse.sampling_ops import sample, token_log_probs

__all__ = ["rms_norm", "add_rms_norm", "RMSNorm", "Communicator", "CommError", "CommTimeoutError",
           "CallMismatchError", "reference",
           "quantize", "dequantize", "quant_fp8", "invariant_matmul", "invariant_attention", "rope_and_cache",
           "silu_and_mul",
           "token_log_probs", "sample"]
__version__ = "0.1.0"
