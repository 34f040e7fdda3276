"""Rendering ``chat_template.jinja`` with Python jinja2, the way an HF-style host does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .render import TemplateError

TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def load_template(source: str | None = None, *, trim: bool = True) -> jinja2.Template:
    """Compile the chat template; ``trim`` mimics HF's trim_blocks/lstrip_blocks environment."""
    env = ImmutableSandboxedEnvironment(trim_blocks=trim, lstrip_blocks=trim)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source if source is not None else TEMPLATE_PATH.read_text())


def render_with_template(template: jinja2.Template, messages: list[dict], **kwargs: Any) -> str:
    """Render ``messages`` with ``template``; kwargs as for ``render.render``."""
    return template.render(messages=messages, **kwargs)
