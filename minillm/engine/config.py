"""Every engine option, defined once (design.md §8). ``LLM``, the server's config and the CLI
all read this dataclass; its field names follow vLLM's where the concept is the same."""
from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, dataclass, fields

POLICIES = ("chunked", "prefill-first")
MATMUL_MODES = ("auto", "aten")             # engine/matmul.py

# Fields a command names in its own way (its positional model, --device, --dtype, --seed): no engine flag.
NOT_FLAGS = ("model", "tokenizer", "device", "dtype", "seed")
FLAG_HELP = {
    "max_batch_size": "requests in one step, i.e. KV slots (vLLM's --max-num-seqs)",
    "max_num_batched_tokens": "tokens one step may hold (default: 2048 chunked; prefill-first: at least the "
                              "context)",
    "max_model_len": "context per request (default: the model's, capped to fit the KV memory)",
    "kv_memory_fraction": "share of free device memory the KV cache may take",
    "scheduling_policy": "chunked (decodes and prefill chunks share each step) or prefill-first",
    "enable_prefix_caching": "reuse a finished request's K/V for a later prompt with the same prefix",
    "enforce_eager": "the plain path: no CUDA graphs, torch's own matmuls (overrides --matmul)",
    "matmul": "auto: each weight shape's fastest correct decode matmul on this CPU, measured once and "
              "cached; aten: torch's F.linear (the readable reference)",
    "compile": "torch.compile the decode step (Inductor; eager is the default and the reference)",
    "sync_timing": "synchronise the device before stamping traces (timestamps = work done)",
    "step_history": "StepRecords the engine keeps (GET /v1/steps)",
}


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
    enforce_eager: bool = False             # True: no CUDA graphs, plain matmuls (vLLM's name)
    matmul: str = "auto"                    # "auto": chosen per CPU by measurement (engine/matmul.py); "aten"
    compile: bool = False                   # torch.compile the decode step (Inductor); eager is the reference
    sync_timing: bool = True                # synchronise before stamping traces (timestamps = work done)
    step_history: int = 4096                # StepRecords kept in the engine's ring buffer

    def __post_init__(self) -> None:
        problems = []
        if self.matmul not in MATMUL_MODES:
            problems.append(f"matmul must be one of {', '.join(MATMUL_MODES)}, got {self.matmul!r}")
        if self.scheduling_policy not in POLICIES:
            problems.append(f"scheduling_policy must be one of {', '.join(POLICIES)}, got "
                            f"{self.scheduling_policy!r}")
        for name in ("max_batch_size", "max_num_batched_tokens", "max_model_len", "step_history"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                problems.append(f"{name} must be an integer ≥ 1, got {v!r}")
        if not 0 < self.kv_memory_fraction <= 1:
            problems.append(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction!r}")
        if problems:
            raise ValueError("invalid EngineConfig: " + "; ".join(problems))

    def resolved_matmul(self) -> str:
        """The matmul mode the runner applies: the plain one under enforce_eager. Under compile the
        runner keeps the chosen kernels only where they beat Inductor's own (engine/matmul.py prepare)."""
        return "aten" if self.enforce_eager else self.matmul

    def resolved_budget(self, max_model_len: int) -> int:
        """Tokens one step may hold. Chunked: 2048 (a long prompt is split across steps).
        Prefill-first: at least the context, so a whole prompt fits one step."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.scheduling_policy == "chunked" else max(2048, max_model_len)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                      defaults: dict | None = None) -> None:
        """One flag per field (``--max-batch-size`` …), in a group of its own. Values are checked by
        ``__post_init__`` (one place), so a flag takes any string of its type and a bad value is
        this class's one-line error. A flag not given stays None: :meth:`from_args` then applies
        ``defaults``, else the field's default."""
        hints = typing.get_type_hints(cls)
        g = parser.add_argument_group("engine options (EngineConfig)")
        for f in fields(cls):
            if f.name in NOT_FLAGS:
                continue
            flag = "--" + f.name.replace("_", "-")
            default = (defaults or {}).get(f.name, f.default if f.default is not MISSING else None)
            help_ = FLAG_HELP.get(f.name, f.name) + (f" (default: {default})" if default is not None else "")
            if hints[f.name] is bool:
                g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
                continue
            kind = next(t for t in (typing.get_args(hints[f.name]) or (hints[f.name],))
                        if t is not type(None))
            metavar = ("{" + ",".join(POLICIES) + "}" if f.name == "scheduling_policy"
                       else kind.__name__.upper())
            g.add_argument(flag, type=kind, default=None, metavar=metavar, help=help_)

    @classmethod
    def from_args(cls, a: argparse.Namespace, exclude: tuple[str, ...] = (), **defaults) -> "EngineConfig":
        """The config a namespace asks for: the flags given (not None), else ``defaults``, else the
        fields' own. ``exclude``: names that mean something else in this command. Raises ValueError
        (one line) for a bad value."""
        options = dict(defaults)
        for name in cls.names():
            v = getattr(a, name, None)
            if v is not None and name not in exclude:
                options[name] = v
        return cls(**options)
