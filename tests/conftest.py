import os

import pytest
import torch

# Keep tests deterministic and light on the 2-core CI box.
torch.set_num_threads(min(2, os.cpu_count() or 1))
os.environ.setdefault("MINILLM_FAST", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_llm():
    from minillm import LLM
    return LLM(model="tiny", device="cpu", dtype="fp32", max_batch_size=8)
