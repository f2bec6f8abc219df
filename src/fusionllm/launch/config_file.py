"""Run configuration files: every option of `fusionllm train` and `fusionllm coordinator` in a TOML file.

An option is a key in one of five sections, named as its flag without the dashes (``batch-size``;
``batch_size`` is read too); the sections and their keys are those of the one declaration of the
options (``core/options.py``)::

    [train]        model, task, steps, batch-size, lr, data, evaluation, metrics ...
    [cluster]      where it runs: cluster, device, workers, plan (scheduler, replicas, micro-batches), TLS
    [sync]         synchronous or hierarchical, and the groups' settings
    [compress]     the codec of the links
    [reliability]  checkpoints, failure detection, the numeric guard, re-planning

``read_config`` checks a file against the options of the command that reads it: a section or key
it does not know is an error that names it (and the section a misplaced key belongs in). Flags on
the command line override the file (the CLI gives the file's values to click as defaults).
``dump_config`` writes resolved options back as a file that reads back to the same ``Options`` (unset
options as comments; paths made absolute for the file a run keeps, which starts it again from anywhere).
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

from fusionllm.core.errors import ConfigError
from fusionllm.core.options import TRAIN, Options, command_leaves, leaves

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

SECTIONS: dict[str, tuple[str, ...]] = {s.name: tuple(f.name for f in fields(getattr(Options(), s.name))) for s in fields(Options)}
SECTION_OF = {leaf.name: leaf.section for leaf in leaves().values()}
NOT_IN_FILES = frozenset({"config_file", "print_config"})  # the options that name or print the file itself


def read_config(path: Path, options: Iterable[str], *, root: type[Any] = Options) -> dict[str, Any]:
    """The options ``path`` sets, by parameter name (``batch_size``), checked against ``options``
    (the command's parameter names) and the sections of the declaration ``root``."""
    known = set(options)
    section_of = {leaf.name: leaf.section for leaf in leaves(root).values()}
    sections = dict.fromkeys(section_of.values())
    try:
        doc = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file (fusionllm train --print-config > run.toml writes one)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    out: dict[str, Any] = {}
    for section, table in doc.items():
        if not isinstance(table, dict):
            home = section_of.get(section.replace("-", "_"))
            where = f"put it under [{home}]" if home else f"keys go under one of {', '.join(f'[{s}]' for s in sections)}"
            raise ConfigError(f"{path}: key {section!r} is outside every section: {where}")
        if section not in sections:
            raise ConfigError(f"{path}: unknown section [{section}]; the sections are {', '.join(f'[{s}]' for s in sections)}")
        for key, value in table.items():
            name = key.replace("-", "_")
            home = section_of.get(name)
            if home is None or name not in known:
                raise ConfigError(f"{path}: [{section}] has no key {key!r}: {_suggest(name, known, section_of)}")
            if home != section:
                raise ConfigError(f"{path}: key {key!r} belongs in [{home}], not [{section}]")
            if isinstance(value, dict):
                raise ConfigError(f"{path}: [{section}] {key} is a table; it takes a value as its flag --{name.replace('_', '-')} does")
            if name in out:
                raise ConfigError(f"{path}: [{section}] sets {key!r} twice (as {name} and {name.replace('_', '-')})")
            out[name] = value
    return out


def _suggest(name: str, known: set[str], section_of: dict[str, str]) -> str:
    close = [k for k in known if k in section_of and (name in k or k in name)]
    close = close or [k for k in difflib.get_close_matches(name, list(known), n=2) if k in section_of]
    if close:
        return "did you mean " + " or ".join(sorted(f"{k.replace('_', '-')} (in [{section_of[k]}])" for k in close)) + "?"
    return "not an option of this command (fusionllm train --print-config lists them)"


def dump_config(options: Options, header: str = "", *, command: str = TRAIN, absolute: bool = False) -> str:
    """The options of ``command`` as a config file, by section; ``None`` as a comment. It reads back
    (``read_config``) to the same options; ``absolute``: paths made absolute, so that the file starts the
    same run from any directory."""
    lines = [f"# {line}" for line in header.splitlines()]
    ours = command_leaves(command, type(options))
    for section in fields(options):
        present = [f.name for f in fields(getattr(options, section.name)) if f.name in ours]
        if not present:
            continue
        lines += ["", f"[{section.name}]"] if lines else [f"[{section.name}]"]
        for name in present:
            value = getattr(getattr(options, section.name), name)
            key = name.replace("_", "-")
            if value is None or (isinstance(value, (list, tuple)) and not value):
                lines.append(f"# {key} = (not set)")
            else:
                lines.append(f"{key} = {_toml_value(value.resolve() if absolute and isinstance(value, Path) else value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else "nan" if math.isnan(value) else repr(value)
    if isinstance(value, Path):
        return json.dumps(str(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's
