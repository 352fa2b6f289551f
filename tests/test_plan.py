"""`ddpkit.plan` and `fits`: the planner's per-block figures are exact for every selective list,
its choice is the cheapest on the frontier whose simulated step peak fits, that peak is what a
real 2-rank run measures, and "will it fit" names its GPU (issues #15, #18)."""
import itertools

import pytest

import ddpkit
import fixtures_module as fm
from ddpkit.engine.policies import install
from ddpkit.spec.setting import CheckpointSetting
from ddpkit.predict.estimate import trace_activations, traced_flops
from ddpkit.predict.gpus import GPUS, CUDA_CONTEXT, parse_bytes, usable_bytes

RUN = dict(world_size=2, micro_batch=4, seq_len=32, optimizer="adamw", steps=3, peak_every=1,
           backend="gloo", device="cpu")


def configs():
    yield ddpkit.TrainConfig(model=fm.make_model, data=fm.make_data, loss=fm.loss_fn, **RUN)
    yield ddpkit.TrainConfig(model="gpt", n_blocks=5, width=32, **RUN)
    pytest.importorskip("transformers")
    yield ddpkit.TrainConfig(model=fm.make_gpt2, **RUN)


def truth(cfg, setting):
    """A setting's figures traced on their own (not from the per-block sums the planner uses)."""
    return trace_activations(cfg, setting), traced_flops(cfg, setting)


def test_the_plan_is_the_cheapest_frontier_choice_whose_peak_fits():
    from ddpkit.predict.plan import _choice, _figures

    for cfg in configs():
        fig = _figures(cfg)
        for mask in itertools.product((False, True), repeat=cfg.n_blocks):
            setting = CheckpointSetting.from_mask(mask, cfg.checkpoint.stacks)
            c = _choice(fig, setting)  # the planner's figures, from per-block sums...
            assert (c.activations, c.flops) == truth(cfg, setting)  # ...equal the traced ones
        front = ddpkit.plan(cfg, 10**12).frontier
        low, high = min(c.total for c in front), max(c.total for c in front)
        for share in (0.2, 0.7):  # budgets between the frontier's ends
            p = ddpkit.plan(cfg, low + int(share * (high - low)), allowance=0)
            if not p.fits:  # the optimizer step is the peak: said so, nothing chosen
                assert "checkpointing cannot lower" in p.reason, (cfg.model, share)
                continue
            assert p.choice.peak == ddpkit.estimate(p.apply()).peak()  # a simulated step's
            assert p.choice.total <= p.budget and p.choice in p.frontier
            for c in p.frontier:  # every cheaper choice of the frontier peaks above it
                if c.flops < p.choice.flops:
                    assert ddpkit.estimate(cfg.replace(checkpoint=c.checkpoint)).peak().bytes \
                        > p.budget, (cfg.model, share, c.mask)


def test_every_row_the_plan_shows_is_a_simulated_peak():
    """Issue #41 item 3: the frontier's rows were placed (the step without checkpointing less
    what a list saves: up to 11% under the simulated peak, a region's recompute coming back in
    the backward) and a user picks from them. Each row is now its own simulated step, and the
    choice is the cheapest row that fits: table, choice and peak() agree to the byte."""
    cfg = ddpkit.TrainConfig(model="gpt", n_blocks=4, width=32, **{**RUN, "micro_batch": 8})
    wide = ddpkit.plan(cfg, 10**12, allowance=0)
    table = wide.frontier_table()
    assert table.simulated.all() and table.peak_bytes.is_monotonic_decreasing
    for row in table.itertuples():
        value = CheckpointSetting.parse(row.mask)
        assert row.peak_bytes == ddpkit.estimate(cfg.replace(checkpoint=value)).peak().bytes
    budget = sorted(table.peak_bytes)[len(table) // 2]
    p = ddpkit.plan(cfg, budget, allowance=0)
    assert p.choice.total == budget == ddpkit.estimate(p.apply()).peak().bytes
    assert all(c.total > budget for c in p.frontier if c.flops < p.choice.flops)


def test_the_planned_run_measures_what_was_predicted():
    pytest.importorskip("transformers")
    cfg = ddpkit.TrainConfig(model=fm.make_gpt2, **{**RUN, "micro_batch": 8})
    unchecked = ddpkit.estimate(cfg).peak()
    assert unchecked.phase == "backward"  # activations dominate: checkpointing can help
    budget = unchecked.bytes - int(0.3 * unchecked.ledger["activations"])
    p = ddpkit.plan(cfg, budget, allowance=0)
    assert p.checkpoint is not None and p.choice.flops_ratio > 1.0 and p.choice.total <= budget
    res = ddpkit.train(p.apply())
    rank0 = [m for m in res.metrics if m["rank"] == 0]
    assert all(m["activation_bytes"] == p.choice.activations for m in rank0)
    # the step's peak, measured on every rank and every step (0, 1 and the steady state)
    for m in res.metrics:
        want = ddpkit.estimate(p.apply()).peak(step=min(m["step"], 1), rank=m["rank"])
        assert abs(m["peak_bytes"] - want.bytes) <= 0.03 * want.bytes
    assert max(m["peak_bytes"] for m in res.metrics) <= 1.03 * budget
    # FLOPs of the real model (real tensors, one process) against the predicted ratio
    from ddpkit.engine.data import first_batch, make_dataset
    from ddpkit.engine.probes import count_flops
    from ddpkit.spec.model import build_model, compute_loss

    plan = cfg.rank_plan()
    model = build_model(plan)[0]
    batch = first_batch(plan, make_dataset(plan))

    def flops(value):
        install(plan, model, cfg.checkpoint.with_value(value))
        return count_flops(lambda: compute_loss(model, batch).backward())

    assert flops(p.checkpoint) / flops(None) == pytest.approx(p.choice.flops_ratio, rel=1e-9)


def test_nothing_fits_says_what_would():
    cfg = ddpkit.TrainConfig(model="gpt", n_blocks=4, width=32, **{**RUN, "micro_batch": 8})
    # just what FSDP needs with every block checkpointed: DDP keeps every state whole
    tight = ddpkit.estimate(cfg.replace(strategy="fsdp", checkpoint="full")).peak().bytes
    p = ddpkit.plan(cfg, tight, allowance=0)
    assert not p.fits and p.choice is None and p.reason
    changes = [a["change"] for a in p.alternatives]
    assert any(c.startswith("micro_batch=4, accum_steps=2") for c in changes)
    assert any("fsdp" in c for c in changes)
    fsdp = next(a for a in p.alternatives if "fsdp" in a["change"])
    assert fsdp["fits"] and fsdp["predicted"] <= tight
    with pytest.raises(ValueError, match="nothing fits the budget: see plan.alternatives"):
        p.apply()


def test_fits_names_the_gpu_and_its_overhead():
    cfg = ddpkit.TrainConfig(model="gpt", n_blocks=4, width=32, **RUN)
    est = ddpkit.estimate(cfg)
    fit = est.fits("T4")
    assert fit and fit.usable == usable_bytes("T4") < GPUS["T4"] - CUDA_CONTEXT
    assert "T4" in repr(fit) and "not counted" in repr(fit)
    assert not est.fits(est.total // 2)
    big = est.largest_micro_batch(64 * 2**20)
    assert big >= 1
    assert ddpkit.estimate(cfg.replace(micro_batch=big)).fits(64 * 2**20)
    assert not ddpkit.estimate(cfg.replace(micro_batch=big + 1)).fits(64 * 2**20)


def test_a_cards_fit_is_its_cuda_rank_not_this_machines_cpu_rank():
    """`fits(cfg, "H100")` on a config that runs on CPU here asks about the card: its rank is
    simulated as the CUDA rank it would be there (the card's cuBLAS workspaces held, CUDA's
    512-byte blocks), the same answer as ``estimate(cfg).peak(device=...)``."""
    from ddpkit.predict.gpus import card_target
    from ddpkit.predict.simulate import cublas_workspaces

    cfg = ddpkit.TrainConfig(model="mlp", n_blocks=2, width=32, micro_batch=2, world_size=2,
                             backend="gloo", device="cpu")
    est = ddpkit.estimate(cfg)
    here, h100, t4 = est.peak(), est.fits("H100").peak, est.fits("T4").peak
    assert h100.ledger == est.peak(device="H100").ledger and h100.bytes == est.peak(device="h100").bytes
    assert here.ledger["other"] < 2**20   # a CPU rank holds no cuBLAS workspace
    assert h100.ledger["other"] - t4.ledger["other"] == \
        cublas_workspaces(card_target("H100")) - cublas_workspaces(card_target("T4")) > 0
    assert h100.ledger["gradients"] % 512 == 0 != here.ledger["gradients"] % 512
    with pytest.raises(ValueError, match=r"peak\(device=1024\): pass a card's name such as 'H100'"):
        est.peak(device=1024)
    # the plans against a card plan the card's rank: its peaks, and on time its step time too
    p = ddpkit.plan(cfg, "T4")
    assert p.fits and p.choice.peak == est.peak(device="T4") == t4
    q = ddpkit.plan(cfg, "T4", objective="time")
    assert q.choice.peak == ddpkit.estimate(q.choice.config).peak(device="T4")
    assert q.choice.seconds == ddpkit.estimate(q.choice.config).step_time(device="T4").seconds


@pytest.mark.parametrize("value, message", [
    ("12 parsecs", r"memory_budget='12 parsecs': pass bytes \(an int > 0\) or a string like '12GiB'"),
    (-5, r"memory_budget=-5: pass bytes"),
    (True, r"memory_budget=True: pass bytes"),
])
def test_bad_budgets_name_the_fix(value, message):
    with pytest.raises(ValueError, match=message):
        parse_bytes(value)


def test_budget_strings_and_unknown_gpus():
    assert parse_bytes("12GiB") == 12 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000
    with pytest.raises(ValueError, match=r"gpu='Z80' is not a card ddpkit knows; pass one of T4, .* \(ddpkit.predict.gpus.GPUS\)"):
        ddpkit.estimate(ddpkit.TrainConfig()).fits("Z80")


def test_the_largest_micro_batch_is_the_edge_of_any_growing_peak(monkeypatch):
    """The search asks few simulated steps (each costs seconds) yet must land on the edge
    exactly: the largest micro-batch that fits, one more does not, whatever the peak's shape.
    Checked against a scan over synthetic peaks: linear, quadratic, stepped, with a jump."""
    import random
    import types

    from ddpkit.predict import fits

    rnd = random.Random(1)
    asked = []
    for trial in range(600):
        a, b, c, d = rnd.randint(0, 1000), rnd.randint(1, 50), rnd.randint(0, 3000), rnd.random() * 3
        kind = trial % 4

        def phases(mb, a=a, b=b, c=c, d=d, kind=kind):
            fw = a + b * mb + (int(d * mb * mb) if kind == 1 else 0) + (37 * (mb // 7) if kind == 2 else 0)
            if kind == 3:
                fw = a + b * mb + 200 * (mb > 50)
            return {"forward": fw, "optimizer": c}

        seen = set()

        def fake_peak(cfg, phases=phases, seen=seen, target=None):
            seen.add(cfg.micro_batch)
            by = phases(cfg.micro_batch)
            return types.SimpleNamespace(bytes=max(by.values()), by_phase=by)

        usable = rnd.randint(0, 400_000)
        monkeypatch.setattr(fits, "predicted_peak", fake_peak)
        monkeypatch.setattr(fits, "usable_bytes", lambda gpu, usable=usable: usable)
        monkeypatch.setattr(fits, "card_target", lambda gpu: None)
        cfg = types.SimpleNamespace(replace=lambda micro_batch: types.SimpleNamespace(micro_batch=micro_batch))
        want = 0
        for mb in range(1, 4097):
            if max(phases(mb).values()) > usable:
                break
            want = mb
        assert fits.largest_micro_batch(cfg, "any") == want, (trial, kind, usable)
        asked.append(len(seen))
    assert max(asked) <= 16 and sum(asked) / len(asked) < 8, (max(asked), sum(asked) / len(asked))


def test_plan_on_time_lists_each_candidates_own_peak_and_step_time():
    """``plan(objective="time")`` (#44 item 4): every candidate it lists has the peak
    ``estimate(cfg).peak(device=...)`` gives and the step time ``estimate(cfg).step_time()`` gives for
    its config, fits the budget, and is the least recompute of its strategy and micro-batch
    that fits (the rung before it, where there is one, does not); the choice is the fastest."""
    from ddpkit.predict.planner import _ladder

    cfg = ddpkit.TrainConfig(model="gpt", n_blocks=4, width=16, seq_len=16, vocab=32,
                             micro_batch=4, optimizer="adamw", world_size=2)
    plain, full = (ddpkit.estimate(cfg.replace(checkpoint=c)).peak(device="H100").bytes
                   for c in (None, "full"))  # an H100's rank, as the plan for it simulates
    p = ddpkit.plan(cfg, (plain + full) // 2, objective="time", device="H100", allowance=0)
    assert p.fits and p.choice.seconds == min(c.seconds for c in p.candidates)
    for c in p.candidates:
        if c.changes["bucket_cap_mb"] not in (None, 4):
            continue  # two bucket sizes of four: each is a simulation of its own here
        est = ddpkit.estimate(c.config)
        assert c.fits and c.peak == est.peak(device="H100") and c.peak.bytes <= p.budget
        assert c.seconds == est.step_time(device="H100").seconds, c.label
        ladder = [None, *_ladder(c.config)]
        rung = ladder.index(c.changes["checkpoint"])
        if rung:  # checkpointing only where the rung before it does not fit
            before = c.config.replace(checkpoint=ladder[rung - 1])
            assert ddpkit.estimate(before).peak(device="H100").bytes > p.budget, c.label
