"""Your own model through every part of the kit: a user nn.Module with its data and loss, and
transformers GPT-2 and Llama from tiny configs, on real 2-rank gloo runs (issue #10)."""
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import ddpkit
from ddpkit.runtime.pool import shared_pool
import fixtures_module as fm
from ddpkit.spec.model import build_model
from procs import in_tmp

pytest.importorskip("transformers")

RUN = dict(world_size=2, micro_batch=4, accum_steps=2, steps=3, seq_len=16, backend="gloo",
           device="cpu")
MODELS = {"net": dict(model=fm.make_model, data=fm.make_data, loss=fm.loss_fn),
          "gpt2": dict(model=fm.make_gpt2), "llama": dict(model=fm.make_llama)}


@pytest.fixture(scope="module")
def pool():
    return shared_pool(2, "gloo", "cpu")  # the kernel's shared warm ranks, as train's default


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("name", MODELS)
def test_checkpointing_keeps_the_weights_and_bytes_fall_as_estimated(pool, name):
    runs = {}
    for setting in (None, 2, "full"):
        cfg = ddpkit.TrainConfig(**MODELS[name], **RUN, checkpoint=setting)
        runs[setting] = (cfg, ddpkit.train(cfg, pool=pool))
    ref = runs[None][1].state_dict
    assert max_diff(ref, build_model(runs[None][0].rank_plan())[0].state_dict()) > 1e-4  # it did train
    measured = []
    for setting, (cfg, res) in runs.items():
        assert max_diff(res.state_dict, ref) <= 1e-5, setting
        acts = res.summary()["activation_bytes"]
        est = ddpkit.estimate(cfg)
        assert est.method == "traced"
        assert acts == est.activations, (setting, acts, est.activations)  # exact, fp32
        measured.append(acts)
    assert measured[0] > measured[1] > measured[2]
    # the config's state_dict keys are the model's own: nothing was wrapped
    assert set(ref) == set(build_model(runs[None][0].rank_plan())[0].state_dict())


def test_accumulation_2x4_equals_one_batch_of_8(pool):
    two = ddpkit.train(ddpkit.TrainConfig(**MODELS["net"], **RUN), pool=pool)
    one = ddpkit.train(ddpkit.TrainConfig(**MODELS["net"], **{**RUN, "micro_batch": 8,
                                                                "accum_steps": 1}), pool=pool)
    assert max_diff(two.state_dict, one.state_dict) <= 1e-5
    assert two.per_rank("allreduce_calls") == one.per_rank("allreduce_calls")  # no_sync


def test_sweep_over_checkpoint_settings_of_a_transformers_model(pool):
    cfg = ddpkit.TrainConfig(**MODELS["llama"], **{**RUN, "steps": 2})
    table = ddpkit.sweep(cfg, pool=pool, checkpoint=[None, [True, False, True, False]])
    assert list(table.checkpoint) == ["none", "1,0,1,0,"]  # the setting's one text form
    assert (table.activation_bytes == table.predicted_activation_bytes).all()
    assert table.recompute_flops_ratio[1] > table.recompute_flops_ratio[0] == 1.0


def test_blocks_found_in_each_model():
    info = {n: ddpkit.TrainConfig(**m, **RUN).info for n, m in MODELS.items()}
    assert (info["net"].blocks, info["net"].n_blocks) == ("body", 4)
    assert (info["gpt2"].blocks, info["gpt2"].block_class) == ("transformer.h", "GPT2Block")
    assert (info["llama"].blocks, info["llama"].block_class) == ("model.layers", "LlamaDecoderLayer")
    assert ddpkit.TrainConfig(**MODELS["gpt2"], **RUN).n_blocks == 4
    builtin = ddpkit.TrainConfig(model="gpt", n_blocks=3).info  # the teaching models alike
    assert (builtin.blocks, builtin.n_blocks, builtin.block_class) == ("blocks", 3, "GPTBlock")


def test_estimate_per_block_and_within_2s():
    import time

    cfg = ddpkit.TrainConfig(**MODELS["gpt2"], **RUN, checkpoint="full")
    t0 = time.perf_counter()
    est = ddpkit.estimate(cfg)
    assert time.perf_counter() - t0 < 2.0 + 3.0  # generous here; bench/ holds the figure
    table = est.blocks_table()
    assert list(table["block"]) == [f"transformer.h.{i}" for i in range(4)]
    assert (table["keeps_bytes"] > table["boundary_bytes"]).all()
    assert (table["recompute_flops"] > 0).all()
    # no checkpointing keeps every block's bytes; each checkpointed block keeps its boundary
    none = ddpkit.estimate(cfg.replace(checkpoint=None)).activations
    assert none - est.activations == sum(b.keeps - b.boundary for b in est.blocks)


def test_a_models_own_checkpointing_is_reported_and_replaced(pool):
    def make():
        m = fm.make_gpt2()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        return m

    cfg = ddpkit.TrainConfig(model=make, **RUN, checkpoint=2)
    assert cfg.info.own_checkpointing
    # the doctor says so (a warning: in a trainer of your own, reentrant + find_unused crashes)
    with pytest.warns(UserWarning, match=r"\[hf_reentrant_find_unused\].*own gradient "
                                         r"checkpointing is on.*ddpkit turns it off"):
        res = ddpkit.train(cfg, pool=pool)
    plain = ddpkit.train(cfg.replace(model=fm.make_gpt2), pool=pool)
    assert res.summary()["activation_bytes"] == plain.summary()["activation_bytes"]
    assert max_diff(res.state_dict, plain.state_dict) <= 1e-6


@pytest.mark.parametrize("strategy", ["ddp_zero1", "fsdp"])
def test_strategies_run_a_transformers_model(pool, strategy):
    base = ddpkit.TrainConfig(**MODELS["gpt2"], **RUN, optimizer="adamw", checkpoint=2)
    ref = ddpkit.train(base, pool=pool)
    res = ddpkit.train(base.replace(strategy=strategy), pool=pool)
    assert max_diff(res.state_dict, ref.state_dict) <= 1e-5


def test_save_and_resume_a_user_model(pool, tmp_path):
    cfg = ddpkit.TrainConfig(**MODELS["net"], **{**RUN, "steps": 4}, save_every=2,
                             save_dir=str(tmp_path))
    full = ddpkit.train(cfg, pool=pool)
    again = ddpkit.train(cfg.replace(save_every=0), pool=pool, resume_from=str(tmp_path / "step_000001"))
    assert [m["loss"] for m in again.metrics if m["rank"] == 0] == \
        [m["loss"] for m in full.metrics if m["rank"] == 0 and m["step"] >= 2]
    assert max_diff(again.state_dict, full.state_dict) == 0.0


def test_doctor_finds_the_same_hazards_on_a_user_model():
    def make():
        m = fm.make_model()
        m.body[1].ln = nn.BatchNorm1d(32)  # BatchNorm inside a checkpointed block
        return m

    cfg = ddpkit.TrainConfig(model=make, data=fm.make_data, loss=fm.loss_fn, **RUN,
                             checkpoint="full", use_reentrant=True, find_unused_parameters=True)
    found = ddpkit.doctor(cfg).pitfalls
    assert "batchnorm_in_checkpoint" in found
    assert "reentrant_find_unused" in found
    assert not ddpkit.doctor(ddpkit.TrainConfig(**MODELS["net"], **RUN, checkpoint="full"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_trains_a_model_by_import_path(tmp_path):
    args = ["--model", "tests.fixtures_module:make_model", "--data",
            "tests.fixtures_module:make_data", "--loss", "tests.fixtures_module:loss_fn", "--micro-batch", "4", "--accum-steps", "2",
            "--checkpoint", "2", "--steps", "3", "--backend", "gloo", "--device", "cpu"]
    out = tmp_path / "tr.json"
    root = Path(__file__).parent.parent  # the import path is relative to the project root
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "ddpkit", "train", *args, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=root,
                          env=in_tmp(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = ddpkit.TrainConfig(model="tests.fixtures_module:make_model",
                             data="tests.fixtures_module:make_data",
                             loss="tests.fixtures_module:loss_fn", **{**RUN, "checkpoint": 2})
    assert cfg.to_cli()[:6] == args[:6]
    ref = ddpkit.train(cfg)
    loss = lambda recs: [m["loss"] for m in recs if m["rank"] == 0]
    assert loss(json.loads(out.read_text())) == pytest.approx(loss(ref.metrics), abs=1e-6)


# --- bad input: refused before any rank starts, naming the setting and the fix
class NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)


def raising():
    raise RuntimeError("no weights here")


def sized(width):
    return fm.Net(width)


@pytest.mark.parametrize("kwargs, message", [
    (dict(model=raising, data=fm.make_data), r"TrainConfig.model=raising raised RuntimeError while building the model: no weights here$"),
    (dict(model=sized, data=fm.make_data), r"TrainConfig.model=sized cannot be called with no arguments \(missing a required argument: 'width'\); the factory must build the model with no arguments"),
    (dict(model=lambda: 3, data=fm.make_data), r"returned a int, not an nn.Module; return the model"),
    (dict(model=NoBlocks, data=fm.make_data), r"TrainConfig.blocks=None: found no repeated blocks in NoBlocks"),
    (dict(model=fm.make_model, data=fm.make_data, blocks="body.nope"), r"TrainConfig.blocks='body.nope': Net has no submodule there; pass one of \['body'"),
    (dict(model="no_such_module:make"), r"TrainConfig.model='no_such_module:make' does not import \(ModuleNotFoundError"),
    (dict(model=fm.make_model, data="fixtures_module:nope"), r"TrainConfig.data='fixtures_module:nope' does not import \(AttributeError"),
    (dict(model=fm.make_model), r"TrainConfig.data=None: Net is not a Hugging Face causal LM"),
    (dict(model="mlp", data=fm.make_data), r"TrainConfig.data= is for your own model"),
])
def test_bad_model_settings_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ddpkit.TrainConfig(**kwargs, **RUN)


def test_short_dataset_and_bad_loss_are_refused_before_spawn(monkeypatch):
    import ddpkit.runtime.launch

    monkeypatch.setattr(ddpkit.runtime.launch, "RankGroup", None)  # any spawn would now fail loudly
    short = lambda cfg: torch.utils.data.TensorDataset(torch.randn(10, 16), torch.zeros(10).long())
    with pytest.raises(ValueError, match=r"has 10 samples, fewer than one global batch \(world_size=2 x "
                                         r"micro_batch=4 x accum_steps=2 = 16\)"):
        ddpkit.train(ddpkit.TrainConfig(model=fm.make_model, data=short, loss=fm.loss_fn, **RUN))
    vector = lambda model, batch: model(batch[0]).sum(dim=1)
    with pytest.raises(ValueError, match=r"TrainConfig.loss=.* gave a tensor of shape \(\d+,\), not a "
                                         r"scalar float tensor"):
        ddpkit.train(ddpkit.TrainConfig(model=fm.make_model, data=fm.make_data, loss=vector, **RUN))


def test_a_notebook_factory_has_no_torchrun_command():
    cfg = ddpkit.TrainConfig(model=lambda: fm.Net(), data=fm.make_data, loss=fm.loss_fn, **RUN)
    with pytest.raises(ValueError, match=r"defined in the notebook \(__main__\): the CLI and torchrun"):
        cfg.to_torchrun()
