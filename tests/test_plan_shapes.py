"""`dropless plan` on models whose widths are not the default ones: an explicit head width, grouped
key/value heads, multi-head latent attention (MLA), LatentMoE, identity experts, MTP, and the two
published recipes (plan presets). The planner reads every width from the model it builds (on the
meta device for the parameters, on fake tensors for the activations); these tests check its figures
against the real model's tensors, as tests/test_plan.py does for the default shapes, and its refusals
of bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dropless.config import load_config
from dropless.model import MoEModel
from dropless.plan import cli
from dropless.plan.activations import activation_bytes
from dropless.plan.model import plan
from dropless.plan.validate import measure
from dropless.runs.presets import preset_path
from plan_cases import check_two_ranks, config, one_thread  # noqa: F401  (one_thread: an autouse fixture)

SMALL = ["model.n_layers=3", "train.batch_size=4", "train.seq_len=64", "model.max_seq_len=128",
         "train.optimizer=adamw"]
HEAD_DIM = ["model.head_dim=24", "model.n_kv_heads=2", "model.qk_norm=true"]  # 4 heads of 24 in d=256
# MLA with value heads as wide as the query/key heads: the CPU's fused attention kernel takes it,
# so a CPU run keeps what the planner plans (narrower value heads: test_mla_narrow_value_heads_...)
MLA = ["model.attention=mla", "model.q_lora_rank=48", "model.kv_lora_rank=64", "model.rope_head_dim=16",
       "model.head_dim=48", "model.v_head_dim=48"]
MLA_NARROW_V = [*MLA[:-1], "model.v_head_dim=40"]


def small(*extra: str, dtype: str = "fp32"):
    return config(SMALL, *extra, dtype=dtype)


def _meta(cfg) -> MoEModel:
    with torch.device("meta"):
        return MoEModel(cfg.model)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", ["head_dim", "mla_mtp"])
def test_wide_heads_and_mla_match_the_real_model(case: str, dtype: str) -> None:
    """An explicit head width (wider than d_model / n_heads) with grouped key/value heads, and MLA
    with MTP, whose rotary part is narrower than its heads: the planner's states are the real
    tensors' bytes exactly and its activations within 2% of what a real forward leaves alive, as
    for the default shape. Re-deriving the rotary width as d_model / n_heads (or the MTP module's
    as the head width) fails to broadcast in the block's rotary."""
    extra = HEAD_DIM if case == "head_dim" else [*MLA, "model.mtp_depth=1", "model.tie_embeddings=false"]
    cfg = small(*extra, dtype=dtype)
    measured = measure(cfg, steps=1, distributed=False)
    p = plan(cfg, 1)
    for comp in ("params", "grads", "optimizer"):
        assert getattr(p, comp) == measured[comp], comp
    assert abs(p.activations / measured["activations"] - 1) < 0.02, (p.activations, measured["activations"])


@pytest.mark.parametrize("bf16", [False, True])
def test_mla_narrow_value_heads_keep_no_score_matrix(bf16: bool) -> None:
    """MLA's value heads narrower than its query/key heads (DeepSeek-V3: 128 and 192): the CPU has
    no fused attention for that and its math path keeps an [S, S] matrix per head; a GPU's
    memory-efficient kernel keeps q, k, v, the output and the fp32 log-sum-exp (plus its two int64
    RNG scalars), which the planner counts (plan/fake_world.py). So the attention's bytes are those
    tensors exactly, and the activations per token do not depend on how the tokens split into
    sequences; the math path's [S, S] makes longer sequences cost more per token."""
    import torch.nn.functional as F

    from dropless.plan.fake_world import fake_world
    from dropless.saved_bytes import saved_bytes

    B, H, S, Dqk, Dv = 2, 4, 64, 48, 40
    with fake_world():
        q, k = (torch.empty(B, H, S, Dqk, requires_grad=True) for _ in range(2))
        v = torch.empty(B, H, S, Dv, requires_grad=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            kept = saved_bytes(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               q, k, v, include_inputs=False).bytes
    es = 2 if bf16 else 4  # autocast's copies of q, k, v (and the output) in bf16
    assert kept == B * H * S * (2 * Dqk + 2 * Dv) * es + B * H * S * 4 + 2 * 8
    cfg = small(*MLA_NARROW_V).model
    assert activation_bytes(cfg, 4, 64, bf16).total == activation_bytes(cfg, 2, 128, bf16).total


# (preset, parameter name, shape): the published checkpoints' tensors (Hugging Face names in the
# comments), as the dropless model lays them out
PRESET_TENSORS = [
    # Qwen3-30B-A3B: q_proj [4096, 2048], k_proj and v_proj [512, 2048] (fused here), o_proj [2048, 4096]
    ("plan/qwen3_30b_a3b", "blocks.0.attn.qkv.weight", (4096 + 2 * 512, 2048)),
    ("plan/qwen3_30b_a3b", "blocks.0.attn.out.weight", (2048, 4096)),
    ("plan/qwen3_30b_a3b", "blocks.0.attn.q_norm.weight", (128,)),  # self_attn.q_norm
    ("plan/qwen3_30b_a3b", "blocks.0.ffn.experts.w_down_EFD", (128, 768, 2048)),  # 128 x down_proj [2048, 768]
    # Qwen3-235B-A22B: q_proj [8192, 4096], k_proj and v_proj [512, 4096], o_proj [4096, 8192]
    ("plan/qwen3_235b_a22b", "blocks.0.attn.qkv.weight", (8192 + 2 * 512, 4096)),
    ("plan/qwen3_235b_a22b", "blocks.0.attn.out.weight", (4096, 8192)),
    ("plan/qwen3_235b_a22b", "blocks.93.ffn.experts.w_down_EFD", (128, 1536, 4096)),  # 128 x down_proj [4096, 1536]
    # DeepSeek-V3: q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj of a layer
    ("plan/deepseek_v3", "blocks.3.attn.q_a.weight", (1536, 7168)),
    ("plan/deepseek_v3", "blocks.3.attn.q_b.weight", (128 * 192, 1536)),
    ("plan/deepseek_v3", "blocks.3.attn.kv_a.weight", (512 + 64, 7168)),
    ("plan/deepseek_v3", "blocks.3.attn.kv_b.weight", (128 * (128 + 128), 512)),
    ("plan/deepseek_v3", "blocks.3.attn.out.weight", (7168, 128 * 128)),
    ("plan/deepseek_v3", "blocks.0.ffn.gate_up.weight", (2 * 18432, 7168)),  # a dense layer's gate and up
    ("plan/deepseek_v3", "blocks.3.ffn.experts.w_down_EFD", (256, 2048, 7168)),
]


@pytest.mark.parametrize("preset", ["plan/qwen3_30b_a3b", "plan/deepseek_v3", "plan/qwen3_235b_a22b"])
def test_plan_presets_are_the_published_models_and_plan(preset: str) -> None:
    """The recipes' models have the published checkpoints' attention and expert tensors (Qwen3's
    128-wide heads and grouped keys/values, DeepSeek-V3's latent attention), and plan at their
    published layouts (Qwen3-30B-A3B: EP 16 on 16 ranks, which ran on 80 GB devices; DeepSeek-V3:
    EP 64, 16 pipeline ranks of 2 stages on 2048; Qwen3-235B-A22B: EP 8, 8 pipeline ranks of 4
    stages on 64)."""
    cfg = load_config(preset_path(preset))
    shapes = dict((n, tuple(p.shape)) for n, p in _meta(cfg).named_parameters())
    for name, param, shape in PRESET_TENSORS:
        if name == preset:
            assert shapes[param] == shape, param
    if preset == "plan/qwen3_30b_a3b":
        p = plan(cfg, 16)
        assert p.peak <= 80 * 10**9
    elif preset == "plan/deepseek_v3":
        p = plan(cfg, 2048)
        assert (p.pipeline, cfg.parallel.pipeline.num_stages) == (16, 32)
    else:
        p = plan(cfg, 64)
        assert (p.pipeline, cfg.parallel.pipeline.num_stages) == (8, 32)
    assert p.params > 0 and p.activation_detail.moe_block > 0


def test_validate_recipe_case_keeps_the_recipe_widths() -> None:
    """`python -m dropless.plan.validate --cases qwen3_30b_a3b_1l` (docs/planner.md) measures the
    Qwen3-30B-A3B recipe cut only where its module note says (blocks, experts, vocabulary, sequence):
    every other field of the model is the recipe's, and at EP 4 a rank holds the 16 experts a rank of
    the full model holds at EP 8."""
    from dataclasses import asdict

    from dropless.plan.validate import case_config
    recipe = asdict(load_config(preset_path("plan/qwen3_30b_a3b")).model)
    cut = case_config("qwen3_30b_a3b_1l", 4, "bf16", ("parallel.ep_size=4",))
    case = asdict(cut.model)
    changed = {k for k in recipe if recipe[k] != case[k]}
    assert changed == {"n_layers", "vocab_size", "max_seq_len", "moe"}, changed
    assert {k for k in recipe["moe"] if recipe["moe"][k] != case["moe"][k]} == {"num_experts"}
    train = cut.train
    assert (train.optimizer, train.dtype, train.batch_size * train.seq_len) == ("adamw", "bf16", 512)
    assert cut.model.moe.num_experts // cut.parallel.ep_size == recipe["moe"]["num_experts"] // 8


# a spread of model knobs, each changing which parameters exist or how wide they are
PARAM_CASES = {
    "latent_identity": ["model.moe.latent_dim=128", "model.moe.latent_norm=true",
                        "model.moe.n_identity_experts=2"],
    "mtp_untied": ["model.mtp_depth=2", "model.tie_embeddings=false"],
    "shared_dense": ["model.moe.n_shared_experts=2", "model.moe.d_shared=96", "model.n_dense_layers=2",
                     "model.d_ff_dense=320"],
    "layer_freq": ["model.n_layers=4", "model.moe_layer_freq=[1, 3]"],
    "head_dim": HEAD_DIM,
    "mla": MLA_NARROW_V,
}


@pytest.mark.parametrize("case", sorted(PARAM_CASES))
def test_parameter_bytes_are_the_meta_models_parameters(case: str) -> None:
    """At world 1 (nothing sharded) params and grads are 4 B per element of the model built on the
    meta device, each parameter once (a tied head is the embedding's), and AdamW's state 8 B per
    element plus a 4 B step per tensor."""
    cfg = small(*PARAM_CASES[case])
    params = {id(q): q for q in _meta(cfg).parameters()}.values()
    n = sum(q.numel() for q in params)
    p = plan(cfg, 1)
    assert (p.params, p.grads, p.optimizer) == (4 * n, 4 * n, 8 * n + 4 * len(params))


def test_tied_head_counted_once() -> None:
    cfg = small()
    untied = plan(small("model.tie_embeddings=false"), 1)
    assert untied.params - plan(cfg, 1).params == 4 * cfg.model.vocab_size * cfg.model.d_model


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_latent_ep_buffers_carry_latent_rows(dtype: str) -> None:
    """LatentMoE under expert parallelism (world 2, EP 2 buffered, two gloo processes): the
    all-to-alls carry the latent rows (width l, the projection's compute dtype), not d_model rows of
    the fp32 residual stream: the planned buffers are what the all-to-alls allocate, to 0.1% (the
    d_model width gave 2x in fp32, 3x in bf16). States exact, activations within 2%."""
    check_two_ranks(small("parallel.ep_size=2", "parallel.ep_mode=buffered", "model.moe.latent_dim=128", dtype=dtype))


@pytest.mark.parametrize("argv,names", [
    (["tiny", "--world", "3", "--set", "parallel.ep_size=2"], ["--world 3", "parallel.ep_size=2"]),
    (["no_such_preset"], ["CONFIG 'no_such_preset'", "plan/deepseek_v3"]),
    (["tiny", "--device-memory=-5GiB"], ["--device-memory '-5GiB'"]),
    (["tiny", "--pipeline", "8", "--world", "8"], ["--pipeline 8", "parallel.pp_size", "model.n_layers=4"]),
    (["tiny", "--json", "{tmp}/no_such_folder/plan.json"], ["--json", "folder does not exist"]),
])
def test_cli_refuses_bad_input_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                argv: list[str], names: list[str]) -> None:
    """Each refusal is exit status 2 and one line naming the flag or field (and its value), before
    anything is written: no traceback (a --json path in a missing folder raised one after the table
    was printed; more pipeline stages than layers planned an empty stage)."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("dropless plan: error:")
    for name in names:
        assert name in captured.err, (name, captured.err)
    assert not list(tmp_path.iterdir())
