# The README's two commands: `make train` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned: a bare `torch` requirement would pull a multi-GB CUDA build; this CPU build
# installs from local disk on the project's machines.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv train test test-slow test-all test-isa bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,plots,progress,logging]"
	touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(BIN)/dropless train $(ARGS)

# `make test` leaves out the tests marked slow (long training runs, 4-rank worlds, the inductor
# builds): about 8 minutes on 2 cores. CI runs `make test-slow` after it, so it runs every test.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The numerics-sensitive tests (GEMM-bearing parity, reruns, resume, EP and distributed training)
# again under MKL's AVX-512 and AVX2 fp32 GEMM kernels: a row of an fp32 GEMM rounds differently
# depending on the kernel path and the batch around it, so a test that holds on this CPU's default
# path can fail on another machine's (AMX vs AVX-512 vs AVX2). CI runs it after `make test`.
ISA_TESTS ?= tests/distributed/test_ep.py tests/distributed/test_ep_sums.py \
	tests/distributed/test_parallel_train.py tests/distributed/test_skip_buffers.py \
	tests/distributed/test_health_counts.py tests/test_moe_layer.py tests/test_grouped_gemm.py \
	tests/test_permute.py tests/test_strategies.py tests/test_activations.py tests/test_balance.py \
	tests/test_capacity_and_config.py tests/test_compile.py tests/test_bench_layer.py \
	tests/ops/test_quant_gemm.py tests/train/test_training.py tests/train/test_resume.py \
	tests/train/test_nonfinite.py tests/train/test_checkpoint.py tests/train/test_optim_lowp.py
ISA_TESTS += tests/serve/test_packed_experts.py tests/serve/test_quantize.py
ISA_TESTS += tests/serve/test_kv_cache.py tests/serve/test_generate.py tests/test_decode_experts.py
ISA_TESTS += tests/test_model_knobs.py tests/test_identity_experts.py tests/test_latent_moe.py tests/test_mtp.py tests/serve/test_knobs_generate.py
ISA_TESTS += tests/test_offload.py tests/distributed/test_recompute_ep.py
ISA_TESTS += tests/test_recompute.py tests/test_routing_norm_topk.py tests/serve/test_serving_topk.py \
	tests/serve/test_replay_recompute.py tests/serve/test_replay_training.py
ISA_TESTS += tests/test_hf_parity.py tests/test_hf_attention.py tests/test_hf_deepseek.py tests/test_hf_upcycle.py
ISA_TESTS += tests/test_lean_experts.py
ISA_TESTS += tests/distributed/test_ep_spill.py tests/distributed/test_ep_adaptive.py tests/distributed/test_ep_replicas.py
ISA_TESTS += tests/distributed/test_ep_overlap.py tests/distributed/test_knobs_ep.py tests/train/test_bias_rules.py
ISA_TESTS += tests/distributed/test_lora_ep.py tests/train/test_lora_train.py
# Muon batching changes no bits only if a batched GEMM computes each matrix as it computes it alone
ISA_TESTS += tests/train/test_muon.py
ISA_TESTS += tests/distributed/test_ep_payload.py tests/distributed/test_ep_ring.py tests/distributed/test_ep_hier.py
ISA_SETTINGS ?= AVX512 AVX2

test-isa: $(STAMP)
	@set -e; for isa in $(ISA_SETTINGS); do \
		echo "== MKL_ENABLE_INSTRUCTIONS=$$isa"; \
		MKL_ENABLE_INSTRUCTIONS=$$isa $(BIN)/python -m pytest -q -p no:cacheprovider $(ISA_TESTS) $(PYTEST_ARGS); \
	done


bench: $(STAMP)
	$(BIN)/dropless bench layer --shape small --routing balanced
	$(BIN)/dropless bench layer --shape medium --routing balanced

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
