"""After training: loading a run for inference, evaluation, generation, serving-time routing changes,
4-bit experts and routing replay records. Sits beside `train` (it uses the model, never the other
way round)."""
