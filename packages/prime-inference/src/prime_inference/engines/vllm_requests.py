"""A request as vLLM takes it: our sampling fields as vLLM's ``SamplingParams``, and what vLLM refuses when the request
is added as a one-line 400. Every vllm import is inside a function (the module imports without the extra)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from prime_core.io import one_line

from prime_inference.engines.base import EngineRequest
from prime_inference.protocol import RequestError
from prime_inference.token_logprobs import TAP_FLAG


def sampling_params(request: EngineRequest, tapped: bool) -> Any:
    """vLLM's ``SamplingParams`` of one engine request: every field of ours (``tapped``: the worker-side tap collects
    the sampled log-probs, so vLLM computes no alternatives)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    p = request.params
    structured = StructuredOutputsParams(**p.structured_outputs) if p.structured_outputs else None
    return SamplingParams(
        n=1,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k if p.top_k > 0 else -1,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logit_bias=p.logit_bias or None,
        allowed_token_ids=p.allowed_token_ids,
        structured_outputs=structured,
        seed=p.seed,
        stop=p.stop or None,
        stop_token_ids=p.stop_token_ids or None,
        ignore_eos=p.ignore_eos,
        max_tokens=p.max_tokens,
        min_tokens=p.min_tokens,
        logprobs=0 if tapped else p.logprobs,  # the tap needs no alternatives
        prompt_logprobs=p.prompt_logprobs,
        # Log-probs as flat per-request lists, not a dict and a Logprob object per token and alternative.
        flat_logprobs=p.logprobs is not None,
        include_stop_str_in_output=p.include_stop_str_in_output,
        # The server detokenizes; vLLM only needs text to match stop strings.
        detokenize=bool(p.stop),
        skip_special_tokens=p.skip_special_tokens,
        extra_args={TAP_FLAG: True} if tapped else None,
        output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
    )


async def refused_as_400(outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """vLLM's outputs of one request, with what vLLM refuses before generating (its ``ValueError`` from checking the
    request: a grammar its backend cannot compile, a parameter its sampler does not take) as a one-line 400, as
    `vllm serve` answers it, not a 500 with a traceback in the log. Errors once tokens flow stay errors."""
    started = False
    try:
        async for output in outputs:
            started = True
            yield output
    except ValueError as e:
        if started:
            raise
        raise RequestError(f"vLLM refused the request: {one_line(str(e))}", param="sampling_params") from None
    finally:  # closed early (the client left): closing vLLM's generator aborts the request inside the engine
        await outputs.aclose()  # type: ignore[attr-defined]
