"""Resolve a config from CLI flags, TOML files, environment variables and defaults.

Precedence, highest first: CLI ``--a.b value`` > TOML files given with ``@ file.toml`` (later files
win) > environment ``PRIME_A__B`` > defaults. ``--a @ file.toml`` loads a file into the ``a`` section.
Every user error is a ``ConfigError`` whose one-line message names the key and where it came from.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from prime_core.config.base import ConfigError  # noqa: F401  (defined beside BaseConfig: a leaf every module can import)
from prime_core.config.base import clipped_repr as clip
from prime_core.config.introspect import (
    _fields_of,
    _is_bool_type,
    _is_dict_type,
    _is_list_type,
    _models_in,
    _unwrap,
    all_keys,
    fill_union_tags,
    tags_with_key,
)

T = TypeVar("T", bound=BaseModel)

ENV_PREFIX = "PRIME_"
MAX_CONFIG_BYTES = 16 * 2**20  # a checkpoint or a dataset given by mistake is refused before it is read


@dataclass
class _Sources:
    """Nested values plus, for every leaf path, a description of where it came from."""

    values: dict[str, Any] = field(default_factory=dict)
    origin: dict[tuple[str, ...], str] = field(default_factory=dict)

    def set(self, path: tuple[str, ...], value: Any, origin: str) -> None:
        node = self.values
        for i, key in enumerate(path[:-1]):
            child = node.get(key)
            if not isinstance(child, dict):
                child = {}
                node[key] = child
                self.origin.pop(path[: i + 1], None)
            node = child
        node[path[-1]] = value
        self.origin.pop(path, None)  # the newest source comes last: errors on a whole section name it
        self.origin[path] = origin

    def merge_tree(self, prefix: tuple[str, ...], tree: Mapping[str, Any], origin: str) -> None:
        for key, value in tree.items():
            path = prefix + (key,)
            if isinstance(value, Mapping) and value:
                self.merge_tree(path, value, origin)
            else:
                self.set(path, dict(value) if isinstance(value, Mapping) else value, origin)

    def origin_below(self, path: Sequence[str | int]) -> str | None:
        """The origin of some value set inside ``path`` (for errors reported on a whole section)."""
        keys = tuple(str(p) for p in path)
        found = [o for p, o in self.origin.items() if p[: len(keys)] == keys]
        return found[-1] if found else None

    def origin_of(self, path: Sequence[str | int]) -> str | None:
        keys = tuple(str(p) for p in path)
        for n in range(len(keys), 0, -1):
            if keys[:n] in self.origin:
                return self.origin[keys[:n]]
        return None


def _suggest(bad: str, candidates: Sequence[str], cutoff: float = 0.6) -> str:
    close = difflib.get_close_matches(bad, list(candidates), n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _suggest_word(part: str, prefix: str, fields: Mapping[str, Any]) -> str:
    """A sibling that has the typed key as whole words (``nodes`` -> ``num_nodes``, ``gpus`` -> ``gpus_per_node``),
    the shortest first: nearer than a similar spelling (``nodelist``)."""
    words = part.split("_")
    hits = [k for k in fields if any(k.split("_")[i : i + len(words)] == words for i in range(k.count("_") + 1))]
    best = min(hits, key=len, default=None)
    return f" (did you mean {f'{prefix}.{best}' if prefix else best!r}?)" if best else ""


def _normalize_key(key: str) -> str:
    return key.strip().replace("-", "_")


def resolve_path(model: type[BaseModel], dotted: str, origin: str) -> tuple[tuple[str, ...], Any]:
    """Check a dotted key against the config class; return its normalized path and leaf annotation."""
    parts = tuple(_normalize_key(p) for p in dotted.split("."))
    if any(not p for p in parts):
        raise ConfigError(f"{origin}: malformed key {dotted!r}")
    models: list[type[BaseModel]] = [model]
    annotation: Any = model
    for i, part in enumerate(parts):
        if not models:
            if _is_dict_type(annotation):
                return parts, Any  # free-form dict: anything below is the user's
            parent = ".".join(parts[:i])
            raise ConfigError(f"{origin}: key {dotted!r} goes below {parent!r}, which is not a section")
        fields = _fields_of(models)
        if part not in fields:
            prefix = ".".join(parts[:i])
            candidates = [f"{prefix}.{k}" if prefix else k for k in fields]
            full, bad = ".".join(parts).replace("_", "-"), ".".join(parts)
            # A key of a section given at the top (rl's ``optim``), or of another command's config (sft's data.path
            # to the trainer), says so; only then the nearest spelling.
            inside = sorted((k for k in all_keys(model) if k.endswith(f".{bad}")), key=len)
            owner = None if inside else _owner_of(model, bad)
            suggestion = f" (did you mean {inside[0]!r}?)" if inside else f" (an option of {owner})" if owner else ""
            suggestion = (
                suggestion or _suggest_word(part, prefix, fields) or _suggest(bad, candidates + all_keys(model))
            )
            raise ConfigError(f"{origin}: unknown key {full!r}{suggestion.replace('_', '-')}")
        annotation = fields[part]
        models = _models_in(annotation)
    return parts, annotation


# ---------------------------------------------------------------- value parsing


def parse_scalar_text(text: str, annotation: Any) -> Any:
    """Turn CLI/env text into a Python value; pydantic does the final type check."""
    stripped = text.strip()
    if stripped and stripped[0] in "[{":
        try:
            return json.loads(stripped)
        except RecursionError:
            raise ValueError("a list or table nested too deeply") from None
        except json.JSONDecodeError:
            try:
                return tomllib.loads(f"v = {stripped}")["v"]
            except (tomllib.TOMLDecodeError, RecursionError) as e:
                raise ValueError(f"cannot parse {clip(text)} as a list or table: {e or 'nested too deeply'}") from None
    if _is_list_type(annotation) and not _models_in(annotation):
        return [p.strip() for p in text.split(",") if p.strip()] if text.strip() else []
    if _is_dict_type(annotation):
        raise ValueError(f"expected a JSON or TOML table like '{{\"k\": 1}}', got {clip(text)}")
    if not stripped and Path in _unwrap(annotation):
        raise ValueError("empty path (a path of '' would mean the current directory)")
    if stripped.lower() in ("none", "null") and type(None) in typing.get_args(annotation):
        return None
    return text


# ---------------------------------------------------------------- sources


def load_toml(path_text: str, origin: str) -> dict[str, Any]:
    if not path_text:
        raise ConfigError(f"{origin}: '@' must be followed by a TOML file path")
    path = Path(path_text).expanduser()
    if not path.is_file():
        # A FIFO or a device is never opened: reading one would wait for a writer or never end.
        why = "is a directory" if path.is_dir() else "is not a regular file" if path.exists() else "not found"
        why = "is a symlink that leads nowhere" if why == "not found" and path.is_symlink() else why
        raise ConfigError(f"{origin}: config file {path_text!r} {why}")
    if (size := path.stat().st_size) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{origin}: config file {path_text!r} is {size / 2**20:.0f} MiB; a config is at most "
                          f"{MAX_CONFIG_BYTES // 2**20} MiB (is it the right file?)")  # fmt: skip
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{origin}: cannot parse TOML file {path_text!r}: {e}") from None
    except RecursionError:
        raise ConfigError(
            f"{origin}: cannot parse TOML file {path_text!r}: arrays or tables nested too deeply"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{origin}: cannot read config file {path_text!r}: {e}") from None


def _normalize_tree(
    model: type[BaseModel], tree: Mapping[str, Any], prefix: tuple[str, ...], origin: str
) -> dict[str, Any]:
    """Normalize kebab-case keys of a TOML tree and check every key exists."""
    out: dict[str, Any] = {}
    for raw_key, value in tree.items():
        dotted = ".".join(prefix + (str(raw_key),))
        path, annotation = resolve_path(model, dotted, origin)
        key = path[-1]
        if key in out:
            raise ConfigError(f"{origin}: key {dotted!r} is given twice (kebab and snake case)")
        if isinstance(value, Mapping) and _models_in(annotation):
            out[key] = _normalize_tree(model, value, path, origin)
        else:
            _check_toml_leaf(value, annotation, f"{origin}: {dotted.replace('_', '-')}")
            out[key] = value
    return out


def _check_toml_leaf(value: Any, annotation: Any, where: str) -> None:
    """What pydantic's lax mode would take silently: ``max_steps = true`` as 1, ``output_dir = ""`` as ``.``."""
    alternatives = _unwrap(annotation)
    numeric = {int, float} & set(alternatives) and bool not in alternatives and Any not in alternatives
    if isinstance(value, bool) and numeric:
        raise ConfigError(f"{where}: expected a number, got the boolean {str(value).lower()}")
    if value == "" and Path in alternatives:
        raise ConfigError(f"{where}: empty path (a path of '' would mean the current directory)")


@dataclass
class ParsedArgs:
    """The result of splitting argv: sources and the flags the loader itself handles."""

    sources: _Sources
    help: bool = False
    dry_run: bool = False


def _split_flag(token: str) -> tuple[str, str | None]:
    body = token[2:]
    if "=" in body:
        key, value = body.split("=", 1)
        return key, value
    return body, None


def collect_sources(
    model: type[BaseModel],
    argv: Sequence[str],
    *,
    environ: Mapping[str, str] | None = None,
    env_prefix: str = ENV_PREFIX,
    extra_flags: Sequence[str] = (),
) -> ParsedArgs:
    """Merge defaults < env < TOML files < CLI into one nested dict with origins (not yet validated)."""
    merged = _Sources()
    parsed = ParsedArgs(sources=merged)
    _read_environment(model, merged, os.environ if environ is None else environ, env_prefix)
    toml_layers: list[tuple[tuple[str, ...], dict[str, Any], str]] = []
    cli: list[tuple[tuple[str, ...], Any, str]] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.startswith("@"):
            path_text, i = _file_argument(tokens, i)
            origin = f"file {path_text}" if path_text else "CLI"
            tree = load_toml(path_text, "CLI" if not path_text else origin)
            toml_layers.append(((), _normalize_tree(model, tree, (), origin), origin))
        elif token in ("-h", "--help"):
            parsed.help, i = True, i + 1
        elif token in ("--dry-run", "--dry_run"):
            parsed.dry_run, i = True, i + 1
        elif not token.startswith("--") or token == "--":
            raise ConfigError(f"CLI: unexpected argument {clip(token)} (options look like --key value or @ file.toml)")
        elif _split_flag(token)[0] in extra_flags:
            i += 1
        elif _split_flag(token)[1] is None and i + 1 < len(tokens) and tokens[i + 1].startswith("@"):
            # --section @ file.toml loads a file into that section.
            key = _split_flag(token)[0]
            path_text, i = _file_argument(tokens, i + 1)
            path, annotation = resolve_path(model, key, f"CLI --{key}")
            if not _models_in(annotation):
                raise ConfigError(f"CLI --{key}: '@ file' can only load a section, and {key!r} is a value")
            origin = f"file {path_text}" if path_text else f"CLI --{key}"
            toml_layers.append((path, _normalize_tree(model, load_toml(path_text, origin), path, origin), origin))
        else:
            path, value, origin, i = _flag(model, tokens, i)
            cli.append((path, value, origin))
    for prefix, tree, origin in toml_layers:
        merged.merge_tree(prefix, tree, origin)
    _apply_flags(merged, cli)
    return parsed


def _commands() -> dict[str, type[BaseModel]]:
    from prime_core.config.inference import InferenceConfig
    from prime_core.config.orchestrator import EvalConfig, OrchestratorConfig
    from prime_core.config.rl import RLConfig
    from prime_core.config.trainer import SFTConfig, TrainerConfig

    return {"rl": RLConfig, "trainer": TrainerConfig, "sft": SFTConfig, "orchestrator": OrchestratorConfig,
            "eval": EvalConfig, "inference": InferenceConfig}  # fmt: skip


def _owner_of(model: type[BaseModel], dotted: str) -> str | None:
    """The first prime command (other than ``model``'s) whose config has the key ``dotted``."""
    for name, root in _commands().items():
        if not issubclass(model, root) and dotted in all_keys(root):
            return name
    return None


def _any_command_keys() -> set[str]:
    """Top-level keys of every prime command's config: a PRIME_ variable may be meant for another process."""
    from prime_core.config.inference import InferenceConfig
    from prime_core.config.liveness import WatchConfig
    from prime_core.config.orchestrator import EvalConfig, OrchestratorConfig
    from prime_core.config.rl import RLConfig
    from prime_core.config.sandbox import SandboxNodeConfig
    from prime_core.config.trainer import SFTConfig, TrainerConfig

    roots = (RLConfig, TrainerConfig, SFTConfig, InferenceConfig, OrchestratorConfig, EvalConfig, SandboxNodeConfig,
             WatchConfig)  # fmt: skip
    return set(_fields_of(list(roots)))


def _read_environment(model: type[BaseModel], merged: _Sources, environ: Mapping[str, str], env_prefix: str) -> None:
    """``PRIME_A__B=value``. PRIME_ names of no option here are left alone (several processes share an
    environment, and the project reads a few PRIME_ variables of its own), unless the name is a near miss of an
    option here and an option of no other command: ``PRIME_MAX_STEP`` would otherwise be ignored silently."""
    known_top = set(_fields_of([model]))
    for name in sorted(environ):
        if not name.startswith(env_prefix):
            continue
        dotted = ".".join(p.lower() for p in name[len(env_prefix) :].split("__"))
        top = dotted.split(".")[0]
        if top not in known_top:
            close = difflib.get_close_matches(top, sorted(known_top), n=1, cutoff=0.8)
            if close and top not in _any_command_keys():
                raise ConfigError(f"env {name}: no option {top!r} (did you mean {env_prefix}{close[0].upper()}?)")
            continue
        origin = f"env {name}"
        path, annotation = resolve_path(model, dotted, origin)
        try:
            value = parse_scalar_text(environ[name], annotation)
        except ValueError as e:
            raise ConfigError(f"{origin}: {e}") from None
        merged.set(path, value, origin)


def _file_argument(tokens: list[str], i: int) -> tuple[str, int]:
    """The path of ``@file`` or ``@ file`` at ``tokens[i]``, and the index after it."""
    token = tokens[i]
    if token[1:]:
        return token[1:], i + 1
    return (tokens[i + 1] if i + 1 < len(tokens) else ""), i + 2


def _flag(model: type[BaseModel], tokens: list[str], i: int) -> tuple[tuple[str, ...], Any, str, int]:
    """The option at ``tokens[i]`` (``--key value``, ``--key=value``, ``--flag``, ``--no-flag``): its path, value,
    origin and the index after it."""
    key, inline = _split_flag(tokens[i])
    i += 1
    origin = f"CLI --{key}"
    path, annotation, negated = _flag_path(model, key)
    if negated:
        if not _is_bool_type(annotation):
            raise ConfigError(f"{origin}: --no- only applies to boolean options, and {'.'.join(path)!r} is not one")
        if inline is not None:
            raise ConfigError(f"{origin}: --{key} takes no value")
        return path, False, origin, i
    if inline is not None:
        value: Any = inline
    elif _is_bool_type(annotation):
        value = True
        if i < len(tokens) and tokens[i].lower() in ("true", "false", "1", "0", "yes", "no"):
            value, i = tokens[i], i + 1
        elif i < len(tokens) and not tokens[i].startswith(("--", "@")):
            raise ConfigError(
                f"{origin}: expected true or false (or --{key} / --no-{key} alone), got {clip(tokens[i])}"
            )
    else:
        values = []
        while i < len(tokens) and not tokens[i].startswith("--") and not tokens[i].startswith("@"):
            values.append(tokens[i])
            i += 1
        if not values:
            raise ConfigError(f"{origin}: missing value")
        if len(values) > 1 and not _is_list_type(annotation):
            raise ConfigError(f"{origin}: expected one value, got {len(values)}: {' '.join(values)}")
        value = values if len(values) > 1 else values[0]
    return path, _parse_flag_value(value, annotation, origin), origin, i


def _flag_path(model: type[BaseModel], key: str) -> tuple[tuple[str, ...], Any, bool]:
    """The field an option names, its annotation, and whether it is negated (``--no-a.flag``, ``--a.no-flag``)."""
    try:
        return (*resolve_path(model, key, f"CLI --{key}"), False)
    except ConfigError:
        head, _, leaf = key.rpartition(".")
        if leaf.startswith(("no-", "no_")):
            positive = f"{head}.{leaf[3:]}" if head else leaf[3:]
        elif key.startswith(("no-", "no_")):
            positive = key[3:]
        else:
            raise
        return (*resolve_path(model, positive, f"CLI --{key}"), True)


def _parse_flag_value(value: Any, annotation: Any, origin: str) -> Any:
    if isinstance(value, str):
        try:
            return parse_scalar_text(value, annotation)
        except ValueError as e:
            raise ConfigError(f"{origin}: {e}") from None
    if not isinstance(value, list):
        return value
    flat: list[Any] = []
    for v in value:
        flat.extend(parse_scalar_text(v, annotation) if "," in v else [v])
    return flat


def _apply_flags(merged: _Sources, cli: list[tuple[tuple[str, ...], Any, str]]) -> None:
    """CLI options win over files and environment; the same option given twice must agree."""
    seen: dict[tuple[str, ...], tuple[Any, str]] = {}
    for path, value, origin in cli:
        if path in seen and seen[path][0] != value:
            raise ConfigError(
                f"{origin}: conflicts with {seen[path][1]} ({'.'.join(path)} given {clip(seen[path][0])} and {clip(value)})"
            )
        seen[path] = (value, origin)
        merged.set(path, value, origin)


# ---------------------------------------------------------------- validation


def _clean_loc(model: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    """Drop the union tags pydantic puts in error locations (e.g. ``loss.grpo.clip``), keep field names."""
    out: list[str] = []
    models: list[type[BaseModel]] = [model]
    for part in loc:
        text = str(part)
        fields = _fields_of(models) if models else {}
        if models and text not in fields:
            continue
        out.append(text)
        models = _models_in(fields[text]) if text in fields else []
    return out


def locate(sources: _Sources, model: type[BaseModel], loc: Sequence[str]) -> tuple[str, list[str]]:
    """Where the value at ``loc`` came from and the key the user set for it (``defaults`` when unset)."""
    loc = list(loc)
    origin = sources.origin_of(loc) or sources.origin_below(loc)
    if origin is None and len(loc) > 1 and loc[1] in model.model_fields:
        # A launcher-level shared field (rl's --max-steps) is copied into each process section before
        # validation; name the key the user set, not the section's copy of it.
        shared = sources.origin_of(loc[1:]) or sources.origin_below(loc[1:])
        if shared is not None:
            return shared, loc[1:]
    return origin or "defaults", loc


def _format_validation_error(err: ValidationError, sources: _Sources, model: type[BaseModel]) -> str:
    first = err.errors()[0]
    origin, loc = locate(sources, model, _clean_loc(model, first["loc"]))
    key = ".".join(loc).replace("_", "-")
    # A validator's ValueError: its own message, without pydantic's "Value error, " prefix.
    error = (first.get("ctx") or {}).get("error")
    msg = str(error) if first["type"] == "value_error" and error is not None else first["msg"]
    if first["type"] == "extra_forbidden":
        tags = tags_with_key(model, loc) if loc else []
        hint = f" (an option of {'.'.join(loc[:-1]).replace('_', '-')}.type {' or '.join(tags)})" if tags else ""
        return f"{origin}: unknown key {key!r}{hint}"
    if not loc or (first["type"] == "value_error" and isinstance(first.get("input"), dict)):
        # A check across fields names them: blame the one the user set last (origins are in set order). A section's
        # check may name a key set at the top (rl's shared --ckpt.resume-step, copied into trainer).
        def named(p: tuple[str, ...]) -> bool:
            return any(".".join(p[:i]) in msg for i in range(min(2, len(p)), 1 + len(p)))

        found = [
            o for p, o in sources.origin.items() if named(p) or (p[: len(loc)] == tuple(loc) and named(p[len(loc) :]))
        ]
        origin = found[-1] if found else origin
        if not loc:
            return f"{origin}: {msg}"
    inp = first.get("input")
    shown = "" if isinstance(inp, dict) or inp is None else f", got {clip(inp)}"
    return f"{origin}: {key}: {msg}{shown}"


def validate(model: type[T], sources: _Sources) -> T:
    fill_union_tags(model, sources.values)
    try:
        return model.model_validate(sources.values)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, sources, model)) from None


def load_config(
    model: type[T],
    argv: Sequence[str] = (),
    *,
    environ: Mapping[str, str] | None = None,
    env_prefix: str = ENV_PREFIX,
) -> T:
    """Resolve ``model`` from argv, TOML files and env. Raises ``ConfigError`` (one line) on bad input."""
    parsed = collect_sources(model, argv, environ=environ, env_prefix=env_prefix)
    return validate(model, parsed.sources)
