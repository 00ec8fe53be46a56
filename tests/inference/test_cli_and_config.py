"""The `inference` entry point and InferenceConfig validation, without starting an engine (except one subprocess)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prime_core.config import ConfigError, load_config
from prime_core.config.inference import InferenceConfig

from .helpers import free_port


def test_help_is_fast_and_lists_options():
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "prime_inference.entrypoints.inference", "--help"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    for flag in ("--model.name", "--engine", "--server.port", "--server.api-key", "--server.weight-roots",
                 "--max-model-len", "--max-batch-size", "--logprobs-mode", "--vllm.tensor-parallel-size",
                 "--vllm.extra-args"):  # fmt: skip
        assert flag in out.stdout
    print(f"inference --help: {elapsed:.2f}s")
    assert elapsed < 5


def test_help_imports_nothing_heavy():
    code = (
        "import sys\nfrom prime_inference.entrypoints.inference import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'vllm', 'transformers', 'fastapi'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_non_loopback_host_requires_weight_roots(tmp_path):
    with pytest.raises(ConfigError, match="weight_roots"):
        load_config(InferenceConfig, ["--server.host", "0.0.0.0"])
    config = load_config(InferenceConfig, ["--server.host", "0.0.0.0", "--server.weight-roots", str(tmp_path)])
    assert config.server.weight_roots == [tmp_path]
    assert load_config(InferenceConfig, ["--server.host", "::1"]).server.host == "::1"


def test_vllm_lora_needs_half_precision():
    with pytest.raises(ConfigError, match="float32.*LoRA"):
        load_config(InferenceConfig, ["--engine", "vllm", "--lora.enable", "--model.dtype", "float32"])
    assert load_config(InferenceConfig, ["--engine", "vllm", "--lora.enable", "--model.dtype", "bfloat16"]).lora_enabled
    # The torch engine serves adapters in any precision.
    assert load_config(InferenceConfig, ["--engine", "torch", "--lora.enable", "--model.dtype", "float32"]).lora_enabled


def test_toml_and_cli_sources(tmp_path):
    toml = tmp_path / "i.toml"
    toml.write_text(
        'engine = "torch"\nmax_model_len = 512\n[server]\nport = 9001\n[vllm]\nextra_args = ["--kv-cache-dtype", "fp8"]\n'
    )
    config = load_config(InferenceConfig, ["@", str(toml), "--server.port", "9002"])
    assert (config.engine, config.max_model_len, config.server.port) == ("torch", 512, 9002)
    assert config.vllm.extra_args == ["--kv-cache-dtype", "fp8"]


def test_auto_engine_is_torch_without_cuda():
    import torch
    from prime_inference.engines import select_engine

    expected = "vllm" if torch.cuda.is_available() and _has("vllm") else "torch"
    assert select_engine(InferenceConfig()) == expected
    assert select_engine(InferenceConfig(engine="torch")) == "torch"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_engine_without_vllm_is_one_line_before_anything_starts(tmp_path, capsys):
    """`inference --engine vllm` on a CPU-only install: one line naming the extra (was a ModuleNotFoundError
    traceback from the vLLM app)."""
    from prime_inference.entrypoints.inference import main

    model = Path(__file__).parents[2] / "examples/reverse_text/model"
    port = str(free_port())
    with pytest.raises(SystemExit) as exit_info:
        main(["--model.name", str(model), "--engine", "vllm", "--server.port", port, "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 1 and "vllm" in err and "--engine torch" in err, err


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_weight_dir_checks(tmp_path, other_weights_dir):
    from prime_core.schemas.weights import FilesystemManifest, WeightUpdateRequest
    from prime_inference.protocol import RequestError
    from prime_inference.weights import FilesystemReceiver, check

    def check_weight_dir(weight_dir: str, roots: list):
        path, manifest, receiver = check(WeightUpdateRequest(weight_dir=weight_dir), roots)
        assert isinstance(manifest, FilesystemManifest) and isinstance(receiver, FilesystemReceiver)
        return path

    assert check_weight_dir(str(other_weights_dir), []) == other_weights_dir.resolve()
    assert check_weight_dir(str(other_weights_dir), [other_weights_dir.parent]) == other_weights_dir.resolve()
    with pytest.raises(RequestError, match="outside"):
        check_weight_dir(str(other_weights_dir), [tmp_path])
    link = tmp_path / "link"
    link.symlink_to(other_weights_dir)
    with pytest.raises(RequestError, match="outside"):  # a symlink inside the root pointing out is refused
        check_weight_dir(str(link), [tmp_path])
    (tmp_path / "half").mkdir()
    with pytest.raises(RequestError, match="STABLE"):
        check_weight_dir(str(tmp_path / "half"), [tmp_path])


@pytest.mark.integration
def test_inference_command_serves_chat(model_dir, tmp_path):
    """Without ``--output-dir`` the server's files go to a directory of its own under ``outputs/`` (before: into
    ``outputs/`` itself, beside an ``rl`` run's or another server's)."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prime_inference.entrypoints.inference", "--model.name", str(model_dir),
         "--engine", "torch", "--server.port", str(port), "--max-model-len", "64", "--server.api-key", "k"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
    )  # fmt: skip
    label = "-".join(Path(model_dir).parts[-2:])
    run_dir = tmp_path / "outputs" / f"{label}-inference-{port}"
    url, headers = f"http://127.0.0.1:{port}", {"Authorization": "Bearer k"}
    try:
        wait_healthy(url, proc, headers)
        r = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})  # fmt: skip
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
        assert [p.name for p in (tmp_path / "outputs").iterdir()] == [run_dir.name]
        log = run_dir / "logs" / "inference.log"
        size = log.stat().st_size
        for _ in range(20):  # what a long run sends for ever: health probes, generate requests
            assert httpx.get(f"{url}/health", headers=headers, timeout=5).status_code == 200
        # No line per request: the log of a run of days stays the size of its startup and its events.
        assert log.stat().st_size == size, log.read_text()[size:]
        assert "/v1/chat/completions" not in log.read_text()
        assert (run_dir / "configs" / "inference.toml").is_file() and (
            run_dir / "progress" / "inference.json"
        ).is_file()
        # vLLM compiles grammars on the server's main thread: its stack may grow to 256 MB (`deepen_main_stack`)
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        soft = next(line.split()[3] for line in limits.splitlines() if line.startswith("Max stack size"))
        assert soft == "unlimited" or int(soft) >= 256 * 1024 * 1024, limits
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.integration
def test_sigterm_cuts_requests_that_would_hold_the_exit_forever(model_dir, tmp_path):
    """A request waiting on a paused engine never finishes: uvicorn's graceful shutdown waited for it without end."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prime_inference.entrypoints.inference", "--model.name", str(model_dir),
         "--engine", "torch", "--server.port", str(port), "--output-dir", str(tmp_path), "--max-model-len", "64",
         "--server.shutdown-timeout", "1"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url, answers = f"http://127.0.0.1:{port}", []
    try:
        wait_healthy(url, proc)
        assert httpx.post(f"{url}/pause", timeout=30).status_code == 200
        waiting = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{url}/v1/chat/completions", timeout=120, json={"messages": [{"role": "user", "content": "hi"}]})))  # fmt: skip
        waiting.start()
        time.sleep(1.0)  # the request reaches the paused engine
        assert waiting.is_alive()
        proc.terminate()
        proc.wait(timeout=60)  # before the fix: still waiting for the paused request after minutes
        waiting.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [a.status_code for a in answers] == [500]  # the client gets an answer, not a hang
    log = (tmp_path / "logs" / "inference.log").read_text()
    assert "a request was cut: still running 1s after the shutdown began (server.shutdown_timeout)" in log
    assert "Traceback" not in log


def wait_healthy(url: str, proc: subprocess.Popen, headers: dict[str, str] | None = None, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", headers=headers, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    raise AssertionError(f"no /health from {url} in {timeout:.0f} s")


def test_log_probs_are_raw_standalone_and_processed_under_rl():
    """vLLM's default (raw) for `inference`; `rl` gives its server the trainer's (processed) unless told otherwise."""
    from prime_core.config.rl import RLConfig
    from prime_launch.host import HostFacts
    from prime_launch.resolver import resolve

    assert InferenceConfig().logprobs_mode == "raw"
    assert load_config(InferenceConfig, argv=["--logprobs-mode", "processed"]).logprobs_mode == "processed"
    facts = HostFacts(cores=4, executables={n: f"/bin/{n}" for n in ("inference", "orchestrator", "trainer")})
    for argv, mode in (([], "processed"), (["--inference.logprobs-mode", "raw"], "raw")):
        rl = load_config(RLConfig, ["--output-dir", "/data/exp", "--inference.engine", "torch", *argv])
        assert resolve(rl, facts).configs["inference"].logprobs_mode == mode


def test_a_key_from_an_environment_variable_guards_every_route(model_dir, tmp_path, monkeypatch):
    """``server.api_key_var``: the key stays out of the config the server writes into its run directory (a multi-node
    SLURM job passes its per-launch key this way); a named variable that is unset stops the server in one line."""
    from .helpers import start_server

    monkeypatch.setenv("TEST_PRIME_KEY", "k-from-env")
    server = start_server(model_dir, server={"api_key_var": "TEST_PRIME_KEY"}, output_dir=str(tmp_path))
    try:
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 401
        auth = {"Authorization": "Bearer k-from-env"}
        assert httpx.get(f"{server.url}/health", headers=auth, timeout=5).status_code == 200
    finally:
        server.stop()
    monkeypatch.delenv("TEST_PRIME_KEY")
    out = subprocess.run(
        [sys.executable, "-m", "prime_inference.entrypoints.inference", "--model.name", str(model_dir),
         "--engine", "torch", "--server.api-key-var", "TEST_PRIME_KEY", "--output-dir", str(tmp_path / "b")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: server.api_key_var: the environment variable")
