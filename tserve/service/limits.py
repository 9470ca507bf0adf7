"""The request limits every API shares, each one function with one message: how many inputs one request holds
(--max-prompts), how many characters one input has (--max-input-chars), and max_tokens against the server's limit
(--max-tokens-limit). A broken one is an `InvalidInput` (400), which each API renders in its own shape."""

from __future__ import annotations

from tserve.service.errors import InvalidInput


def check_input_count(count: int, limit: int, what: str = "inputs") -> None:
    if count > limit:
        raise InvalidInput(f"{count} {what} in one request; the limit is {limit}", "too_many_inputs")


def check_input_chars(text: str, limit: int, what: str = "the prompt") -> None:
    if len(text) > limit:
        raise InvalidInput(f"{what} has {len(text)} characters; the limit is {limit}", "input_too_long")


def check_max_tokens(max_tokens: int, limit: int) -> None:
    if max_tokens > limit:
        raise InvalidInput(f"max_tokens {max_tokens} exceeds the server's limit of {limit}", "max_tokens_too_large")
