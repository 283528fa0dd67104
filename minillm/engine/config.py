"""Every engine option, defined once (design.md §8). ``LLM``, the server's config and the CLI
all read this dataclass; its field names follow vLLM's where the concept is the same."""
from __future__ import annotations

from dataclasses import dataclass, fields

POLICIES = ("chunked", "prefill-first")


@dataclass
class EngineConfig:
    model: str = "tiny"                     # a preset (shape twin), a checkpoint directory or a hub id
    tokenizer: str | None = None            # None: the checkpoint's own, or the shipped default for twins
    device: str | None = None               # None: cuda → mps → cpu
    dtype: str | None = None                # None: bf16 on CUDA, fp32 on the CPU
    seed: int = 0                           # weights of a twin, and unseeded sampling
    max_batch_size: int = 64                # vLLM's max_num_seqs: KV slots = rows in one step
    max_num_batched_tokens: int | None = None   # token budget of one step (None: see resolved_budget)
    max_model_len: int | None = None        # context per request; None: the model's, capped to fit
    kv_memory_fraction: float = 0.5         # of free device memory the KV cache may take
    scheduling_policy: str = "chunked"      # "chunked" (vLLM V1's default) or "prefill-first" (10.4's stall)
    enable_prefix_caching: bool = True      # a finished request's K/V serves later prompts with its prefix
    enforce_eager: bool = False             # True: never capture CUDA graphs (vLLM's name)
    compile: bool = False                   # torch.compile the decode step (Inductor); eager is the reference
    sync_timing: bool = True                # synchronise before stamping traces (timestamps = work done)
    step_history: int = 4096                # StepRecords kept in the engine's ring buffer

    def __post_init__(self) -> None:
        problems = []
        if self.scheduling_policy not in POLICIES:
            problems.append(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {self.scheduling_policy!r}")
        for name in ("max_batch_size", "max_num_batched_tokens", "max_model_len", "step_history"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                problems.append(f"{name} must be an integer ≥ 1, got {v!r}")
        if not 0 < self.kv_memory_fraction <= 1:
            problems.append(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction!r}")
        if problems:
            raise ValueError("invalid EngineConfig: " + "; ".join(problems))

    def resolved_budget(self, max_model_len: int) -> int:
        """Tokens one step may hold. Chunked: 2048 (a long prompt is split across steps).
        Prefill-first: at least the context, so a whole prompt fits one step."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.scheduling_policy == "chunked" else max(2048, max_model_len)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
