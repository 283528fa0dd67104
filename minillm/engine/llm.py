"""``LLM``: the vLLM-shaped front door (``generate``, ``stream``) over one ``LLMEngine``."""
from __future__ import annotations

from typing import Iterator

from minillm.core.device import default_dtype, parse_dtype, pick_device
from minillm.engine.config import EngineConfig
from minillm.engine.engine import LLMEngine, RequestOutput, generation_config_eos
from minillm.engine.sampling import SamplingParams
from minillm.engine.tokenizer import load_tokenizer
from minillm.model.loader import is_shape_twin, load_model, resolve_checkpoint


class LLM:
    """``LLM(model="tiny")`` then ``generate`` / ``stream`` (the API mirrors vLLM's).

    ``model``: a preset (a shape twin with random weights: its text is gibberish, its speed is
    real), a Hugging Face checkpoint directory, or a hub id available on this machine. Every
    other keyword is a field of ``EngineConfig`` (or pass ``config=EngineConfig(...)``).
    """

    def __init__(self, model: str = "tiny", *, config: EngineConfig | None = None, **options):
        if config is None:
            config = EngineConfig(model=str(model), **options)
        elif options:
            raise TypeError("give either config=EngineConfig(...) or keyword options, not both")
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = parse_dtype(config.dtype) if config.dtype is not None else default_dtype(self.device)
        self.model_name = str(config.model)
        self.is_shape_twin = is_shape_twin(config.model)
        checkpoint = None if self.is_shape_twin else resolve_checkpoint(config.model)
        tokenizer = config.tokenizer if config.tokenizer is not None else (
            str(checkpoint) if checkpoint is not None else None)
        self.tokenizer = load_tokenizer(tokenizer)
        self.model = load_model(config.model, self.device, self.dtype, config.seed)
        engine = LLMEngine(self.model, self.tokenizer, config)
        extra = generation_config_eos(checkpoint)
        if extra:
            engine.eos_ids = engine.eos_ids | extra
        self.engine = engine

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        seqs = [self.engine.prepare(p, sp) for p, sp in zip(prompts, params_list)]  # all validated first
        for s in seqs:
            self.engine.enqueue(s)
        bar = _progress(len(seqs)) if use_tqdm else None
        while any(not s.finished for s in seqs):
            for o in self.engine.step():
                if o.finished and bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [self.engine.output_of(self.engine.pop_finished(s.request_id)) for s in seqs]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas as they are produced. Closing the iterator early aborts the request."""
        rid = self.engine.add_request(prompt, params)
        seq = self.engine.get(rid)
        try:
            while not seq.finished:
                for o in self.engine.step():
                    if o.request_id == rid and o.delta:
                        yield o.delta
            if seq.finish_reason == "error":
                raise RuntimeError(f"request {rid} failed: {seq.error}")
        finally:
            if not seq.finished:
                self.engine.abort(rid)
            self.last_output = self.engine.output_of(self.engine.pop_finished(rid))


def _progress(total: int):
    from tqdm.auto import tqdm
    return tqdm(total=total, unit="req")
