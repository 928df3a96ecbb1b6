"""The phase timers of bench/step_phases.py on the tiny model with an MTP layer."""

from __future__ import annotations

import pytest
import torch

from bench.step_phases import phase_timers
from control.sampling_params import SamplingParams
from model.deepseek import DeepseekModel
from model.layers import MoE
from runtime.generate import OfflineGenerator
from runtime.speculative_generate import SpeculativeGenerator
from tinymodel.make import make_tiny_model

PROMPT = [1, 5, 9, 30, 2, 7, 8, 100, 200, 3, 4, 17, 250]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    path = make_tiny_model(
        tmp_path_factory.mktemp("mtp"), seed=11, overrides={"num_nextn_predict_layers": 1}
    )
    return DeepseekModel.from_pretrained(path, dtype=torch.float32, progress=False, mtp=True)


def _moes(model):
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]


def test_one_row_reads_top_k_experts_and_the_timers_come_off(mtp_model):
    offline = OfflineGenerator(mtp_model, page_size=4)
    table = offline.pool.new_table()
    logits = offline.prefill(table, PROMPT)
    routed = [moe.routed_experts for moe in _moes(mtp_model)]
    assert routed  # the tiny model has MoE layers: the count below is not vacuous
    with phase_timers(mtp_model) as phases:
        timed = offline.decode(table, int(logits.argmax()), len(PROMPT))
    reference = offline.decode(table, int(logits.argmax()), len(PROMPT))
    assert torch.equal(timed, reference)  # the wrappers change nothing of the output
    # One row picks top-k distinct experts in each MoE layer.
    assert phases.moe_calls == len(routed)
    assert phases.per_step(1)["experts_per_moe_layer"] == mtp_model.cfg.num_experts_per_tok
    assert phases.main_s > 0.0 and phases.draft_s == 0.0
    assert not {"forward", "forward_with_hidden", "forward_mtp"} & mtp_model.__dict__.keys()
    assert [moe.routed_experts for moe in _moes(mtp_model)] == routed


def test_speculative_steps_split_into_verify_and_draft(mtp_model):
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    spec = SpeculativeGenerator(mtp_model, 1)
    expected = spec.generate(PROMPT, params).token_ids
    with phase_timers(mtp_model) as phases:
        assert spec.generate(PROMPT, params).token_ids == expected
    assert phases.main_s > 0.0 and phases.draft_s > 0.0
    # Prefill chunks and verify passes are main forwards: the union of their rows' picks is
    # at least top-k and at most every expert.
    k, experts = mtp_model.cfg.num_experts_per_tok, mtp_model.cfg.n_routed_experts
    assert k <= phases.per_step(1)["experts_per_moe_layer"] <= experts
