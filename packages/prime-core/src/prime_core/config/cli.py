"""The command-line front end shared by every entry point: help, errors, dry run."""

from __future__ import annotations

import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from prime_core.config.loader import ConfigError, _models_in, _unwrap, collect_sources, locate, validate

T = TypeVar("T", bound=BaseModel)


def _type_name(annotation: Any) -> str:
    names = [_type_text(a) for a in _unwrap(annotation)]
    return " | ".join(names) if names else "any"


def _type_text(a: Any) -> str:
    """``list[str]`` for ``list[Annotated[str, AfterValidator(...)]]``: the constraints are the validators' business,
    and their repr (a function's address, pydantic's FieldInfo) is no type a user can write."""
    origin, args = typing.get_origin(a), typing.get_args(a)
    if origin is typing.Annotated:
        return _type_text(args[0])
    if origin is typing.Literal:
        return "|".join(str(x) for x in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_text(x) for x in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_text(x) for x in args)}]"
    if a is Ellipsis or a is type(None):
        return "..." if a is Ellipsis else "None"
    return getattr(a, "__name__", str(a).replace("typing.", ""))


def _default_text(info: Any) -> str:
    if info.default is not PydanticUndefined:
        return repr(info.default)
    if info.default_factory is not None:
        try:
            value = info.default_factory()
        except TypeError:
            return "(computed)"
        return "(section)" if isinstance(value, BaseModel) else repr(value)
    return "(required)"


def format_help(model: type[BaseModel], prog: str, description: str | None = None) -> str:
    lines = [f"usage: {prog} [@ config.toml ...] [--key.subkey VALUE ...] [--dry-run] [--help]", ""]
    if description:
        lines += [description.strip(), ""]
    lines += [
        "Sources, highest first: CLI --key.subkey VALUE > TOML files (@ file.toml; later files win) >",
        "environment PRIME_KEY__SUBKEY > defaults. Booleans: --flag / --no-flag. Lists: a,b or JSON.",
        "",
    ]

    def walk(cls: type[BaseModel], prefix: str, title: str) -> None:
        leaves, sections = [], []
        for name, info in cls.model_fields.items():
            subs = _models_in(info.annotation)
            if subs and all(not typing.get_origin(a) for a in _unwrap(info.annotation)):
                sections.append((name, info, subs))
            else:
                leaves.append((name, info))
        if leaves:
            lines.append(f"{title}:")
            for name, info in leaves:
                flag = f"--{prefix}{name}".replace("_", "-")
                lines.append(f"  {flag} {_type_name(info.annotation)}  (default: {_default_text(info)})")
                if info.description:
                    for doc_line in info.description.strip().splitlines():
                        lines.append(f"      {doc_line.strip()}")
            lines.append("")
        for name, info, subs in sections:
            sub_title = f"{prefix}{name}".replace("_", "-")
            doc = f" - {info.description.strip().splitlines()[0]}" if info.description else ""
            if len(subs) > 1:
                lines.append(f"[{sub_title}]{doc} (one of: {', '.join(s.__name__ for s in subs)})")
                lines.append("")
            for sub in subs:
                walk(sub, f"{prefix}{name}.", f"[{sub_title}]" + (f" ({sub.__name__})" if len(subs) > 1 else doc))

    walk(model, "", "options")
    return "\n".join(lines).rstrip() + "\n"


def config_to_toml(config: BaseModel) -> str:
    """Serialize a resolved config to TOML that ``@`` loads back to an equal object (None omitted)."""
    import tomli_w

    def strip_none(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip_none(v) for k, v in value.items() if v is not None}
        if isinstance(value, list):
            return [strip_none(v) for v in value]
        return value

    data = strip_none(config.model_dump(mode="json", exclude_none=True))
    return tomli_w.dumps(data)


def write_config(config: BaseModel, path: str | Path) -> Path:
    from prime_core.io import atomic_write_text

    atomic_write_text(path, config_to_toml(config))
    return Path(path)


def fail(message: str) -> typing.NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_world(config: BaseModel, sources: Any, *, network: bool, writes_output_dir: bool = False) -> None:
    """Model names and environment ids must point at something loadable (see `prime_core.preflight`), and with
    ``writes_output_dir`` the output directory must take files; the first that does not is a ``ConfigError`` naming
    the key and where its value came from. A dry run skips the network."""
    from prime_core.preflight import check_writable, find_problems

    problems = find_problems(config, network=network)
    output_dir = getattr(config, "output_dir", None)
    if output_dir is None and hasattr(config, "trainer"):  # rl: the trainer's directory is the run's
        output_dir = config.trainer.output_dir
    if writes_output_dir and not problems and output_dir is not None and (reason := check_writable(output_dir)):
        problems.append((("output_dir",), reason))
    if problems:
        path, reason = problems[0]
        origin, loc = locate(sources, type(config), path)
        raise ConfigError(f"{origin}: {'.'.join(loc).replace('_', '-')}: {reason}")


def parse_cli(
    model: type[T],
    argv: Sequence[str] | None = None,
    *,
    prog: str,
    description: str | None = None,
    on_dry_run: Callable[[T], None] | None = None,
    network: bool = True,
    writes_output_dir: bool = False,
) -> T:
    """Resolve a config for an entry point. Prints help, one-line errors (exit 2), or handles --dry-run.

    Bad model names and environment ids are errors here too, before the entry point loads anything; with
    ``network=False`` (and in a dry run) a hub id is not checked for being downloadable from here. An entry point
    that writes into ``output_dir`` passes ``writes_output_dir``: a directory that takes no files (read-only, full,
    not permitted) is a one-line error before anything heavy loads (not in ``--bench`` runs).

    Dry run: resolve, validate, write the resolved config to ``<output_dir>/configs/<prog>.toml`` (print it when
    the config has no ``output_dir``; or call ``on_dry_run``) and exit 0.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parsed = collect_sources(model, argv)
        if parsed.help:
            sys.stdout.write(format_help(model, prog, description))
            raise SystemExit(0)
        config = validate(model, parsed.sources)
        writes = writes_output_dir and not getattr(config, "bench", False)
        check_world(config, parsed.sources, network=network and not parsed.dry_run, writes_output_dir=writes)
    except ConfigError as e:
        fail(str(e))
    if parsed.dry_run:
        if on_dry_run is not None:
            on_dry_run(config)
        else:
            try:
                show_resolved(config, prog)
            except OSError as e:  # a directory that cannot be created or written: what --dry-run is there to find
                fail(f"output-dir: cannot write the resolved config under {getattr(config, 'output_dir', '')}: {e}")
        raise SystemExit(0)
    return config


def show_resolved(config: BaseModel, prog: str) -> None:
    """A dry run's output: the resolved config written to ``<output_dir>/configs/<prog>.toml`` (beside it as
    ``<prog>.dry-run.toml`` in the directory of a run that trained or sampled), or printed when the config has no
    ``output_dir``."""
    output_dir = getattr(config, "output_dir", None)
    if output_dir is None:  # nowhere to write it: show it
        sys.stdout.write(config_to_toml(config))
    else:
        from prime_core.run_dir import RunDir, has_run_outputs

        name = prog.replace(" ", "-")
        path = Path(output_dir) / "configs" / f"{name}.toml"
        if path.exists() and has_run_outputs(RunDir(output_dir)):  # that run's record of its config stays as it was
            path = path.with_name(f"{name}.dry-run.toml")
        print(f"resolved config written to {write_config(config, path)}")
