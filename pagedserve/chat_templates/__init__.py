"""Chat templates we ship for models whose files carry none (e.g. the base Gemma-3-270M GGUF).

One Jinja file per architecture, written by us from the model family's documented turn format;
a model's own template, --chat-template or a request's template always come first.
"""

from __future__ import annotations

from importlib.resources import files

_TEMPLATE_FILES = {"gemma3": "gemma3.jinja"}
"""Architecture (our registry key) -> its template file in this package."""


def default_chat_template(architecture: str | None) -> str | None:
    """The template we ship for `architecture`, or None."""
    file_name = _TEMPLATE_FILES.get(architecture or "")
    if file_name is None:
        return None
    return files(__package__).joinpath(file_name).read_text(encoding="utf-8")
