"""Run configuration files: every option of `fusionllm train` and `fusionllm coordinator` in a TOML file.

An option is a key in one of five sections, named as its flag without the dashes (``batch-size``;
``batch_size`` is read too)::

    [train]        model, task, steps, batch-size, lr, data, evaluation, metrics ...
    [cluster]      where it runs: cluster, device, workers, plan (scheduler, replicas, micro-batches), TLS
    [sync]         synchronous or hierarchical, and the groups' settings
    [compress]     the codec of the links
    [reliability]  checkpoints, failure detection, the numeric guard, re-planning

``read_config`` checks a file against the options of the command that reads it: a section or key
it does not know is an error that names it (and the section a misplaced key belongs in). Flags on
the command line override the file (the CLI gives the file's values to click as defaults).
``dump_config`` writes resolved options back as a file that starts the same run again: paths made
absolute, unset options as comments.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fusionllm.core.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

SECTIONS: dict[str, tuple[str, ...]] = {
    "train": ("model", "task", "steps", "batch_size", "seq_len", "lr", "warmup", "seed", "data", "tokenizer", "init_from", "image_size",
              "precision", "recompute", "threads", "eval_every", "eval_batches", "metrics", "log_to", "dashboard"),
    "cluster": ("cluster", "single_process", "device", "backends", "worker_python", "run_dir", "listen", "token_file", "workers",
                "relay_port", "join_timeout", "port_file", "schedule", "micro_batches", "replicas", "scheduler", "hardware", "probe_links",
                "probe_seconds", "collectives", "tls_cert", "tls_key", "tls_ca"),
    "sync": ("sync", "groups", "regroup", "inner_steps", "fragments", "outer_codec", "outer_lr", "outer_momentum", "outer_aggregate", "overlap_steps",
             "blocking_sync", "group_batch"),
    "compress": ("compress",),
    "reliability": ("checkpoint_dir", "checkpoint_every", "keep_checkpoints", "resume", "stop_timeout", "dead_after", "numeric_guard",
                    "guard_factor", "evict_after", "max_recoveries", "replan_factor"),
}
SECTION_OF = {name: section for section, names in SECTIONS.items() for name in names}
NOT_IN_FILES = frozenset({"config_file", "print_config"})  # the options that name or print the file itself


def read_config(path: Path, options: Iterable[str]) -> dict[str, Any]:
    """The options ``path`` sets, by parameter name (``batch_size``), checked against ``options``
    (the command's parameter names)."""
    known = set(options)
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
            home = SECTION_OF.get(section.replace("-", "_"))
            where = f"put it under [{home}]" if home else f"keys go under one of {', '.join(f'[{s}]' for s in SECTIONS)}"
            raise ConfigError(f"{path}: key {section!r} is outside every section: {where}")
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown section [{section}]; the sections are {', '.join(f'[{s}]' for s in SECTIONS)}")
        for key, value in table.items():
            name = key.replace("-", "_")
            home = SECTION_OF.get(name)
            if home is None or name not in known:
                raise ConfigError(f"{path}: [{section}] has no key {key!r}: {_suggest(name, known)}")
            if home != section:
                raise ConfigError(f"{path}: key {key!r} belongs in [{home}], not [{section}]")
            if isinstance(value, dict):
                raise ConfigError(f"{path}: [{section}] {key} is a table; it takes a value as its flag --{name.replace('_', '-')} does")
            if name in out:
                raise ConfigError(f"{path}: [{section}] sets {key!r} twice (as {name} and {name.replace('_', '-')})")
            out[name] = value
    return out


def _suggest(name: str, known: set[str]) -> str:
    close = [k for k in known if k in SECTION_OF and (name in k or k in name)]
    if close:
        return "did you mean " + " or ".join(sorted(f"{k.replace('_', '-')} (in [{SECTION_OF[k]}])" for k in close)) + "?"
    return "not an option of this command (fusionllm train --print-config lists them)"


def dump_config(values: Mapping[str, Any], header: str = "") -> str:
    """``values`` (parameter name -> resolved value) as a config file, by section; ``None`` as a comment."""
    lines = [f"# {line}" for line in header.splitlines()]
    for section, names in SECTIONS.items():
        present = [n for n in names if n in values and n not in NOT_IN_FILES]
        if not present:
            continue
        lines += ["", f"[{section}]"] if lines else [f"[{section}]"]
        for name in present:
            value = values[name]
            key = name.replace("_", "-")
            lines.append(f"# {key} = (not set)" if value is None or (isinstance(value, (list, tuple)) and not value) else f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else "nan" if math.isnan(value) else repr(value)
    if isinstance(value, Path):
        return json.dumps(str(value.resolve()))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's
