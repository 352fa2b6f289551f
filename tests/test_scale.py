"""Real sizes from small ones (issue #19): a large model traced cut to 3 blocks and simulated
cut to 3 and 4, its figures carried to all N, equal to the whole model's to the byte and FLOP."""
import itertools

import pytest

import ddpkit
from ddpkit.spec.setting import CheckpointSetting
from ddpkit.predict import scale
from ddpkit.predict.simulate import simulate
from ddpkit.predict.trace import traced

CPU = dict(backend="gloo", device="cpu")


def llama(layers=6):
    def make():
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=layers, num_attention_heads=4,
                                            num_key_value_heads=2, vocab_size=256,
                                            max_position_embeddings=64, use_cache=False))
    return make


def configs():
    yield ddpkit.TrainConfig(model="gpt", n_blocks=6, width=64, seq_len=32, micro_batch=4, **CPU)
    pytest.importorskip("transformers")
    yield ddpkit.TrainConfig(model=llama(), seq_len=32, micro_batch=2, **CPU)


@pytest.mark.parametrize("i", [0, 1], ids=["gpt", "llama"])
def test_the_carried_trace_is_the_whole_trace(i):
    cfg = list(configs())[i]
    whole, cut = traced(cfg, keep=None), traced(cfg, keep=3)
    assert cut.scaled and len(cut.blocks) == 3 and not whole.scaled
    assert cut.param_bytes == whole.param_bytes
    assert (cut.block_keeps, cut.block_boundary, cut.block_flops) == \
        (whole.block_keeps, whole.block_boundary, whole.block_flops)
    settings = [None, "full", 2, 3, 6] + [list(m) for m in
                                        itertools.product((False, True), repeat=6)][::7]
    for value in settings:
        s = CheckpointSetting.of(value, 6)
        assert cut.forward_bytes(s) == whole.forward_bytes(s), value
        assert cut.step_flops(s) == whole.step_flops(s), value


@pytest.mark.parametrize("change", [dict(), dict(checkpoint="full"), dict(strategy="fsdp"),
                                    dict(strategy="ddp_zero1", precision="bf16")],
                         ids=["ddp", "full", "fsdp", "zero1-bf16"])
def test_the_scaled_step_is_the_whole_step(change):
    pytest.importorskip("transformers")
    cfg = ddpkit.TrainConfig(model=llama(), seq_len=32, micro_batch=2, optimizer="adamw",
                             **CPU, **change)
    whole = simulate(cfg)
    scaled = scale.scaled(simulate, cfg, 0)
    assert scaled.how == "scaled from 3 and 4 blocks"
    for step in (0, 1):  # to a few bytes: AdamW's 4-byte step counts land in different parts
        a, b = scaled.peaks[step], whole.peaks[step]
        assert abs(a.bytes - b.bytes) <= 64 and a.phase == b.phase
        assert all(abs(a.ledger[k] - b.ledger[k]) <= 64 for k in a.ledger)
