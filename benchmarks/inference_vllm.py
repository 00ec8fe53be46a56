"""vLLM rollout benchmark (GPU): prime's server against vLLM's own `LLM.generate`, real vocabulary, one run.

    python benchmarks/inference_vllm.py [--prompts 512] [--tokens 512] [--vocab 151936] [--profile 8] [--out DIR]

Models: two random-init Qwen3-0.6B-shaped models with a word-level tokenizer of ``--vocab`` tokens built locally
(151,936 = Qwen3's: log-probs and detokenization cost what they cost in a real run; 0: the tests' 354 tokens).

Our server (`inference --engine vllm`, one subprocess): health, a chat call, /update_weights to the second model must
change greedy output; then, all requests in flight and ``ignore_eos``, output tok/s of /inference/v1/generate for
* ``logprobs`` / ``no_logprobs``: N prompts x T tokens with / without ``logprobs: 0`` (no seeds);
* ``groups_no_logprobs``: the same seeded requests without log-probs (what seeds cost, apart from log-probs);
* ``groups``: the orchestrator's pattern, N/G prompts x G rollouts, each request with its own seed and
  ``logprobs: 1`` (what renderers' client, the orchestrator's, always sends; vLLM's offline peer runs ``logprobs=0``);
* ``turn2``: a multi-turn continuation of ``groups`` (prompt = turn-1 prompt + its completion + E env tokens);
* ``groups_httpx``: ``groups`` sent through httpx, the orchestrator's client (aiohttp otherwise);
* ``--profile S``: py-spy over the server and its engine core for S seconds of a repeat of ``--profile-phase``.
``--vllm-server``: the same bodies to `vllm serve`'s own /inference/v1/generate (the HTTP peer, same engine flags).
``--vllm-logprobs``: our server again with vLLM's own log-prob path instead of ``vllm.fast_token_logprobs``.
Then vLLM offline (`LLM`, same engine settings and weights), the same sets: no log-probs, ``logprobs=0`` (vLLM's
defaults; seeded too), ``logprobs=0, detokenize=False, flat_logprobs=True``; groups and turn 2 with and without
log-probs. Parity: the server's ``groups`` log-probs against vLLM's ``logprobs=0`` on the same seeded requests
(where the tokens agree) and against vLLM's prompt log-probs of the server's tokens (teacher forcing).
Writes <out>/inference_vllm-<time>.json: device, commit, vocabulary, every number, the target ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import tree_commit
from pyspy_profile import profile_during
from serve_load import free_port, host_cpu, post_all, request_body, stop_server, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of exactly ``vocab_size`` tokens (ChatML specials, then w3, w4, ...): no hub access."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def make_tokenizer(args: argparse.Namespace):
    from transformers import AutoTokenizer

    if args.tokenizer:
        return AutoTokenizer.from_pretrained(args.tokenizer)
    if args.vocab:
        return word_tokenizer(args.vocab)
    sys.path.insert(0, str(ROOT))
    from tests.inference.helpers import build_tokenizer

    return build_tokenizer()


def save_model(path: Path, seed: int, tokenizer, args: argparse.Namespace) -> None:
    import torch
    from prime_core.io import mark_stable
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = json.loads(Path(args.config).read_text())
    shape.update(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id, max_position_embeddings=4096, use_cache=True,
    )  # fmt: skip
    if args.layers:
        shape["num_hidden_layers"] = shape["max_window_layers"] = args.layers
    config = Qwen3Config(**{k: v for k, v in shape.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # random init of ~0.6B parameters is slow on CPU
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    mark_stable(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def request_sets(vocab: int, args: argparse.Namespace) -> dict[str, list[dict]]:
    """Each set: a list of {"prompt", "max_tokens", "seed" (or None), "logprobs" (0, 1 or None)}."""
    rng = random.Random(0)
    prompts = [[rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    plain = [{"prompt": p, "max_tokens": args.tokens, "seed": None} for p in prompts]
    n, g = args.prompts // args.group, args.group
    groups = [
        {"prompt": prompts[i], "max_tokens": args.tokens, "seed": 1000 * i + j} for i in range(n) for j in range(g)
    ]
    return {
        "logprobs": [{**r, "logprobs": 0} for r in plain],
        "no_logprobs": [{**r, "logprobs": None} for r in plain],
        "groups": [{**r, "logprobs": 1} for r in groups],
        "groups_no_logprobs": [{**r, "logprobs": None} for r in groups],
    }


def continuation(groups: list[dict], completions: list[list[int]], vocab: int, args: argparse.Namespace) -> list[dict]:
    """Turn 2: previous prompt + its completion + env tokens (a tool result, say), a new seed."""
    rng = random.Random(1)
    out = []
    for r, done in zip(groups, completions, strict=True):
        env = [rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(args.env_tokens)]
        out.append({**r, "prompt": r["prompt"] + done + env, "max_tokens": args.turn2_tokens, "seed": r["seed"] + 1})
    return out


def summary(elapsed: float, completions: list[list[int]]) -> dict:
    tokens = sum(len(c) for c in completions)
    return {
        "requests": len(completions),
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / elapsed,
    }


# ---------------------------------------------------------------- our server


def run_server_phase(url: str, requests: list[dict], client: str = "aiohttp") -> tuple[dict, list[dict]]:
    import msgspec

    elapsed, arrivals, raw = asyncio.run(post_all(url, [request_body(r) for r in requests], client))
    choices = [msgspec.json.decode(b)["choices"][0] for b in raw]
    result = summary(elapsed, [c["token_ids"] for c in choices])
    arrivals.sort()
    result["client"] = client
    result["responses_arrived_s"] = {"first": arrivals[0], "median": arrivals[len(arrivals) // 2], "last": arrivals[-1]}
    print(f"  server {len(requests)} requests ({client}): {result['output_tok_per_s']:,.0f} tok/s, responses at "
          f"{arrivals[0]:.2f}..{arrivals[-1]:.2f} s", flush=True)  # fmt: skip
    return result, choices


def served_logprobs(choice: dict) -> list[float]:
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(choice["token_ids"]):
        raise RuntimeError(f"{len(content)} log-probs for {len(choice['token_ids'])} tokens")
    return [c["logprob"] for c in content]


def check_server(url: str, prompt: list[int], other: Path, result: dict) -> None:
    """A chat call works, and /update_weights to the second model changes greedy output."""
    import httpx

    probe = {"token_ids": prompt, "sampling_params": {"max_tokens": 16, "temperature": 0}}
    before = httpx.post(f"{url}/inference/v1/generate", json=probe, timeout=600).json()["choices"][0]["token_ids"]
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=600,
                      json={"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 8, "temperature": 0})  # fmt: skip
    result["chat"] = {"status": chat.status_code, "usage": chat.json().get("usage")}
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/update_weights", json={"weight_dir": str(other), "step": 1}, timeout=1200)
    update_s = time.perf_counter() - t0
    after = httpx.post(f"{url}/inference/v1/generate", json=probe, timeout=600).json()["choices"][0]["token_ids"]
    result["update_weights"] = {"status": r.status_code, "seconds": update_s, "output_changed": before != after}
    print("update_weights:", json.dumps(result["update_weights"]), flush=True)


def start_prime_server(model: Path, work: Path, args, result: dict, stage: str, *extra: str):
    """`inference --engine vllm` on ``model`` with the benchmark's engine settings; (process, url) once healthy."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "prime_inference.entrypoints.inference", "--engine", args.engine, "--model.name", str(model),
           "--model.dtype", "bfloat16", "--server.port", str(port), "--output-dir", str(work / stage),
           "--max-model-len", str(args.max_model_len), "--vllm.max-num-seqs", str(args.prompts),
           "--vllm.gpu-memory-utilization", str(args.gpu_memory_utilization), "--log.level", "warning",
           "--vllm.extra-args",
           json.dumps(["--max-num-batched-tokens", str(args.max_num_batched_tokens), *args.engine_args])]  # fmt: skip
    if args.enforce_eager:
        cmd.append("--vllm.enforce-eager")
    cmd += extra
    t = time.perf_counter()
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        health = wait_healthy(url, server, args.startup_timeout)
    except BaseException:
        stop_server(server)
        raise
    result["stages_s"][stage + "_start"] = time.perf_counter() - t
    return server, url, health


def server_phases(base: Path, other: Path, sets: dict, work: Path, out_dir: Path, args, result: dict) -> None:
    server, url, result["health"] = start_prime_server(base, work, args, result, "server")
    phases = result["server"]
    try:
        check_server(url, sets["logprobs"][0]["prompt"], other, result)
        run_server_phase(url, sets["logprobs"][:16])  # warm-up
        for name in ("logprobs", "no_logprobs", "groups_no_logprobs", "groups"):
            run_server_phase(url, sets[name])  # a first run of a shape pays Triton JIT compiles, once a server
            phases[name], choices = run_server_phase(url, sets[name])
        sets["turn2"] = continuation(sets["groups"], [c["token_ids"] for c in choices], result["vocab_size"], args)
        sets["groups_served"] = [{"token_ids": c["token_ids"], "logprobs": served_logprobs(c)} for c in choices]
        phases["turn2"], _ = run_server_phase(url, sets["turn2"])
        if "groups_httpx" not in args.skip_phases:
            phases["groups_httpx"], _ = run_server_phase(url, sets["groups"], client="httpx")
        if args.profile:
            result["profile"] = profile_during(
                server.pid,
                args.profile,
                out_dir,
                lambda: run_server_phase(url, sets[args.profile_phase])[0],
                "inference_vllm_profile",
            )
    finally:
        stop_server(server)


def vllm_logprobs_phases(other: Path, sets: dict, work: Path, args, result: dict) -> None:
    """Our server again, on the updated weights, with vLLM's own log-prob path instead of the default
    ``vllm.fast_token_logprobs``: the log-prob sets, to show what the tap saves."""
    server, url, _ = start_prime_server(
        other, work, args, result, "server_vllm_logprobs", "--no-vllm.fast-token-logprobs"
    )
    try:
        run_server_phase(url, sets["logprobs"][:16])  # warm-up
        for name in ("logprobs", "groups", "turn2"):
            result["server_vllm_logprobs"][name], choices = run_server_phase(url, sets[name])
            if name == "groups":
                sets["groups_served_vllm_logprobs"] = [
                    {"token_ids": c["token_ids"], "logprobs": served_logprobs(c)} for c in choices
                ]
    finally:
        stop_server(server)


def vllm_server_phases(base: Path, sets: dict, args, result: dict) -> None:
    """The HTTP peer: vLLM's own `vllm serve` with the same engine flags, its /inference/v1/generate (vLLM's defaults:
    detokenized log-probs as dicts), the same request bodies. Request logging off, as on our server."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(base), "--port", str(port), "--seed", "0",
           "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.prompts),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--logprobs-mode", "processed_logprobs",
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--disable-uvicorn-access-log",
           *args.engine_args]  # fmt: skip
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    t = time.perf_counter()
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        wait_healthy(url, server, args.startup_timeout)
        result["stages_s"]["vllm_server_start"] = time.perf_counter() - t
        run_server_phase(url, sets["logprobs"][:16])  # warm-up
        for name in ("logprobs", "no_logprobs", "groups"):
            result["vllm_server"][name], _ = run_server_phase(url, sets[name])
    finally:
        stop_server(server)


# ---------------------------------------------------------------- vLLM offline


def offline_llm_kwargs(model: str, args: argparse.Namespace) -> dict:
    """vLLM engine settings equal to what the server passes (see `vllm_cli_args`), for a like-for-like offline run."""
    return dict(
        model=model, dtype="bfloat16", seed=0, max_model_len=args.max_model_len, max_num_seqs=args.prompts,
        gpu_memory_utilization=args.gpu_memory_utilization, logprobs_mode="processed_logprobs",
        enforce_eager=args.enforce_eager, max_num_batched_tokens=args.max_num_batched_tokens,
    )  # fmt: skip


def run_offline_phase(llm, requests: list[dict], **options) -> tuple[dict, list]:
    """``options``: SamplingParams fields on top of each request's own (``logprobs`` None drops log-probs)."""
    from vllm import SamplingParams

    params = [
        SamplingParams(
            max_tokens=r["max_tokens"], ignore_eos=True, seed=r["seed"], **{"logprobs": r["logprobs"], **options}
        )
        for r in requests
    ]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    result = summary(elapsed, [o.outputs[0].token_ids for o in outs])
    print(f"  vLLM {options} {len(requests)} requests: {result['output_tok_per_s']:,.0f} tok/s", flush=True)
    return result, outs


def first_entries(logprobs) -> list[float]:
    """The first (sampled or actual token's) log-prob of each position of vLLM's logprobs, flat or per-token dicts."""
    if hasattr(logprobs, "start_indices"):
        return [
            logprobs.logprobs[s] if s < e else float("nan")
            for s, e in zip(logprobs.start_indices, logprobs.end_indices, strict=True)
        ]
    return [next(iter(d.values())).logprob if d else float("nan") for d in logprobs]


def parity(llm, groups: list[dict], served: list[dict], vllm_outs: list, teacher: int) -> dict:
    """The server's log-probs against vLLM's ``logprobs=0`` (same seeds, where the tokens agree) and against vLLM's
    prompt log-probs of the server's own tokens (teacher forcing, ``teacher`` sequences)."""
    from vllm import SamplingParams

    same, worst = 0, 0.0
    for s, o in zip(served, vllm_outs, strict=True):
        if list(o.outputs[0].token_ids) == s["token_ids"]:
            same += 1
            worst = max(
                worst, max(abs(a - b) for a, b in zip(s["logprobs"], first_entries(o.outputs[0].logprobs), strict=True))
            )
    same_sampling = {"same_token_sequences": same, "of": len(served), "max_abs_diff": worst}
    if teacher <= 0:
        return {"vs_vllm_logprobs0": same_sampling}
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    pick = list(range(0, len(groups), max(1, len(groups) // teacher)))[:teacher]
    prompts = [{"prompt_token_ids": groups[i]["prompt"] + served[i]["token_ids"]} for i in pick]
    forced = llm.generate(prompts, sp, use_tqdm=False)
    diffs = []
    for i, o in zip(pick, forced, strict=True):
        ref = first_entries(o.prompt_logprobs)[len(groups[i]["prompt"]) :]
        diffs += [abs(a - b) for a, b in zip(served[i]["logprobs"], ref, strict=True)]
    return {
        "vs_vllm_logprobs0": same_sampling,
        "vs_vllm_prompt_logprobs": {"sequences": len(pick), "tokens": len(diffs), "max_abs_diff": max(diffs),
                                    "mean_abs_diff": sum(diffs) / len(diffs)},
    }  # fmt: skip


def offline_phases(other: Path, sets: dict, args: argparse.Namespace, result: dict) -> None:
    from vllm import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(**offline_llm_kwargs(str(other), args))
    result["stages_s"]["offline_start"] = time.perf_counter() - t
    llm.generate([{"prompt_token_ids": r["prompt"]} for r in sets["logprobs"][:16]], SamplingParams(max_tokens=8))
    phases = result["offline"]
    fast = {"detokenize": False, "flat_logprobs": True}
    phases["no_logprobs"], _ = run_offline_phase(llm, sets["no_logprobs"])
    phases["logprobs"], _ = run_offline_phase(llm, sets["logprobs"])
    if "logprobs_seeded" not in args.skip_phases:
        seeded = [{**r, "seed": 7 + i} for i, r in enumerate(sets["logprobs"])]
        phases["logprobs_seeded"], _ = run_offline_phase(llm, seeded)
    phases["logprobs_flat_nodetok"], _ = run_offline_phase(llm, sets["logprobs"], **fast)
    phases["groups_no_logprobs"], _ = run_offline_phase(llm, sets["groups"], logprobs=None)
    phases["groups"], group_outs = run_offline_phase(llm, sets["groups"], logprobs=0)
    phases["groups_flat_nodetok"], _ = run_offline_phase(llm, sets["groups"], **fast, logprobs=0)
    if "turn2" in sets:
        phases["turn2_no_logprobs"], _ = run_offline_phase(llm, sets["turn2"], logprobs=None)
        phases["turn2"], _ = run_offline_phase(llm, sets["turn2"], logprobs=0)
    for suffix in ("", "_vllm_logprobs"):
        served, key = "groups_served" + suffix, "logprob_parity" + suffix
        if served in sets:
            result[key] = parity(llm, sets["groups"], sets[served], group_outs, args.teacher)


def ratios(result: dict) -> dict:
    """The issue's targets: server vs vLLM with log-probs (>= 0.95) and without (>= 0.85), per request pattern."""
    s, o = result.get("server", {}), result.get("offline", {})
    pairs = {  # name: (numerator phase, denominator phase); "vllm:" marks an offline numerator
        "server_vs_vllm_logprobs": ("logprobs", "logprobs"), "server_vs_vllm_no_logprobs": ("logprobs", "no_logprobs"),
        "groups_server_vs_vllm_logprobs": ("groups", "groups"),
        "groups_server_vs_vllm_no_logprobs": ("groups", "groups_no_logprobs"),
        "turn2_server_vs_vllm_logprobs": ("turn2", "turn2"),
        "turn2_server_vs_vllm_no_logprobs": ("turn2", "turn2_no_logprobs"),
        "server_no_logprobs_vs_vllm_no_logprobs": ("no_logprobs", "no_logprobs"),
        "vllm_flat_nodetok_vs_vllm_no_logprobs": ("vllm:logprobs_flat_nodetok", "no_logprobs"),
    }  # fmt: skip
    out = {}
    # vllm_logprobs_: our server on vLLM's log-prob path (--no-vllm.fast-token-logprobs)
    for prefix, served in (("", s), ("vllm_logprobs_", result.get("server_vllm_logprobs", {}))):
        for name, (a, b) in pairs.items():
            num = o.get(a.removeprefix("vllm:")) if a.startswith("vllm:") else served.get(a)
            if num and o.get(b) and not (prefix and a.startswith("vllm:")):
                out[prefix + name] = num["output_tok_per_s"] / o[b]["output_tok_per_s"]
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=512, help="requests per set (all in flight; max_num_seqs)")
    parser.add_argument("--tokens", type=int, default=512, help="output tokens per request (turn 1)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--group", type=int, default=16, help="rollouts per prompt in the orchestrator pattern")
    parser.add_argument("--env-tokens", type=int, default=64, help="env tokens appended before turn 2")
    parser.add_argument("--turn2-tokens", type=int, default=256, help="output tokens per request in turn 2")
    parser.add_argument("--vocab", type=int, default=151936, help="word-level vocabulary size; 0: tests' tokenizer")
    parser.add_argument("--tokenizer", default=None, help="tokenizer dir/hub id instead of --vocab")
    parser.add_argument("--config", default=str(ROOT / "benchmarks" / "models" / "qwen3-0.6b" / "config.json"))
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers of --config")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384, help="both engines (LLM's default)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / torch.compile (both runs)")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--profile", type=float, default=0, help="seconds of py-spy profile of the server (0: none)")
    parser.add_argument(
        "--teacher", type=int, default=64, help="sequences checked against vLLM's prompt log-probs (0: none)"
    )
    parser.add_argument(
        "--profile-phase", default="logprobs", choices=("logprobs", "no_logprobs", "groups", "groups_no_logprobs")
    )
    parser.add_argument("--vllm-server", action="store_true", help="also measure `vllm serve` (the HTTP peer)")
    tap_off = "also our server with vLLM's own log-prob path (--no-vllm.fast-token-logprobs)"
    parser.add_argument("--vllm-logprobs", action="store_true", help=tap_off)
    parser.add_argument(
        "--engine-args", type=json.loads, default=[], help="JSON list of `vllm serve` flags for both servers"
    )
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--engine", default="vllm", help="server engine (torch: a CPU smoke test of this script)")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--skip-phases", default="", help="comma-separated: groups_httpx, logprobs_seeded")
    parser.add_argument("--stop-on-server-error", action="store_true", help="skip the vLLM phases if the server fails")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="directory of the result JSON")
    parser.add_argument("--commit", default=os.environ.get("PRIME_COMMIT"), help="default: git rev-parse HEAD")
    args = parser.parse_args()
    args.skip_phases = sorted(filter(None, args.skip_phases.split(",")))
    if args.prompts % args.group:
        parser.error(f"--prompts ({args.prompts}) must be a multiple of --group ({args.group})")
    return args


def main() -> None:
    args = parse_args()
    import torch

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"inference_vllm-{time.strftime('%Y%m%d-%H%M%S')}.json"
    result: dict = {
        "benchmark": "inference_vllm", "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "host_cpu": host_cpu(), "commit": tree_commit(args.commit), "config": vars(args),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "stages_s": {}, "server": {}, "server_vllm_logprobs": {}, "vllm_server": {}, "offline": {},
    }  # fmt: skip
    try:
        t = time.perf_counter()
        work = Path(tempfile.mkdtemp(prefix="prime-bench-"))
        base, other = work / "base", work / "weights" / "step_1"
        tokenizer = make_tokenizer(args)
        save_model(base, 0, tokenizer, args)
        save_model(other, 1, tokenizer, args)
        result["stages_s"]["save_models"] = time.perf_counter() - t
        model_config = json.loads((base / "config.json").read_text())
        result["model"] = {k: model_config.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")}  # fmt: skip
        result["vocab_size"] = model_config["vocab_size"]
        sets = request_sets(result["vocab_size"], args)
        if not args.skip_server:
            try:
                server_phases(base, other, sets, work, out_dir, args, result)
            except Exception as e:  # still measure vLLM itself, unless told not to
                result["server_error"] = f"{type(e).__name__}: {e}"
                print("server phases failed:", result["server_error"], flush=True)
                if args.stop_on_server_error:
                    raise
            out.write_text(json.dumps(result, indent=2) + "\n")
        if args.vllm_logprobs and "turn2" in sets:
            vllm_logprobs_phases(other, sets, work, args, result)
            out.write_text(json.dumps(result, indent=2) + "\n")
        if args.vllm_server:
            vllm_server_phases(base, sets, args, result)
            out.write_text(json.dumps(result, indent=2) + "\n")
        if not args.skip_offline:
            offline_phases(other, sets, args, result)
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        with contextlib.suppress(ImportError):
            import vllm

            result["vllm"] = vllm.__version__
        result["targets"] = ratios(result)
        out.write_text(json.dumps(result, indent=2) + "\n")
        shown = [k for k in result if k.startswith(("server", "vllm_server", "offline", "targets", "logprob_parity"))]
        print(json.dumps({k: result.get(k) for k in shown}, indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
