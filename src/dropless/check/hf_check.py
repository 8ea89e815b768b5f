"""The export stage's checks: which Hugging Face family can hold a row, and that what export-hf wrote
(and import-hf read back) computes the run's logits.

A row goes to the first family of hf/mapping.py that can express it (Qwen3-MoE first: the only one
with q/k norms); a row none can express is exported as `FALLBACK` and must be refused naming the field.
Logits are compared in fp32 with the run's routed experts at full precision (`precision="bf16"`, the
unquantised path: an HF model has no emulated MXFP8/NVFP4 GEMMs); the tolerance is the fp32 reference
tolerance of the test suite (tests/tolerances.py REFERENCE[float32]): the same math in the same
order up to the GEMM kernels' blocking.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import torch

from ..config import ModelConfig
from ..hf import mapping
from ..model import MoEModel
from ..hf.load_run import load_model
from .runner import Failed

FALLBACK = "qwen3_moe"
RTOL, ATOL = 1e-5, 5e-6  # tests/tolerances.py REFERENCE[torch.float32]: module note


def family(cfg: ModelConfig) -> str | None:
    for fam in mapping.FAMILIES:
        try:
            mapping.check_exportable(cfg, fam)
        except ValueError:
            continue
        return fam
    return None


def _full_precision(cfg: ModelConfig) -> ModelConfig:
    return replace(cfg, moe=replace(cfg.moe, precision="bf16"))


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(1))


def run_logits(run: Path) -> tuple[MoEModel, torch.Tensor]:
    model, _ = load_model(run, "cpu", model_cfg=_full_precision)
    with torch.no_grad():
        return model, model(tokens(model.cfg.vocab_size)).logits


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape or not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
        diff = (a - b).abs().max().item() if a.shape == b.shape else f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
        raise Failed(f"{what}: logits differ from the run's (max |diff| {diff})")


def load_export(run: Path, out: Path) -> str:
    """Load the export with transformers: no missing/unexpected key, the run's logits. Returns a note."""
    try:
        import transformers  # the one place this optional dependency is imported here
    except ImportError:
        return "transformers not installed: the export was not loaded"
    model, want = run_logits(run)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True,
                                                                 dtype=torch.float32)
    # DeepSeek-V3's MTP layers (model.layers.{n_layers + k}.*, hf/deepseek.py): transformers never
    # builds them and ignores them by name only at DeepSeek's 61 layers; elsewhere they are unexpected
    mtp = tuple(f"model.layers.{model.cfg.n_layers + k}." for k in range(model.cfg.mtp_depth))
    unexpected = {k for k in info.get("unexpected_keys", ()) if not (mtp and k.startswith(mtp))}
    bad = {k: v for k, v in {**info, "unexpected_keys": unexpected}.items()
           if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise Failed(f"transformers loaded the export with {bad}")
    with torch.no_grad():
        close(hf.eval()(tokens(model.cfg.vocab_size)).logits, want, "transformers")
    return f"loaded with transformers {transformers.__version__}"


def with_byte_tokenizer(export: Path, dest: Path) -> Path:
    """A copy of an export that holds no tokenizer (a byte-level run exports none), with a byte-level
    tokenizer.json of 256 ids added: import-hf takes a checkpoint only with its tokenizer."""
    shutil.copytree(export, dest)
    if not (dest / "tokenizer.json").exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.save(str(dest / "tokenizer.json"))
    return dest


def compare_runs(run: Path, imported: Path) -> None:
    """The run that import-hf wrote computes the original run's logits."""
    _, want = run_logits(run)
    _, got = run_logits(imported)
    close(got, want, "import-hf")
