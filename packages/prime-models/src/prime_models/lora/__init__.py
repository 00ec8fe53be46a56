"""LoRA: named low-rank adapters injected into a built model's linear layers, and their PEFT-format export.

`apply_lora` replaces each targeted `nn.Linear` (matched by its attribute name, e.g. ``q_proj``) with a `LoRALinear`
that keeps the base ``weight``/``bias`` under the same names (HF conversion, DCP checkpoints and FSDP wrapping see
the same parameters as before) and adds per-adapter ``lora_A.<adapter>`` / ``lora_B.<adapter>`` linear layers:

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T

A is Kaiming-uniform initialized and B zero, so a new adapter leaves the model's outputs unchanged. Every parameter
that is not an adapter is frozen. Apply it to a fully built (materialized) model before FSDP, as the parallelize
order in `prime_models.parallel` expects: FSDP then shards base and adapter parameters alike, and only the adapters
get gradients.

Several adapters may live on one base model (multi-tenant training, multi-adapter serving). Which one a forward uses
is a property of the model, not of the call: `set_active_adapter` picks one adapter for the whole batch (training),
`set_row_adapters` one per batch row (serving a mixed batch). An adapter that a layer does not have contributes zero
in that layer.

Export: `save_adapter` writes ``adapter_config.json`` + ``adapter_model.safetensors`` with PEFT's key names
(``base_model.model.<module>.lora_A.weight``), which vLLM's LoRA loader and ``peft.PeftModel.from_pretrained`` read;
`load_adapter` reads such a directory back. Merged full weights come from
``prime_models.save_hf(model, path, lora_adapter=name)``, or in place from `merge_adapter` / `unmerge_adapter`.

Shape legend: B batch rows, S sequence, I in features, O out features, R rank.
"""

from prime_core.schemas.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS

from prime_models.lora.adapters import (
    DEFAULT_TARGET_MODULES,
    AdapterSelection,
    LoRALinear,
    LoRASpec,
    adapter_names,
    adapter_parameters,
    add_adapter,
    apply_lora,
    check_adapter_name,
    freeze_base,
    is_adapter_param,
    lora_layers,
    merge_adapter,
    remove_adapter,
    selection,
    set_active_adapter,
    set_row_adapters,
    unmerge_adapter,
    use_adapter,
)
from prime_models.lora.files import (
    PEFT_PREFIX,
    adapter_state_dict,
    copy_adapters,
    install_adapter,
    load_adapter,
    read_adapter,
    save_adapter,
)

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "DEFAULT_TARGET_MODULES",
    "PEFT_PREFIX",
    "AdapterSelection",
    "LoRALinear",
    "LoRASpec",
    "adapter_names",
    "adapter_parameters",
    "adapter_state_dict",
    "add_adapter",
    "apply_lora",
    "check_adapter_name",
    "copy_adapters",
    "freeze_base",
    "install_adapter",
    "is_adapter_param",
    "load_adapter",
    "lora_layers",
    "merge_adapter",
    "read_adapter",
    "remove_adapter",
    "save_adapter",
    "selection",
    "set_active_adapter",
    "set_row_adapters",
    "unmerge_adapter",
    "use_adapter",
]
