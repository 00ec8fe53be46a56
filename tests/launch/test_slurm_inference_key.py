"""A multi-node SLURM job's inference servers listen on every interface of their nodes, so they require a key that no
config file in the run directory holds. Before, any host reaching a node's port could /pause the engine or
/reload_weights, and a key the user set failed the job's own health checks (its curl sent none)."""

from __future__ import annotations

import http.server
import os
import stat
import subprocess
import threading
from pathlib import Path

from tests.launch.launch_fakes import HERE
from tests.launch.test_slurm import render

NODES = ["--slurm.num-inference-nodes", "1", "--slurm.num-trainer-nodes", "1", "--slurm.gpus-per-node", "2"]


def _render(tmp_path: Path, *args: str) -> str:
    result = render(tmp_path, "rl", "@", str(HERE / "rl_example.toml"), *NODES, *args)
    assert result.returncode == 0, result.stderr
    assert subprocess.run(["bash", "-n", str(tmp_path / "run" / "slurm" / "rl.sbatch")]).returncode == 0
    return result.stdout


def _configs(tmp_path: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in (tmp_path / "run" / "configs").glob("*.toml")}


def _key_block(script: str) -> str:
    """The script's lines that make the key and define the health probe."""
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# The inference servers listen"))
    end = next(i for i, line in enumerate(lines) if line.startswith("healthy() {"))
    return "\n".join(lines[start : end + 1])


class _Guarded(http.server.BaseHTTPRequestHandler):
    key = ""
    seen: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        auth = self.headers.get("Authorization", "")
        self.seen.append(auth)
        self.send_response(200 if auth == f"Bearer {self.key}" else 401)
        self.end_headers()

    def log_message(self, *args):
        pass


def _probe(block: str, key_file: Path | None, key: str) -> tuple[int, list[str]]:
    """Run the script's key lines and its health probe against a server that answers 200 only to ``key``."""
    _Guarded.key, _Guarded.seen = key, []
    server = http.server.HTTPServer(("127.0.0.1", 0), _Guarded)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/health"
        done = subprocess.run(["bash", "-c", f'{block}\nhealthy "{url}"'], capture_output=True, text=True, timeout=30)
    finally:
        server.shutdown()
    return done.returncode, _Guarded.seen


def test_multi_node_job_makes_a_fresh_key_its_servers_require(tmp_path):
    script = _render(tmp_path)
    key_file = tmp_path / "run" / "inference.key"
    configs = _configs(tmp_path)
    assert 'api_key_var = "PRIME_INFERENCE_API_KEY"' in configs["inference.toml"]
    assert 'api_key_var = "PRIME_INFERENCE_API_KEY"' in configs["orchestrator.toml"]
    assert "api_key =" not in configs["inference.toml"] + configs["orchestrator.toml"]
    # A fresh key at every launch, before any server starts; the watchdog's probes carry it too.
    assert script.index(f"> {key_file}.tmp") < script.index("inference @")
    assert "prime-launch watch" in script and "--api-key-var PRIME_INFERENCE_API_KEY" in script
    code, seen = _probe(_key_block(script), key_file, key="")  # the server knows no key yet: 401
    assert code != 0
    key = key_file.read_text()
    assert len(key) == 64 and stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    code, seen = _probe(_key_block(script).replace("(umask", "true || (umask"), key_file, key=key)
    assert code == 0 and seen == [f"Bearer {key}"]
    assert key not in script and not any(key in text for text in _configs(tmp_path).values())


def test_a_key_the_user_set_is_carried_by_the_jobs_health_probe(tmp_path):
    script = _render(tmp_path, "--inference.server.api-key", "sekret-of-the-user")
    key_file = tmp_path / "run" / "inference.key"
    assert key_file.read_text() == "sekret-of-the-user" and stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    assert "umask" not in _key_block(script)  # the user's key is kept, not replaced
    assert not any("sekret-of-the-user" in text for text in _configs(tmp_path).values())
    assert "sekret-of-the-user" not in script
    code, seen = _probe(_key_block(script), key_file, key="sekret-of-the-user")
    assert code == 0 and seen == ["Bearer sekret-of-the-user"]


def test_a_key_variable_the_user_named_is_used_as_is(tmp_path):
    script = _render(tmp_path, "--inference.server.api-key-var", "MY_CLUSTER_KEY")
    assert not (tmp_path / "run" / "inference.key").exists()
    assert "export MY_CLUSTER_KEY" in script and "--api-key-var MY_CLUSTER_KEY" in script
    configs = _configs(tmp_path)
    assert 'api_key_var = "MY_CLUSTER_KEY"' in configs["inference.toml"] + configs["orchestrator.toml"]
    code, seen = _probe(f"MY_CLUSTER_KEY=k1\n{_key_block(script)}", None, key="k1")
    assert code == 0 and seen == ["Bearer k1"]


def test_a_key_variable_that_is_no_name_is_refused(tmp_path):
    result = render(
        tmp_path, "rl", "@", str(HERE / "rl_example.toml"), *NODES, "--inference.server.api-key-var", "K;touch /tmp/x"
    )
    assert result.returncode == 2 and "api-key-var" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "slurm" / "rl.sbatch").exists()
