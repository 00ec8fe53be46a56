"""The pool keeps every slot's and workspace's cgroup files open: a process whose soft RLIMIT_NOFILE is the common
1024 ran out of descriptors once enough slots had been used, well into a run. The pool lifts the soft limit to what
it needs at start, or names the hard limit that stops it. Each case runs in a subprocess (limits are per process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.sandbox.conftest import SESSION_UIDS

pytestmark = pytest.mark.xdist_group("sandbox")


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_the_soft_limit_is_lifted_to_the_need_within_the_hard_one():
    out = run("""
        import resource
        from prime_orchestrator.sandbox.cgroups import lift_open_files
        N = resource.RLIMIT_NOFILE
        resource.setrlimit(N, (256, 8000))
        print(lift_open_files(5000), resource.getrlimit(N)[0])
        resource.setrlimit(N, (256, 600))
        print(lift_open_files(5000), resource.getrlimit(N)[0])
    """)
    assert out.splitlines() == [
        "None 5000",
        "open files are limited to 600 (RLIMIT_NOFILE's hard limit) 600",
    ]


def test_a_pool_started_under_a_soft_limit_of_1024_holds_descriptors_for_every_slot_and_workspace():
    out = run(f"""
        import resource
        from prime_core.config.sandbox import SandboxPoolConfig
        from prime_orchestrator.sandbox.cgroups import FDS_PER_KEY
        from prime_orchestrator.sandbox.leases import NUM_WORKSPACES
        from prime_orchestrator.sandbox.pool import SandboxPool
        N = resource.RLIMIT_NOFILE
        resource.setrlimit(N, (1024, resource.getrlimit(N)[1]))
        pool = SandboxPool(SandboxPoolConfig(max_concurrency=300, uid_base={SESSION_UIDS + 320_000}))
        if pool._cgroups is None:
            print("no cgroups")
        else:
            print(resource.getrlimit(N)[0] >= FDS_PER_KEY * (300 + NUM_WORKSPACES))
    """)
    if out == "no cgroups":
        pytest.skip("the pool makes no cgroups on this host (no descriptors kept open)")
    assert out == "True"
