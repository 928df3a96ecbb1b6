"""Fixtures shared by the node test suites: the tiny model (bf16) and the offline oracle."""

import pytest
import torch

from model.deepseek import DeepseekModel
from native import ops
from runtime.generate import OfflineGenerator
from tinymodel.make import make_tiny_model


@pytest.fixture(scope="session")
def one_thread():
    """Nodes run one kernel thread by default; on a shared 2-core machine more threads only
    contend (a tiny-model forward gets ~10x slower)."""
    was = torch.get_num_threads()
    ops.set_num_threads(1)
    yield
    ops.set_num_threads(was)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=5)


@pytest.fixture(scope="session")
def model(tiny_dir):
    return DeepseekModel.from_pretrained(tiny_dir, dtype=torch.bfloat16, progress=False)


@pytest.fixture(scope="session")
def offline(model):
    """offline(prompt, params) -> OfflineGenerator's token ids (the oracle), cached."""
    generator = OfflineGenerator(model, page_size=16, chunk_size=256)
    cache = {}

    def run(prompt, params):
        key = (tuple(prompt), params)
        if key not in cache:
            cache[key] = generator.generate(list(prompt), params).token_ids
        return cache[key]

    return run
