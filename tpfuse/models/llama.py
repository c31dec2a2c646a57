"""A tensor-parallel Llama-family decoder whose layer boundaries run on tpfuse.

Megatron-style tensor parallelism over a ``tpfuse.Communicator`` of W ranks, every rank
holding 1/W of each block:

- attention: q, k and v in one column-parallel projection (rank r holds query heads
  [r * H/W, (r + 1) * H/W) and the matching kv heads), rotary embedding and the KV-cache
  write in one kernel, causal attention with grouped-query heads (decode steps over the
  filled cache positions alone), then the row-parallel o_proj, which leaves a partial sum;
- MLP: gate and up in one column-parallel projection, the activation, the row-parallel
  down_proj (a partial sum);
- each partial sum goes through the layer boundary (``tpfuse.models.boundary``: all-reduce,
  residual add and the next RMSNorm; after the last layer, the final norm);
- embedding replicated on every rank (a lookup: no communication); LM head vocab-parallel
  (rank r holds vocabulary rows [r * V/W, (r + 1) * V/W), V padded to a multiple of W), its
  logits all-gathered, so every rank holds the same full logits and picks the same token.

``TPModel.from_hf(hf_model, comm)`` takes the weights of a Hugging Face model by name (every
rank passes the same model and keeps its shard); ``TPModel.random(config, comm, seed=...)``
makes seeded random weights (benchmarks of large shapes without downloads). ``model(ids)``
is a prefill returning logits; ``model.generate(ids, n)`` decodes greedily with a KV cache,
the decode step captured in a CUDA graph on GPUs (``DecodeSession``) and optionally compiled.
"""

from __future__ import annotations

import gc
import logging
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpfuse.activation_ops import silu_and_mul
from tpfuse.attention_ops import invariant_attention
from tpfuse.kernels.linear import check_chunks, counters_for, layer_chunks
from tpfuse.linear_ops import invariant_matmul
from tpfuse.fp8_ops import quant_fp8
from tpfuse.models.boundary import Boundary
from tpfuse.models.config import ModelConfig
from tpfuse.models.fp8 import PROJECTIONS, Fp8Activation, fp8_linear, quantize_weight
from tpfuse.rope_ops import rope_and_cache
from tpfuse.sampling_ops import sample, token_log_probs

ROW_PARALLEL = ("o_proj", "down_proj")
"""The projections whose K is split over the ranks (each leaves a partial sum)."""

Tensor = torch.Tensor
logger = logging.getLogger("tpfuse.models")


@dataclass
class Shard:
    """This rank's part of the model: world size, rank and the local sizes."""

    world_size: int
    rank: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int  # rows of the LM head shard (padded vocabulary / world size)

    @classmethod
    def of(cls, config: ModelConfig, world_size: int, rank: int) -> "Shard":
        config.check_tensor_parallel(world_size)
        return cls(world_size, rank, config.num_heads // world_size, config.num_kv_heads // world_size,
                   config.intermediate_size // world_size, -(-config.vocab_size // world_size))


def _param(*shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    """One block's local weights; the computation is in ``TPModel`` (one place to read)."""

    def __init__(self, c: ModelConfig, s: Shard, dtype, device):
        super().__init__()
        d = c.head_dim
        self.qkv_proj = _param((s.heads + 2 * s.kv_heads) * d, c.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = _param((s.heads + 2 * s.kv_heads) * d, dtype=dtype, device=device) if c.qkv_bias else None
        self.q_norm = _param(d, dtype=dtype, device=device) if c.qk_norm else None
        self.k_norm = _param(d, dtype=dtype, device=device) if c.qk_norm else None
        self.o_proj = _param(c.hidden_size, s.heads * d, dtype=dtype, device=device)
        self.gate_up_proj = _param(2 * s.intermediate, c.hidden_size, dtype=dtype, device=device)
        self.down_proj = _param(c.hidden_size, s.intermediate, dtype=dtype, device=device)
        self.input_norm = _param(c.hidden_size, dtype=dtype, device=device)
        self.post_attention_norm = _param(c.hidden_size, dtype=dtype, device=device)


class TPModel(nn.Module):
    """A dense decoder-only transformer, tensor-parallel over ``comm``.

    Args:
        config: the shape (``ModelConfig``; presets in ``tpfuse.models.PRESETS``).
        comm: a ``tpfuse.Communicator`` of the tensor-parallel group, or None for one rank.
        boundary: the layer boundary, one of ``tpfuse.models.BOUNDARIES`` ("fused": tpfuse's
            fused all-reduce + residual + RMSNorm; "split": the same bits unfused; "torch",
            "symm_mem": the torch stacks, for comparison).
        dtype, device: of the weights and activations (device: the communicator's, or CPU).
        invariant: every projection through ``tpfuse.invariant_matmul`` (docs/design.md 1.2),
            the row-parallel ones (o_proj, down_proj) as fp32 partial sums of G / W of their
            layer's G chunks, all-reduced in fp32 over the ranks' tree and rounded once before
            the residual add (with boundary "fused" in the fused kernel where the message fits
            the workspace, else the "split" composition in slices of rows: the same bits; at one
            rank the GEMM rounds, the same bits again), and attention
            through ``tpfuse.invariant_attention`` (1.3) in prefill too, over the KV cache as
            in decode. The logits then have the same bits at every TP size, alone and in a
            batch, and from a prefill as from the decode steps (tests/test_models.py).
            ``boundary`` must be "split" or "fused". bf16 or fp16 weights. (Every bf16 or fp16
            model's decode steps attend through ``tpfuse.invariant_attention``, over the filled
            cache positions alone; a plain model's prefill, and an fp32 model's decode, through
            torch's SDPA.)
        sequence_parallel: prefill with the residual stream split over the ranks (Megatron's
            sequence parallelism): each boundary a reduce-scatter + residual add + RMSNorm of
            the rank's rows and an all-gather (``Communicator.reduce_scatter_add_rms_norm``,
            ``all_gather``), where the prompt's B * T rows divide over the world size; decode
            steps, and prompts whose rows do not divide or exceed the communicator's
            ``max_bytes``, run the all-reduce boundary. The
            logits have the bits of the model without it. boundary "fused" only, not invariant.
        fp8: the projections in e4m3 (``tpfuse.models.fp8``: weights scaled per output row
            when loaded, activations per token), the boundary quantizing its normed output
            in its kernel (``all_reduce_add_rms_norm_fp8``; "split" then ``quant_fp8``: the
            same bits); the LM head stays bf16. bf16 only, not invariant nor sequence-parallel.

    Weights are uninitialised: use ``from_hf`` or ``random``. Every rank must run the same
    calls in the same order (each forward is a sequence of collectives). Raises ValueError
    when heads, kv heads or the MLP width do not split over the world size, or (invariant)
    when a row-parallel layer's chunks do not split over it.
    """

    def __init__(self, config: ModelConfig, comm=None, *, boundary: str = "fused", dtype=torch.bfloat16,
                 device=None, invariant: bool = False, sequence_parallel: bool = False, fp8: bool = False):
        super().__init__()
        world, rank = (1, 0) if comm is None else (comm.world_size, comm.rank)
        self.config, self.comm = config, comm
        self.shard = s = Shard.of(config, world, rank)
        self.invariant = invariant
        if invariant:
            _check_invariant(config, world, boundary, dtype)
        if sequence_parallel and (boundary != "fused" or invariant):
            raise ValueError("sequence_parallel needs boundary='fused' and invariant=False (the reduce-scatter "
                             f"kernel takes the model dtype, not an invariant model's fp32 partials); got boundary "
                             f"{boundary!r}, invariant={invariant}")
        self.sequence_parallel = sequence_parallel and world > 1
        if fp8 and (invariant or sequence_parallel or dtype != torch.bfloat16):
            raise ValueError("fp8 runs bf16 activations, without invariant=True (torch._scaled_mm picks its kernel, "
                             "and so its sums' order, by shape: not batch-invariant) or sequence_parallel; got "
                             f"dtype {dtype}, invariant={invariant}, sequence_parallel={sequence_parallel}")
        self.fp8 = fp8
        device = torch.device(device) if device is not None else (comm.device if comm is not None else
                                                                   torch.device("cpu"))
        self.dtype, self.device = dtype, device
        self.boundary = Boundary(boundary, comm)
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(config, s, dtype, device) for _ in range(config.num_layers))
        self.norm = _param(config.hidden_size, dtype=dtype, device=device)
        self.lm_head = _param(s.vocab, config.hidden_size, dtype=dtype, device=device)
        self.inv_freq = torch.empty(config.head_dim // 2, dtype=torch.float32, device=device)
        # The invariant GEMMs' per-tile counts, one buffer for every call (each leaves it zero):
        # no zeroing kernel per projection.
        counters = None
        if invariant:
            projections = [(getattr(self.layers[0], name), name in ROW_PARALLEL) for name in PROJECTIONS]
            size = max(counters_for(w.shape[1], self._chunks(w, row_parallel))
                       for w, row_parallel in projections + [(self.lm_head, False)])
            counters = torch.zeros(size, dtype=torch.int32, device=device)
        self.register_buffer("_counters", counters, persistent=False)
        self.rope_scaling = 1.0  # cos and sin are multiplied by it (Hugging Face's attention_scaling)
        self._rope_cache: tuple[int, Tensor, Tensor] | None = None
        self._session: DecodeSession | None = None
        if comm is not None:  # its graphs must go before the group does (Communicator.on_close)
            comm.on_close(self._drop_session)

    # ------------------------------------------------------------------ construction

    def set_boundary(self, name: str) -> None:
        """Switch the layer boundary (drops captured decode graphs; collective on the group)."""
        if self.invariant:
            _check_invariant(self.config, self.shard.world_size, name, self.dtype)
        if self.sequence_parallel and name != "fused":
            raise ValueError(f"a sequence_parallel model runs boundary 'fused' only, got {name!r}")
        self.boundary = Boundary(name, self.comm)
        self._drop_session()

    def _drop_session(self) -> None:
        # Closed first: a session still referenced elsewhere (a caller's, torch.compile's cache)
        # must not keep its graph, whose captured NCCL all-gather keeps destroy_process_group
        # waiting. It refers to itself through its step function: only the cycle collector
        # frees it, and with it a KV cache of up to tens of GB.
        if self._session is not None:
            self._session.close()
        self._session = None
        gc.collect()

    @classmethod
    def from_hf(cls, hf_model, comm=None, *, boundary: str = "fused", dtype=None, device=None,
                invariant: bool = False, sequence_parallel: bool = False, fp8: bool = False) -> "TPModel":
        """Shard a Hugging Face ``transformers`` causal LM (Llama, Mistral, Qwen2, Qwen3, Gemma).

        Every rank passes a model with the same weights; weights are taken by name from its
        state dict and converted to ``dtype`` (default: the model's). ``device`` defaults to
        the communicator's, or without one to the Hugging Face model's. The rotary inverse
        frequencies and scaling are taken from the model itself, so any static rope type
        (default, llama3, linear, ...) matches it exactly."""
        config = ModelConfig.from_hf(hf_model.config)
        sd = hf_model.state_dict()
        first = next(iter(sd.values()))
        dtype = dtype or first.dtype
        device = device if device is not None or comm is not None else first.device
        model = cls(config, comm, boundary=boundary, dtype=dtype, device=device, invariant=invariant,
                    sequence_parallel=sequence_parallel, fp8=fp8)
        rotary = hf_model.model.rotary_emb
        if getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):
            raise NotImplementedError(f"rope type {rotary.rope_type!r} changes with the sequence length: not supported")
        model.inv_freq.copy_(rotary.inv_freq.float())
        model.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))

        def get(name):
            return sd[name].to(dtype)

        lm_head = get("lm_head.weight") if "lm_head.weight" in sd else get("model.embed_tokens.weight")
        model.load_full_weights(get, lm_head)
        return model

    @classmethod
    def random(cls, config: ModelConfig, comm=None, *, seed: int = 0, boundary: str = "fused",
               dtype=torch.bfloat16, device=None, invariant: bool = False,
               sequence_parallel: bool = False, fp8: bool = False) -> "TPModel":
        """Seeded random weights (N(0, 1/fan_in) projections, norms near 1): each full weight
        from (seed, its Hugging Face name) alone, then sharded as ``from_hf`` does, so every
        world size holds the same model (what ``tpfuse verify`` compares across TP sizes).
        Each full tensor is made on the device and dropped once its shard is copied."""
        model = cls(config, comm, boundary=boundary, dtype=dtype, device=device, invariant=invariant,
                    sequence_parallel=sequence_parallel, fp8=fp8)
        shapes = _hf_shapes(config)

        def get(name):
            g = torch.Generator(device=model.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            shape = shapes[name]
            w = torch.randn(shape, generator=g, device=model.device)
            if len(shape) == 1:  # norms and biases
                centre = 0.0 if name.endswith("bias") or config.norm_weight_offset else 1.0
                return (centre + 0.1 * w).to(dtype)
            return (w / math.sqrt(shape[1])).to(dtype)

        model.load_full_weights(get, get("lm_head.weight"))
        model.inv_freq.copy_(1.0 / (config.rope_theta ** (
            torch.arange(0, config.head_dim, 2, dtype=torch.float32, device=model.device) / config.head_dim)))
        return model

    @torch.no_grad()
    def load_full_weights(self, get, lm_head: Tensor) -> None:
        """Copy this rank's shard out of full (unsharded) weights: ``get(hf_name)`` returns
        the Hugging Face tensor of that name; ``lm_head`` is [vocab, hidden]."""
        c, s, r = self.config, self.shard, self.shard.rank
        d = c.head_dim
        if self.fp8 and self.layers[0].qkv_proj.dtype == torch.float8_e4m3fn:
            raise RuntimeError("an fp8 model's weights are loaded once (from_hf or random): build a new model")

        def rows(t, n):  # rank r's block of n rows
            return t[r * n:(r + 1) * n]

        self.embed_tokens.copy_(get("model.embed_tokens.weight"))
        self.norm.copy_(get("model.norm.weight"))
        padded = torch.zeros(s.vocab * s.world_size, c.hidden_size, dtype=lm_head.dtype, device=lm_head.device)
        padded[:c.vocab_size] = lm_head
        self.lm_head.copy_(rows(padded, s.vocab))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            qkv = [rows(get(p + f"self_attn.{n}_proj.weight"), h * d)
                   for n, h in (("q", s.heads), ("k", s.kv_heads), ("v", s.kv_heads))]
            layer.qkv_proj.copy_(torch.cat(qkv))
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(torch.cat([rows(get(p + f"self_attn.{n}_proj.bias"), h * d)
                                                for n, h in (("q", s.heads), ("k", s.kv_heads), ("v", s.kv_heads))]))
            if layer.q_norm is not None:
                layer.q_norm.copy_(get(p + "self_attn.q_norm.weight"))
                layer.k_norm.copy_(get(p + "self_attn.k_norm.weight"))
            layer.o_proj.copy_(get(p + "self_attn.o_proj.weight")[:, r * s.heads * d:(r + 1) * s.heads * d])
            layer.gate_up_proj.copy_(torch.cat([rows(get(p + "mlp.gate_proj.weight"), s.intermediate),
                                                rows(get(p + "mlp.up_proj.weight"), s.intermediate)]))
            layer.down_proj.copy_(get(p + "mlp.down_proj.weight")[:, r * s.intermediate:(r + 1) * s.intermediate])
            layer.input_norm.copy_(get(p + "input_layernorm.weight"))
            layer.post_attention_norm.copy_(get(p + "post_attention_layernorm.weight"))
            if self.fp8:  # each shard's rows scaled on their own, the bf16 copies dropped
                for name in PROJECTIONS:
                    q, scales = quantize_weight(getattr(layer, name))
                    setattr(layer, name, nn.Parameter(q, requires_grad=False))
                    setattr(layer, name + "_scale", nn.Parameter(scales, requires_grad=False))

    # ------------------------------------------------------------------ the computation

    def _rope(self, positions: int) -> tuple[Tensor, Tensor]:
        """cos and sin tables [positions, head_dim] in the model dtype (Hugging Face's math:
        fp32 angles, cos/sin times the rope scaling, rounded once), sliced from a cache that
        only grows."""
        if self._rope_cache is None or self._rope_cache[0] < positions:
            t = torch.arange(positions, device=self.device, dtype=torch.float32)
            freqs = t[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_cache = (positions, (emb.cos() * self.rope_scaling).to(self.dtype),
                                (emb.sin() * self.rope_scaling).to(self.dtype))
        return self._rope_cache[1][:positions], self._rope_cache[2][:positions]

    def _embed(self, ids: Tensor) -> Tensor:
        h = F.embedding(ids, self.embed_tokens)
        if self.config.scale_embeddings:
            h = h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype)
        return h

    def _attention(self, layer: DecoderLayer, h: Tensor, cos: Tensor, sin: Tensor, cache, pos, mask,
                   start: Tensor) -> Tensor:
        """Attention's partial sum for this rank's heads; cos and sin: the rope tables, row p for
        position p. Prefill (pos None): causal over h's own tokens (positions from 0), written
        into ``cache`` ([B, kv_heads, S, head_dim] k and v) when given. Decode (pos: [B] int64,
        each sequence's position; h: [B, 1, hidden]): writes k, v at pos and attends to each
        sequence's cache positions up to its pos (an fp32 model under ``mask``, [B, 1, 1, S]
        bool). start: [B] int32, pos or (prefill) zeros."""
        c, s = self.config, self.shard
        b, t, _ = h.shape
        d = c.head_dim
        qkv = self._project(h, layer, "qkv_proj", layer.qkv_bias).view(b, t, s.heads + 2 * s.kv_heads, d)
        qk, v = qkv[:, :, :s.heads + s.kv_heads], qkv[:, :, s.heads + s.kv_heads:]
        if layer.q_norm is not None:
            qk = torch.cat([self.boundary.rms_norm(qk[:, :, :s.heads], layer.q_norm, c.rms_norm_eps, 0.0),
                            self.boundary.rms_norm(qk[:, :, s.heads:], layer.k_norm, c.rms_norm_eps, 0.0)], dim=2)
        # q and k rotated and k, v written at their positions, in one kernel (torch's ops' bits).
        keys, values = cache if cache is not None else (qk.new_empty(b, s.kv_heads, t, d) for _ in range(2))
        q = rope_and_cache(qk, v, cos, sin, start, keys, values)
        scale = d ** -0.5
        if self.invariant or (pos is not None and self._decode_kernel()):
            # Decode: tpfuse's attention over the filled positions only (SDPA would read the
            # whole cache under a mask: 4x its time at batch 1). An invariant model's prefill
            # too, over the cache as the decode steps: the same bits at each position.
            o = invariant_attention(q, keys, values, start, scale)
        elif pos is None:
            o = F.scaled_dot_product_attention(q, keys[:, :, :t], values[:, :, :t], is_causal=True, scale=scale,
                                               enable_gqa=s.heads != s.kv_heads)
        else:
            # An fp32 model's decode (tpfuse's attention takes bf16 and fp16): the whole cache,
            # masked. Each kv head's query heads become its "query rows", so the cache is read
            # once per kv head, with no expansion to every query head.
            group = s.heads // s.kv_heads
            o = F.scaled_dot_product_attention(q.reshape(b, s.kv_heads, group, d), keys, values, attn_mask=mask,
                                               scale=scale)
        o = o.reshape(b, s.heads, t, d).transpose(1, 2).reshape(b, t, s.heads * d)
        return self._project(o, layer, "o_proj")

    def _mlp(self, layer: DecoderLayer, h: Tensor) -> Tensor:
        gate_up = self._project(h, layer, "gate_up_proj")
        if self.config.hidden_act == "silu":  # one kernel, torch's bits on GPUs
            return self._project(silu_and_mul(gate_up), layer, "down_proj")
        gate, up = gate_up.chunk(2, dim=-1)
        return self._project(F.gelu(gate, approximate="tanh") * up, layer, "down_proj")

    def _project(self, x: Tensor | Fp8Activation, layer: DecoderLayer, name: str, bias: Tensor | None = None) -> Tensor:
        """The block's projection ``name``: o_proj and down_proj row-parallel, the others
        column-parallel; fp8 models' on e4m3 operands (x quantized here unless the boundary
        did it)."""
        if self.fp8:
            return fp8_linear(x, getattr(layer, name), getattr(layer, name + "_scale"), bias)
        if name in ROW_PARALLEL:
            return self._row(x, getattr(layer, name))
        return self._column(x, getattr(layer, name), bias)

    def _decode_kernel(self) -> bool:
        """Whether decode attention runs tpfuse's kernel over the filled positions (bf16, fp16)
        rather than SDPA over the whole cache under a mask (fp32)."""
        return self.dtype in (torch.bfloat16, torch.float16)

    def _chunks(self, weight: Tensor, row_parallel: bool) -> int:
        """The invariant GEMM's chunks of a projection: its layer's G, of which a row-parallel
        shard holds G / W."""
        world = self.shard.world_size if row_parallel else 1
        return layer_chunks(weight.shape[1] * world) // world

    def _column(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """A column-parallel projection (its whole reduction on this rank), in x's dtype."""
        if not self.invariant:
            return F.linear(x, weight, bias)
        chunks = self._chunks(weight, False)
        if bias is None:
            return invariant_matmul(x, weight, chunks, counters=self._counters)
        # The bias added in fp32 and the sum rounded once, as F.linear does.
        return (invariant_matmul(x, weight, chunks, torch.float32, self._counters) + bias.float()).to(x.dtype)

    def _row(self, x: Tensor, weight: Tensor) -> Tensor:
        """A row-parallel projection: this rank's partial sum (invariant: fp32, G / W chunks,
        for the all-reduce to round once; at one rank rounded here, the same rounding)."""
        if not self.invariant:
            return F.linear(x, weight)
        out_dtype = torch.float32 if self.shard.world_size > 1 else x.dtype
        return invariant_matmul(x, weight, self._chunks(weight, True), out_dtype, self._counters)

    def _hidden(self, ids: Tensor, cos: Tensor, sin: Tensor, caches, pos) -> Tensor:
        """The final-normed hidden states [B, T, hidden] of ``ids`` [B, T]."""
        c = self.config
        eps, offset = c.rms_norm_eps, c.norm_weight_offset
        mask = None
        if pos is not None and not self._decode_kernel():  # each sequence's cache positions up to its pos
            mask = (torch.arange(caches[0][0].shape[2], device=ids.device) <= pos[:, None]).view(len(pos), 1, 1, -1)
        # Each sequence's first position, int32 once per call (the attention op would cast per layer).
        start = pos.to(torch.int32) if pos is not None else torch.zeros(ids.shape[0], dtype=torch.int32,
                                                                         device=ids.device)
        residual = self._embed(ids)
        h = self.boundary.rms_norm(residual, self.layers[0].input_norm, eps, offset)
        if self.fp8:
            h = Fp8Activation(*quant_fp8(h, "token"))
        boundary = self.boundary
        if self.sequence_parallel and pos is None and self.boundary.serves_sequence_parallel(residual):
            # Prefill with the residual stream split over the ranks: the same bits (docs/design.md 8).
            boundary, residual = self.boundary.sequence_parallel, self.boundary.rows_of_rank(residual)
        for i, layer in enumerate(self.layers):
            cache = None if caches is None else caches[i]
            partial = self._attention(layer, h, cos, sin, cache, pos, mask, start)
            last = i + 1 == len(self.layers)
            # fp8: every boundary feeds an fp8 GEMM but the last one (the bf16 LM head)
            h, residual = boundary(partial, residual, layer.post_attention_norm, eps, offset, fp8=self.fp8)
            next_norm = self.norm if last else self.layers[i + 1].input_norm
            h, residual = boundary(self._mlp(layer, h), residual, next_norm, eps, offset, fp8=self.fp8 and not last)
        return h

    def _logits(self, h: Tensor) -> Tensor:
        """Full logits [..., vocab] on every rank from the vocab-parallel LM head."""
        return self.boundary.gather_last_dim(self._column(h, self.lm_head))[..., :self.config.vocab_size]

    @torch.no_grad()
    def forward(self, input_ids: Tensor) -> Tensor:
        """Prefill: logits [B, T, vocab] of ``input_ids`` [B, T] (int64) on every rank."""
        t = self._check_ids(input_ids, 0)
        cos, sin = self._rope(t)
        return self._logits(self._hidden(input_ids, cos, sin, None, None))

    @torch.no_grad()
    def log_probs(self, input_ids: Tensor, lengths=None) -> Tensor:
        """log p(input_ids[:, t + 1] | input_ids[:, :t + 1]) from one forward pass: [B, T - 1]
        fp32 (``tpfuse.token_log_probs``), 0 from each sequence's length on (``lengths`` as in
        ``generate``: right padding). What a trainer scores a sampler's tokens with: with an
        invariant model, the bits of the decode steps' logits at any batch and TP size."""
        t = self._check_ids(input_ids, 0)
        lengths = _check_lengths(lengths, input_ids.shape[0], t)
        ids = _without_padding(input_ids, lengths)
        logits = self(ids)[:, :-1]
        out = token_log_probs(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).view(logits.shape[:2])
        return out.masked_fill(_past(lengths.to(out.device) - 1, t - 1), 0.0)  # entry j scores token j + 1

    def _check_ids(self, input_ids: Tensor, new_tokens: int) -> int:
        if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
            raise ValueError(f"input_ids must be int64 [batch, tokens], got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        if input_ids.device != self.device:
            raise ValueError(f"input_ids is on {input_ids.device}, the model on {self.device}")
        if input_ids.numel() == 0:
            raise ValueError(f"input_ids must hold at least one token per sequence, got shape {tuple(input_ids.shape)}")
        total = input_ids.shape[1] + new_tokens
        c = self.config
        if total > c.max_position_embeddings:
            raise ValueError(f"{total} tokens exceed max_position_embeddings={c.max_position_embeddings}")
        if c.sliding_window is not None and total > c.sliding_window:
            raise NotImplementedError(f"{total} tokens exceed the sliding window ({c.sliding_window}): "
                                      "sliding-window attention is not supported")
        return input_ids.shape[1]

    # ------------------------------------------------------------------ decoding

    def decode_session(self, batch: int, seq_len: int, *, cuda_graph: bool | None = None,
                       compile: bool | str = False) -> "DecodeSession":
        """A ``DecodeSession`` for ``batch`` sequences of up to ``seq_len`` tokens (reused while
        the arguments and the boundary stay the same; a new one frees the previous cache)."""
        cuda_graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        key = (batch, seq_len, cuda_graph, compile)
        if self._session is None or self._session.key != key:
            self._drop_session()  # free the old cache first
            self._session = DecodeSession(self, batch, seq_len, cuda_graph=cuda_graph, compile=compile)
        return self._session

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, *, lengths=None, pad_token_id: int = 0,
                 temperature: float = 0.0, top_p: float = 1.0, seed=0, cuda_graph: bool | None = None,
                 compile: bool | str = False, return_logits: bool = False):
        """Decoding: ``input_ids`` [B, T] int64 (B prompts of T tokens) -> [B, T +
        max_new_tokens], the same on every rank. Prompts of other lengths come right-padded
        with ``lengths`` (int [B], each in 1..T): every sequence decodes from its own position,
        and row b of the result holds its prompt, its new tokens, then ``pad_token_id``.
        Greedy at ``temperature`` 0; above it, seeded draws (``tpfuse.sample``: temperature,
        top_p) whose noise depends on the sequence's ``seed`` (an int for all, or one per
        sequence) and the position drawn: a sequence draws the same tokens alone or in any
        batch (with an invariant model's logits). With ``return_logits``, also the logits
        [B, max_new_tokens, vocab] each new token was picked from. The decode step runs as a
        captured CUDA graph (``cuda_graph``, default on CUDA) and, with ``compile``, compiled by
        ``torch.compile(fullgraph=True)`` (True: inductor; a string names another backend). A
        new (batch, length, cuda_graph, compile) or boundary captures a new step; the same
        arguments reuse it. A compiled step stays in torch.compile's cache, and with it its KV
        cache, until ``torch._dynamo.reset()``."""
        t = self._check_ids(input_ids, max_new_tokens)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        b = input_ids.shape[0]
        lengths = _check_lengths(lengths, b, t)
        device = input_ids.device
        seeds = torch.as_tensor(seed, dtype=torch.int64)
        if seeds.shape not in ((), (b,)):
            raise ValueError(f"seed must be an int or one int per sequence ({b}), got shape {tuple(seeds.shape)}")
        seeds = seeds.expand(b).contiguous().to(device)
        first = lengths.to(device)  # each sequence's first new position (copied once: no host sync per step)

        def pick(step_logits: Tensor, i: int) -> Tensor:
            """Every sequence's i-th new token (at position lengths + i)."""
            if temperature == 0:
                return step_logits.argmax(-1)
            return sample(step_logits, seeds, first + i, temperature, top_p)

        dec = self.decode_session(b, t + max_new_tokens, cuda_graph=cuda_graph, compile=compile)
        logits = [dec.prefill(input_ids, lengths)]
        new = [pick(logits[0], 0)]
        for i in range(1, max_new_tokens):
            logits.append(dec.step(new[-1]).clone())
            new.append(pick(logits[-1], i))
        out = torch.full((b, t + max_new_tokens), pad_token_id, dtype=torch.int64, device=device)
        out[:, :t] = input_ids.masked_fill(_past(first, t), pad_token_id)
        out.scatter_(1, first[:, None] + torch.arange(max_new_tokens, device=device), torch.stack(new, dim=1))
        return (out, torch.stack(logits, dim=1)) if return_logits else out


def _hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face name and shape of every full weight ``load_full_weights`` asks for."""
    c, d = config, config.head_dim
    h, q, kv = c.hidden_size, c.num_heads * d, c.num_kv_heads * d
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (c.vocab_size, h)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (c.intermediate_size, h),
                   p + "mlp.up_proj.weight": (c.intermediate_size, h),
                   p + "mlp.down_proj.weight": (h, c.intermediate_size), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
        if c.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if c.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return shapes


def _check_invariant(config: ModelConfig, world: int, boundary: str, dtype: torch.dtype) -> None:
    """ValueError unless an invariant model of ``config`` serves ``world`` ranks."""
    if boundary not in ("split", "fused"):
        raise ValueError(f"an invariant model sums over tpfuse's tree: boundary 'split' or 'fused', got {boundary!r}")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"an invariant model runs in bf16 or fp16, got {dtype}")
    for name, k, row_parallel in (("o_proj", config.num_heads * config.head_dim, True),
                                  ("down_proj", config.intermediate_size, True),
                                  ("the column-parallel projections", config.hidden_size, False)):
        chunks = layer_chunks(k)
        try:
            check_chunks(k, chunks)
        except ValueError as e:
            raise ValueError(f"invariant: {name} cannot be summed by tpfuse.invariant_matmul: {e}") from None
        if row_parallel and chunks % world:  # a column-parallel layer's K stays whole on every rank
            raise ValueError(f"invariant: {name}'s K={k} is summed in {chunks} chunks, which do not split over "
                             f"{world} ranks (TP sizes dividing {chunks} keep the bits)")


class DecodeSession:
    """Greedy decode state of a ``TPModel``: the KV cache ([B, kv_heads, seq_len, head_dim]
    per layer, zero-initialised) and the decode step, captured as a CUDA graph when
    ``cuda_graph`` (inputs copied into static buffers, replayed per token) and compiled
    with ``torch.compile(fullgraph=True)`` when ``compile``.

    ``prefill(ids, lengths=None) -> logits [B, vocab]`` of each prompt's last token;
    ``step(tokens [B]) -> logits [B, vocab]`` of each sequence's next position (a view of a
    static buffer under a graph: clone it to keep it)."""

    def __init__(self, model: TPModel, batch: int, seq_len: int, *, cuda_graph: bool, compile: bool | str):
        self.model, self.batch, self.seq_len = model, batch, seq_len
        self.key = (batch, seq_len, cuda_graph, compile)
        s, c = model.shard, model.config
        shape = (batch, s.kv_heads, seq_len, c.head_dim)
        self.caches = [(torch.zeros(shape, dtype=model.dtype, device=model.device),
                        torch.zeros(shape, dtype=model.dtype, device=model.device)) for _ in model.layers]
        self.cos, self.sin = model._rope(seq_len)
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=model.device)
        self.pos = torch.zeros(batch, dtype=torch.int64, device=model.device)  # the step's input (static)
        # Each sequence's next position, advanced on the device (a host-to-device copy from
        # pageable memory per step would stall the host on the GPU); the host keeps the furthest.
        self.next_pos = torch.zeros(batch, dtype=torch.int64, device=model.device)
        self.furthest = 0
        self._step = self._eager_step
        if compile:
            # Inductor fuses elementwise chains and would keep bf16 intermediates in fp32;
            # emulate_precision_casts rounds them where eager does, so compiled decode gives
            # eager's bits (tested; GEMMs and attention stay the same library calls).
            backend = "inductor" if compile is True else compile
            options = {"emulate_precision_casts": True} if backend == "inductor" else None
            self._step = torch.compile(self._eager_step, fullgraph=True, backend=backend, options=options)
        self.graph = self._capture() if cuda_graph else None

    def _eager_step(self, tokens: Tensor, pos: Tensor) -> Tensor:
        m = self.model
        h = m._hidden(tokens[:, None], self.cos, self.sin, self.caches, pos)  # the rope rows of each pos
        return m._logits(h[:, 0])

    def _capture(self) -> torch.cuda.CUDAGraph:
        """Warm up (compilation, Triton JIT, allocator) on a side stream, capture one step,
        then clear the cache the warm-up steps wrote into (slot 0)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self._step(self.tokens, self.pos)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: NCCL's watchdog thread keeps running during the capture.
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            self.logits = self._step(self.tokens, self.pos)
        for k, v in self.caches:
            k.zero_()
            v.zero_()
        return graph

    def close(self) -> None:
        """Release the captured graph and the KV cache (``TPModel`` closes its session when it
        makes a new one and when its communicator closes); later calls raise."""
        if self.graph is not None:
            self.graph.reset()
        self.graph, self.caches = None, None

    def _check_open(self) -> None:
        if self.caches is None:
            raise RuntimeError("this decode session is closed (its model made a new one, or its communicator closed)")

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, lengths: Tensor | None = None) -> Tensor:
        """Fill the cache from ``input_ids`` [B, T], right-padded to T where ``lengths`` (int
        [B], each in 1..T; default all T) gives shorter prompts; logits [B, vocab] of each
        sequence's last prompt token. The padding's keys and values sit past a sequence's
        length, where its steps write their own before any query reads them."""
        self._check_open()
        b, t = input_ids.shape
        if b != self.batch or t >= self.seq_len:
            raise ValueError(f"prefill of {tuple(input_ids.shape)} does not fit this decode session "
                             f"(batch {self.batch}, {self.seq_len} tokens)")
        lengths = _check_lengths(lengths, b, t)
        for k, v in self.caches:
            k.zero_()
            v.zero_()
        h = self.model._hidden(_without_padding(input_ids, lengths), self.cos[:t], self.sin[:t], self.caches, None)
        self.next_pos.copy_(lengths)
        self.furthest = int(lengths.max())
        last = (lengths - 1).to(input_ids.device)
        return self.model._logits(h[torch.arange(b, device=h.device), last])

    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        """Decode one token per sequence (``tokens`` [B]), each at its own next position."""
        self._check_open()
        if self.furthest >= self.seq_len:
            raise ValueError(f"the decode session holds {self.seq_len} tokens: no position left")
        self.tokens.copy_(tokens)
        self.pos.copy_(self.next_pos)
        self.next_pos += 1
        self.furthest += 1
        if self.graph is None:
            return self._step(self.tokens, self.pos)
        self.graph.replay()
        return self.logits


def _past(lengths: Tensor, tokens: int) -> Tensor:
    """[B, tokens] bool on lengths' device: True from each sequence's length on (its padding)."""
    return torch.arange(tokens, device=lengths.device) >= lengths[:, None]


def _without_padding(ids: Tensor, lengths: Tensor) -> Tensor:
    """ids with every position from a sequence's length on set to token 0: a padding id (any
    value, -1 say) never reaches the embedding or a gather."""
    return ids.masked_fill(_past(lengths.to(ids.device), ids.shape[1]), 0)


def _check_lengths(lengths, batch: int, tokens: int) -> Tensor:
    """Prompt lengths as a CPU int64 [batch] tensor, each in 1..tokens (None: all tokens)."""
    if lengths is None:
        return torch.full((batch,), tokens, dtype=torch.int64)
    lengths = torch.as_tensor(lengths).to("cpu", torch.int64)
    if lengths.shape != (batch,) or int(lengths.min()) < 1 or int(lengths.max()) > tokens:
        raise ValueError(f"lengths must give each of the {batch} prompts a length in 1..{tokens}, got "
                         f"{lengths.tolist()}")
    return lengths
