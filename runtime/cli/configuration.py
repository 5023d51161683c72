"""``orgchart config``: the effective configuration, and where each value came from.

Each key is shown with its value and its origin: ``default``, the configuration file's
path, or the name of the environment variable that set it (``ORGCHART_OLLAMA__URL``,
``ORGCHART_DATABASE_URL``). ``--json`` prints ``{section: {key: value}}`` only. A database
URL is shown with its password hidden. Reads no database and no model server.

``--markdown`` prints the reference of every setting instead (docs/configuration.md is
this output): each key's type, default, environment variable and one line of meaning,
read from the pydantic settings of :mod:`runtime.config` (a key's ``Field(description=)``
or the ``#:`` comment above it).
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Iterator
from typing import Annotated, Any, Literal, get_args, get_origin

import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from rich.markup import escape
from rich.table import Column, Table

from runtime import config as config_module
from runtime.cli.common import JsonOpt, out, print_json, settings
from runtime.config import ENV_PREFIX, Settings
from runtime.store.postgres.urls import redacted, sqlalchemy_url

#: The command that writes docs/configuration.md (its test names it when the file is stale).
REGENERATE = "orgchart config --markdown > docs/configuration.md"
#: Keys of :class:`Settings` that are not sections (where the values came from).
_NOT_SECTIONS = ("source", "sources")


def _shown(section: str, key: str, value: Any) -> Any:
    if section == "database" and key == "url" and value:
        return redacted(sqlalchemy_url(value))
    return value


def config(json_: JsonOpt = False, markdown: Annotated[bool, typer.Option(
        "--markdown", help="Print the reference of every setting (docs/configuration.md).")]
        = False) -> None:
    """Print the effective configuration and where each value came from."""
    if markdown:
        typer.echo(reference_markdown(), nl=False)
        return
    effective = settings()
    rows = [(section, key, _shown(section, key, value), origin)
            for section, key, value, origin in effective.explain()]
    if json_:
        sections: dict[str, dict[str, Any]] = {}
        for section, key, value, _origin in rows:
            sections.setdefault(section, {})[key] = value
        print_json(sections)
        return
    # Long values fold; the key and where it came from stay whole on their line.
    table = Table(Column("key", no_wrap=True), Column("value", overflow="fold"),
                  Column("from", no_wrap=True),
                  title=f"configuration (file: {effective.source or 'none'})",
                  title_justify="left")
    for section, key, value, origin in rows:
        table.add_row(f"{section}.{key}", escape(json.dumps(value, default=str)),
                      escape(origin), style=None if origin != "default" else "dim")
    out.print(table)


# ------------------------------------------------------------------ the reference (--markdown)
def doc_comments(model: type[BaseModel]) -> dict[str, str]:
    """``{key: text}`` from the ``#:`` comment lines right above each key of ``model``."""
    lines, _ = inspect.getsourcelines(model)
    found: dict[str, str] = {}
    for number, line in enumerate(lines):
        key = re.match(r"\s+([a-z_]+): ", line)
        if not key:
            continue
        above: list[str] = []
        for previous in reversed(lines[:number]):
            if not previous.strip().startswith("#:"):
                break
            above.insert(0, previous.strip()[2:].strip())
        if above:
            found.setdefault(key.group(1), " ".join(above))
    return found


def _markdown(text: str) -> str:
    """Docstring markup (double backquotes, ``:func:`` roles) as Markdown code."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def meaning(model: type[BaseModel], key: str) -> str:
    """One line saying what ``key`` of ``model`` does ("" when nobody wrote one)."""
    text = model.model_fields[key].description or doc_comments(model).get(key, "")
    text = re.sub(rf"^`{key}`: ", "", _markdown(text))
    return text[:1].upper() + text[1:]


def _type_name(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is dict and _is_table(args[1]):
        return "tables"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return "None" if annotation is type(None) else annotation.__name__


def _bounds(field: FieldInfo) -> str:
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "length >="}
    found = [f"{words[name]} {getattr(m, name)}" for m in field.metadata
             for name in words if getattr(m, name, None) is not None]
    return f" ({', '.join(found)})" if found else ""


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    shown = json.dumps(value, default=str).replace("|", "\\|")
    return f"`{shown}`"


def _env_name(model: type[BaseModel], section: str | None, key: str) -> str:
    """The variable that sets ``section.key`` (a dict's value is JSON), or "file only" (tables)."""
    field = model.model_fields[key]
    variable = f"`{ENV_PREFIX}{section.upper()}__{key.upper()}`" if section else ""
    if section is None or any(_is_table(arg) for arg in get_args(field.annotation)):
        return "file only"
    if get_origin(field.annotation) is dict:
        return f"{variable} (JSON)"
    if get_origin(field.annotation) is list:
        try:
            model.model_validate({key: "a,b"})
        except ValidationError:
            return "file only"
    return variable


def _is_table(annotation: Any) -> typing.TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def reference_sections() -> Iterator[tuple[str, type[BaseModel], str | None]]:
    """``(heading, model, env section or None)`` for each table of the file, in order."""
    for name, field in Settings.model_fields.items():
        if name in _NOT_SECTIONS:
            continue
        annotation = field.annotation
        if get_origin(annotation) is dict:  # [tenants.<name>]: tables by name
            yield f"{name}.<name>", get_args(annotation)[1], None
            continue
        if not _is_table(annotation):
            continue
        yield name, annotation, name
        for key, inner in annotation.model_fields.items():
            if get_origin(inner.annotation) is dict and _is_table(get_args(inner.annotation)[1]):
                yield f"{name}.{key}.<name>", get_args(inner.annotation)[1], None


def _section_text(heading: str, model: type[BaseModel], env: str | None) -> list[str]:
    doc = _markdown(inspect.getdoc(model) or "")
    named = re.match(r"`\[([^\]]+)\]`: (.)", doc)  # the table's own name wins
    if named:
        heading = named.group(1)
        doc = named.group(2).upper() + doc[named.end():]
    lines = [f"## `[{heading}]`", "", doc, "",
             "| key | type | default | environment variable | meaning |",
             "|---|---|---|---|---|"]
    for key, field in model.model_fields.items():
        lines.append(f"| `{key}` | {_type_name(field.annotation)}{_bounds(field)} | "
                     f"{_default(field)} | {_env_name(model, env, key)} | "
                     f"{meaning(model, key)} |")
    return [*lines, ""]


def reference_markdown() -> str:
    """docs/configuration.md: every setting of :mod:`runtime.config`, section by section."""
    head = [
        "# Configuration reference",
        "",
        f"<!-- Generated from runtime/config.py by `{REGENERATE}`; do not edit. -->",
        "",
        "Every key of `orgchart.toml`: its type (with its bounds), its default, the "
        "environment variable that overrides it and what it does. The file is "
        "`./orgchart.toml`, or the one named by `orgchart --config PATH` or "
        "`ORGCHART_CONFIG`; the copy at the root of the repository lists every key with "
        "its default. `ORGCHART_<SECTION>__<KEY>` overrides a key (list values "
        "comma-separated or JSON, dicts JSON); tables of tables (`[tenants.<name>]`, ...) "
        "are set in the file only. The database URL is also read from `ORGCHART_DATABASE_URL` or "
        "`DATABASE_URL` (they win over the file); unset, an embedded PostgreSQL under "
        "`ORGCHART_HOME` serves.",
        "",
        "An unknown section or key, or a bad value, is an error naming it and suggesting "
        "the closest valid key. A retired key is an error naming its replacement: "
        + ", ".join(f"`{old}` (use `{new}`)"
                    for old, new in config_module.RETIRED_KEYS.items()) + ". "
        "`orgchart config` prints the values in effect and where each came from.",
        "",
    ]
    body = [line for section in reference_sections() for line in _section_text(*section)]
    return "\n".join([*head, *body]).rstrip() + "\n"
