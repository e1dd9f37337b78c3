"""Checkpoint files: reading, writing and converting them, below data, eval, engine and infer."""
