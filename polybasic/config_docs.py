"""docs/recipes.md, generated from the recipe schema (polybasic.config): every section and field with its
type, default and meaning. `polybasic recipes --fields` prints it; a test keeps docs/recipes.md current.

A field's meaning is the comment on its line in polybasic.config (with the comment lines that follow
it), a section's introduction its docstring.
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize
import typing

from polybasic import config

HEADER = """# Recipe fields

Generated from `polybasic/config.py` by `polybasic recipes --fields` (a test keeps this file current).
A recipe is a YAML file with the sections below; every field is optional (the default shown is used).
Run a shipped recipe by name (`polybasic recipes` lists them) or a YAML path, and override any field with
`--set section.field=value`, e.g. `polybasic run smollm2-quick --set distill.train.lr=1e-2`.
"""


def field_comments(cls) -> dict[str, str]:
    """{field: the comment on its line and the comment-only lines right after it} in cls's source."""
    src = inspect.getsource(cls)
    comments: dict[str, str] = {}
    current, last_line = None, -1
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.NAME and tok.start[1] == 4 and tok.line[4:].split(":")[0].strip() == tok.string \
                and ":" in tok.line and not tok.line.lstrip().startswith(("def ", "@")):
            current, last_line = tok.string, tok.start[0]
        elif tok.type == tokenize.COMMENT and current is not None:
            own = tok.start[0] == last_line
            follows = tok.start[0] == last_line + 1 and tok.line.strip().startswith("#")
            if own or follows:
                comments[current] = (comments.get(current, "") + " " + tok.string.lstrip("# ").strip()).strip()
                last_line = tok.start[0]
        elif tok.type == tokenize.NAME and tok.string == "def":
            current = None
    return comments


SOURCE = "data source (a shipped name, a path or a Hub id)"
SOURCES = "data sources (each a shipped name, a path or a Hub id)"


def _type(tp) -> str:
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))
    return str(text).replace("typing.", "")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return "(section)" if not hasattr(type(value), "SHORTHAND") else f"`{getattr(value, type(value).SHORTHAND)}`"
    return f"`{value!r}`" if not isinstance(value, str) else (f"`{value}`" if value else "`''`")


def _doc(cls) -> str:
    doc = inspect.getdoc(cls) or ""
    return "" if doc.startswith(cls.__name__ + "(") else " ".join(doc.split())


def _section(path: str, cls, out: list[str]) -> None:
    hints = typing.get_type_hints(cls)
    notes = {k: v for base in reversed(cls.__mro__) if dataclasses.is_dataclass(base)
             for k, v in field_comments(base).items()}
    out += [f"\n## `{path}`" if path else "\n## top level", ""]
    if _doc(cls):
        out += [_doc(cls), ""]
    out += ["| field | type | default | meaning |", "|---|---|---|---|"]
    nested = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and not hasattr(tp, "SHORTHAND"):
            nested.append((f"{path}.{f.name}" if path else f.name, tp))
            out.append(f"| `{f.name}` | section | - | see [`{nested[-1][0]}`](#{nested[-1][0].replace('.', '')}) |")
            continue
        inner = typing.get_args(tp)[0] if typing.get_origin(tp) is list and typing.get_args(tp) else None
        kind = SOURCE if hasattr(tp, "SHORTHAND") else SOURCES if hasattr(inner, "SHORTHAND") \
            else _type(f.type)
        out.append(f"| `{f.name}` | {kind} | {_default(f)} | {notes.get(f.name, '').replace('|', '/')} |")
    for sub_path, sub in nested:
        _section(sub_path, sub, out)


def render_fields() -> str:
    """The markdown of docs/recipes.md."""
    out = [HEADER]
    _section("", config.Recipe, out)
    out += ["\n## Data sources (`quantize.data`, `distill.data`, `profile.data`)", "",
            " ".join((inspect.getdoc(config.DataSource) or "").split()), ""]
    return "\n".join(out).rstrip() + "\n"
