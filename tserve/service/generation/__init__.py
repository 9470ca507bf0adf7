"""Serving causal language models: the served model (OpenAI's completions go through it) and tool calls."""
