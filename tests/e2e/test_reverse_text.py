"""The reverse-text example end to end on CPU: the real `rl` with inference (torch engine), orchestrator and trainer.

The README run itself (the model gets better under eval at temperature 1.0 and greedily), then shortened runs of
examples/reverse_text/rl.toml without its evals: resume equality, teardown when any one process is killed, an
external server, weights by broadcast.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prime_core.schemas import read_microbatches

from tests.tiny import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "reverse_text" / "rl.toml"
RL = Path(sys.executable).with_name("rl")

# Not in the `multiprocess` xdist group: an `rl` run's processes take one thread each (the launcher splits the cores)
# and hold no collectives between trainer ranks, so two runs on the two workers share the cores without the gloo
# slowdown that group avoids; tests/scheduling.py starts the README run first.
pytestmark = pytest.mark.integration


def rl_cmd(out: Path, *extra: str, config: Path = EXAMPLE) -> list[str]:
    return [
        str(RL),
        "@",
        str(config),
        "--output-dir",
        str(out),
        "--inference.server.port",
        str(free_port()),
        "--console",
        "quiet",
        *extra,
    ]


def without_evals(tmp_path: Path) -> Path:
    """The example config minus its evaluation section (the before/after evals cost more than a short run)."""
    text = EXAMPLE.read_text()
    start, end = text.index("[orchestrator.eval]"), text.index("[inference]")
    config = tmp_path / "rl_no_eval.toml"
    config.write_text(text[:start] + text[end:])
    return config


def run_rl(out: Path, *extra: str, config: Path = EXAMPLE, timeout: float = 840) -> subprocess.CompletedProcess:
    """Run `rl` to completion. The timeout is generous because the CPU trainer slows down several times over when
    the other xdist worker is busy (a 10-step run took 100 s alone and about 650 s so); pytest's own is 900 s."""
    result = subprocess.run(
        rl_cmd(out, *extra, config=config), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def metrics(out: Path, process: str, key: str) -> dict[int, float]:
    found = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["process"] == process and record["values"].get(key) is not None:
            found[record["step"]] = record["values"][key]
    return found


@pytest.mark.timeout(1800)
def test_readme_run_improves_the_model_as_users_measure_it(tmp_path):
    """`rl @ examples/reverse_text/rl.toml` as the README runs it: the held-out eval (64 prompts) at temperature 1.0
    gains at least 0.10 between the base weights and the final ones, greedy decoding does not get worse, the summary
    prints both, and trainer and inference agree on every log-prob."""
    out = tmp_path / "run"
    result = run_rl(out, timeout=1500)
    rewards = [r for _, r in sorted(metrics(out, "orchestrator", "reward/mean").items())]
    kls = metrics(out, "trainer", "mismatch_kl/mean")
    t1 = metrics(out, "orchestrator", "eval/reverse-text/t1/reward/mean")
    greedy = metrics(out, "orchestrator", "eval/reverse-text/t0/reward/mean")
    print(f"eval t=1 {t1}, greedy {greedy}; training reward first {rewards[:3]} last {rewards[-3:]}")
    assert sorted(t1) == sorted(greedy) == [0, 60], (t1, greedy)
    assert t1[60] >= t1[0] + 0.10, t1
    assert greedy[60] >= greedy[0], greedy
    assert len(rewards) == 60 and len(kls) == 60
    assert max(kls.values()) < 1e-3
    assert "eval reverse-text/t1" in result.stdout and "reward, first 3 steps" in result.stdout
    for name in ("inference", "orchestrator", "trainer"):
        assert (out / "logs" / f"{name}.log").stat().st_size > 0
    final = out / "weights" / "step_60"
    assert (final / "STABLE").exists()
    # The final weights are an HF directory that transformers opens and generates with.
    code = (
        "import sys; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "d = sys.argv[1]; tok = AutoTokenizer.from_pretrained(d); m = AutoModelForCausalLM.from_pretrained(d)\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'cat dog'}], add_generation_prompt=True,"
        " return_tensors='pt', return_dict=True)['input_ids']\n"
        "print(tok.decode(m.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]))\n"
    )
    generated = subprocess.run([sys.executable, "-c", code, str(final)], capture_output=True, text=True, timeout=120)
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert "<reversed>" in generated.stdout


def _process_tree(root: int) -> dict[int, list[str]]:
    """pid -> argv of every live descendant of ``root``."""
    parents, argv = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        parents[int(entry.name)] = ppid
        argv[int(entry.name)] = [c.decode(errors="replace") for c in cmd if c]
    tree, frontier = {}, {root}
    while frontier:
        children = {pid for pid, ppid in parents.items() if ppid in frontier and pid not in tree}
        tree.update({pid: argv[pid] for pid in children})
        frontier = children
    return tree


def _find(tree: dict[int, list[str]], name: str) -> int:
    # Console scripts run as `python .venv/bin/<name> @ config`.
    matches = [pid for pid, cmd in tree.items() if any(Path(c).name == name for c in cmd[:2]) and "@" in cmd]
    assert matches, f"no {name} process under rl: {tree}"
    return min(matches)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


# The trainer in CI; the other two in the slow suite, where tests/faults/test_rl_faults.py also kills and stops each
# process at a random point and resumes (CI time is near its 40-minute budget; each of these runs ~75 s on 2 cores).
@pytest.mark.parametrize(
    "victim",
    [
        "trainer",
        pytest.param("orchestrator", marks=pytest.mark.slow),
        pytest.param("inference", marks=pytest.mark.slow),
    ],
)
def test_kill_any_process_stops_the_run_and_resume_continues(tmp_path, victim):
    """kill -9 of one process after the step-2 checkpoint stops the whole run within 10 s, naming it, and leaves no
    process; resumed from its newest checkpoint R, the run's steps R and R+1 sample the same tokens and train to the
    same losses as an uninterrupted run of R+2 steps. (One test: the resume check had three `rl` runs of its own, and
    an `rl` run's start-up costs more than its few steps on 2 cores.)

    The losses agree to float32 rounding, not bit for bit: inference log-probs enter the loss, and the torch
    engine's continuous batching groups requests differently in every run, which moves the last bits of a
    logit. The schedule is constant so that the killed run (30 steps asked) follows the same learning rates.
    """
    out = tmp_path / "run"
    config = without_evals(tmp_path)
    assert 'type = "constant"' in config.read_text()
    common = ("--orchestrator.batch-size", "32", "--ckpt.interval", "1")
    proc = subprocess.Popen(
        rl_cmd(out, "--max-steps", "30", *common, config=config), cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoints" / "step_2" / "STABLE").exists():
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.2)
        tree = _process_tree(proc.pid)
        os.kill(_find(tree, victim), signal.SIGKILL)
        killed_at = time.monotonic()
        output, _ = proc.communicate(timeout=30)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"rl stopped {elapsed:.2f}s after kill -9 of {victim}")
    assert proc.returncode != 0
    assert elapsed < 10
    assert victim in output and "SIGKILL" in output
    leftover = [p for p in tree if _alive(p)]
    assert leftover == [], {p: tree[p] for p in leftover}
    # Resume from the newest checkpoint and finish two more steps.
    steps = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*") if (p / "STABLE").exists())
    resume = steps[-1]
    run_rl(out, "--max-steps", str(resume + 2), *common, "--ckpt.resume-step", str(resume), config=config)
    assert (out / "weights" / f"step_{resume + 2}" / "STABLE").exists()
    straight = tmp_path / "straight"
    run_rl(straight, "--max-steps", str(resume + 2), *common, config=config)
    assert_same_steps(straight, out, (resume, resume + 1))


def assert_same_steps(straight: Path, resumed: Path, steps: tuple[int, ...]) -> None:
    """``steps`` of the resumed run trained on the same tokens as the straight run's, to the same losses."""
    for step in steps:
        _, want_batches = read_microbatches(straight / "rollouts" / f"step_{step}" / "rank_0.safetensors")
        _, got_batches = read_microbatches(resumed / "rollouts" / f"step_{step}" / "rank_0.safetensors")
        for want_mb, got_mb in zip(want_batches, got_batches, strict=True):
            assert (want_mb.input_ids == got_mb.input_ids).all() and (want_mb.loss_mask == got_mb.loss_mask).all()
    want = metrics(straight, "trainer", "loss/mean")
    got = metrics(resumed, "trainer", "loss/mean")  # the last record of a step: the resumed run's
    print(f"losses straight {want}, resumed {got}")
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-7), (want, got)


def test_rl_against_a_separately_started_inference_server(tmp_path):
    """Seed 001's split: `inference @ i.toml` on its own, then `rl --trainer @ t.toml --orchestrator @ o.toml`."""
    out = tmp_path / "run"
    configs = tmp_path / "configs"
    port = free_port()
    dry_cmd = [
        str(RL),
        "@",
        str(without_evals(tmp_path)),
        "--output-dir",
        str(configs),
        "--inference.server.port",
        str(port),
    ]
    dry = subprocess.run([*dry_cmd, "--dry-run"], cwd=ROOT, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    server = subprocess.Popen(
        [str(RL.with_name("inference")), "@", str(configs / "configs" / "inference.toml"), "--log.file", "false"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        result = subprocess.run(
            [
                str(RL),
                "--trainer",
                "@",
                str(configs / "configs" / "trainer.toml"),
                "--orchestrator",
                "@",
                str(configs / "configs" / "orchestrator.toml"),
                "--orchestrator.client.base-urls",
                f"http://127.0.0.1:{port}",
                # The resolved section files set these explicitly, so they are overridden per section.
                "--trainer.output-dir",
                str(out),
                "--orchestrator.output-dir",
                str(out),
                "--trainer.max-steps",
                "2",
                "--orchestrator.max-steps",
                "2",
                "--orchestrator.batch-size",
                "32",
                "--console",
                "quiet",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert server.poll() is None, "rl must leave a server it did not start running"
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert (out / "weights" / "step_2" / "STABLE").exists()
    assert not (out / "logs" / "inference.log").exists()
    assert len(metrics(out, "orchestrator", "reward/mean")) == 2


@pytest.mark.parametrize("async_level", [0, 1])
def test_weights_by_broadcast_instead_of_files(tmp_path, async_level):
    """`weights.broadcast.type = "nccl"` (gloo between CPU processes): no step but the last writes safetensors.
    async 0: inference serves exactly the trainer's weights (mismatch KL at rounding level). async 1: the
    orchestrator ships its last rollouts before the trainer broadcasts the last weights, and still relays them (a
    broadcast blocks the trainer until inference takes it), so the run ends instead of hanging."""
    out = tmp_path / "run"
    run_rl(
        out, "--max-steps", "3", "--orchestrator.batch-size", "32", "--async-level", str(async_level),
        "--trainer.weights.broadcast.type", "nccl", "--trainer.weights.broadcast.port", str(free_port()),
        "--trainer.weights.broadcast.timeout-s", "300", config=without_evals(tmp_path),
    )  # fmt: skip
    kls = metrics(out, "trainer", "mismatch_kl/mean")
    sends = metrics(out, "trainer", "time/publish_send")
    print(f"async {async_level}: mismatch KL {kls}; broadcast seconds {sends}")
    assert len(kls) == 3
    if async_level == 0:
        assert max(kls.values()) < 1e-3
    assert sorted(sends) == [0, 1]  # the final weights (step 3) only go to disk
    final = out / "weights" / "step_3"
    assert not (final / "broadcast.json").exists() and any(final.glob("*.safetensors"))
    log = (out / "logs" / "orchestrator.log").read_text()
    assert "inference now serves weights step 2" in log, log[-2000:]
