"""``prompt_bound``: messages that no context of the model holds are refused before the renderer tokenizes them (an
environment's 100 MB answer held its worker's renderer for minutes), with the error the server answers for an
over-long prompt; messages that may fit render exactly as before."""

from __future__ import annotations

import json
import time

import pytest

from tests.fixtures.models import build_tool_tokenizer

CONTEXT = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bound_model")
    build_tool_tokenizer().save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": CONTEXT}))
    return path


def build(model_dir):
    from prime_orchestrator.rendering import resolve_renderer
    from pydantic import TypeAdapter
    from renderers import RendererConfig, create_renderer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = TypeAdapter(RendererConfig).validate_python(resolve_renderer("default", str(model_dir)))
    return create_renderer(tokenizer, config), tokenizer


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_an_enormous_message_is_refused_at_once_as_over_the_context(model_dir):
    """Before: 4M characters took ~6 s to tokenize on this tokenizer (100 MB: past any rollout timeout)."""
    from verifiers.v1.errors import ProviderError

    renderer, _ = build(model_dir)
    for render in (
        lambda text: renderer.render(user(text), add_generation_prompt=True),
        lambda text: renderer.render_ids(user(text), add_generation_prompt=True),
        lambda text: renderer.bridge_to_next_turn([1] * 10, [2] * 5, user(text)),
    ):
        start = time.monotonic()
        with pytest.raises(ProviderError, match=f"maximum context length is {CONTEXT} tokens") as caught:
            render("x" * 4_000_000)
        assert time.monotonic() - start < 0.5 and caught.value.status_code == 400


def test_messages_that_may_fit_render_as_before_and_a_bridge_counts_its_known_tokens(model_dir):
    from prime_orchestrator.prompt_bound import SLACK
    from verifiers.v1.errors import ProviderError

    renderer, tokenizer = build(model_dir)
    per_token = max(len(t) for t in tokenizer.get_vocab()) * SLACK
    fits = "x" * ((CONTEXT + 1) * per_token - 1)  # may fit as far as characters tell: tokenized (the server judges)
    assert len(renderer.render(user(fits), add_generation_prompt=True).token_ids) > CONTEXT
    parts = [{"role": "user", "content": [{"type": "text", "text": fits}, {"type": "text", "text": "x"}]}]
    with pytest.raises(ProviderError):  # text parts count: one character more
        renderer.render(parts, add_generation_prompt=True)
    with pytest.raises(ProviderError):  # the previous turns' tokens count
        renderer.bridge_to_next_turn([1] * CONTEXT, [2], user("x" * per_token))


@pytest.mark.parametrize(
    ("config", "ceiling"),
    [
        ({"max_position_embeddings": 4096}, 4096),
        ({"max_position_embeddings": 32768, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 131072),
        ({"text_config": {"max_position_embeddings": 8192}}, 8192),
        ({"n_positions": 1024}, 1024),
        ({"hidden_size": 8}, None),
        ([1, 2], None),
    ],
)
def test_the_context_ceiling_is_read_off_the_model_config(tmp_path, config, ceiling):
    from prime_orchestrator.prompt_bound import context_ceiling

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert context_ceiling(str(tmp_path)) == ceiling
    assert context_ceiling(str(tmp_path / "missing")) is None and context_ceiling("Qwen/Qwen3-0.6B") is None
