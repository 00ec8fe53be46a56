"""Where each process of a run goes: GPUs or CPU, trainer ranks, threads, a shared GPU's memory split, or the nodes
of a multi-node SLURM job. Pure: decided from the user's config and the host's facts; ``prime_launch.resolver``
turns the decision into each process's config."""

from __future__ import annotations

from dataclasses import dataclass, field

from prime_core.config.rl import RLConfig

from prime_launch.colocate import Shares, check_fit, shared_gpu_transport, sharing_notes
from prime_launch.cpu_threads import THREAD_ENV_VARS, split_cpu_threads
from prime_launch.host import ClusterFacts, HostFacts, wants_gpus


@dataclass
class Placement:
    """Where each role runs, and what that asks of the configs."""

    use_gpu: bool
    num_trainer_ranks: int
    trainer_device: str | None = None
    """The trainer's ``device`` the placement needs (None keeps the config's)."""
    inference_engine: str | None = None
    """The engine the placement needs (None keeps the config's)."""
    inference_data_parallel: int | None = None
    """vLLM's ``data_parallel_size`` over the server's GPUs (None keeps the config's)."""
    num_inference_servers: int = 1
    """0: no server is started (the orchestrator uses one started elsewhere)."""
    server_address: tuple[str, int] | None = None
    """Where each server binds when other nodes reach it (multi-node); None keeps the config's."""
    shares: Shares | None = None
    """Inference and trainer share GPUs: each one's memory fraction."""
    weights_transport: str | None = None
    """The trainer's ``weights.broadcast.type`` the placement needs (None keeps the config's)."""
    teacher_engine: str | None = None
    """The teacher server's engine as placed (None keeps ``teacher.engine``)."""
    teacher_data_parallel: int | None = None
    """vLLM's ``data_parallel_size`` over the teacher's GPUs (None keeps ``teacher.vllm``'s)."""
    teacher_shares_gpu: bool = False
    """The teacher shares a GPU with the others: it starts once the policy's server has reserved its memory."""
    env_of: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per role, the environment variables its devices and threads need."""
    devices: dict[str, str] = field(default_factory=dict)
    """Per role, a description of its devices (for messages)."""
    notes: list[str] = field(default_factory=list)


def colocated(rl: RLConfig, gpus: list[int]) -> bool:
    """Whether inference and trainer share GPUs: as ``devices.colocate`` says, else when one GPU is all there is."""
    if rl.inference is None:
        return False
    return rl.devices.colocate if rl.devices.colocate is not None else len(gpus) == 1


def place_on_host(rl: RLConfig, facts: HostFacts) -> Placement:
    """Devices (inference first, then trainer) and CPU threads of every role on one machine."""
    gpus: list[int] = []
    if wants_gpus(rl):
        gpus = list(rl.devices.gpu_ids) if rl.devices.gpu_ids is not None else list(facts.gpus)
        if rl.devices.type == "cuda" and not gpus:
            raise ValueError("devices.type = cuda but no GPU is visible (CUDA_VISIBLE_DEVICES / nvidia-smi)")
    place = _place_on_gpus(rl, gpus, facts) if gpus else _place_on_cpu(rl)
    place.devices["orchestrator"] = "CPU"
    _assign_threads(rl, place, facts)
    return place


def _place_on_gpus(rl: RLConfig, gpus: list[int], facts: HostFacts) -> Placement:
    inference = rl.inference
    num_inf = rl.devices.num_inference_gpus if inference is not None else 0
    num_train = rl.devices.num_trainer_gpus
    shared = colocated(rl, gpus)
    place = Placement(use_gpu=True, num_trainer_ranks=num_train, num_inference_servers=int(inference is not None))
    place.env_of = {"inference": {}, "orchestrator": {"CUDA_VISIBLE_DEVICES": ""}, "trainer": {}}
    if rl.devices.colocate and inference is None:
        place.notes.append(
            "devices.colocate: rl starts no inference server here, so the trainer has its GPUs to itself"
        )
    if shared and max(num_inf, num_train) > len(gpus):
        raise ValueError(
            f"devices.colocate: {num_inf} inference and {num_train} trainer GPUs requested but only {len(gpus)} "
            f"available ({gpus}); lower devices.num_inference_gpus / devices.num_trainer_gpus"
        )
    if not shared and num_inf + num_train > len(gpus):
        raise ValueError(
            f"{num_inf} inference + {num_train} trainer GPUs requested but only {len(gpus)} available ({gpus}); "
            "lower devices.num_inference_gpus / devices.num_trainer_gpus, set devices.gpu_ids, or share GPUs "
            "with devices.colocate = true"
        )
    inf_ids = gpus[:num_inf]
    train_ids = gpus[:num_train] if shared else gpus[num_inf : num_inf + num_train]
    place.env_of["trainer"]["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, train_ids))
    place.trainer_device = "cuda" if rl.trainer.device == "auto" else None
    place.devices["trainer"] = f"GPU {','.join(map(str, train_ids))}"
    if inference is not None:
        _place_inference_on_gpus(rl, place, inf_ids, train_ids, shared, facts)
    _place_teacher_on_gpus(rl, place, gpus, inf_ids, train_ids)
    return place


def _place_inference_on_gpus(
    rl: RLConfig, place: Placement, inf_ids: list[int], train_ids: list[int], shared: bool, facts: HostFacts
) -> None:
    inference = rl.inference
    assert inference is not None
    num_inf = len(inf_ids)
    place.env_of["inference"]["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, inf_ids))
    place.devices["inference"] = f"GPU {','.join(map(str, inf_ids))}"
    if shared:
        _share_gpus(rl, place, train_ids, facts)
    tp = inference.vllm.tensor_parallel_size
    if num_inf % tp:
        raise ValueError(f"devices.num_inference_gpus ({num_inf}) is not a multiple of tensor_parallel_size ({tp})")
    if inference.vllm.data_parallel_size == 1 and num_inf // tp > 1:
        place.inference_data_parallel = num_inf // tp
        place.notes.append(f"inference: data parallel size {num_inf // tp} (x tensor parallel {tp})")


def _place_teacher_on_gpus(
    rl: RLConfig, place: Placement, gpus: list[int], inf_ids: list[int], train_ids: list[int]
) -> None:
    """The teacher's vLLM on ``teacher.gpu_ids``, else on the next ``teacher.num_gpus`` GPUs nobody else has."""
    teacher = rl.teacher
    if teacher is None:
        return
    taken = inf_ids + train_ids
    if teacher.gpu_ids is not None:
        ids = list(teacher.gpu_ids)
        shared = sorted(set(ids) & set(taken))
        if shared and not rl.user_set("teacher.vllm.gpu_memory_utilization"):
            raise ValueError(
                f"teacher.gpu_ids shares GPU {shared} with the other processes: set teacher.vllm.gpu_memory_utilization "
                "to the share of its memory the teacher may take"
            )
        for gpu in shared:
            _check_teacher_share(rl, place, gpu, gpu in inf_ids, gpu in train_ids)
        place.teacher_shares_gpu = bool(shared)
    else:
        free = [g for g in gpus if g not in taken]
        if len(free) < teacher.num_gpus:
            raise ValueError(
                f"teacher.num_gpus ({teacher.num_gpus}): only {len(free)} GPU(s) left after inference and trainer "
                f"({gpus}); lower it, or share a GPU with teacher.gpu_ids and teacher.vllm.gpu_memory_utilization"
            )
        ids = free[: teacher.num_gpus]
    tp = teacher.vllm.tensor_parallel_size
    if len(ids) % tp:
        raise ValueError(f"teacher: {len(ids)} GPU(s) is not a multiple of teacher.vllm.tensor_parallel_size ({tp})")
    if teacher.vllm.data_parallel_size == 1 and len(ids) // tp > 1:
        place.teacher_data_parallel = len(ids) // tp
    place.env_of["teacher"] = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}
    place.devices["teacher"] = f"GPU {','.join(map(str, ids))}"
    if place.teacher_shares_gpu:
        place.devices["teacher"] += f" shared, vLLM {teacher.vllm.gpu_memory_utilization:g} of its memory"


def _check_teacher_share(rl: RLConfig, place: Placement, gpu: int, inference: bool, trainer: bool) -> None:
    """A GPU the teacher's vLLM shares: the memory shares of everyone on it fit (the trainer's only when capped)."""
    assert rl.teacher is not None
    shares, util = place.shares, rl.teacher.vllm.gpu_memory_utilization
    if trainer and shares is None:
        raise ValueError(
            f"teacher.gpu_ids: GPU {gpu} is the trainer's, which takes its memory uncapped unless inference and trainer "
            "share GPUs (devices.colocate); give the teacher another GPU"
        )
    taken = {"teacher.vllm.gpu_memory_utilization": util}
    if inference:
        key = "devices.inference_memory_fraction" if shares else "inference.vllm.gpu_memory_utilization"
        taken[key] = shares.inference_fraction if shares else rl.inference.vllm.gpu_memory_utilization
    if trainer and shares is not None:
        taken["devices.trainer_memory_fraction"] = shares.trainer_fraction
    if sum(taken.values()) > 1.0 + 1e-9:
        parts = " + ".join(f"{key} {value:g}" for key, value in taken.items())
        raise ValueError(f"teacher.gpu_ids: GPU {gpu} is over-committed ({parts} > 1); lower them")


def _share_gpus(rl: RLConfig, place: Placement, train_ids: list[int], facts: HostFacts) -> None:
    """Colocated: vLLM's memory share and how weights travel, once the trainer is known to fit beside vLLM."""
    assert rl.inference is not None
    micro_batch_tokens = rl.orchestrator.micro_batch_rows * rl.orchestrator.seq_len
    model = facts.model
    shares = check_fit(
        rl.devices, rl.trainer, len(train_ids), train_ids, facts.gpu_memory, model.num_params, model.config,
        micro_batch_tokens,
    )  # fmt: skip
    utilization_given = rl.user_set("inference.vllm.gpu_memory_utilization")
    place.notes += sharing_notes(shares, rl.trainer, rl.inference, utilization_given)
    place.shares = shares
    one_gpu = len(train_ids) == 1 and rl.devices.num_inference_gpus == 1
    configured = rl.trainer.weights.broadcast.type
    # vLLM 0.26 rejects an adapter built from IPC tensors (IndexError in set_lora of the merged projections, one H100,
    # 2026-11-26): a LoRA run on vLLM keeps sending adapters by files until that path is fixed.
    adapters_on_vllm = rl.trainer.model.lora is not None and rl.inference.engine == "vllm"
    if adapters_on_vllm and configured == "cuda_ipc":
        raise ValueError(
            "trainer.weights.broadcast.type = cuda_ipc with model.lora on vLLM: adapters over CUDA IPC are not "
            "supported by vLLM yet; use filesystem"
        )
    transport, note = shared_gpu_transport(
        configured, rl.user_set("trainer.weights.broadcast.type"), one_gpu, bool(rl.runs) or adapters_on_vllm
    )
    if transport != configured:
        place.weights_transport = transport
        place.notes.append(note)
    for role_name in ("inference", "trainer"):
        place.devices[role_name] += f" {shares.describe(role_name)}"


def _place_on_cpu(rl: RLConfig) -> Placement:
    inference = rl.inference
    if rl.trainer.device == "cuda":
        raise ValueError("trainer.device = cuda but no GPU is visible")
    if (attn := rl.trainer.init.attn) in ("flash_attn", "flash_attn4"):  # else the trainer fails once inference is up
        raise ValueError(f"trainer.init.attn = {attn} needs a GPU; use auto (or sdpa) on CPU")
    ranks = rl.devices.num_cpu_trainer_procs
    place = Placement(use_gpu=False, num_trainer_ranks=ranks, trainer_device="cpu")
    place.num_inference_servers = int(inference is not None)
    place.env_of = {role: {"CUDA_VISIBLE_DEVICES": ""} for role in ("inference", "orchestrator", "trainer")}
    place.devices["trainer"] = f"CPU x{ranks}" if ranks > 1 else "CPU"
    if inference is not None:
        place.devices["inference"] = "CPU (torch engine)"
        if inference.engine == "vllm":
            raise ValueError("inference.engine = vllm needs a GPU; use engine = torch (or auto) on CPU")
        place.inference_engine = "torch"
        if inference.torch.device not in ("auto", "cpu"):
            raise ValueError(f"inference.torch.device = {inference.torch.device} but no GPU is visible")
    else:
        place.env_of["inference"] = {}
    if rl.teacher is not None:
        if rl.teacher.engine == "vllm":
            raise ValueError("teacher.engine = vllm needs a GPU; use engine = torch (or auto) on CPU")
        if rl.teacher.torch.device not in ("auto", "cpu"):
            raise ValueError(f"teacher.torch.device = {rl.teacher.torch.device} but no GPU is visible")
        place.teacher_engine = "torch"
        place.env_of["teacher"] = {"CUDA_VISIBLE_DEVICES": ""}
        place.devices["teacher"] = "CPU (torch engine)"
    return place


def _assign_threads(rl: RLConfig, place: Placement, facts: HostFacts) -> None:
    """Threads of the processes on CPU: an explicit OMP_NUM_THREADS (env_vars or environment) stays for every
    role that devices.cpu_threads does not name."""
    inference = rl.inference
    use_gpu, num_trainer_ranks = place.use_gpu, place.num_trainer_ranks
    teacher = rl.teacher is not None and not use_gpu
    servers = [*(["inference"] if inference else []), *(["teacher"] if teacher else [])]
    on_cpu = ["orchestrator"] if use_gpu else ["orchestrator", "trainer", *servers]
    explicit = dict(rl.devices.cpu_threads)
    if inference is not None and inference.torch.num_threads is not None:
        explicit.setdefault("inference", inference.torch.num_threads)
    if teacher and rl.teacher.torch.num_threads is not None:
        explicit.setdefault("teacher", rl.teacher.torch.num_threads)
    inherited = rl.env_vars.get("OMP_NUM_THREADS") or facts.environ.get("OMP_NUM_THREADS")
    threads = split_cpu_threads(
        facts.cores,
        inference=not use_gpu and inference is not None,
        trainer_ranks=0 if use_gpu else num_trainer_ranks,
        explicit=explicit,
        teacher=teacher,
    )
    for name in on_cpu:
        if inherited and name not in explicit:
            place.devices[name] += f", OMP_NUM_THREADS={inherited} (inherited)"
            continue
        for var in THREAD_ENV_VARS:
            place.env_of[name][var] = str(threads[name])
        per_rank = " per rank" if name == "trainer" and num_trainer_ranks > 1 else ""
        place.devices[name] += f", {threads[name]} thread{'s' if threads[name] > 1 else ''}{per_rank}"


def place_on_cluster(rl: RLConfig, facts: ClusterFacts) -> Placement:
    """A multi-node SLURM job: one inference server per inference node, data parallel over its GPUs; the trainer
    under torchrun on the trainer nodes; the orchestrator beside trainer rank 0. The job script sets devices."""
    if rl.runs:
        raise ValueError("runs (multi-tenant LoRA) launch on one node: use the single-node-rl template")
    if rl.teacher is not None:
        raise ValueError(
            "[teacher] starts on one node only: in a multi-node job serve the teacher separately (`inference`) and set "
            "each distilling env's distill.teacher.base_url"
        )
    use_gpu = facts.gpus_per_node > 0
    unit = "GPU" if use_gpu else "CPU rank"
    place = Placement(
        use_gpu=use_gpu,
        num_trainer_ranks=facts.num_trainer_nodes * facts.procs_per_node,
        trainer_device="cuda" if use_gpu else "cpu",
        num_inference_servers=facts.num_inference_nodes,
        server_address=("0.0.0.0", facts.inference_port),
    )
    place.devices["trainer"] = f"{facts.num_trainer_nodes} node(s) x {facts.procs_per_node} {unit}(s)"
    inference = rl.inference
    if facts.num_inference_nodes > 0:
        if inference is None:
            raise ValueError("num_inference_nodes > 0 needs an [inference] config (or set it to 0 with inference_url)")
        place.devices["inference"] = f"{facts.num_inference_nodes} node(s) x {facts.gpus_per_node} GPU(s)"
        if use_gpu:
            place.inference_engine = "vllm" if inference.engine == "auto" else None
            tp = inference.vllm.tensor_parallel_size
            if facts.gpus_per_node % tp:
                raise ValueError(
                    f"gpus_per_node ({facts.gpus_per_node}) is not a multiple of tensor_parallel_size ({tp})"
                )
            place.inference_data_parallel = facts.gpus_per_node // tp
        else:
            place.inference_engine = "torch"
    place.devices["orchestrator"] = "CPU, beside trainer rank 0"
    return place
