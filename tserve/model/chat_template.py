"""A rendered chat that ends inside its last message (`continue_final_message`), as transformers cuts it."""

from __future__ import annotations

from typing import Any


def continued(rendered: str, messages: list[dict[str, Any]]) -> str:
    """`rendered` (the chat without a generation prompt) cut right after the final message's text, so that the
    model goes on writing that message (a reply whose start is given) rather than closing it: the text's last
    occurrence in the rendering, its trailing spaces kept only where the template kept them (transformers'
    `apply_chat_template(continue_final_message=True)`)."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):  # content parts: the last one with text
        final = next((part["text"] for part in reversed(final) if isinstance(part, dict) and "text" in part), None)
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a final message with text to continue")
    if final.strip() not in rendered:
        raise ValueError("continue_final_message: the final message's text does not appear in the rendered chat")
    at = rendered.rindex(final.strip())
    if rendered[at:at + len(final.lstrip())] == final.lstrip():
        return rendered[:at + len(final.lstrip())]
    return rendered[:at + len(final.strip())]
