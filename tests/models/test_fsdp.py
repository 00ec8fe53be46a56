"""FSDP2 over gloo on CPU: two ranks train exactly like one process."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from prime_models import ParallelDims, get_model_spec, hf_state_dict, load_model, save_hf

from tests.models.conftest import VOCAB, tiny_config
from tests.ranks import leave_group

# Runs training processes: on the same xdist worker as the others (they oversubscribe 2 cores together).
pytestmark = pytest.mark.xdist_group("multiprocess")

STEPS, BATCH, SEQ = 5, 4, 17


def _batches():
    g = torch.Generator().manual_seed(123)
    # One fixed batch: the loss must then fall step over step.
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)] * STEPS


def _train(rank: int, world: int, model_type: str, init_file: str, out_dir: str) -> list[float]:
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = load_model(tiny_config(model_type), seed=0)
        get_model_spec(model_type).parallelize_fn(model, ParallelDims(world_size=world), ac="selective", ac_every=2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        per_rank = BATCH // world
        losses = []
        for ids in _batches():
            ids = ids[rank * per_rank : (rank + 1) * per_rank]
            logprobs, _ = model(ids[:, :-1], targets=ids[:, 1:])
            # Equal-sized local batches: FSDP's gradient averaging then equals the global-batch mean gradient.
            loss = -logprobs.mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = loss.detach()
            if world > 1:
                dist.all_reduce(loss)
                loss /= world
            losses.append(loss.item())
        save_hf(model, f"{out_dir}/ckpt_ws{world}")
        if rank == 0:
            with open(f"{out_dir}/losses_ws{world}.json", "w") as f:
                json.dump(losses, f)
        return losses
    finally:
        if world > 1:
            leave_group()


@pytest.mark.integration
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_fsdp2_two_ranks_match_one_process(model_type, tmp_path):
    single = _train(0, 1, model_type, "", str(tmp_path))
    mp.spawn(_train, args=(2, model_type, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    sharded = json.loads((tmp_path / "losses_ws2.json").read_text())
    diffs = [abs(a - b) for a, b in zip(single, sharded, strict=True)]
    print(f"{model_type}: losses 1 proc {single}\n  2 procs {sharded}\n  max diff {max(diffs):.2e}")
    assert single[-1] < single[0]
    assert max(diffs) < 1e-6

    # save_hf gathered the DTensor shards on rank 0 into the same checkpoint the single process wrote.
    a = dict(hf_state_dict(load_model(tmp_path / "ckpt_ws1")))
    b = dict(hf_state_dict(load_model(tmp_path / "ckpt_ws2")))
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
