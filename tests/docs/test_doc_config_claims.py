"""What the prose of README.md and docs/*.md says about config options matches the config classes.

- Every key of a ``toml`` block of the docs is an option (of ``rl``, or of another entry point's config): a user
  who pastes the block gets no ``unknown key`` error.
- A default stated next to an option, ``\\`key\\` (default 3)``, ``\\`key\\` (600 s)``, ``\\`key\\` (off by default)`` or
  ``\\`key = value\\` (default)``, is that option's default (for a key that several sections share, one of theirs): a
  user who leaves it unset gets what the page says. A value that holds only in a context the sentence gives (bench
  mode, a test's setting, an unset option's fallback) is listed in ``CONTEXTUAL``.
- Every option of every entry point's config is named somewhere in the docs.
- Every metric name in the docs is one a process logs.
"""

from __future__ import annotations

import re
import tomllib
import typing
from typing import Any

import pytest
from prime_core.config.inference import InferenceConfig
from prime_core.config.introspect import _unwrap
from prime_core.config.liveness import WatchConfig
from prime_core.config.orchestrator import EvalConfig, OrchestratorConfig
from prime_core.config.rl import RLConfig
from prime_core.config.sandbox import SandboxClientConfig, SandboxNodeConfig
from prime_core.config.slurm import SlurmConfig
from prime_core.config.trainer import SFTConfig, TrainerConfig
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from tests.docs.doc_commands import REPO, doc_files

ROOTS: dict[str, type[BaseModel]] = {
    "rl": RLConfig,
    "trainer": TrainerConfig,
    "sft": SFTConfig,
    "orchestrator": OrchestratorConfig,
    "eval": EvalConfig,
    "inference": InferenceConfig,
    "sandbox-node": SandboxNodeConfig,
    "sandbox client": SandboxClientConfig,
    "slurm": SlurmConfig,
    "prime-launch watch": WatchConfig,
}
TOML_BLOCK = re.compile(r"^```toml\n(.*?)^```", re.M | re.S)


def _models(annotation: Any) -> list[type[BaseModel]]:
    """Config classes an annotation holds, directly or as list items / dict values."""
    found: list[type[BaseModel]] = []
    for alt in _unwrap(annotation):
        if isinstance(alt, type) and issubclass(alt, BaseModel):
            found.append(alt)
        else:
            for arg in typing.get_args(alt):
                found.extend(_models(arg))
    return found


def _is_map_of_models(annotation: Any) -> bool:
    return any(typing.get_origin(a) is dict and _models(typing.get_args(a)[-1]) for a in _unwrap(annotation))


def _field(models: list[type[BaseModel]], name: str):
    for model in models:
        for fname, info in model.model_fields.items():
            if name in (fname, info.alias):
                return info
    return None


def unknown_keys(table: dict, models: list[type[BaseModel]], prefix: str = "") -> list[str]:
    """Dotted keys of a TOML table that no field of ``models`` (a union's alternatives) takes."""
    bad = []
    for key, value in table.items():
        info = _field(models, key.replace("-", "_"))
        if info is None:
            bad.append(prefix + key)
            continue
        subs = _models(info.annotation)
        if not subs:
            continue  # a free table (args, kwargs) or a plain value
        if _is_map_of_models(info.annotation) and isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, dict):
                    bad += unknown_keys(sub, subs, f"{prefix}{key}.{name}.")
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict):
                bad += unknown_keys(item, subs, f"{prefix}{key}.")
    return bad


def toml_blocks() -> list[tuple[str, str]]:
    found = []
    for path in doc_files():
        text = path.read_text()
        for m in TOML_BLOCK.finditer(text):
            found.append((f"{path.relative_to(REPO)}:{text[: m.start()].count(chr(10)) + 1}", m.group(1)))
    return found


@pytest.mark.parametrize(("where", "block"), toml_blocks(), ids=[w for w, _ in toml_blocks()])
def test_toml_blocks_name_real_options(where: str, block: str):
    table = tomllib.loads(block)
    misses = {name: unknown_keys(table, [root]) for name, root in ROOTS.items()}
    best = min(misses, key=lambda name: len(misses[name]))
    assert not misses[best], f"{where}: no such option in any config (closest: {best}): {misses[best]}"


# --- stated defaults -------------------------------------------------------------------------------------------------


def _defaults(model: type[BaseModel], prefix: str, out: dict[str, list[Any]], seen: tuple = ()) -> None:
    for name, info in model.model_fields.items():
        dotted = prefix + name
        # A factory's default is a section or a collection, never a stated scalar.
        out.setdefault(dotted, []).extend([] if info.default is PydanticUndefined else [info.default])
        for sub in _models(info.annotation):
            if sub not in seen:
                _defaults(sub, dotted + ".", out, (*seen, sub))


def all_defaults() -> dict[str, list[Any]]:
    """Every dotted key of every entry point's config (and each suffix of it) -> the defaults it has."""
    by_key: dict[str, list[Any]] = {}
    for root in ROOTS.values():
        _defaults(root, "", by_key)
    by_suffix: dict[str, list[Any]] = {}
    for key, values in by_key.items():
        parts = key.split(".")
        for i in range(len(parts)):
            by_suffix.setdefault(".".join(parts[i:]), []).extend(values)
    return by_suffix


NUMBER = r"-?\d[\d,_]*(?:\.\d+)?(?:e-?\d+)?"
# `key` (default 3 ...), `key` (600 s), `key`, default 1e-3 ; `key` (off by default)
CLAIM = re.compile(
    r"`(?:--)?(?P<key>[a-z][a-z0-9_.\-]*)`(?: of `?\w+`?)?"
    rf"(?:\s*\((?:default\s+)?(?P<num>{NUMBER})(?P<unit>\s*s\b|\s*GiB\b|[),;: ])"
    rf"|,\s*default\s+(?P<num2>{NUMBER})\b"
    r"|\s*\((?P<off>off|on) by default\))"
)
ASSIGNED = re.compile(r"`(?P<key>[a-z][a-z0-9_.]*) = (?P<value>[^`]+)` \(default\)")
# (doc, key, stated value): true of the context the doc gives, not of the option's default.
CONTEXTUAL = {
    ("docs/trainer.md", "max_steps", 5): "--bench's own default (_TrainerBase._bench_defaults)",
    ("docs/liveness.md", "rollout_timeout", 60): "the fault test's setting, in a table of tests",
    ("docs/inference.md", "max_num_seqs", 1024): "the engine's value when max_num_seqs is unset",
    ("docs/orchestrator.md", "client.max_concurrent", 64): "ClientConfig's fill-in for concurrency = fixed",
}
GIB = 1024**3


def _as_number(text: str) -> float:
    return float(text.replace(",", "").replace("_", ""))


def _matches(stated: Any, defaults: list[Any]) -> bool:
    for value in defaults:
        if isinstance(stated, bool) or isinstance(value, bool):
            if isinstance(stated, bool) and (value is stated or (value is None and stated is False)):
                return True
        elif isinstance(stated, str) or isinstance(value, str):
            if stated == value:
                return True
        elif isinstance(value, (int, float)) and abs(value - stated) <= 1e-9 * max(1.0, abs(stated)):
            return True
    return False


def stated_defaults() -> list[tuple[str, str, Any]]:
    """(where, key, stated default) of each claim in the docs about a key that is an option."""
    defaults = all_defaults()
    found = []
    for path in doc_files():
        if path.name == "benchmarks.md":
            continue  # measurements of runs, which set their own options
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for m in CLAIM.finditer(line):
                key = m.group("key").replace("-", "_")
                if key not in defaults:
                    continue
                if m.group("off"):
                    stated: Any = m.group("off") == "on"
                else:
                    stated = _as_number(m.group("num") or m.group("num2"))
                    if (m.group("unit") or "").strip() == "GiB":
                        stated *= GIB
                found.append((f"{path.relative_to(REPO)}:{number}", key, stated))
            for m in ASSIGNED.finditer(line):
                if m.group("key") in defaults:
                    value = tomllib.loads(f"v = {m.group('value')}")["v"]
                    found.append((f"{path.relative_to(REPO)}:{number}", m.group("key"), value))
    return found


def test_stated_defaults_are_the_defaults():
    claims = stated_defaults()
    assert len(claims) > 30, "the claim pattern no longer finds the docs' stated defaults"
    defaults = all_defaults()
    wrong = [
        f"{where}: `{key}` stated {stated!r}, default {sorted(map(repr, defaults[key]))}"
        for where, key, stated in claims
        if not _matches(stated, defaults[key]) and (where.split(":")[0], key, stated) not in CONTEXTUAL
    ]
    assert not wrong, "\n".join(wrong)


# --- every option is documented ---------------------------------------------------------------------------------------


def test_every_option_is_named_in_the_docs():
    """Each config option appears by name (snake or kebab case, ``--no-`` of a flag too) somewhere in README.md or
    docs/: ``--help`` lists every option, but a user reading the page about a section must learn the option exists."""
    text = "\n".join(path.read_text() for path in doc_files())
    words = set(re.findall(r"[a-z][a-z0-9_]*", text.replace("--no-", " ").replace("-", "_")))
    missing, seen = [], set()

    def walk(model: type[BaseModel], prefix: str, root: str, stack: tuple = ()) -> None:
        for name, info in model.model_fields.items():
            if (model, name) not in seen:
                seen.add((model, name))
                if name not in words:
                    missing.append(f"{root}: {prefix}{name} ({model.__name__})")
            for sub in _models(info.annotation):
                if sub not in stack:
                    walk(sub, f"{prefix}{name}.", root, (*stack, sub))

    for root, model in ROOTS.items():
        walk(model, "", root)
    assert not missing, "options no page names:\n" + "\n".join(missing)


# --- metric names ---------------------------------------------------------------------------------------------------

METRIC = re.compile(r"`([a-z][a-z0-9_]*(?:/(?:[a-z0-9_@]+|<[a-z]+>))+)`")
# First path parts of what the docs name that are files and directories (of the repository or a run), not metrics.
NOT_METRICS = {"benchmarks", "bench", "checkpoints", "configs", "docs", "environments", "examples", "logs", "packages"}
NOT_METRICS |= {"progress", "rng", "rollouts", "samples", "scripts", "src", "tests", "weights"}


def _logged(metric: str, source: str) -> bool:
    """Whether the source writes ``metric`` as a string (``<env>`` a placeholder) or builds it by an f-string
    (``time/publish_files`` from ``f"time/publish_{key}"``)."""
    body = "".join(
        r"\{[^}\"']+\}" if part.startswith("<") else re.escape(part) for part in re.split(r"(<[a-z]+>)", metric)
    )
    if re.search(rf"[\"']{body}[\"']", source):
        return True
    heads = [metric[:i] for i in range(1, len(metric)) if metric[i - 1] in "_/" and "<" not in metric[:i]]
    return any(re.search(rf"[\"']{re.escape(head)}\{{", source) for head in heads)


def test_documented_metrics_are_logged():
    """A metric name in the docs (``failed/rollouts``, ``distill/<env>/reverse_kl``) is one a process logs."""
    source = "\n".join(path.read_text() for path in REPO.glob("packages/*/src/**/*.py"))
    namespaces = set(re.findall(r"[\"']([a-z][a-z0-9_]*)/[a-z{]", source)) - NOT_METRICS
    options = set(all_defaults())
    named, missing = 0, []
    for path in doc_files():
        if path.name == "benchmarks.md":
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for metric in METRIC.findall(line):
                parts = metric.split("/")
                if parts[0] not in namespaces or all(part in options for part in parts):  # `clip_low/clip_high`
                    continue
                named += 1
                if not _logged(metric, source):
                    missing.append(f"{path.relative_to(REPO)}:{number}: {metric}")
    assert named > 50, "the metric pattern no longer finds the docs' metric names"
    assert not missing, "metrics no process logs:\n" + "\n".join(missing)
