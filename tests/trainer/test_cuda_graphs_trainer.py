"""``parallel.cuda_graphs`` in the trainer: what it cannot serve is a one-line error (at load time from the config,
at build time from the world and the model's config), the memory plan never offloads under it, and the RL step
through the graph dispatch (on CPU through `tests.models.cuda_graph_standin`) trains like the eager one and reads
nothing back per micro-batch."""

from __future__ import annotations

import pytest
import torch
from prime_core.config import ConfigError, load_config
from prime_core.config.parallel import ParallelConfig
from prime_core.config.trainer import TrainerConfig
from prime_models.parallel.cuda_graphs import apply_cuda_graphs, cuda_graphs_of
from prime_trainer import memory as M
from prime_trainer.parallel import validate_cuda_graphs
from prime_trainer.rl.loss import build_objective
from prime_trainer.rl.train import forward_backward
from prime_trainer.world import World

from tests.models.cuda_graph_standin import graphs_on_cpu  # noqa: F401 (fixture)
from tests.trainer.test_host_syncs import components, micro_batches, reads
from tests.trainer.test_memory_plan import _components, _micro_batch

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py

CLASHES = {
    "model.cp > 1": ["--model.cp", "2"],
    "model.ep > 1": ["--model.ep", "2"],
    "model.fp8": ["--model.fp8.recipe", "tensorwise"],
    "model.dtype = 'bfloat16'": ["--model.dtype", "bfloat16"],
    "init.attn = 'flash_attn'": ["--init.attn", "flash_attn"],
    "device = 'cpu'": ["--device", "cpu"],
    "unset fsdp_one_rank": ["--parallel.fsdp-one-rank", "true"],
    "unset cpu_offload": ["--parallel.cpu-offload", "true"],
    "unset ac_offload_attention": ["--parallel.ac", "full", "--parallel.ac-keep-attention", "-1",
                                   "--parallel.ac-offload-attention", "true"],
}  # fmt: skip


@pytest.mark.parametrize("clash", list(CLASHES))
def test_what_cuda_graphs_cannot_serve_is_a_one_line_config_error(clash):
    with pytest.raises(ValueError, match="cuda_graphs") as e:
        load_config(TrainerConfig, ["--parallel.cuda-graphs", "true", *CLASHES[clash]])
    assert clash in str(e.value) and len(str(e.value).strip().splitlines()) == 1
    assert load_config(TrainerConfig, CLASHES[clash]).parallel.cuda_graphs is False  # fine without graphs


def test_what_only_the_world_or_the_model_tells_is_a_one_line_error_at_build():
    graphs = ParallelConfig(cuda_graphs=True)

    def world(ranks: int, device: str) -> World:
        return World(rank=0, world_size=ranks, local_rank=0, device=torch.device(device))

    validate_cuda_graphs(graphs, world(1, "cuda"), {"model_type": "qwen3"})
    validate_cuda_graphs(ParallelConfig(), world(2, "cpu"), {"num_experts": 8})  # nothing to check without graphs
    for w, hf, what in (
        (world(2, "cuda"), {}, "2 ranks"),
        (world(1, "cpu"), {}, "device cpu"),
        (world(1, "cuda"), {"num_experts": 8}, "MoE"),
        (world(1, "cuda"), {"vision_config": {}}, "vision-language"),
    ):
        with pytest.raises(ConfigError, match=what):
            validate_cuda_graphs(graphs, w, hf)


def test_the_memory_plan_never_offloads_under_cuda_graphs(monkeypatch):
    hosts = []
    real = M.choose_plan
    monkeypatch.setattr(M, "_budgets", lambda c: (10**12, 10**12))
    monkeypatch.setattr(M, "choose_plan", lambda *a, **kw: hosts.append(a[4]) or real(*a, **kw))
    for graphs in ("false", "true"):
        M.plan_memory(_components("--parallel.cuda-graphs", graphs, device="cuda"), [_micro_batch(2, 32)])
    assert hosts == [10**12, 0]


@pytest.mark.usefixtures("graphs_on_cpu")
def test_the_rl_step_through_the_graphs_trains_like_the_eager_one(tiny_model_dir, tmp_path):
    grads, models = [], []
    for graphed in (False, True):
        c = components(TrainerConfig, tiny_model_dir, tmp_path / str(graphed))
        if graphed:
            apply_cuda_graphs(c.model)
        objective = build_objective(c.config.loss)
        forward_backward(c, objective, micro_batches(3), 1.0)
        grads.append({n: p.grad.clone() for n, p in c.model.named_parameters() if p.grad is not None})
        models.append(c)
    assert grads[1].keys() == grads[0].keys() and grads[0]
    for k, v in grads[0].items():
        torch.testing.assert_close(grads[1][k], v, msg=k)
    c = models[1]
    graphs = cuda_graphs_of(c.model)
    assert (graphs.captures, graphs.replays) == (1, 3)  # packed rows of one shape: one graph
    # The packing comes from the host arrays: a graphed micro-batch reads nothing back either.
    objective = build_objective(c.config.loss)
    c.optimizer.zero_grad(set_to_none=True)
    mbs = {n: micro_batches(n) for n in (1, 3)}  # (their packing is computed on the host: reads of host tensors)
    one = reads(lambda: forward_backward(c, objective, mbs[1], 1.0))
    three = reads(lambda: forward_backward(c, objective, mbs[3], 1.0))
    assert one == three and graphs.replays == 7 and graphs.captures == 1
