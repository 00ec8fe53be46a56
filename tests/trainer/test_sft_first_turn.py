"""An assistant message that opens a conversation (a greeting before the user speaks, or a row with an empty
``prompt`` list): its role header, and a default system prompt the template adds before it (as Qwen2.5's does when
no system message leads), were trained as the assistant's text. Only the assistant's own text is trained."""

import pytest
from prime_core.config.trainer import LossMaskConfig
from prime_trainer.sft.data import build_samples, load_tokenizer, tokenize_conversation

from tests.trainer.trainer_utils import CHAT_TEMPLATE, write_char_tokenizer

DEFAULT_SYSTEM = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module", params=["plain", "default system prompt"])
def tokenizer(tmp_path_factory, request):
    template = CHAT_TEMPLATE if request.param == "plain" else DEFAULT_SYSTEM + CHAT_TEMPLATE
    return load_tokenizer(str(write_char_tokenizer(tmp_path_factory.mktemp("tok"), template)), None)


def _trained(tokenizer, ids, mask) -> str:
    return "".join(tokenizer.convert_ids_to_tokens(i) for i, m in zip(ids, mask, strict=True) if m)


def test_an_opening_assistant_message_trains_its_text_only(tokenizer):
    chat = [
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "abc"},
        {"role": "assistant", "content": "cba"},
    ]
    ids, mask = tokenize_conversation(tokenizer, chat, None, LossMaskConfig())
    assert _trained(tokenizer, ids, mask) == "hi<|im_end|>\ncba<|im_end|>\n"


def test_a_row_with_an_empty_prompt_trains_the_completion_only(tokenizer):
    (sample,) = build_samples([{"prompt": [], "completion": "olleh"}], tokenizer, LossMaskConfig(), 64)
    assert _trained(tokenizer, sample.input_ids.tolist(), sample.loss_mask.tolist()) == "olleh<|im_end|>\n"


def test_a_role_named_like_a_config_method_is_never_trained(tokenizer):
    """``getattr(loss_mask, role)`` found pydantic's methods: roles `json`, `copy`, `dict`, `schema` were trained."""
    chat = [{"role": "user", "content": "abc"}, {"role": "json", "content": "x"}, {"role": "assistant", "content": "y"}]
    ids, mask = tokenize_conversation(tokenizer, chat, None, LossMaskConfig())
    assert _trained(tokenizer, ids, mask) == "y<|im_end|>\n"
