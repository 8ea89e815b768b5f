"""`dropless bench lora` (bench/lora.py): both sides run in their own process on the same tiny
checkpoint and batch, their first steps compute the same loss, and the expert adapters written into
peft's layout are the update dropless applies.

Quick mode: a 2-layer Qwen3-MoE (d 64, E 8, k 2, f 32, V 512), batch 2 x seq 16, fp32: ~20 s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from dropless.bench import lora as bl  # noqa: E402
from dropless.bench import lora_peft  # noqa: E402


@pytest.mark.slow
def test_quick_mode_runs_both_sides_and_they_agree(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "bench.json"
    assert bl.main(["--quick", "--warmup", "2", "--steps", "2", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    below = lines[next(i for i, line in enumerate(lines) if line.startswith("---")) + 1:]
    rows = [line.split()[0] for line in below[:below.index("")]]
    assert rows == ["dropless", "peft"], table
    assert "PASSED" in table
    data = json.loads(out.read_text())
    cmp, sides = data["comparison"], data["sides"]
    assert cmp["equivalent"] and all(c["passed"] for c in cmp["checks"].values())
    assert set(cmp["checks"]) == {"loss", "logits", "grads", "delta"}
    assert cmp["delta_check"]["params"] == 4  # gate_up and down of each of the 2 layers
    # every adapter's gradient compared: 2 layers x (q|k|v, out: A and B; experts: a1 b1 a2 b2)
    assert cmp["first_step"]["grads_compared"] == 2 * (4 + 4)
    for name, side in sides.items():
        assert len(side["losses"]) == 4 and side["tokens_per_s"] > 0, name
        assert side["train_peak"] >= side["rss_loaded"] > 0, name
        assert side["process_peak"] == max(side["load_peak"], side["train_peak"]), name
        assert side["losses"][-1] < side["losses"][0], f"{name}: the optimizer did not lower the loss"
    # the same targets: peft holds q, k and v's A separately where dropless shares one A (r x D per
    # layer, three copies instead of one), every other adapter the same size
    r, D, L = data["meta"]["rank"], sides["dropless"]["d_model"], sides["dropless"]["n_layers"]
    assert sides["peft"]["trainable"] - sides["dropless"]["trainable"] == 2 * r * D * L
    # each library's grouped GEMM ran (transformers resolved its experts to grouped_mm, not its loop)
    assert sides["peft"]["experts_implementation"] == "grouped_mm"
    assert sides["peft"]["grouped_ops"] and sides["dropless"]["grouped_ops"]


def _peft_experts(E: int = 5, D: int = 12, Fx: int = 7, r: int = 3, alpha: float = 6.0):
    """A 1-layer transformers Qwen3-MoE with peft adapters on its fused experts; returns its two
    ParamWrappers by parameter name. Odd widths and prime E: a transposed or mis-strided layout shows."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=16, hidden_size=D, intermediate_size=8, moe_intermediate_size=Fx,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      head_dim=4, num_experts=E, num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    wrappers = lora_peft._param_wrappers(model)
    return {name.rsplit(".", 1)[-1]: w for name, w in wrappers.items()}, alpha / r


@torch.no_grad()
def test_expert_layout_is_what_peft_reads() -> None:
    """expert_A / expert_B put dropless's a [E, I, r], b [E, r, O] where peft's get_delta_weight reads
    them: its delta of a parameter stored [E, O, I] is (a_e b_e s)^T for every expert e; expert_a /
    expert_b invert them; and the comparison notices two experts' B swapped (the check the bench
    runs can fail)."""
    wrappers, s = _peft_experts()
    g = torch.Generator().manual_seed(0)
    for pname, w in wrappers.items():
        E, O, I = getattr(w.get_base_layer(), pname).shape
        r = w.r["default"]
        a, b = torch.randn(E, I, r, generator=g), torch.randn(E, r, O, generator=g)
        w.lora_A["default"].weight.copy_(lora_peft.expert_A(a))
        w.lora_B["default"].weight.copy_(lora_peft.expert_B(b))
        assert torch.equal(lora_peft.expert_a(w.lora_A["default"].weight, E), a)  # the gradients' way back
        assert torch.equal(lora_peft.expert_b(w.lora_B["default"].weight, E), b)
        expected = (torch.bmm(a, b) * s).transpose(1, 2)
        torch.testing.assert_close(w.get_delta_weight("default"), expected, rtol=lora_peft.DELTA_RTOL, atol=0)
        w.lora_B["default"].weight.copy_(lora_peft.expert_B(b[[1, 0, *range(2, E)]]))
        assert not torch.allclose(w.get_delta_weight("default"), expected, rtol=lora_peft.DELTA_RTOL, atol=0)


def test_refusals() -> None:
    assert bl.main([]) == 2  # neither --hf-dir nor --quick
    assert bl.main(["--quick", "--steps", "0"]) == 2
    assert bl.main(["--hf-dir", "/nonexistent"]) == 2
