"""One prefill per distinct prompt: rollouts of the same prompt admitted together share its KV cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from prime_inference.engines.model_runner import CachedDecoder, RecomputeDecoder, load_causal_lm
from prime_inference.engines.torch_engine import _same_prompt_groups
from transformers import AutoConfig, AutoModelForCausalLM


def _seq(prompt: list[int], lora: str | None = None, image: bool = False):
    return SimpleNamespace(
        request=SimpleNamespace(prompt_ids=prompt, lora_name=lora, multimodal=object() if image else None)
    )


def test_groups_by_prompt_and_adapter_and_keep_images_apart():
    seqs = [_seq([1, 2]), _seq([1, 2], "a"), _seq([3]), _seq([1, 2]), _seq([1, 2], "a"), _seq([1, 2], image=True),
            _seq([1, 2], image=True)]  # fmt: skip
    index = {id(s): i for i, s in enumerate(seqs)}
    assert [[index[id(s)] for s in g] for g in _same_prompt_groups(seqs)] == [[0, 3], [1, 4], [2], [5], [6]]


@pytest.mark.parametrize("decoder_cls", [CachedDecoder, RecomputeDecoder])
def test_copied_prompt_decodes_exactly_like_its_own_prefill(model_dir, decoder_cls):
    cpu = torch.device("cpu")
    if decoder_cls is CachedDecoder:
        model, _ = load_causal_lm(str(model_dir), dtype=torch.float32, device=cpu, trust_remote_code=False)
    else:  # the fallback decoder serves transformers models
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    decoder = decoder_cls(model, AutoConfig.from_pretrained(model_dir), num_slots=3, max_len=64, device=cpu)
    prompt = [5, 9, 14, 3, 7, 21, 2]
    first = decoder.prefill(0, prompt)
    decoder.copy_prompt(0, 1, len(prompt))
    assert torch.equal(decoder.prefill(2, prompt), first)
    token = int(first.argmax())
    # Slot 1 never ran its prompt: its cache is slot 0's copy, so it continues exactly like slot 2, which did.
    copied = decoder.decode([1], [token], [len(prompt)])
    prefilled = decoder.decode([2], [token], [len(prompt)])
    assert torch.equal(copied, prefilled)
