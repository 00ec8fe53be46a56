"""The token-in generate path: log-probs taken from vLLM's flat arrays, their response encoding, and the
orchestrator's request pattern (groups with per-request seeds, a multi-turn continuation) on the CPU server."""

from __future__ import annotations

import asyncio
import json
import math
import random
from dataclasses import dataclass, field

import httpx
import msgspec
import pytest
import torch
from prime_inference.engines.vllm_engine import prompt_logprobs_of, split_logprobs
from prime_inference.generate_logprobs import generate_logprobs


@dataclass
class Logprob:
    """vLLM's `vllm.logprobs.Logprob` (the dict path's values)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FlatLogprobs:
    """vLLM 0.26's `vllm.logprobs.FlatLogprobs` layout: position i owns entries [start_indices[i], end_indices[i]),
    the sampled token first, then the top k by rank."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)

    def append(self, ids: list[int], values: list[float], ranks: list[int]) -> None:
        self.start_indices.append(len(self.logprobs))
        self.token_ids += ids
        self.logprobs += values
        self.ranks += ranks
        self.end_indices.append(len(self.logprobs))

    def __len__(self) -> int:
        return len(self.start_indices)


def sampler_output(n: int, k: int, seed: int = 0) -> tuple[list[int], FlatLogprobs, list[dict[int, Logprob]]]:
    """What vLLM's sampler hands back for n positions: sampled ids, and the same log-probs flat and as dicts."""
    rng = random.Random(seed)
    sampled, flat, dicts = [], FlatLogprobs(), []
    for _ in range(n):
        logits = torch.randn(50, generator=torch.Generator().manual_seed(rng.randrange(10**6))) * 3
        lps = torch.log_softmax(logits, -1)
        tid = rng.randrange(50)
        order = torch.argsort(lps, descending=True).tolist()
        ids = [tid, *order[:k]]  # the sampled token may reappear among the top k, as in vLLM
        values = [float(lps[i]) for i in ids]
        ranks = [order.index(tid) + 1, *range(1, k + 1)]
        sampled.append(tid)
        flat.append(ids, values, ranks)
        dicts.append({i: Logprob(v, r) for i, v, r in zip(ids, values, ranks, strict=True)})
    return sampled, flat, dicts


def test_flat_logprobs_k0_are_handed_over_without_per_token_objects():
    sampled, flat, dicts = sampler_output(64, 0)
    lps, top = split_logprobs(sampled, flat, 0)
    assert lps is flat.logprobs and top is None  # the engine's own list: nothing built per token
    assert lps == split_logprobs(sampled, dicts, 0)[0]
    assert len(lps) == len(sampled) and all(v <= 0 for v in lps)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_flat_top_logprobs_equal_the_dict_path(k):
    sampled, flat, dicts = sampler_output(40, k, seed=k)
    lps, top = split_logprobs(sampled, flat, k)
    ref_lps, ref_top = split_logprobs(sampled, dicts, k)
    assert lps == ref_lps
    assert top == ref_top
    for tid, alternatives in zip(sampled, top, strict=True):
        assert tid not in alternatives and len(alternatives) <= k
        assert list(alternatives.values()) == sorted(alternatives.values(), reverse=True)


def test_flat_logprobs_for_another_number_of_positions_are_refused():
    sampled, flat, _ = sampler_output(5, 0)
    with pytest.raises(RuntimeError, match="5 positions, 6 tokens"):
        split_logprobs([*sampled, 1], flat, 0)


def reference_body(ids: list[int], lps: list[float], tops: list[dict[int, float]], k: int) -> dict:
    """vLLM's token-in log-prob layout built the plain way (one dict per entry)."""
    content = []
    for tid, lp, top in zip(ids, lps, tops, strict=True):
        ranked = {tid: lp, **{t: v for t, v in top.items() if t != tid}}
        entries = [{"token": f"token_id:{t}", "logprob": max(v, -9999.0), "bytes": None} for t, v in ranked.items()]
        content.append({**entries[0], "top_logprobs": entries[: max(k, 1)]})
    return {"content": content}


@pytest.mark.parametrize("k", [0, 1, 3])
def test_generate_logprobs_encode_vllms_layout(k):
    sampled, flat, _ = sampler_output(30, max(k, 1), seed=10 + k)
    lps, top = split_logprobs(sampled, flat, max(k, 1))
    lps[3], lps[7] = float("-inf"), -12345.0  # clamped to -9999 like vLLM's server
    encoded = msgspec.json.encode({"logprobs": generate_logprobs(sampled, lps, top, k)})
    assert json.loads(encoded)["logprobs"] == reference_body(sampled, lps, top, k)
    content = json.loads(encoded)["logprobs"]["content"]
    assert content[3]["logprob"] == content[7]["logprob"] == -9999.0
    assert all(len(c["top_logprobs"]) == max(k, 1) for c in content)


def test_generate_logprobs_refuse_a_length_mismatch():
    with pytest.raises(ValueError):
        generate_logprobs([1, 2, 3], [-1.0, -2.0], [], 0)


# ---------------------------------------------------------------- the orchestrator's pattern on the CPU server


async def post_group(url: str, prompt: list[int], seeds: list[int], max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as client:  # a loaded 2-core CI host is slow
        bodies = [
            {"token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "seed": s, "logprobs": 0,
                                                       "ignore_eos": True}}
            for s in seeds
        ]  # fmt: skip
        rs = await asyncio.gather(*[client.post(f"{url}/inference/v1/generate", json=b) for b in bodies])
    return [r.json()["choices"][0] for r in rs]


def logprobs_of(choice: dict) -> list[float]:
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    for c in content:
        assert c["top_logprobs"] == [{"token": c["token"], "logprob": c["logprob"], "bytes": None}]
    return [c["logprob"] for c in content]


def model_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]


def test_group_seeds_and_continuation_logprobs(server, model_dir):
    """A group of 8 seeded rollouts sent together: one log-prob per token equal to the model's; a seed gives the
    same rollout when sent again in another order; a turn-2 continuation's log-probs match the model too."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt, seeds = [12, 40, 7, 99, 3], [100 + i for i in range(8)]
    first = asyncio.run(post_group(server.url, prompt, seeds, 12))
    again = asyncio.run(post_group(server.url, prompt, seeds[::-1], 12))[::-1]
    assert [c["token_ids"] for c in again] == [c["token_ids"] for c in first]
    assert len({tuple(c["token_ids"]) for c in first}) > 1  # different seeds, different rollouts
    for a, b in zip(first, again, strict=True):
        assert max(abs(x - y) for x, y in zip(logprobs_of(a), logprobs_of(b), strict=True)) < 1e-5
    worst = 0.0
    for choice in first[:3]:
        ref = model_logprobs(model, prompt, choice["token_ids"])
        worst = max(worst, float((torch.tensor(logprobs_of(choice), dtype=torch.float64) - ref).abs().max()))
        turn2 = prompt + choice["token_ids"] + [5, 6, 7]  # + env tokens
        (cont,) = asyncio.run(post_group(server.url, turn2, [7], 8))
        ref2 = model_logprobs(model, turn2, cont["token_ids"])
        worst = max(worst, float((torch.tensor(logprobs_of(cont), dtype=torch.float64) - ref2).abs().max()))
    assert worst < 1e-4 and math.isfinite(worst)


def test_prompt_logprobs_read_from_both_vllm_layouts():
    """A distillation teacher on vLLM: prompt log-probs come back per position as {token: (log-prob, rank)}, the
    first position None, whether vLLM hands over dicts or flat arrays (an empty first position)."""
    _, flat, dicts = sampler_output(5, 0, seed=3)
    flat.start_indices.insert(0, 0)
    flat.end_indices.insert(0, 0)
    want = [None, *({t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in dicts)]
    assert prompt_logprobs_of([None, *dicts]) == want
    assert prompt_logprobs_of(flat) == want
