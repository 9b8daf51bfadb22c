"""Checkpoint files: atomic directory writes and safe (weights-only) reads."""
