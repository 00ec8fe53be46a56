import subprocess
import sys


def test_import_prime_orchestrator_imports_no_torch():
    code = (
        "import sys, prime_orchestrator, prime_orchestrator.orchestrator, prime_orchestrator.eval_runner, "
        "prime_orchestrator.entrypoints.orchestrator, prime_core.transport_zmq\n"
        "bad = [m for m in ('torch', 'transformers', 'prime_trainer', 'prime_models', 'prime_inference') if m in sys.modules]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_help_is_fast_and_lists_options():
    out = subprocess.run(
        [sys.executable, "-m", "prime_orchestrator.entrypoints.orchestrator", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--async-level" in out and "--advantage.type" in out
    out = subprocess.run(
        [sys.executable, "-m", "prime_orchestrator.entrypoints.eval", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--environment-ids" in out and "--weights-dir" in out
