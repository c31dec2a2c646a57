"""A tensor-parallel model from a Hugging Face one, on several ranks:

    torchrun --nproc-per-node 2 examples/tp_model.py

A tiny Llama with random weights made here (no download); pass your own model the same way.
GPUs when there are (NCCL), else the CPU (gloo).
"""

import os

import torch
import torch.distributed as dist

import tpfuse  # before transformers, which imports triton: without CUDA tpfuse sets up Triton's interpreter
from tpfuse.models import TPModel
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

if torch.cuda.is_available():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    device = "cuda"
else:
    dist.init_process_group("gloo")
    device = "cpu"

torch.manual_seed(0)  # every rank builds the same weights
# Heads, kv heads, the MLP and the vocabulary split over 1, 2 or 4 ranks.
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=8)
hf = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()
# With a checkpoint: hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)

prompt = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)
with tpfuse.Communicator() as comm:
    model = TPModel.from_hf(hf, comm, boundary="fused")  # this rank's shard
    tokens = model.generate(prompt, 8)                     # greedy, the same tokens on every rank
    logits = model(prompt)                                  # prefill logits [1, 8, vocab]
    if dist.get_rank() == 0:
        print("generated:", tokens[0, 8:].tolist(), "- prefill logits", tuple(logits.shape))
dist.destroy_process_group()
