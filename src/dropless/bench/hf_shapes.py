"""Synthetic Hugging Face checkpoints with the layer shapes of published MoE models, for load benchmarks.

    python -m dropless.bench.hf_shapes qwen3_30b_a3b --layers 2 --out DIR [--shard-size 500MB] [--seed 0]

Loading a checkpoint is a memory problem before it is a speed problem: a 128-expert Qwen3 layer is
604M parameters, a Mixtral-8x7B layer 1.4B. The tiny checkpoints of the hf tests cannot show that, and
the real ones are tens of GB to download. These are the real widths (hidden size, expert count and
width, attention heads, vocabulary) cut to a few layers, with random weights: made by transformers'
own config and model classes and written by its `save_pretrained` (per-expert tensor names, sharded
with an index file, as the published checkpoints are), plus a small byte-level BPE tokenizer.json
(fewer tokens than the vocabulary, which `dropless train --init-from hf:DIR` accepts).

Memory: the transformers model is built on the meta device, materialised empty on the CPU in bf16
(`to_empty`) and initialised in place, one tensor at a time; nothing is ever held in fp32, so making
the 1-layer Mixtral (1.71B parameters, 3.4 GB in bf16) stays near its bf16 size. Saved in bf16.

Shapes (parameters counted with the vocabulary: embedding and untied head):
- qwen3_30b_a3b: Qwen3-30B-A3B's layers; 1.25B at 1 layer, 1.87B at 2 (0.62B per layer).
- mixtral_8x7b: Mixtral-8x7B-v0.1's layers; 1.71B at 1 layer (1.41B of it the 8 experts).
- deepseek_v3_small: DeepSeek-V3's routing and attention ranks at a reduced width (module table
  below); 0.30B at 2 layers (the dense first layer and one MoE layer), +0.21B per further MoE layer.
The folder given must be new or empty: nothing is ever written into an existing model. What each
costs to make: docs/loading.md "Checkpoints with published shapes".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from .. import atomic
from ..data.tokenizer import train_byte_bpe
from ..hf.optional import require


def _transformers() -> Any:
    require("tokenizers", "python -m dropless.bench.hf_shapes")
    return require("transformers", "python -m dropless.bench.hf_shapes")


def qwen3_30b_a3b_config(layers: int = 2) -> Any:
    """Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, num_experts 128, num_experts_per_tok 8,
    moe_intermediate_size 768, num_attention_heads 32, num_key_value_heads 4, head_dim 128,
    vocab_size 151936, tie_word_embeddings false, norm_topk_prob true, rope_theta 1e6,
    rms_norm_eps 1e-6, max_position_embeddings 40960, decoder_sparse_step 1, mlp_only_layers []
    (every layer MoE), router_aux_loss_coef 0.001; 48 layers, cut to `layers`."""
    return _transformers().Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
        router_aux_loss_coef=0.001)


def mixtral_8x7b_config(layers: int = 1) -> Any:
    """mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size 4096, intermediate_size 14336,
    num_local_experts 8, num_experts_per_tok 2, num_attention_heads 32, num_key_value_heads 8,
    vocab_size 32000, rope_theta 1e6, rms_norm_eps 1e-5, max_position_embeddings 32768,
    tie_word_embeddings false, router_aux_loss_coef 0.02; 32 layers, cut to `layers`."""
    return _transformers().MixtralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
        router_aux_loss_coef=0.02)


def deepseek_v3_small_config(layers: int = 2) -> Any:
    """deepseek-ai/DeepSeek-V3 config.json, kept: q_lora_rank 1536, kv_lora_rank 512,
    qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, n_routed_experts 256,
    num_experts_per_tok 8, n_group 8, topk_group 4, routed_scaling_factor 2.5, n_shared_experts 1,
    first_k_dense_replace 1, norm_topk_prob true, scoring sigmoid, rms_norm_eps 1e-6, rope_theta 1e4.
    Reduced (published value in brackets): hidden_size 1024 [7168], moe_intermediate_size 256 [2048],
    intermediate_size 2048 [18432], num_attention_heads = num_key_value_heads 16 [128],
    vocab_size 32000 [129280], 61 layers cut to `layers`; num_nextn_predict_layers 0 [1] (no MTP
    layer). 256 experts x 3 x 1024 x 256 = 201M parameters per MoE layer; fp32 2 layers: 1.2 GB."""
    return _transformers().DeepseekV3Config(
        vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=256,
        n_group=8, topk_group=4, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=0,
        max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)


SHAPES: dict[str, Callable[[int], Any]] = {
    "qwen3_30b_a3b": qwen3_30b_a3b_config,
    "mixtral_8x7b": mixtral_8x7b_config,
    "deepseek_v3_small": deepseek_v3_small_config,
}


def meta_model(config: Any) -> torch.nn.Module:
    """The transformers model of `config` on the meta device in bf16 (shapes only, no memory)."""
    with torch.device("meta"):
        return _transformers().AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def param_count(config: Any) -> int:
    return sum(p.numel() for p in meta_model(config).parameters())


@torch.no_grad()
def _initialise(model: torch.nn.Module, std: float, seed: int) -> None:
    """Random weights in place, tensor by tensor: N(0, std) for matrices (transformers'
    initializer_range), U(0.5, 1.5) for norm weights (a swapped norm shows), N(0, 0.1) for
    DeepSeek's routing correction bias (it must steer the choice), zero for other biases."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1 and "norm" in name:
            p.uniform_(0.5, 1.5, generator=gen)
        elif p.dim() == 1:
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(0.0, 0.1, generator=gen)


def write_tokenizer(folder: Path, vocab: int = 512) -> None:
    """A byte-level BPE tokenizer.json of at most `vocab` tokens trained on a few lines of Python."""
    text = ["def f(x):\n    return x + 1\n", "import os\nimport sys\n", "class A:\n    pass\n",
            "for i in range(10):\n    print(i, i * i, str(i).upper())\n", "with open(path) as fh:\n"] * 20
    train_byte_bpe(text, folder, vocab)


def write(config: Any, out: str | Path, shard_size: str = "500MB", seed: int = 0) -> Path:
    """Save a random-weight bf16 model of `config` (module note) and a tokenizer.json into `out`,
    assembled in a hidden folder and renamed into place; returns `out`."""
    out = Path(out).absolute()
    atomic.require_empty_dir(out, "--out")
    model = meta_model(config)
    model.to_empty(device="cpu")
    _initialise(model, float(getattr(config, "initializer_range", 0.02)), seed)
    with atomic.build_dir(out) as tmp:
        model.save_pretrained(tmp, max_shard_size=shard_size)
        write_tokenizer(tmp)
    return out


def make(shape: str, out: str | Path, layers: int | None = None, shard_size: str = "500MB",
         seed: int = 0) -> Path:
    """The checkpoint of `shape` (a key of SHAPES) with `layers` layers (its default if None)."""
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r}: must be one of {', '.join(SHAPES)}")
    if layers is not None and layers < 1:
        raise ValueError(f"--layers={layers}: must be >= 1")
    config = SHAPES[shape]() if layers is None else SHAPES[shape](layers)
    return write(config, out, shard_size, seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dropless.bench.hf_shapes", description=__doc__.split("\n")[0])
    p.add_argument("shape", choices=list(SHAPES))
    p.add_argument("--out", required=True, help="the folder to write (new or empty)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--shard-size", default="500MB", help="save_pretrained's max_shard_size")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        out = make(args.shape, args.out, args.layers, args.shard_size, args.seed)
    except ValueError as err:
        print(f"hf_shapes: error: {err}", file=sys.stderr)
        return 2
    n = json.loads((out / "config.json").read_text())
    print(f"wrote {args.shape} ({n['num_hidden_layers']} layers, "
          f"{param_count(SHAPES[args.shape](n['num_hidden_layers'])) / 1e9:.3f}B parameters) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
