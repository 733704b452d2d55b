"""Chat templates: found in an HF tokenizer directory and rendered the way transformers renders them.

Where transformers looks: `chat_template.jinja` (the format transformers >= 4.43 saves), else the
`chat_template` entry of `tokenizer_config.json` (a string, or a list of named templates of which
"default" is used), so a directory saved by either version gives the same template. Rendering
uses a sandboxed jinja2 environment with HF's settings (trim_blocks, lstrip_blocks,
loopcontrols) and globals (`raise_exception`, `strftime_now`, a `tojson` that does not escape
HTML), so the prompt text is byte-identical to `apply_chat_template(..., tokenize=False)`.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"


def find_chat_template(hf_dir: Path, tokenizer_config: dict) -> str | None:
    """The directory's default chat template, None if it has none."""
    path = Path(hf_dir) / TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    value = tokenizer_config.get("chat_template")
    if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached: rendering, not parsing, is the per-prompt cost)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def check_messages(messages) -> list[dict]:
    """A chat as a list of {"role": str, "content": ...} dicts (ValueError naming the bad entry)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"message {i} must be an object with a string 'role' and a 'content', got {m!r}")
    return messages


def render(source: str, messages: list[dict], add_generation_prompt: bool, special_tokens: dict[str, str],
           **extra) -> str:
    """The template rendered for `messages` (HF passes the special tokens by name, e.g. bos_token)."""
    try:
        return compile_template(source).render(messages=check_messages(messages),
                                               add_generation_prompt=add_generation_prompt,
                                               **special_tokens, **extra)
    except jinja2.exceptions.TemplateError as err:
        raise ValueError(f"chat template: {err}") from None
