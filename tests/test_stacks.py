"""All the stacks (issue #27): ``blocks=None`` finds every stack of repeated blocks (T5's encoder
and decoder), ``blocks=`` takes one path or several, settings count blocks over all stacks with
segments per stack, and checkpointing, FSDP, the estimate, the doctor and the Lab act on every
stack. Real 2-rank gloo runs on T5 (4 encoder + 4 decoder blocks, tiny config)."""
import pytest
import torch
import torch.nn as nn

import ddpkit
from ddpkit.runtime.pool import shared_pool
from ddpkit.engine.policies import CheckpointPolicy
from ddpkit.spec.blocks import find_stacks
from ddpkit.spec.setting import CheckpointSetting

pytest.importorskip("transformers")

RUN = dict(world_size=2, micro_batch=4, accum_steps=2, steps=2, backend="gloo", device="cpu")


def make_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(num_layers=4, num_decoder_layers=4, d_model=32,
                                               d_ff=64, d_kv=8, num_heads=4, vocab_size=64,
                                               dropout_rate=0.0, decoder_start_token_id=0,
                                               pad_token_id=0, eos_token_id=1))


def make_pairs(cfg):
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(2, 64, (64, 8), generator=g), torch.randint(2, 64, (64, 8), generator=g)
    return [{"input_ids": a, "labels": b} for a, b in zip(x, y)]


T5 = dict(model=make_t5, data=make_pairs)
BOTH = ("encoder.block", "decoder.block")


@pytest.fixture(scope="module")
def pool():
    return shared_pool(2, "gloo", "cpu")  # the kernel's shared warm ranks, as train's default


def max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# --- finding them
class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Stage(nn.Module):  # a stage holds a stack of its own: only the outer stack counts
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.acts = nn.ModuleList(nn.GELU() for _ in range(3))  # no parameters: no stack


class Towers(nn.Module):
    def __init__(self):
        super().__init__()
        self.text = nn.Sequential(Layer(), Layer())
        self.stages = nn.ModuleList(Stage() for _ in range(2))


def test_every_stack_is_found_in_the_models_order_none_inside_another():
    assert [(p, len(c)) for p, c in find_stacks(Towers())] == [("text", 2), ("stages", 2)]
    info = ddpkit.TrainConfig(**T5, **RUN).info
    assert info.blocks == BOTH and info.stack_sizes == (4, 4) and info.n_blocks == 8
    assert [tuple(s) for s in info.stacks] == [("encoder.block", 4, "T5Block"),
                                              ("decoder.block", 4, "T5Block")]


def test_blocks_takes_one_path_or_several():
    several = ddpkit.TrainConfig(**T5, **RUN, blocks=list(BOTH))
    assert several.blocks == BOTH and several.n_blocks == 8
    assert ddpkit.TrainConfig(**T5, **RUN, blocks="encoder.block,decoder.block").blocks == BOTH
    assert "--blocks encoder.block,decoder.block" in " ".join(several.to_cli())
    one = ddpkit.TrainConfig(**T5, **RUN, blocks="decoder.block")
    assert (one.blocks, one.n_blocks, one.checkpoint.stacks) == ("decoder.block", 4, (4,))


def test_stacks_named_twice_or_one_inside_another_are_refused():
    with pytest.raises(ValueError, match=r"TrainConfig.blocks=\['stages', 'stages.0.layers'\]: "
                                         r"'stages.0.layers' lies inside 'stages'; name each stack "
                                         r"once, none inside another"):
        find_stacks(Towers(), ["stages", "stages.0.layers"])
    with pytest.raises(ValueError, match=r"'text' is named twice"):
        find_stacks(Towers(), "text,text")


@pytest.mark.parametrize("blocks, message", [
    (["encoder.block", "decoder.nope"], r"TrainConfig.blocks=\('encoder.block', 'decoder.nope'\): "
                                        r"T5ForConditionalGeneration has no submodule at "
                                        r"'decoder.nope'; pass one of"),
    ([], r"TrainConfig.blocks=\[\]: names no container of blocks; pass a dotted path"),
    ("encoder", r"TrainConfig.blocks='encoder': 'encoder' is a T5Stack, not a non-empty "
                r"nn.ModuleList or nn.Sequential; name the container that holds the blocks"),
])
def test_bad_blocks_are_refused_naming_the_fix(blocks, message):
    with pytest.raises(ValueError, match=message):
        ddpkit.TrainConfig(**T5, **RUN, blocks=blocks)


# --- settings over the stacks
def test_segments_are_made_in_each_stack_and_never_cross_one():
    s = CheckpointSetting.of(2, (4, 4))
    assert s.segments == [(0, 2, True), (2, 4, False), (4, 6, True), (6, 8, False)]
    assert s.regions == [(0, 2), (4, 6)] and s.label() == "2 segments per stack"
    assert CheckpointSetting.of("full", (4, 4)).regions == [(i, i + 1) for i in range(8)]
    assert CheckpointSetting.of(None, (4, 4)).segments == [(0, 4, False), (4, 8, False)]
    uneven = CheckpointSetting.of(2, (4, 3))  # as checkpoint_sequential lays out each stack
    assert uneven.segments == [(0, 2, True), (2, 4, False), (4, 5, True), (5, 7, False)]
    cfg = ddpkit.TrainConfig(**T5, **RUN, checkpoint=2)
    assert cfg.checkpoint == s and str(cfg.checkpoint) == "2 per stack"
    assert CheckpointSetting.of(CheckpointSetting.parse(str(s)), s.stacks) == s
    with pytest.raises(ValueError, match=r"TrainConfig.checkpoint=4: segments are made in each of "
                                         r"the model's 2 stacks \(as checkpoint_sequential runs "
                                         r"each\), and the shortest has 3 blocks; pass "
                                         r"checkpoint<=3"):
        CheckpointSetting.of(4, (4, 3))
    with pytest.raises(ValueError, match=r"policy of 2 segments per stack made for stacks of \[8\] "
                                         r"blocks, applied to stacks of \[4, 4\]"):
        CheckpointPolicy(CheckpointSetting.of(2, 8)).apply(make_t5(), list(BOTH))


def test_the_estimate_names_each_block_by_its_path():
    est = ddpkit.estimate(ddpkit.TrainConfig(**T5, **RUN, checkpoint="full"))
    assert list(est.blocks_table()["block"]) == [f"{p}.{i}" for p in BOTH for i in range(4)]
    assert all(b.keeps > b.boundary > 0 and b.flops > 0 for b in est.blocks)


def test_the_doctor_checkpoints_every_stack():
    cfg = ddpkit.TrainConfig(**T5, **RUN, checkpoint=2, find_unused_parameters=True,
                             use_reentrant=True)
    found = ddpkit.doctor(cfg)
    where = [f.where for f in found if f.pitfall == "reentrant_find_unused"]
    assert where == ["decoder.block[0:2], encoder.block[0:2]"]  # both stacks' first segments


def test_the_lab_shows_the_stacks():
    cfg = ddpkit.TrainConfig(**T5, **RUN)
    with ddpkit.Lab(cfg) as lab:
        assert [(p, len(names)) for p, names in lab.blocks.stacks] == [(p, 4) for p in BOTH]
        assert lab.controls["segments"].max == 4  # segments are made in each stack
        lab.controls["segments"].value = 2
        assert [t.value for t in lab.block_toggles] == [True, True, False, False] * 2
        assert lab.block_toggles[4].tooltip == "checkpoint decoder.block.0"


# --- real runs: every stack checkpointed, measured = estimated, the weights of none
def test_full_checkpoints_all_eight_blocks_and_the_estimate_equals_the_measurement(pool):
    runs = {}
    for setting in (None, 2, "full"):
        cfg = ddpkit.TrainConfig(**T5, **RUN, checkpoint=setting)
        runs[setting] = (cfg, ddpkit.train(cfg, pool=pool))
    ref = runs[None][1].state_dict
    for setting, (cfg, res) in runs.items():
        assert max_diff(res.state_dict, ref) <= 1e-5, setting
        assert res.summary()["activation_bytes"] == ddpkit.estimate(cfg).activations, setting
    assert runs["full"][0].checkpoint.regions == [(i, i + 1) for i in range(8)]
    # the encoder's blocks alone (what blocks=None found before) keep more: the decoder's count
    encoder = ddpkit.TrainConfig(**T5, **RUN, checkpoint="full", blocks="encoder.block")
    alone = ddpkit.train(encoder, pool=pool).summary()["activation_bytes"]
    assert alone == ddpkit.estimate(encoder).activations
    assert runs["full"][1].summary()["activation_bytes"] < alone


def fsdp_units(ctx, plan):
    """On a rank: the model wrapped as the run wraps it; which modules are FSDP units."""
    from torch.distributed.fsdp import FSDPModule

    from ddpkit.engine import strategies
    from ddpkit.spec.model import build_model

    model = build_model(plan)[0]
    strategies.wrap(plan, model, ctx)
    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def test_fsdp_shards_every_stacks_blocks(pool):
    cfg = ddpkit.TrainConfig(**T5, **RUN, checkpoint="full", optimizer="adamw", strategy="fsdp")
    units = pool.launch(fsdp_units, cfg.rank_plan()).returns
    want = [""] + [f"{p}.{i}" for p in BOTH for i in range(4)]  # the root, and every block
    assert sorted(units[0]) == sorted(want) and units[0] == units[1]
    sharded = ddpkit.train(cfg, pool=pool)
    plain = ddpkit.train(cfg.replace(strategy="ddp"), pool=pool)
    assert max_diff(sharded.state_dict, plain.state_dict) <= 1e-5


def test_a_t5_sweep_says_per_stack_in_its_table_its_figure_and_its_marks(pool):
    # one value travels: the records and the table carry str(setting), which says "per stack" on
    # a model of two stacks; the trade-off figure and the live plot's change mark say so too
    cfg = ddpkit.TrainConfig(**T5, **{**RUN, "steps": 1, "accum_steps": 1})
    table = ddpkit.sweep(cfg, pool=pool, progress=False, checkpoint=[None, 2])
    assert list(table.checkpoint) == ["none", "2 per stack"]
    record = table.result[1].metrics[0]
    assert record["checkpoint"] == "2 per stack"
    assert CheckpointSetting.of(record["checkpoint"], (4, 4)) == cfg.replace(checkpoint=2).checkpoint
    labels = [t for tr in ddpkit.tradeoff(table).data if tr.text is not None for t in tr.text]
    assert "checkpoint=2 per stack" in labels
    plots = ddpkit.LivePlots(world_size=1)
    plots.new_run(1, setting=cfg.checkpoint)
    plots.add({**record, "rank": 0, "step": 5, "changed": "checkpoint"})
    plots.flush(force=True)
    assert [a.text for a in plots.loss.layout.annotations] == ["step 5: 2 segments per stack"]
