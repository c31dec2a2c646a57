"""Tensor-parallel models whose layer boundaries run on tpfuse (``TPModel``)."""

from tpfuse.models.boundary import BOUNDARIES
from tpfuse.models.config import ARCHITECTURES, PRESETS, ModelConfig
from tpfuse.models.llama import DecodeSession, TPModel

__all__ = ["TPModel", "DecodeSession", "ModelConfig", "PRESETS", "ARCHITECTURES", "BOUNDARIES"]
