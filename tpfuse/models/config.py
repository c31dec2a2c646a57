"""``ModelConfig``: the shape of a dense decoder-only transformer, from a Hugging Face config
or a preset.

Supported (``ARCHITECTURES``): Llama 2/3, Mistral (without a sliding window shorter than the
sequence), Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm) and Gemma (``(1 + w)`` norms
through ``norm_weight_offset``, a tanh-GELU MLP, embeddings scaled by sqrt(hidden)). Anything
else raises ``NotImplementedError`` naming what is not supported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    architecture: str = "llama"
    qkv_bias: bool = False
    """q/k/v projections carry biases (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over head_dim of q and k before the rotary embedding (Qwen3)."""
    norm_weight_offset: float = 0.0
    """Every RMSNorm scales by weight + this (Gemma: 1.0)."""
    hidden_act: str = "silu"
    """The MLP's gate activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)."""
    scale_embeddings: bool = False
    """Embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype (Gemma)."""
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    """Mistral's window: sequences may not be longer (no sliding-window attention here)."""

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise NotImplementedError(f"architecture {self.architecture!r} is not supported; tpfuse.models serves "
                                      f"{', '.join(ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise NotImplementedError(f"hidden_act {self.hidden_act!r} is not supported (silu, gelu_tanh)")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def check_tensor_parallel(self, world_size: int) -> None:
        """ValueError unless heads, kv heads and the MLP width split evenly over world_size."""
        for what, n in (("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads),
                        ("intermediate_size", self.intermediate_size)):
            if n % world_size:
                raise ValueError(f"{what}={n} does not split over {world_size} ranks (tensor parallelism shards "
                                 f"it; choose a world size that divides it)")

    @classmethod
    def from_hf(cls, hf_config) -> "ModelConfig":
        """The config of a Hugging Face ``transformers`` Llama, Mistral, Qwen2, Qwen3 or Gemma model."""
        arch = getattr(hf_config, "model_type", None)
        if arch not in ARCHITECTURES:
            raise NotImplementedError(f"Hugging Face model_type {arch!r} is not supported; tpfuse.models serves "
                                      f"{', '.join(ARCHITECTURES)}")
        c = hf_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        if getattr(c, "mlp_bias", False) or (arch in ("llama", "qwen3") and getattr(c, "attention_bias", False)):
            raise NotImplementedError(f"{arch} with attention_bias or mlp_bias: the row-parallel projections' biases "
                                      "are not supported")
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        sliding = getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window", True) else None
        act = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_tanh"}.get(c.hidden_act)
        if act is None:
            raise NotImplementedError(f"hidden_act {c.hidden_act!r} is not supported (silu, gelu_pytorch_tanh)")
        return cls(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads, head_dim=head_dim,
            rms_norm_eps=c.rms_norm_eps, rope_theta=float(theta), max_position_embeddings=c.max_position_embeddings,
            architecture=arch, qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
            norm_weight_offset=1.0 if arch == "gemma" else 0.0, hidden_act=act, scale_embeddings=arch == "gemma",
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            sliding_window=sliding if arch in ("mistral", "qwen2", "qwen3") else None)


PRESETS = {
    # Meta-Llama-3-8B / 70B (rope without the 3.1 scaling; 8192 positions).
    "llama3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                             num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0),
    "llama3-70b": ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                              num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0),
    # Qwen2.5-32B: q/k/v biases, 152064 tokens.
    "qwen2.5-32b": ModelConfig(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64,
                               num_heads=40, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                               max_position_embeddings=32768, architecture="qwen2", qkv_bias=True),
    # A dense model of hidden size 2880 with gpt-oss-20b's attention shape (64 heads of 64, 8 kv
    # heads, 24 layers, its vocabulary) and a 3x SwiGLU MLP: the hidden size whose norm tiles
    # are padded (2880 is not a power of two).
    "hidden2880": ModelConfig(vocab_size=201088, hidden_size=2880, intermediate_size=8640, num_layers=24,
                              num_heads=64, num_kv_heads=8, head_dim=64, rope_theta=150000.0,
                              max_position_embeddings=131072),
}
"""Shapes users run, for ``TPModel.random`` (benchmarks without downloads)."""
