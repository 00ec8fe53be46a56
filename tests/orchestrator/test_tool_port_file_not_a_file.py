"""A shared tool server's port file (``MCP_PORT_FILE``, read from the server's environment) that is a FIFO: the
orchestrator's watch opened it and waited for a writer for good. It now reads as no port yet."""

import os
import subprocess
import sys
import textwrap

import pytest


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_port_file_that_is_not_a_file_reads_as_no_port(tmp_path, kind):
    path = tmp_path / "port"
    os.mkfifo(path) if kind == "fifo" else path.symlink_to("/dev/zero")
    code = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # the old read of /dev/zero ends here
        from prime_orchestrator.tool_watch import _port
        try:
            print(_port({{"MCP_PORT_FILE": {str(path)!r}}}))
        except MemoryError:
            print("MemoryError")
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the port read was still waiting after 60 s (killed)")
    assert proc.stdout.strip() == "None", proc.stderr[-2000:]
