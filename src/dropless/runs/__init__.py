"""The run directory: presets, checkpoints, resume rules, logs, loading."""
