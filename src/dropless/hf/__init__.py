"""Hugging Face checkpoints in and out (Qwen3-MoE, Mixtral, DeepSeek-V3) and upcycling: docs/models.md."""
