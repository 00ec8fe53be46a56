"""LoRA adapters over CUDA IPC (a LoRA run whose trainer and inference share a GPU), everything but the GPU: the trainer
hands its adapter's tensors over through the store instead of writing files, the torch engine serves them under the
adapter's name exactly like the same adapter from files, checkpoint steps keep the PEFT files a resume re-serves,
and the settings that cannot work are one-line errors. CUDA IPC itself is replaced as in tests/inference/test_cuda_ipc.py
(an in-process registry); vLLM's worker-side loader runs against stand-ins of its classes here and for real in
tests/inference/test_weight_transports_gpu.py."""

from __future__ import annotations

import json
import sys
import threading
import types

import httpx
import pytest
import torch
import torch.distributed as dist
from prime_core.config.trainer import TrainerConfig, WeightBroadcastConfig
from prime_core.io import wait_stable
from prime_core.run_dir import RunDir
from prime_core.schemas.adapters import ADAPTER_INFO, AdapterInfo, is_adapter_dir
from prime_core.schemas.weights import CudaIpcAdapter, CudaIpcManifest, FilesystemManifest, held_files, read_manifest
from prime_inference import vllm_lora
from prime_models import load_model
from prime_models import lora as L
from prime_trainer.weights import transport_name
from prime_trainer.weights.cuda_ipc import CudaIpcPublisher
from pydantic import ValidationError

from tests.inference.helpers import start_server
from tests.inference.test_cuda_ipc import CPU_WORLD, FakeIpc
from tests.inference.test_lora_serving import PROMPTS, _greedy, _reference_greedy
from tests.tiny import free_port

NAME = "tenant"


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def trainer_model(base_dir, seed: int):
    """The trainer's model of a LoRA run: the base with adapter ``NAME``, its A and B random (output-changing)."""
    model = load_model(base_dir)
    L.apply_lora(model, L.LoRASpec(rank=4, alpha=8.0), [NAME], seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in L.adapter_parameters(model, NAME):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def publisher(run_dir: RunDir, base_dir) -> CudaIpcPublisher:
    config = WeightBroadcastConfig(type="cuda_ipc", port=free_port(), timeout_s=60)
    # `build` refuses a trainer on CPU; the transport itself runs here with FakeIpc standing in for the GPU.
    return CudaIpcPublisher(run_dir, CPU_WORLD, 1, tokenizer=str(base_dir), config=config, adapter=NAME,
                            base_model=str(base_dir))  # fmt: skip


def publish_and_relay(pub: CudaIpcPublisher, model, step: int, url: str, durable: bool) -> httpx.Response:
    timings: dict = {}
    sender = threading.Thread(target=lambda: timings.update(pub.publish(step, model, durable=durable)))
    sender.start()
    step_dir = wait_stable(pub.run_dir.weight_step(step), timeout=60)
    r = httpx.post(f"{url}/update_weights", json={"weight_dir": str(step_dir), "step": step}, timeout=60)
    sender.join(timeout=60)
    assert not sender.is_alive() and timings["send_s"] > 0
    return r


def test_the_adapter_goes_through_gpu_memory_and_serves_like_its_files(monkeypatch, tmp_path, model_dir, one_rank):
    FakeIpc(monkeypatch)
    run_dir = RunDir(tmp_path / "run")
    pub = publisher(run_dir, model_dir)
    server = start_server(model_dir)
    try:
        for step, seed in ((1, 1), (2, 2)):  # a new adapter, then the same name replaced
            model = trainer_model(model_dir, seed)
            r = publish_and_relay(pub, model, step, server.url, durable=False)
            assert r.status_code == 200, r.text
            assert r.json()["lora_name"] == NAME and r.json()["weight_step"] == step
            step_dir = run_dir.weight_step(step)
            manifest = read_manifest(step_dir)
            assert isinstance(manifest, CudaIpcManifest) and manifest.adapter.name == NAME
            assert manifest.adapter.peft_config["r"] == 4 and not any(step_dir.glob("*.safetensors"))
            L.save_adapter(model, NAME, tmp_path / f"files{step}")  # the same adapter, as files
            served = [_greedy(server.url, p, NAME).json()["choices"][0]["token_ids"] for p in PROMPTS]
            assert served == _reference_greedy(model_dir, tmp_path / f"files{step}")
        cards = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert cards[NAME]["weight_step"] == 2

        # A checkpoint step also keeps its PEFT files, which a resumed run re-serves from the directory alone.
        model = trainer_model(model_dir, 3)
        assert publish_and_relay(pub, model, 3, server.url, durable=True).status_code == 200
        step_dir = run_dir.weight_step(3)
        assert is_adapter_dir(step_dir) and not (step_dir / ADAPTER_INFO).exists()
        assert read_manifest(step_dir, "filesystem") == AdapterInfo(name=NAME, step=3, base_model=str(model_dir))
        r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(step_dir), "source": "filesystem"})
        assert r.status_code == 200 and r.json()["lora_name"] == NAME, r.text
        L.save_adapter(model, NAME, tmp_path / "files3")
        served = [_greedy(server.url, p, NAME).json()["choices"][0]["token_ids"] for p in PROMPTS]
        assert served == _reference_greedy(model_dir, tmp_path / "files3")
    finally:
        server.stop()


def test_steps_only_for_disk_announce_the_adapters_files(tmp_path, model_dir, one_rank):
    """The initial adapter and the final step are not served now: PEFT files and ``prime_adapter.json``."""
    run_dir = RunDir(tmp_path / "run")
    pub = publisher(run_dir, model_dir)
    pub.publish(0, trainer_model(model_dir, 1), durable=True, serve=False)
    step_dir = run_dir.weight_step(0)
    assert is_adapter_dir(step_dir) and json.loads((step_dir / ADAPTER_INFO).read_text())["name"] == NAME
    assert read_manifest(step_dir) == AdapterInfo(name=NAME, step=0, base_model=str(model_dir))


def test_what_a_one_time_step_holds_on_disk():
    base = dict(step=4, host="h", port=1, num_workers=1, gpu_uuid="g", timeout_s=1)
    adapter = CudaIpcAdapter(name=NAME, base_model="m", peft_config={"r": 4})
    assert held_files(CudaIpcManifest(**base)) == FilesystemManifest()
    assert held_files(CudaIpcManifest(**base, adapter=adapter)) == AdapterInfo(name=NAME, step=4, base_model="m")
    with pytest.raises(ValidationError):
        CudaIpcAdapter(name="no spaces", peft_config={})


def test_which_transport_publishes_a_lora_run_and_what_is_refused():
    def config(broadcast: str, **more) -> TrainerConfig:
        return TrainerConfig.model_validate({"model": {"lora": {}}, "weights": {"broadcast": {"type": broadcast}},
                                             **more})  # fmt: skip

    assert transport_name(config("cuda_ipc"), "trainer", NAME) == "cuda_ipc"
    assert transport_name(config("filesystem"), "trainer", NAME) == "adapter"
    assert transport_name(config("cuda_ipc"), "sft", NAME) == "adapter"
    with pytest.raises(
        ValidationError, match=r"set weights.broadcast.type = 'filesystem' or 'cuda_ipc' \(got 'nccl'\)"
    ):
        config("nccl")
    runs = [{"name": "a", "output_dir": "/tmp/prime-runs/a"}]
    with pytest.raises(ValidationError, match=r"runs .* use weights.broadcast.type = 'filesystem' \(got 'cuda_ipc'\)"):
        config("cuda_ipc", runs=runs)


# ---- vLLM's worker-side loader, against stand-ins of vLLM's classes ----


class FakeLoRAModel:
    # The keyword arguments of one vLLM version: the loader passes those it names and leaves the others out.
    @classmethod
    def from_lora_tensors(cls, lora_model_id, tensors, peft_helper, device="cuda", dtype=None, model_vocab_size=None):
        return types.SimpleNamespace(id=lora_model_id, tensors=tensors, rank=peft_helper.r, device=device, dtype=dtype,
                                     vocab=model_vocab_size)  # fmt: skip


class FakeManager:
    def __init__(self, max_rank: int = 8):
        self.lora_config = types.SimpleNamespace(lora_dtype=torch.bfloat16, max_lora_rank=max_rank)
        self._adapter_manager = types.SimpleNamespace(model=types.SimpleNamespace(hf_to_vllm_mapper=None))
        self._lora_model_cls = FakeLoRAModel
        self.vocab_size = 96
        self.from_files: list[str] = []

    def _load_adapter(self, lora_request):
        self.from_files.append(lora_request.lora_path)
        return "from files"


@pytest.fixture
def fake_vllm(monkeypatch):
    class PEFTHelper:
        def __init__(self, config):
            self.r = config["r"]

        @classmethod
        def from_dict(cls, config):
            return cls(config)

        def validate_legal(self, lora_config):
            if self.r > lora_config.max_lora_rank:
                raise ValueError("rank too large")

    module = types.ModuleType("vllm.lora.peft_helper")
    module.PEFTHelper = PEFTHelper
    for name in ("vllm", "vllm.lora"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.lora.peft_helper", module)
    monkeypatch.setattr(vllm_lora, "KEPT", {})


def test_vllms_loader_builds_kept_adapters_from_tensors_and_the_rest_from_files(fake_vllm):
    manager = FakeManager()
    vllm_lora.install_loader(manager)
    vllm_lora.install_loader(manager)  # once
    tensors = {"base_model.model.x.lora_A.weight": torch.ones(4, 2)}
    vllm_lora.KEPT[3] = ("cuda_ipc://h:1/step_5", {"r": 4}, tensors)
    request = lambda i, path: types.SimpleNamespace(lora_int_id=i, lora_path=path)  # noqa: E731
    lora = manager._load_adapter(request(3, "cuda_ipc://h:1/step_5"))
    assert lora.id == 3 and lora.tensors is tensors and lora.device == "cpu" and lora.vocab == 96
    assert lora.dtype == torch.bfloat16 and lora.rank == 4
    # The same id loaded from a directory later, or another id: vLLM's own loader.
    assert manager._load_adapter(request(3, "/adapters/step_6")) == "from files"
    assert manager._load_adapter(request(4, "cuda_ipc://h:1/step_5")) == "from files"
    assert manager.from_files == ["/adapters/step_6", "cuda_ipc://h:1/step_5"]
    vllm_lora.KEPT[3] = ("cuda_ipc://h:1/step_5", {"r": 16}, tensors)
    with pytest.raises(ValueError, match="rank too large"):
        manager._load_adapter(request(3, "cuda_ipc://h:1/step_5"))


def test_a_worker_without_lora_or_a_manifest_without_adapter_refuses(fake_vllm):
    with pytest.raises(RuntimeError, match="no LoRA manager at model_runner.lora_manager"):
        vllm_lora.lora_manager(types.SimpleNamespace(model_runner=types.SimpleNamespace()))
    manifest = CudaIpcManifest(step=1, host="h", port=1, num_workers=1, gpu_uuid="g", timeout_s=1)
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(lora_manager=FakeManager()))
    with pytest.raises(ValueError, match="hands over no LoRA adapter"):
        vllm_lora.receive(worker, manifest.model_dump(), 1)
    assert vllm_lora.ipc_path(manifest) == "cuda_ipc://h:1/step_1"
