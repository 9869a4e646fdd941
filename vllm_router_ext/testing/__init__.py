"""Helpers that build small, local DeepSeek-family checkpoints for tests, docs and the demo."""
