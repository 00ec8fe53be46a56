"""A stand-in for the trainer / orchestrator / inference entry points (chosen by the program name).

inference serves /health on the configured port; orchestrator and trainer append metrics records and the
trainer exits 0 after max_steps. FAKE_HANG=1 keeps trainer and orchestrator running (for teardown tests);
FAKE_START_FAIL=1 fails the trainer before any step is logged; FAKE_FILL_DISK=1 has it write until the disk is full;
FAKE_STALL_AT=N has the trainer start step N and never finish it (its heartbeat goes on); FAKE_EXIT_HANG=<name> has
that process report that it is exiting after its steps, then hang.
Every process writes its pid (and that of a `sleep` grandchild) to <output_dir>/pids/.
"""

import json
import os
import subprocess
import sys
import time
import tomllib
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

name = Path(sys.argv[0]).name
args = sys.argv[1:]
if "--dry-run" in args:  # rl --dry-run's check of the orchestrators' environments
    sys.exit(0)
config = tomllib.loads(Path(args[args.index("@") + 1]).read_text())
out = Path(config["output_dir"])


def _wait_gone(pid_file: Path, bound_s: float = 120.0) -> None:
    """Until the process named in ``pid_file`` (written at its end) has exited, at most ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            os.kill(int(pid_file.read_text()), 0)
        except (FileNotFoundError, ValueError):
            pass  # not written yet
        except ProcessLookupError:
            return
        time.sleep(0.05)
    sys.exit(f"fake orchestrator: the trainer did not exit within {bound_s:.0f} s")


(out / "pids").mkdir(parents=True, exist_ok=True)
grandchild = subprocess.Popen(["sleep", "1000"])
(out / "pids" / name).write_text(f"{os.getpid()} {grandchild.pid}")
if os.environ.get("FAKE_SETSID") == name:  # a descendant in its own session (a harness program started with setsid)
    daemon = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    (out / f"{name}.setsid.pid").write_text(str(daemon.pid))
if os.environ.get("FAKE_STUBBORN") == name:  # a descendant slow to stop: it ignores SIGTERM (only SIGKILL ends it)
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(1000)"
    stubborn = subprocess.Popen([sys.executable, "-c", code])
    (out / f"{name}.stubborn.pid").write_text(str(stubborn.pid))
print(f"{name} started with {' '.join(args)}", flush=True)
# Heartbeats as the real processes write them (the launcher's watchdog reads them); FAKE_NO_HEARTBEAT=<name> skips it.
if os.environ.get("FAKE_NO_HEARTBEAT") != name:
    from prime_core import progress

    progress.start_reporting(out, name, rank=0 if name == "trainer" else None)
print(f"{name} CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}", flush=True)


def log(step, values):
    line = json.dumps({"step": step, "process": name, "time": time.time(), "values": values})
    with open(out / "metrics.jsonl", "a") as f:
        f.write(line + "\n")


if name == "inference":

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/health":
                self.send_response(404)
                self.end_headers()
                return
            body = json.dumps({"status": "ok", "weight_step": 0, "run_id": os.environ.get("PRIME_RUN_ID")})
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *a):
            pass

    HTTPServer(("127.0.0.1", config["server"]["port"]), Handler).serve_forever()
elif name in ("orchestrator", "trainer"):
    hang = os.environ.get("FAKE_HANG") == "1"
    if name == "trainer" and os.environ.get("FAKE_TRAINER_FAIL") == "1":
        print("Traceback: something broke in the trainer", flush=True)
        sys.exit(3)
    while name == "orchestrator" and os.environ.get("FAKE_START_FAIL") == "1":
        time.sleep(0.1)  # no step: the trainer fails at start and rl stops us
    if os.environ.get("FAKE_START_FAIL") == "1":
        sys.exit(3)
    if name == "trainer" and os.environ.get("FAKE_FILL_DISK") == "1":
        with open(out / "checkpoints.bin", "wb") as f:  # a checkpoint that does not fit
            while True:
                f.write(b"\0" * 65536)
    for step in range(config["max_steps"]):
        if name == "trainer" and os.environ.get("FAKE_STALL_AT") == str(step):
            progress.begin(f"training step {step}", kind="step")  # alive, beating, never done
            while True:
                time.sleep(0.1)
        if name == "orchestrator":
            log(step, {"reward/mean": 0.1 * step})
        else:
            log(
                step,
                {"loss/mean": 1.0 / (step + 1), "mismatch_kl/mean": 0.001 * step, "throughput/tokens_per_s": 1234.0},
            )
        print(f"{name} step {step}", flush=True)
        time.sleep(0.05)
    print(f"{name} ready", flush=True)
    if os.environ.get("FAKE_FINAL_EVAL_S"):  # the orchestrator outlives the trainer (a final eval)
        if name == "trainer":
            (out / "fake_trainer.pid").write_text(str(os.getpid()))
        else:  # however late the trainer started on a loaded host: after its exit, then the eval's time
            _wait_gone(out / "fake_trainer.pid")
            time.sleep(float(os.environ["FAKE_FINAL_EVAL_S"]))
    if os.environ.get("FAKE_EXIT_HANG") == name:
        progress.stop_reporting()  # says it is exiting, then never does (a deadlock at exit)
        hang = True
    while hang:
        time.sleep(0.1)
    grandchild.kill()
    sys.exit(0)
