"""Node tests run with one kernel thread, like the nodes (fixtures in tests/conftest.py), and
share the float32 tiny model and its offline oracle."""

import pytest
import torch

from model.deepseek import DeepseekModel
from runtime.generate import OfflineGenerator


@pytest.fixture(scope="session", autouse=True)
def nodes_use_one_thread(one_thread):
    yield


@pytest.fixture(scope="session")
def model32(tiny_dir):
    """float32: chunked prefill, a re-prefilled prefix and the decode path agree with offline
    generation token for token (bfloat16 rounding may flip a near-tie)."""
    return DeepseekModel.from_pretrained(tiny_dir, dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def offline32(model32):
    """offline32(prompt, params) -> OfflineGenerator's GenerationResult (the oracle)."""
    return OfflineGenerator(model32, page_size=16, chunk_size=256).generate
