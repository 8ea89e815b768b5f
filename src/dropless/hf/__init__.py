"""Hugging Face checkpoints in and out (Qwen3-MoE, Mixtral): docs/hf.md."""
