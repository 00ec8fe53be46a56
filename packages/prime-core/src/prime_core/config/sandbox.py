"""Configs of the code sandbox: per-execution limits, the local pool, a sandbox node, and the client choice."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from prime_core.config.base import BaseConfig
from prime_core.config.shared import LogConfig


class SandboxLimits(BaseConfig):
    """What one execution may use; breaching any of them ends it as a failed execution with the reason."""

    wall_s: float = Field(default=10.0, gt=0, le=3600)
    """Wall-clock seconds before the execution and every process it started are killed."""
    cpu_s: float = Field(default=10.0, gt=0, le=3600)
    """CPU seconds (rounded up to whole seconds) of all the execution's processes together where the pool counts
    them in a cgroup (each process's RLIMIT_CPU is then a backstop at twice that); elsewhere of each process
    (RLIMIT_CPU)."""
    memory_mb: int = Field(default=512, ge=32, le=1 << 20)
    """Memory in MiB: the address space of each process (RLIMIT_AS; the interpreter itself takes about 20 MiB of
    it) and, where the pool has a memory cgroup, all the execution's processes and its /work files together
    (``memory_mb + disk_mb``)."""
    processes: int = Field(default=16, ge=1, le=4096)
    """Processes and threads the execution may hold at once (RLIMIT_NPROC of its uid, and its pids cgroup where
    there is one): a fork bomb stops here."""
    output_bytes: int = Field(default=1 << 20, ge=1024, le=1 << 30)
    """Bytes of stdout + stderr kept; past this the execution is killed and reported as ``output_limit``."""
    disk_mb: int = Field(default=64, ge=1, le=1 << 16)
    """Size of the private tmpfs mounted on the working directory (/work, also /tmp), and the largest file."""
    open_files: int = Field(default=64, ge=8, le=1 << 16)
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    disk_read_mbps: int | None = Field(default=50, ge=1, le=1 << 20)
    """Megabytes (10^6 bytes) a second that the execution's processes together may read from the host's disks (the
    files bound into the sandbox, through the page cache or around it with ``O_DIRECT``; what the page cache already
    holds is no disk read), where the pool throttles them by cgroup on the disks under its binds (see
    docs/sandboxes.md). None: unlimited."""
    disk_read_iops: int | None = Field(default=1000, ge=1, le=1 << 24)
    """Disk reads a second that the execution's processes together may issue, alongside ``disk_read_mbps``: small
    reads stress a disk at few bytes. None: unlimited."""


class SandboxPoolConfig(BaseConfig):
    """The local pool: pre-warmed zygotes that fork one isolated execution per request."""

    zygotes: int = Field(default=0, ge=0, le=64)
    """Warm interpreters forking executions (0: one per 8 CPU cores, at least one); a dead one is replaced."""
    max_concurrency: int = Field(default=256, ge=1, le=7167)
    """Executions running at once; more wait in line. Each holds its own uid while it runs."""
    uid_base: int | None = Field(default=None, ge=1000, le=4_000_000_000)
    """First of ``1 + max_concurrency + 1024`` host uids: the zygotes' root inside their user namespace, then one
    per concurrent execution and one per workspace. They must own no host files. None: a range of its own per
    process (from its pid), so two pools on one host never share a uid."""
    python: str | None = None
    """Interpreter of the zygotes and of Python solutions (None: the one running the pool). Stdlib only."""
    preload: list[str] = Field(default_factory=list)
    """Extra modules imported once in each zygote, so solutions importing them pay nothing (stdlib + ro_paths)."""
    ro_paths: list[str] = Field(default_factory=list)
    """Extra host paths visible read-only inside (besides /usr, the interpreter prefix and a few /etc files); absolute
    and outside the paths the sandbox makes itself (``/tmp``, ``/work``, ``/etc``, ``/dev``). Each zygote walks them
    at start and covers the unix sockets it finds (a read-only bind does not stop ``connect``); sockets made there
    later stay reachable."""
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    """Default limits of an execution that names none."""
    start_timeout_s: float = Field(default=30.0, gt=0)
    """Seconds a zygote may take to become ready before start-up fails."""
    hang_timeout_s: float = Field(default=20.0, gt=0, le=600)
    """Seconds a zygote may fork nothing while requests wait before it is declared hung, killed and replaced (its
    unforked requests are retried once on the replacement; its running executions end as ``sandbox_error``)."""
    total_memory_mb: int | None = Field(default=None, ge=32)
    """Memory (processes and files) all of this pool's executions may hold together, by the pool's cgroup: past it
    the kernel kills the largest of their processes and the running executions end as ``memory_limit``, naming this
    field. None: half of the host's memory, the cap every pool of the host shares anyway (``max_concurrency ×
    memory_mb`` alone goes past any host's memory). Needs the cgroups (``cgroups``)."""
    total_disk_read_mbps: int | None = Field(default=200, ge=1, le=1 << 24)
    """Megabytes (10^6 bytes) a second that all of this pool's executions together may read from the host's disks,
    by the pool's cgroup, so that they leave the disk to the trainer's checkpoints and the host. cgroup v2 only: v1
    throttles each cgroup alone, and there only each execution's ``limits.disk_read_mbps`` holds. None: unlimited."""
    total_disk_read_iops: int | None = Field(default=4000, ge=1, le=1 << 24)
    """Disk reads a second that all of this pool's executions together may issue (cgroup v2 only, as
    ``total_disk_read_mbps``). None: unlimited."""
    seccomp: bool = True
    """Filter every execution's system calls (an allowlist, see docs/sandboxes.md; needs libseccomp2 on the host).
    Off only for measuring what the filter costs."""
    cgroups: bool = True
    """Bound each execution's memory (processes and files together), processes, CPU time and disk reads by cgroups
    where the host lets the pool make them (cgroup v2 delegation, or writable v1 hierarchies); the pool logs at start
    what it cannot enforce."""
    max_code_bytes: int = Field(default=1 << 20, ge=1024, le=1 << 30)
    """Largest ``code`` (with ``argv`` and ``env``) accepted; a larger request ends as ``error`` before it runs."""
    max_stdin_bytes: int = Field(default=16 << 20, ge=0, le=1 << 30)
    """Largest ``stdin`` accepted; a larger request ends as ``error`` before it runs."""
    max_tests: int = Field(default=1000, ge=1, le=1 << 20)
    """Most test cases in one request; more end the request as ``error`` before it runs."""
    max_test_bytes: int = Field(default=1 << 20, ge=1024, le=1 << 30)
    """Largest total size of the test expressions of one request; more ends it as ``error`` before it runs."""
    program_packages: list[str] = Field(
        default_factory=lambda: ["openai", "mcp", "httpx", "httpx2", "tenacity", "certifi"]
    )
    """Distributions of the pool's own Python environment (and everything they require) that harness programs run
    with, offline: verifiers' ``bash`` agent and ``null`` chat program need these. Bound read-only into each zygote,
    visible only inside program executions (the ``sandbox_pool`` runtime's ``run_program``); a program script
    declaring any other dependency is refused in one line. Empty: the pool hosts no programs (and each zygote start
    saves binding them, about 70 mounts and a walk of 3,000 entries for the default list). Only with ``python``
    unset (the pool's interpreter is this process's own)."""

    @field_validator("ro_paths")
    @classmethod
    def _outside_sandbox_paths(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if not path.startswith("/") or sandbox_owned(path):
                raise ValueError(f"{path!r} must be an absolute path outside {', '.join(SANDBOX_OWNED)}")
        return paths


SANDBOX_OWNED = ("/tmp", "/work", "/etc", "/dev", "/.ws")


def sandbox_owned(path: str) -> bool:
    """Whether ``path`` lies in a directory the sandbox's root filesystem makes itself (a host bind there would
    collide with it)."""
    return any(path == top or path.startswith(top + "/") for top in SANDBOX_OWNED)


class SandboxClientConfig(BaseConfig):
    """Where executions run: a pool in this process, or sandbox nodes over HTTP."""

    urls: list[str] = Field(default_factory=list)
    """Sandbox nodes (``http://host:port``); executions are spread over them round-robin. Empty: a local pool."""
    api_key_var: str | None = None
    """Environment variable holding the bearer token sent to the nodes (None: no auth)."""
    timeout_s: float = Field(default=120.0, gt=0)
    """Seconds one HTTP call to a node may take beyond the execution's own wall limit."""
    max_retries: int = Field(default=2, ge=0)
    """Retries on another node after a connection error (an execution is never retried after it ran)."""
    pool: SandboxPoolConfig = Field(default_factory=SandboxPoolConfig)
    """The local pool's settings (used when ``urls`` is empty)."""


class SandboxNodeConfig(BaseConfig):
    """A dedicated sandbox node: the local pool behind HTTP (``sandbox-node`` entry point)."""

    host: str = "127.0.0.1"
    """Address to listen on. Any other than a loopback address needs ``api_key_var``: the node runs code for
    anyone who can reach it."""
    port: int = Field(default=8200, ge=0, le=65535)
    """Port to listen on (0: any free port, printed at start)."""
    api_key_var: str | None = None
    """Environment variable holding the bearer token clients must send on every route (None: no auth, for a
    node on a loopback address only)."""
    max_body_mb: int = Field(default=32, ge=1, le=1024)
    """Largest request body in MiB; a larger one is refused with HTTP 413 before it is read."""
    idle_s: float = Field(default=30.0, gt=0, le=3600)
    """A connection that sends no request for this many seconds is closed (clients drop theirs after 5 s idle,
    httpx's default), so connections that send nothing cannot hold the node's descriptors (aiohttp's default: an
    hour)."""
    pool: SandboxPoolConfig = Field(default_factory=SandboxPoolConfig)
    """The pool behind the server."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Logging."""
    output_dir: Path | None = None
    """Where the log file goes (None: stderr only)."""

    @model_validator(mode="after")
    def _check(self) -> SandboxNodeConfig:
        if self.api_key_var is not None and not self.api_key_var.strip():
            raise ValueError("api_key_var: must name an environment variable")
        if self.api_key_var is None and not is_loopback(self.host):
            raise ValueError(f"host: {self.host} is reachable from other machines; set api_key_var to require a key")
        return self


def is_loopback(host: str) -> bool:
    """Whether ``host`` names a loopback address (only this machine can connect)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
