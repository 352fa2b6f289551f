"""`ddpkit.doctor`: each hazard it claims, found on a small model built to have it; no false
alarm on the built-in models; the checked model left exactly as it was. One process, no launch."""
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ddpkit import TrainConfig, doctor
from ddpkit.pitfalls.doctor import Finding

D = 6


def x(n=5):
    return torch.randn(n, D, generator=torch.Generator().manual_seed(0))


def kinds(findings):
    return [(f.pitfall, f.where) for f in findings]


class Plain(nn.Module):
    """first -> mid -> head; doctor installs checkpoints on these by name."""

    def __init__(self, spare=False):
        super().__init__()
        self.first, self.mid, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 1)
        self.spare = nn.Linear(D, D) if spare else None

    def forward(self, inp):
        return self.head(torch.tanh(self.mid(torch.tanh(self.first(inp))))).mean()


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.shared, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 1)

    def forward(self, inp):
        return self.head(self.shared(torch.tanh(self.shared(self.stem(inp))))).mean()


class WithBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.seg = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Tanh())
        self.head = nn.Linear(D, 1)

    def forward(self, inp):
        return self.head(self.seg(self.stem(inp))).mean()


class OwnCheckpoint(nn.Module):
    """Checkpoints itself, the way user code does: doctor must see it without being told."""

    def __init__(self, use_reentrant, shared=False, stem=True):
        super().__init__()
        self.use_reentrant, self.shared = use_reentrant, shared
        self.stem = nn.Linear(D, D) if stem else nn.Identity()
        self.body = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.head = nn.Linear(D, 1)

    def forward(self, inp):
        kw = {} if self.use_reentrant == "unset" else {"use_reentrant": self.use_reentrant}
        h = checkpoint(self.body, self.stem(inp), **kw)
        if self.shared:
            h = checkpoint(self.body, h, **kw)
        return self.head(h).mean()


# --- each hazard, on a model built to have it
def test_reentrant_input_no_grad_on_a_named_segment():
    found = doctor(Plain(), x(), checkpoint=["first"], use_reentrant=True)
    assert kinds(found) == [("reentrant_input_no_grad", "first")]
    assert "its input does not require grad" in found[0].message and "2 parameter" in found[0].message
    assert "use_reentrant=False" in found[0].fix
    # the same segment later in the network (its input requires grad), or non-reentrant: fine
    assert doctor(Plain(), x(), checkpoint=["mid"], use_reentrant=True) == []
    assert doctor(Plain(), x(), checkpoint=["first"], use_reentrant=False) == []


def test_reentrant_input_no_grad_in_the_models_own_checkpoint():
    found = doctor(OwnCheckpoint(True, stem=False), x())
    assert kinds(found) == [("reentrant_input_no_grad", "body")]  # the region, not body.0
    assert "None of the inputs have requires_grad=True" in found[0].message


def test_module_used_twice_under_reentrant_checkpointing():
    found = doctor(Shared(), x(), checkpoint=["shared"], use_reentrant=True)
    assert kinds(found) == [("reentrant_shared_module", "shared")]
    assert found[0].message.startswith("the gradients of shared.bias, shared.weight were "
                                       "accumulated 2x in one backward (shared called 2x)")
    assert "Expected to mark a variable ready only once" in found[0].message
    # the fixes the catalogue names remove the finding; without checkpointing there is none
    assert doctor(Shared(), x(), checkpoint=["shared"], use_reentrant=False) == []
    assert doctor(Shared(), x(), checkpoint=["shared"], use_reentrant=True,
                  ddp_kwargs={"static_graph": True}) == []
    assert doctor(Shared(), x()) == []
    # the model's own checkpoint calls are seen too
    assert kinds(doctor(OwnCheckpoint(True, shared=True), x())) == [
        ("reentrant_shared_module", "body.0")]
    assert doctor(OwnCheckpoint(False, shared=True), x()) == []


class Tied(nn.Module):
    """Two layers sharing one weight (tied embeddings do this), each its own segment."""

    def __init__(self):
        super().__init__()
        self.stem, self.a, self.b = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.b.weight = self.a.weight

    def forward(self, inp):
        return self.b(torch.tanh(self.a(self.stem(inp)))).mean()


def test_parameter_shared_by_two_reentrant_segments():
    found = doctor(Tied(), x(), checkpoint=["a", "b"], use_reentrant=True)
    assert kinds(found) == [("reentrant_shared_module", "a")]  # the tied weight's first name
    assert found[0].message.startswith("the gradients of a.weight were accumulated 2x in one "
                                       "backward (one parameter shared by several modules)")
    # one use inside a reentrant region and one outside it: two backward passes as well
    assert kinds(doctor(Tied(), x(), checkpoint=["a"], use_reentrant=True)) == [
        ("reentrant_shared_module", "a")]
    assert doctor(Tied(), x(), checkpoint=["a", "b"], use_reentrant=False) == []
    assert doctor(Tied(), x()) == []


def test_reentrant_with_find_unused_parameters():
    cfg = TrainConfig(checkpoint=2, use_reentrant=True, find_unused_parameters=True)
    found = doctor(cfg)
    assert kinds(found)[0] == ("reentrant_find_unused", "blocks[0:2]")
    assert "12 parameter tensor(s) are invisible in the forward graph" in found[0].message
    # every parameter got a gradient, so find_unused_parameters=True is not needed either: a
    # note (it costs time, nothing is wrong), after the warning
    assert kinds(found)[1] == ("find_unused_not_needed", "(ddp_kwargs)")
    assert [f.severity for f in found] == ["warning", "note"]
    assert found.warnings == found[:1] and found.notes == found[1:]
    assert doctor(cfg.replace(use_reentrant=False, find_unused_parameters=False)) == []
    assert doctor(cfg.replace(static_graph=True, find_unused_parameters=False)) == []


def test_batchnorm_inside_a_checkpointed_segment():
    found = doctor(WithBN(), x(), checkpoint=["seg"])
    assert kinds(found) == [("batchnorm_in_checkpoint", "seg.1")]
    assert "running statistics were updated 2x for 1 forward call(s)" in found[0].message
    assert doctor(WithBN(), x(), checkpoint=["seg.0"]) == []  # BatchNorm outside: fine
    assert doctor(WithBN(), x()) == []


def test_unused_parameters_and_whether_find_unused_is_needed():
    found = doctor(Plain(spare=True), x())
    assert kinds(found) == [("unused_parameters", "spare")]
    assert "2 parameter tensor(s) got no gradient" in found[0].message
    assert "find_unused_parameters=True" in found[0].fix
    assert doctor(Plain(spare=True), x(), ddp_kwargs={"find_unused_parameters": True}) == []
    hint = doctor(Plain(), x(), ddp_kwargs={"find_unused_parameters": True})
    assert kinds(hint) == [("find_unused_not_needed", "(ddp_kwargs)")]
    assert "it is not needed" in hint[0].message and hint[0].severity == "note"


def test_dropout_without_preserved_rng_state():
    cfg = TrainConfig(checkpoint="full", dropout=0.1, preserve_rng_state=False)
    found = doctor(cfg)
    assert kinds(found) == [("dropout_rng", "blocks.0.drop, blocks.1.drop, blocks.2.drop, "
                                            "blocks.3.drop")]
    assert doctor(cfg.replace(preserve_rng_state=True)) == []
    assert doctor(cfg.replace(checkpoint=None)) == []  # nothing recomputed
    # functional dropout (attention's dropout_p) counts too: gpt's own Dropout plus SDPA's
    gpt = doctor(cfg.replace(model="gpt", n_blocks=2, checkpoint="full"))
    assert [f.pitfall for f in gpt] == ["dropout_rng"]


def test_checkpoint_without_use_reentrant():
    found = doctor(OwnCheckpoint("unset"), x())
    assert kinds(found) == [("default_use_reentrant", "body")]
    assert "runs the reentrant variant" in found[0].message
    assert doctor(OwnCheckpoint(False), x()) == [] and doctor(OwnCheckpoint(True), x()) == []


def test_callable_checkpoint_selects_submodules():
    found = doctor(Plain(), x(), checkpoint=lambda name, m: isinstance(m, nn.Linear)
                   and name != "head", use_reentrant=True)
    # first's output needs no grad either (nothing inside it got one), so mid starves too
    assert kinds(found) == [("reentrant_input_no_grad", "first"), ("reentrant_input_no_grad", "mid")]
    assert doctor(Plain(), x(), checkpoint=lambda name, m: name == "mid", use_reentrant=True) == []


# --- no false alarms
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_no_findings_on_the_built_in_models(model):
    n = 4 if model == "mlp" else 2
    settings = [None, 1, 2, "full", [True, False] * (n // 2)]
    for setting in settings:
        for reentrant in (False, True):
            for dropout in (0.0, 0.1):
                cfg = TrainConfig(model=model, n_blocks=n, checkpoint=setting,
                                  use_reentrant=reentrant, dropout=dropout)
                assert doctor(cfg) == [], (setting, reentrant, dropout)
    assert doctor(TrainConfig(model=model, static_graph=True, no_sync=True)) == []


def test_doctor_of_the_default_config_is_fast():
    doctor(TrainConfig())  # first call pays one-off costs
    best = min(_timed(lambda: doctor(TrainConfig())) for _ in range(3))
    assert best < 0.5, best


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --- side-effect free
def test_the_checked_model_is_left_as_it_was():
    model = WithBN()
    model.eval()
    model.stem.weight.grad = torch.ones_like(model.stem.weight)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    found = doctor(model, x(), checkpoint=["seg"])
    assert found  # it did look (BatchNorm was recomputed in training mode)
    assert not model.training and not model.seg[1].training
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert torch.equal(model.stem.weight.grad, torch.ones_like(model.stem.weight))
    assert model.head.weight.grad is None
    assert "forward" not in model.seg.__dict__  # the installed checkpoint is gone
    assert torch.equal(torch.get_rng_state(), rng)

    from ddpkit.spec.model import build_model

    built = build_model(TrainConfig().rank_plan())[0]
    before = dict(built.__dict__)
    doctor(built, (torch.randn(4, 64), torch.randn(4)), checkpoint=2)
    assert "run_blocks" not in built.__dict__ and built.__dict__.keys() == before.keys()


# --- API
def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match=r"checkpoint names \['nope'\] are not submodules of Plain"):
        doctor(Plain(), x(), checkpoint=["nope"])
    with pytest.raises(ValueError, match=r"checkpoint=2 acts on repeated blocks, and this Plain has none"):
        doctor(Plain(), x(), checkpoint=2)
    with pytest.raises(TypeError, match=r"doctor\(model, example_input\): pass one example batch"):
        doctor(Plain())
    with pytest.raises(TypeError, match=r"doctor\(cfg\) builds its own input"):
        doctor(TrainConfig(), x())
    with pytest.raises(TypeError, match=r"takes an nn.Module or a ddpkit.TrainConfig, got str"):
        doctor("mlp", x())


def test_a_whole_call_is_an_example_input():
    # keyword arguments, a loss of your own: the example is a function model -> loss
    found = doctor(Plain(), lambda m: m(inp=x()), checkpoint=["first"], use_reentrant=True)
    assert kinds(found) == [("reentrant_input_no_grad", "first")]
    assert doctor(Plain(), lambda m: m(inp=x()), checkpoint=["mid"], use_reentrant=True) == []


def test_findings_read_well():
    found = doctor(Plain(spare=True), x())
    assert isinstance(found[0], Finding) and found.pitfalls == ["unused_parameters"]
    text = repr(found)
    assert text.startswith("[unused_parameters] at spare: 2 parameter tensor(s) got no gradient")
    assert "\n    fix: pass find_unused_parameters=True" in text
    assert repr(doctor(Plain(), x())) == "doctor: no findings"


def test_ddpkit_doctor_is_the_function_even_after_importing_the_submodule():
    code = ("import ddpkit, ddpkit.pitfalls.doctor; from ddpkit.pitfalls.doctor import Finding; "
            "assert callable(ddpkit.doctor) and ddpkit.doctor.__name__ == 'doctor'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


# --- issue #15: the catalogue grown
class PyRandomDrop(nn.Module):
    """LayerDrop decided inside its own non-reentrant checkpoint, by Python's random or torch's."""

    def __init__(self, draw="python"):
        super().__init__()
        self.draw = draw
        self.stem, self.fc, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 1)

    def block(self, h):
        import random

        u = random.random() if self.draw == "python" else torch.rand(()).item()
        return h if u < 0.5 else h + self.fc(torch.tanh(h))

    def forward(self, inp):
        return self.head(checkpoint(self.block, self.stem(inp), use_reentrant=False)).mean()


def test_a_recompute_that_differs_from_forward():
    import random

    random.seed(10)  # forward keeps the layer (0.57), the recompute drops it (0.43)
    found = doctor(PyRandomDrop(), x())
    assert kinds(found) == [("recompute_differs", "(a checkpointed function)")]
    assert "backward raised CheckpointError: the recompute differed from forward ('torch.utils." \
           "checkpoint: A different number of tensors was saved during the original forward " \
           "and recomputation.')" in found[0].message
    assert random.getstate() == (random.seed(10) or random.getstate())  # put back as it was
    random.seed(0)  # 0.84, 0.76: the same path both times, yet the recompute drew again
    found = doctor(PyRandomDrop(), x())
    assert kinds(found) == [("recompute_differs", "fc")]
    assert "Python's random module was drawn from during backward" in found[0].message
    random.seed(10)
    assert doctor(PyRandomDrop(draw="torch"), x()) == []  # torch's RNG is restored for it


def test_syncbatchnorm_without_a_gpu():
    model = nn.SyncBatchNorm.convert_sync_batchnorm(WithBN())
    found = doctor(model, x())
    if torch.cuda.is_available():
        assert found == []
        pytest.skip("this machine has a GPU: SyncBatchNorm may be right there")
    assert kinds(found) == [("syncbatchnorm_cpu", "seg.1")]
    assert "'SyncBatchNorm layers only work with GPU modules'" in found[0].message
    assert doctor(WithBN(), x()) == []


H4 = "transformer.h.0, transformer.h.1, transformer.h.2, transformer.h.3"  # make_gpt2: 4 layers


def _gpt2(use_reentrant="off", use_cache=True):
    def make():
        import fixtures_module as fm

        m = fm.make_gpt2()
        m.config.use_cache = use_cache
        if use_reentrant != "off":
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        return m
    return make


def test_a_transformers_models_own_checkpointing_and_use_cache():
    pytest.importorskip("transformers")
    run = dict(micro_batch=2, seq_len=16, world_size=2)
    found = doctor(TrainConfig(model=_gpt2(True, use_cache=False), **run))
    assert kinds(found) == [("hf_reentrant_find_unused", H4)] and found[0].severity == "warning"
    assert found[0].message.startswith(
        "the model's own gradient checkpointing is on (is_gradient_checkpointing=True, "
        "use_reentrant=True): ddpkit turns it off for its runs and checkpoints by "
        "TrainConfig.checkpoint=None instead.")
    assert "'Expected to mark a variable ready only once'" in found[0].message
    # non-reentrant: what ddpkit did about it, a note under its own name; off: nothing to report
    found = doctor(TrainConfig(model=_gpt2(False, use_cache=False), **run, checkpoint=2))
    assert kinds(found) == [("hf_own_checkpointing", H4)] and found[0].severity == "note"
    assert "use_reentrant=False" in found[0].message and "ready only once" not in found[0].message
    assert "TrainConfig.checkpoint=2 instead" in found[0].message
    assert doctor(TrainConfig(model=_gpt2(use_cache=False), **run, checkpoint=2)) == []
    # use_cache=True under checkpointing (ddpkit's or the model's own): ddpkit switches it off
    found = doctor(TrainConfig(model=_gpt2(use_cache=True), **run, checkpoint=2))
    assert kinds(found) == [("hf_use_cache", "config.use_cache")]
    assert found[0].message.startswith("use_cache=True in the model's config with checkpointing "
                                       "on: ddpkit sets config.use_cache=False for its runs.")
    assert found[0].fix == ("nothing for ddpkit's runs; in a trainer of your own, set "
                            "model.config.use_cache = False")
    assert doctor(TrainConfig(model=_gpt2(use_cache=True), **run)) == []  # no checkpointing
    found = doctor(TrainConfig(model=_gpt2(True, use_cache=True), **run))
    assert [(f.where, f.severity) for f in found] == [(H4, "warning"), ("config.use_cache", "note")]


def test_a_transformers_causal_lm_as_it_ships_gets_notes_only(recwarn):
    """GPT-2 with its default config (use_cache=True), checkpointed by ddpkit: nothing named after
    another pitfall, nothing to act on; `train`'s check (and so the Lab and the CLI) warns of
    nothing and keeps the note."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    from ddpkit.runs.train import check_config

    def make():
        return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=64,
                                          n_positions=32))

    assert make().config.use_cache is True  # as transformers ships it
    cfg = TrainConfig(model=make, micro_batch=2, seq_len=16, world_size=2)
    for checkpoint in (2, "full", [True, False, True]):
        found = doctor(cfg.replace(checkpoint=checkpoint))
        assert kinds(found) == [("hf_use_cache", "config.use_cache")]
        assert found.warnings == [] and found[0].severity == "note"
    assert doctor(cfg) == []  # no checkpointing: the cache costs nothing extra
    found = check_config(cfg.replace(checkpoint=2))
    assert found.pitfalls == ["hf_use_cache"]
    assert not [w for w in recwarn if "ddpkit" in str(w.message)]
    assert "(note) at config.use_cache" in repr(found)


def test_every_finding_has_its_own_name_and_a_severity():
    """Each name the rules can give is in the catalogue (a warning: act on it) or in the doctor's
    own notes, never both, and a name in neither is refused."""
    import ast
    from pathlib import Path

    import ddpkit.pitfalls.rules as rules
    from ddpkit.pitfalls import catalog

    catalogue = [p.name for p in catalog()]
    assert len(set(catalogue)) == len(catalogue)
    assert not set(rules.NOTES) & set(catalogue)
    assert rules.SEVERITIES.index("note") < rules.SEVERITIES.index("warning")
    # every Finding(...) the doctor's source makes names one of the two, by a literal
    folder = Path(rules.__file__).parent
    named = set()
    for path in (folder / "rules.py", folder / "doctor.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Finding":
                assert isinstance(node.args[0], ast.Constant), ast.unparse(node)[:80]
                named.add(node.args[0].value)
    assert named <= set(catalogue) | set(rules.NOTES) and set(rules.NOTES) <= named
    assert {n: rules.severity_of(n) for n in named} == {
        n: "note" if n in rules.NOTES else "warning" for n in named}
    with pytest.raises(ValueError, match="'made_up': not a pitfall of the catalogue"):
        Finding("made_up", "x", "y", "z")


def test_no_dropout_finding_while_another_thread_forks_the_rng():
    """The Lab simulates steps on its own threads inside a fork of the process's RNG (building a
    model seeds it); the doctor, run meanwhile for the Run button, compares that same RNG across
    backward. Each holds `ddpkit.spec.rng`'s lock, so a model with no random op is never said
    to recompute dropout (it was, in a Lab test run beside a simulation)."""
    import threading

    from ddpkit.spec import rng

    stop = threading.Event()

    def simulate_like_the_lab():
        i = 0
        while not stop.is_set():
            with rng.forked():
                torch.manual_seed(i)  # as building a model does
                torch.randn(64)
                time.sleep(0.0005)
            i += 1

    cfg = TrainConfig(model="gpt", n_blocks=2, width=16, seq_len=8, checkpoint="full", dropout=0.0)
    thread = threading.Thread(target=simulate_like_the_lab, daemon=True)
    thread.start()
    try:
        found = [doctor(cfg).pitfalls for _ in range(20)]
    finally:
        stop.set()
        thread.join()
    assert all("dropout_rng" not in f for f in found), found
