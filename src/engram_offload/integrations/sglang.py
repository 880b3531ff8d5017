"""The SGLang plugin (placeholder until it is written): ``register`` does nothing yet."""

from __future__ import annotations


def register() -> None:
    """SGLang's ``sglang.srt.plugins`` hook."""
