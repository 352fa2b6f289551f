"""Segments that mean the same on every model, and one checkpoint value (issue #21).

``checkpoint=s`` means what ``checkpoint_sequential(segments=s)`` means on transformers models,
which loop over their own ``nn.ModuleList``: a checkpointed segment is one region that keeps one
input and is recomputed as a whole. Real 2-rank gloo runs on GPT-2, Llama and BERT (tiny
configs, nothing downloaded); the guard and the fallbacks on one process."""
import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn

import ddpkit
from ddpkit.runtime.pool import shared_pool
import fixtures_module as fm
from ddpkit.engine.policies import CheckpointPolicy
from ddpkit.spec.setting import CheckpointSetting

pytest.importorskip("transformers")

RUN = dict(world_size=2, micro_batch=4, accum_steps=2, steps=2, seq_len=16, backend="gloo",
           device="cpu")
MODELS = {"gpt2": dict(model=fm.make_gpt2), "llama": dict(model=fm.make_llama),
          "bert": dict(model=fm.make_bert, data=fm.make_tokens)}


@pytest.fixture(scope="module")
def pool():
    return shared_pool(2, "gloo", "cpu")  # the kernel's shared warm ranks, as train's default


def max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# --- one value: one text form, one parse site, one label
@pytest.mark.parametrize("value, n, text, label", [
    (None, 4, "none", "no checkpointing"),
    (1, 4, "1", "no checkpointing"),  # one segment, the last: nothing is checkpointed
    (2, 4, "2", "2 segments"),
    ("full", 4, "full", "every block"),
    ([True, False, True, False], 4, "1,0,1,0,", "blocks 0, 2"),
    ([False, True], 2, "0,1,", "block 1"),
    ([True], 1, "1,", "every block"),
    # short at any block count: runs, a stride, and past six parts the ends with a count
    ([True] * 10 + [False, True], 12, "1,1,1,1,1,1,1,1,1,1,0,1,", "blocks 0-9, 11"),
    ([i % 2 == 0 for i in range(80)], 80, "1,0," * 40, "blocks 0-78, every 2nd"),
    ([i in (0, 1, 5, 9, 20, 30, 31, 32, 33, 70) for i in range(80)], 80,
     "".join("1," if i in (0, 1, 5, 9, 20, 30, 31, 32, 33, 70) else "0," for i in range(80)),
     "blocks 0, 1, 5, 9, …, 70 (10 of 80)"),
])
def test_a_setting_has_one_text_form_and_one_label(value, n, text, label):
    setting = CheckpointSetting.of(value, n)
    assert str(setting) == text and setting.label() == label
    assert CheckpointSetting.of(CheckpointSetting.parse(text), n) == setting
    assert setting.plain == value and setting == value  # what one writes, and compares with


def test_bad_text_and_bad_values_name_the_fix():
    with pytest.raises(ValueError, match=r"TrainConfig.checkpoint='half': write none, a segment "
                                         r"count, full, or one 0/1 per block with commas"):
        CheckpointSetting.parse("half")
    with pytest.raises(TypeError, match=r"CheckpointPolicy takes a CheckpointSetting, got int; "
                                        r"build one with CheckpointSetting.of\(value, stacks\)"):
        CheckpointPolicy(2)
    with pytest.raises(TypeError, match=r"pass a CheckpointSetting, or nothing for the config's "
                                        r"own setting; cfg.checkpoint.with_value\(2\) makes one"):
        ddpkit.predict.estimate.activation_bytes(ddpkit.TrainConfig(), 2)
    with pytest.raises(ValueError, match=r"stacks=\(\) must be the blocks of each of the model's "
                                         r"stacks"):
        CheckpointSetting(2, ())  # a setting is bound to its model's stacks


# --- the estimate: one input per checkpointed segment
@pytest.mark.parametrize("name", MODELS)
def test_an_int_setting_keeps_one_input_per_segment(name):
    cfg = ddpkit.TrainConfig(**MODELS[name], **RUN)
    n, est = cfg.n_blocks, ddpkit.estimate(cfg)
    boundary = [b.boundary for b in est.blocks]
    for s in range(2, n + 1):
        setting = CheckpointSetting.of(s, n)
        per_block = cfg.replace(checkpoint=setting.mask)  # the same blocks, one region each
        fewer = sum(sum(boundary[a + 1:b]) for a, b in setting.regions)  # k - 1 inputs a region
        grouped = ddpkit.estimate(cfg.replace(checkpoint=s)).activations
        assert ddpkit.estimate(per_block).activations - grouped == fewer, (name, s)


# --- real 2-rank runs: measured = estimated, the weights of no checkpointing, DDP and FSDP
@pytest.mark.parametrize("name", MODELS)
def test_segments_on_a_transformers_model_on_two_ranks(pool, name):
    measured, weights = {}, {}
    for extra in ({}, {"find_unused_parameters": True},
                  {"strategy": "fsdp", "optimizer": "adamw"}):
        for setting in (None, 2, 3):
            cfg = ddpkit.TrainConfig(**MODELS[name], **RUN, checkpoint=setting, **extra)
            res = ddpkit.train(cfg, pool=pool, check=False)
            acts = res.summary()["activation_bytes"]
            assert acts == ddpkit.estimate(cfg).activations, (name, setting, extra)  # to the byte
            measured[str(extra), setting] = acts
            weights[str(extra), setting] = res.state_dict
        plain = weights[str(extra), None]
        assert max_diff(plain, build_plain(name)) > 1e-4  # it did train
        for setting in (2, 3):
            assert max_diff(weights[str(extra), setting], plain) <= 1e-5, (name, setting, extra)
        # s=2: blocks 0-1 one region; s=3: blocks 0 and 1 one region each (the same blocks):
        # the 2-block segment keeps 1 block input fewer, measured
        boundary = ddpkit.estimate(cfg).blocks[1].boundary
        assert measured[str(extra), 3] - measured[str(extra), 2] == boundary


def build_plain(name):
    from ddpkit.spec.model import build_model

    return build_model(ddpkit.TrainConfig(**MODELS[name], **RUN).rank_plan())[0].state_dict()


def gpt2_8():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=8, n_embd=32, n_head=4, vocab_size=64,
                                      n_positions=32, bos_token_id=0, eos_token_id=0,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def test_the_peak_rises_with_segment_length_as_for_checkpoint_sequential(pool):
    from ddpkit.predict.plan import cost

    run = dict(world_size=2, micro_batch=8, steps=2, seq_len=32, peak_every=1, backend="gloo",
               device="cpu")
    # the built-in gpt's blocks are an nn.Sequential it calls whole: checkpoint_sequential's
    # own regions; GPT-2 loops over its ModuleList. Segments of 1, 2 and 4 blocks (s=8, 4, 2)
    for model in (dict(model="gpt", n_blocks=8, width=32, vocab=64), dict(model=gpt2_8)):
        peaks, predicted = [], []
        for s in (8, 4, 2):
            cfg = ddpkit.TrainConfig(**model, **run, checkpoint=s)
            res = ddpkit.train(cfg, pool=pool, check=False)
            peaks.append(res.per_rank("peak_bytes")[-1])
            predicted.append(cost(cfg).total)
        assert peaks[0] < peaks[1] < peaks[2], (model, peaks)
        assert predicted[0] < predicted[1] < predicted[2], (model, predicted)


def test_a_region_brings_its_whole_inside_back_at_once():
    from ddpkit.predict.plan import _Blocks, _choice

    # blocks 0-2 keep 10 each (boundary 1), block 3 keeps 4: with s=2 the plain segment (blocks
    # 2-3) holds less than the region of blocks 0-1 brings back while it is recomputed
    fig = _Blocks(saves=[9, 9, 9, 3], keeps=[10, 10, 10, 4], recompute=[5, 5, 5, 5],
                  base_acts=100, base_flops=100, states=0, none=CheckpointSetting(None, 4))
    c = _choice(fig, CheckpointSetting.of(2, 4))
    assert c.activations == 100 - (20 - 1)
    assert c.peak_activations == c.activations - 14 + 19  # blocks 2-3 freed, 0-1 back whole
    per_block = _choice(fig, CheckpointSetting.of([True, True, False, False], 4))
    assert per_block.activations == c.activations + 1  # one more input kept
    assert per_block.peak_activations < c.peak_activations  # one block's inside at a time


# --- the guard and the fallbacks, on one process
class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc, self.drop = nn.Linear(d, d), nn.Dropout(0.3)

    def forward(self, h, scale=None):
        return (h + self.drop(torch.tanh(self.fc(h)))) * scale


class Loop(nn.Module):
    """A model that owns its loop: ``change`` alters the hidden state between blocks 1 and 2;
    ``layerdrop`` draws from torch's RNG before every block and skips block 3."""

    def __init__(self, change=False, layerdrop=False):
        super().__init__()
        self.change, self.layerdrop = change, layerdrop
        self.inp, self.head = nn.Linear(8, 16), nn.Linear(16, 1)
        self.layers = nn.ModuleList(Block() for _ in range(6))

    def forward(self, x):
        h, scale = self.inp(x), torch.full((16,), 1.01)
        for i, layer in enumerate(self.layers):
            if self.layerdrop and torch.rand([]) >= 0 and i == 3:
                continue
            h = layer(h, scale=scale)
            if self.change and i == 1:
                h = torch.sigmoid(h) * 2
        return self.head(h).pow(2).mean()


def run_loop(model, value, use_reentrant=False):
    from ddpkit.engine.probes import ActivationProbe

    model = copy.deepcopy(model)
    policy = CheckpointPolicy(CheckpointSetting.of(value, 6), use_reentrant=use_reentrant)
    policy.apply(model, "layers")
    probe = ActivationProbe(policy)
    torch.manual_seed(7)  # the same dropout masks in every run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.forward(model):
            loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
        loss.backward()
    grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                       for p in model.parameters()])
    return probe.bytes, grads, policy, [str(w.message) for w in caught]


@pytest.mark.parametrize("kind", ["plain", "change", "layerdrop"])
def test_grouped_regions_give_the_gradients_of_no_checkpointing(kind):
    torch.manual_seed(0)
    model = Loop(change=kind == "change", layerdrop=kind == "layerdrop")
    _, ref, _, _ = run_loop(model, None)
    boundary = 4 * 16 * 4
    for value in (2, 3, 6, "full"):
        for reentrant in (False, True):
            acts, grads, policy, said = run_loop(model, value, reentrant)
            assert torch.equal(grads, ref), (kind, value, reentrant)  # dropout and all
    # s=2: blocks 0-2 one region; reentrant: each block its own, two inputs more, and it says so
    grouped, _, policy, said = run_loop(model, 2)
    per_block, _, reentrant, said_reentrant = run_loop(model, 2, use_reentrant=True)
    if kind == "plain":
        assert per_block - grouped == 2 * boundary and not said and not policy.notes
        assert "by hooks on the model's own loop" in policy.describe()
    if kind == "change":  # block 2's input is not block 1's output: it keeps its input
        assert per_block - grouped == boundary
        assert len(policy.notes) == 1 and said == ["ddpkit checkpointing: " + policy.notes[0]]
        assert "block 2's input is not the tensor block 1 returned" in policy.describe()
    assert "use_reentrant=True cannot make one region of several blocks" in reentrant.describe()
    assert any("use_reentrant=False groups them" in s for s in said_reentrant)


def test_a_region_whose_last_block_never_ran_ends_with_the_forward():
    torch.manual_seed(0)
    model = Loop(layerdrop=True)  # block 3, the last of the region of blocks 2-3 (s=3), is skipped
    _, ref, _, _ = run_loop(model, None)
    _, grads, policy, said = run_loop(model, 3)
    assert torch.equal(grads, ref)
    assert "the forward ended with the region of blocks 2-3 open" in policy.describe()


def test_replay_runs_each_block_through_its_hooks_once_per_recompute():
    torch.manual_seed(0)
    model = Loop()
    calls = []
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(functools.partial(lambda i, *a: calls.append(i), i))
    CheckpointPolicy(CheckpointSetting.of(2, 6)).apply(model, "layers")
    model(torch.randn(4, 8)).backward()
    assert calls == [0, 1, 2, 3, 4, 5, 0, 1, 2]  # forward, then the region's one replay


def test_regions_hook_nothing_on_the_blocks_and_come_off_whole():
    # a module with a hook leaves nn.Module.__call__'s fast path (~15 us a call, twice a
    # micro-batch for each block of a region): the regions wrap the blocks' forwards instead
    from ddpkit.engine.policies import remove
    from ddpkit.spec.builtin import build_builtin

    gpt = build_builtin("gpt", n_blocks=4, width=16, mlp_ratio=2, seq_len=8, vocab=32,
                        n_heads=2, dropout=0.0)  # its blocks: an nn.Sequential called whole
    for model, blocks in ((Loop(), "layers"), (gpt, "blocks")):
        stack = model.get_submodule(blocks)
        CheckpointPolicy(CheckpointSetting.of("full", len(stack))).apply(model, blocks)
        assert not any(b._forward_hooks or b._forward_pre_hooks for b in stack)
        remove(model)
        assert not any("forward" in b.__dict__ for b in [*stack, stack])
        assert not model._forward_hooks  # the root's end-of-forward hook is off too
