"""Chat templates (jinja2, sandboxed), rendered the way HF transformers renders them:
trim_blocks + lstrip_blocks, loop controls, `raise_exception`, `tojson`, `strftime_now`."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template raised (raise_exception) or failed to render; maps to INVALID_ARGUMENT."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # HF's tojson: no HTML escaping (unlike jinja2's builtin), unicode kept as is
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: {e}") from None


def _flatten_text_parts(m: dict) -> dict:
    """OpenAI-style content [{"type": "text", "text": ...}, ...] -> one string, when every
    part is text (text-only templates concatenate strings); other content is left alone."""
    c = m.get("content")
    if isinstance(c, list) and c and all(isinstance(p, dict) and p.get("type") == "text" for p in c):
        return {**m, "content": "".join(str(p.get("text", "")) for p in c)}
    return m


def render(source: str, messages: list[dict], add_generation_prompt: bool, **context) -> str:
    """context: bos_token, eos_token, tools, ... passed to the template as variables."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("messages must be a list of dicts")
    for i, m in enumerate(messages):
        if "role" not in m:
            raise ChatTemplateError(f"message {i} has no 'role'")
    messages = [_flatten_text_parts(m) for m in messages]
    tpl = compile_template(source)
    try:
        return tpl.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None
