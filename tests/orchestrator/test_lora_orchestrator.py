"""A LoRA run's orchestrator: loads the trainer's initial adapter, then samples every rollout from it by name."""

import json

import httpx
import pytest
from prime_core.io import mark_stable
from prime_core.schemas.adapters import ADAPTER_INFO
from prime_core.schemas.microbatch import read_microbatches

from tests.orchestrator.test_integration import make_config, run

pytestmark = pytest.mark.integration


def test_lora_run_loads_its_adapter_and_samples_from_it(tmp_path, tiny_model, torch_server):
    from prime_models import load_model
    from prime_models import lora as L

    # What the trainer publishes at step 0 of a LoRA run: the fresh adapter, named.
    model = load_model(tiny_model)
    L.apply_lora(model, L.LoRASpec(rank=4, alpha=8.0), adapters=["tenant-a"])
    step0 = tmp_path / "weights" / "step_0"
    L.save_adapter(model, "tenant-a", step0)
    (step0 / ADAPTER_INFO).write_text(json.dumps({"name": "tenant-a", "step": 0}))
    mark_stable(step0)

    config = make_config(tmp_path, tiny_model, torch_server)
    lora = {"rank": 4, "alpha": 8, "name": "tenant-a"}
    config = config.model_copy(update={"model": config.model.model_validate({"name": str(tiny_model), "lora": lora})})
    orch = run(config)
    assert orch.served_model == "tenant-a"  # every request names the adapter
    cards = {m["id"]: m for m in httpx.get(f"{torch_server.url}/v1/models").json()["data"]}
    assert cards["tenant-a"]["weight_step"] == 0 and cards["tenant-a"]["root"] == str(step0.resolve())
    meta, mbs = read_microbatches(tmp_path / "rollouts" / "step_0" / "rank_0.safetensors")
    assert meta.global_num_samples == 4 and sum(mb.num_loss_tokens for mb in mbs) > 0
