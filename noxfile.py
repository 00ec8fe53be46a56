"""CI sessions. `nox -s ci` is what .ci/run runs; `nox -l` lists the matrix.

Matrix: package x install flavour. Each `isolated` session builds the package's wheel (and the wheels of
the workspace siblings it declares), installs them into a fresh virtual environment with versions pinned
by uv.lock, checks that no other workspace package came along, imports the package and runs its entry
points' --help (plus a smoke command where one exists). Extras that cannot run on a CPU (vllm) are checked
at import level only; flash-attn, deep_ep and transformer-engine need CUDA to build and are GPU-only.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = False

ROOT = Path(__file__).parent
BUILD = ROOT / ".nox" / "_build"
WORKSPACE = ["prime-core", "prime-models", "prime-trainer", "prime-inference", "prime-orchestrator", "prime-launch"]


def _bench_smoke(script: str, out: str) -> list[str]:
    """Two bench steps of `script` on a config-only model directory shipped in the repo: random init, no hub access."""
    model = ["--model.name", "examples/reverse_text/base", "--init.random", "--seq-len", "256"]
    return [script, "--bench", "--max-steps", "2", *model, "--output-dir", f"{{tmp}}/{out}"]


# (package, flavour) -> what to install, which workspace siblings may come along, what to run.
FLAVOURS: dict[str, dict] = {
    "prime-core": dict(requirement="prime-core", siblings=[], scripts=[], smoke=[]),
    "prime-core[wandb,zmq]": dict(requirement="prime-core[wandb,zmq]", siblings=[], scripts=[], smoke=[]),
    "prime-models": dict(requirement="prime-models", siblings=["prime-core"], scripts=[], smoke=[]),
    "prime-trainer": dict(
        requirement="prime-trainer",
        siblings=["prime-core", "prime-models"],
        scripts=["trainer", "sft"],
        smoke=[_bench_smoke("sft", "sft-bench"), _bench_smoke("trainer", "rl-bench")],
    ),
    "prime-inference": dict(requirement="prime-inference", siblings=["prime-core"], scripts=["inference"], smoke=[]),
    "prime-inference[torch]": dict(
        requirement="prime-inference[torch]", siblings=["prime-core", "prime-models"], scripts=["inference"], smoke=[]
    ),
    "prime-inference[vllm]": dict(
        requirement="prime-inference[vllm]",
        siblings=["prime-core"],
        scripts=["inference"],
        smoke=[["python", "-c", "import vllm, prime_inference.engines.vllm_engine"]],
    ),
    "prime-orchestrator": dict(
        requirement="prime-orchestrator",
        siblings=["prime-core"],
        scripts=["orchestrator", "eval", "sandbox-node"],
        smoke=[],
    ),
    "prime-launch": dict(requirement="prime-launch", siblings=["prime-core"], scripts=["rl", "prime-launch"], smoke=[]),
}
CPU_FLAVOURS = [f for f in FLAVOURS if f != "prime-inference[vllm]"]


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    session.run("uv", "run", "--locked", "ruff", "check", ".")
    session.run("uv", "run", "--locked", "ruff", "format", "--check", ".")


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """CPU tests (unit + integration) in the workspace environment, in parallel."""
    # loadgroup: the tests whose training processes hold gloo collectives (several trainer ranks) share one worker
    # (xdist_group "multiprocess"), so they never oversubscribe the CPU together (those collectives slow down many
    # times over when they do); tests/scheduling.py says in which order the work starts.
    args = session.posargs or ["-n", "auto", "--dist", "loadgroup", "--durations", "40", "-m", "not gpu and not slow"]
    # Bytecode compiled once at install: CI's image sets PYTHONDONTWRITEBYTECODE, so otherwise every process a test
    # starts (four or five for each `rl` run) compiled the sources of torch, transformers and verifiers again, which
    # doubled its start-up. Not in pyproject: there it would recheck 17k files on every `uv run` of every user.
    session.run("uv", "run", "--locked", "--compile-bytecode", "pytest", *args)


@nox.session(python=False)
def docs(session: nox.Session) -> None:
    """Every shell command of README.md and docs/*.md, run for real with small step counts (slow: minutes per
    doc). The default test run covers the fast part: every documented entry point command resolves."""
    session.run("uv", "run", "--locked", "pytest", "-n", "0", "-m", "slow", "tests/docs", *session.posargs)


def _build_wheels() -> Path:
    wheels = BUILD / "wheels"
    if not wheels.exists():
        tmp = BUILD / "wheels.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for package in WORKSPACE:
            nox.command.run(["uv", "build", "--package", package, "--wheel", "--out-dir", str(tmp)], external=True)
        tmp.rename(wheels)
    return wheels


def _constraints() -> Path:
    path = BUILD / "constraints.txt"
    if not path.exists():
        BUILD.mkdir(parents=True, exist_ok=True)
        nox.command.run(
            [
                "uv",
                "export",
                "--locked",
                "--all-packages",
                "--all-extras",
                "--no-hashes",
                "--no-emit-workspace",
                "--no-header",
                "--format",
                "requirements-txt",
                "-o",
                str(path),
            ],
            external=True,
            silent=True,
        )
    return path


def _wheel(wheels: Path, package: str) -> Path:
    (found,) = wheels.glob(f"{package.replace('-', '_')}-*.whl")
    return found


@nox.session
@nox.parametrize("flavour", list(FLAVOURS))
def isolated(session: nox.Session, flavour: str) -> None:
    """Install one package from its built wheel alone, import it, run its entry points."""
    spec = FLAVOURS[flavour]
    wheels = _build_wheels()
    constraints = _constraints()
    # Workspace wheels by file path: some of our names also exist on PyPI, which must never be picked.
    package = spec["requirement"].split("[")[0]
    extras = spec["requirement"][len(package) :]
    local = [f"{package}{extras} @ {_wheel(wheels, package).as_uri()}"]
    local += [f"{s} @ {_wheel(wheels, s).as_uri()}" for s in spec["siblings"]]
    session.install(*local, "--constraint", str(constraints))
    installed = session.run("uv", "pip", "freeze", "--python", session.virtualenv.location, silent=True)
    names = {line.split("==")[0].split(" @ ")[0].strip().lower() for line in installed.splitlines()}
    extra = sorted(names & set(WORKSPACE) - {package, *spec["siblings"]})
    if extra:
        session.error(f"{flavour} pulled in workspace packages it must not need: {extra}")
    module = package.replace("-", "_")
    session.run("python", "-c", f"import {module}; print({module}.__name__, {module}.__version__)")
    tmp = session.create_tmp()
    for script in spec["scripts"]:
        session.run(script, "--help", silent=True)
    for command in spec["smoke"]:
        session.run(*[c.format(tmp=tmp) for c in command], env={"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"})


@nox.session(python=False)
def ci(session: nox.Session) -> None:
    """Everything CI runs on a CPU machine: lint, tests, every isolated install."""
    shutil.rmtree(BUILD, ignore_errors=True)
    session.notify("lint")
    session.notify("tests")
    for flavour in FLAVOURS:
        session.notify(f"isolated(flavour='{flavour}')")


def _env() -> None:
    os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")


_env()
