"""The offline, vLLM-compatible API::

    from engine import LLM, SamplingParams
    llm = LLM("path/to/checkpoint", device="cpu", dtype="float32")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=64))
    outs[0].token_ids, outs[0].text, outs[0].finish_reason, outs[0].num_cached_tokens

``llm.embed(prompts)`` returns one vector per prompt (``engine.pooling``: the checkpoint's pooling
unless ``pooling`` says otherwise), computed by the same scheduler and runner as generation.

Invariants: ``generate`` validates every prompt before it queues any (a bad one raises
``RequestValidationError`` and nothing runs); it returns one ``RequestOutput`` per prompt, in input
order, each finished. ``llm.stats`` is the engine's counters snapshot (preemptions, partial prefill
chunks, computed prefill tokens, prefix queries and hits).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceLike
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.kv.pins import DEFAULT_POLICY, CachePolicy
from engine.llm_engine import LLMEngine, RequestValidationError
from engine.lora.registry import LoRARequest
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.pooling import PoolingParams, checkpoint_pooling
from engine.sampling_params import SamplingParams

Prompt = str | SequenceLike[int]
T = TypeVar("T")


class LLM:
    def __init__(
        self,
        model: str,
        device: str = "cpu",
        dtype: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        attention_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        config = EngineConfig(
            model=str(model),
            device=device,
            dtype=dtype,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            attention_backend=attention_backend,
            **kwargs,
        )
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Finish the disk tier's writes (the only state that outlives the process)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def embed(self, prompts: Prompt | SequenceLike[Prompt], pooling: PoolingParams | None = None,
              cache_salt: str | None | SequenceLike[str | None] = None) -> list[list[float]]:
        """One embedding per prompt (strings or token-id lists), in input order."""
        pooling = pooling or checkpoint_pooling(self.engine.config.model)
        outputs = self.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), cache_salt,
                                pooling=pooling)
        return [out.embedding for out in outputs]  # type: ignore[misc]

    def generate(
        self,
        prompts: Prompt | SequenceLike[Prompt],
        params: SamplingParams | SequenceLike[SamplingParams] | None = None,
        cache_salt: str | None | SequenceLike[str | None] = None,
        priority: int | SequenceLike[int] | None = None,
        tenant: str | SequenceLike[str] | None = None,
        pooling: PoolingParams | None = None,
        cache_policy: CachePolicy = DEFAULT_POLICY,
        lora_request: LoRARequest | None | SequenceLike[LoRARequest | None] = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` (strings or token-id lists) to completion; outputs in input order. With
        ``pooling``, each is an embedding request (``RequestOutput.embedding``; see ``embed``);
        ``cache_policy``: every prompt's prefix-cache lifetimes (``engine.kv.pins``); ``lora_request``:
        the LoRA adapter of every prompt, or of each (None: the base model)."""
        prompt_list = _as_prompt_list(prompts)
        n = len(prompt_list)
        params_list = _per_prompt(params if params is not None else SamplingParams(), n, "params",
                                  SamplingParams)
        salts: list[str | None] = _per_prompt(cache_salt, n, "cache_salt", (str, type(None)))
        priorities: list[int] = _per_prompt(priority if priority is not None else 0, n, "priority", int)
        tenants: list[str] = _per_prompt(tenant if tenant is not None else "", n, "tenant", str)
        loras: list[LoRARequest | None] = _per_prompt(lora_request, n, "lora_request",
                                                      (LoRARequest, type(None)))
        token_lists = [
            self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompt_list
        ]
        request_ids = [f"offline-{next(self._ids)}" for _ in range(n)]
        for i, (rid, tokens, sp) in enumerate(zip(request_ids, token_lists, params_list, strict=True)):
            try:
                self.engine.validate_request(rid, tokens, sp)
            except RequestValidationError as e:
                raise RequestValidationError(f"prompt {i}: {e.message}", e.param) from e
        outputs: dict[str, RequestOutput] = {}
        try:
            for i, (rid, prompt) in enumerate(zip(request_ids, prompt_list, strict=True)):
                self.engine.add_request(rid, token_lists[i], params_list[i], tenant=tenants[i],
                                        cache_salt=salts[i], priority=priorities[i], pooling=pooling,
                                        cache_policy=cache_policy, lora=loras[i])
                outputs[rid] = RequestOutput(
                    request_id=rid,
                    prompt_token_ids=token_lists[i],
                    outputs=[CompletionOutput(index=k) for k in range(params_list[i].n)],
                    prompt=prompt if isinstance(prompt, str) else None,
                )
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    out = outputs.get(delta.request_id)
                    if out is not None:
                        out.add(delta)
        except BaseException:
            # Interrupted (or the engine failed): leave no request of this call behind.
            for rid in request_ids:
                self.engine.abort(rid)
            self.engine.discard_pending()
            raise
        return [outputs[rid] for rid in request_ids]


def _as_prompt_list(prompts: Prompt | SequenceLike[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    token_ids = [t for t in items if isinstance(t, int)]
    if items and len(token_ids) == len(items):
        return [token_ids]  # one prompt given as token ids
    prompt_list: list[Prompt] = []
    for p in items:
        if isinstance(p, str):
            prompt_list.append(p)
        elif isinstance(p, SequenceLike) and all(isinstance(t, int) for t in p):
            prompt_list.append(p)
        else:
            raise TypeError(f"each prompt must be a string or a list of token ids, got {type(p).__name__}")
    return prompt_list


def _per_prompt(value: T | SequenceLike[T], n: int, name: str, item_type: Any) -> list[T]:
    if isinstance(value, item_type):
        return [value] * n  # type: ignore[list-item]
    values = list(value)  # type: ignore[arg-type]
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
    for v in values:
        if not isinstance(v, item_type):
            raise TypeError(f"{name} entries must be {item_type}, got {type(v).__name__}")
    return values
