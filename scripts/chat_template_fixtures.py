"""Render chat templates the way Hugging Face's `apply_chat_template` does, as the reference
for tpctl's minijinja rendering (crates/text/tests/chat_templates.rs).

Hugging Face renders with jinja2's ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True) and the loopcontrols extension, a `tojson` filter that keeps non-ASCII
characters, and the globals `raise_exception` and `strftime_now`; the template sees
`messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens and any extra
keyword arguments. This script does the same with jinja2 (pip package `jinja2`) on the
templates in crates/text/tests/fixtures/chat_templates/*.jinja (written for these tests,
each exercising Python-style methods and whitespace control that published templates use),
for a few conversations, and writes crates/text/tests/fixtures/chat_templates.json:
[{"template": NAME, "case": CASE, "context": {...}, "text": RENDERED}, ...].

Usage: python3 scripts/chat_template_fixtures.py
"""
import json
import pathlib
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "crates/text/tests/fixtures"

# A fixed date, so the fixture does not change with the day it is made (tests pass the same).
NOW = datetime(2026, 7, 26)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: NOW.strftime(fmt)
    return env


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, in °C",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"}},
            "required": ["city"],
        },
    },
}

CASES = {
    "plain": {
        "messages": [
            {"role": "system", "content": "  You are terse.  "},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!\n"},
            {"role": "user", "content": "Capital of France? 日本語も"},
        ],
        "add_generation_prompt": True,
    },
    "no_system": {
        "messages": [{"role": "user", "content": "Only a question"}],
        "add_generation_prompt": False,
    },
    "tools": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
            },
            {"role": "tool", "content": "21 °C, sunny"},
        ],
        "tools": [TOOL],
        "add_generation_prompt": True,
    },
    "extra_args": {
        "messages": [{"role": "user", "content": "Think first"}],
        "add_generation_prompt": True,
        "enable_thinking": False,
    },
}


def main():
    env = environment()
    out = []
    for path in sorted((FIXTURES / "chat_templates").glob("*.jinja")):
        template = env.from_string(path.read_text())
        for case, context in CASES.items():
            full = {"bos_token": "<s>", "eos_token": "</s>", **context}
            try:
                text = template.render(**full)
                out.append({"template": path.stem, "case": case, "context": full, "text": text})
            except jinja2.exceptions.TemplateError as e:
                out.append({"template": path.stem, "case": case, "context": full, "error": str(e)})
    (FIXTURES / "chat_templates.json").write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    print(f"{len(out)} renderings")


if __name__ == "__main__":
    main()
