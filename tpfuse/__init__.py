"""tpfuse: exact, fast kernels for the layer boundary of tensor-parallel transformers."""

from tpfuse import _runtime  # noqa: F401  (first: selects Triton's interpreter when CUDA is absent)
from tpfuse import reference
from tpfuse.comm import CommTimeoutError, Communicator
from tpfuse.kernels.codecs import dequantize, quantize
from tpfuse.nn import RMSNorm
from tpfuse.ops import add_rms_norm, rms_norm

__all__ = ["rms_norm", "add_rms_norm", "RMSNorm", "Communicator", "CommTimeoutError", "reference",
           "quantize", "dequantize"]
__version__ = "0.1.0"
