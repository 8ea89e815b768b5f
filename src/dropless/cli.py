"""The `dropless` command: `dropless train | generate | evaluate | import-hf | export-hf | bench NAME | ...`.

Each subcommand lives in its own module and parses its own arguments, so `dropless bench layer -h`
shows that benchmark's options and importing the CLI stays cheap.
"""

from __future__ import annotations

import importlib
import sys

from . import cpu_alloc

COMMANDS = {
    "train": ("dropless.train.run", "train a model (see --help)"),
    "generate": ("dropless.serve.generate_cli", "sample text from a trained run"),
    "diagnose": ("dropless.monitor.report", "routing-health report for a run directory"),
    "record-routing": ("dropless.serve.record_routing", "record the full forward's routing of given tokens"),
    "routing-mismatch": ("dropless.serve.mismatch", "compare two routing records of the same tokens"),
    "quantize": ("dropless.serve.quantize", "store a run's routed experts in 4 bits (mxfp4 | nvfp4)"),
    "evaluate": ("dropless.serve.evaluate_cli", "validation loss of a run (fewer experts: --serve-top-k)"),
    "plan": ("dropless.plan.cli", "predict per-rank training memory (and which knob makes it fit)"),
    "import-hf": ("dropless.hf.import_cli", "a Hugging Face Qwen3-MoE / Mixtral / DeepSeek-V3 checkpoint as a run"),
    "export-hf": ("dropless.hf.export_hf", "a run as a Hugging Face checkpoint (qwen3_moe | mixtral | deepseek_v3)"),
    "merge-lora": ("dropless.hf.merge_lora", "a LoRA run's adapters merged into its base, as a full run"),
    "upcycle": ("dropless.hf.upcycle", "a dense Hugging Face Qwen3 / Llama checkpoint as an MoE run"),
    "prepare-data": ("dropless.data.prepare", "tokenise a corpus once into memory-mapped shards (data.prepared)"),
    "check-matrix": ("dropless.check.matrix", "every pair of knob values through every command (CI's matrix)"),
}
# one pass over a checkpoint, each large tensor allocated once: glibc's default (a large block goes back
# to the kernel when freed) keeps their peak at what they hold at once; the heap that cpu_alloc.py keeps
# for training steps would instead fragment under their sequence of differently sized tensors
# (export-hf of a 1.2B-parameter run: 4.1 GiB peak with it, 2.6 without; hf/export_hf.py)
ONE_PASS = ("import-hf", "export-hf")
BENCHMARKS = {
    "layer": "dropless.bench.layer",
    "ep": "dropless.bench.ep",
    "balance": "dropless.bench.balance",
    "quality": "dropless.bench.quality",
    "precision": "dropless.bench.precision",
    "monitor": "dropless.bench.monitor",
    "generate": "dropless.bench.generate",
    "memory": "dropless.bench.memory",
    "a2a": "dropless.bench.a2a",
    "train": "dropless.bench.train_step",
    "load": "dropless.bench.load",
    "prepare-data": "dropless.bench.prepare_data",
    "data-scale": "dropless.bench.data_scale",
    "lora": "dropless.bench.lora",
    "step": "dropless.bench.step",
    "pipeline": "dropless.bench.pipeline",
}


def usage() -> str:
    lines = ["usage: dropless COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<17} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += [f"  bench NAME  benchmarks: {', '.join(BENCHMARKS)}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in ONE_PASS:
        cpu_alloc.keep_freed_memory()  # before the first large tensor: see cpu_alloc.py
    if cmd == "bench":
        if not rest or rest[0] not in BENCHMARKS:
            print(f"dropless bench: choose one of {', '.join(BENCHMARKS)}", file=sys.stderr)
            return 2
        module = importlib.import_module(BENCHMARKS[rest[0]])
        return int(module.main(rest[1:]) or 0)
    if cmd not in COMMANDS:
        print(f"dropless: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[cmd][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
