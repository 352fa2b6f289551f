"""Measured beside predicted (issue #44): a run's probed records, its summary, a sweep's row and
the swimlanes carry the step time predicted for its config, where this machine is calibrated.

"Calibrated" here is a machine of stated round rates (`machines.synthetic`) put where
`ddpkit.calibrate()` looks, in a folder of the test's own: no calibration runs in a test, and
the numbers checked are the prediction's own, not this machine's speed.
"""
import math
import os

import pytest

import ddpkit
from ddpkit.predict import replay
from ddpkit.predict.calibrate import machine_key, remember
from ddpkit.predict.peak import heaviest_rank, predicted_peak, simulated
from ddpkit.predict.steptime import step_time
from ddpkit.runs import predicted
from machines import synthetic as round_rates

CFG = dict(model="mlp", n_blocks=2, width=16, micro_batch=2, world_size=2, steps=3,
           timeline_every=2, backend="gloo", device="cpu")


def calibrate_with_round_rates(*cfgs):
    """This machine's calibration, cached where ``DDPKIT_CACHE`` says: the round rates, with the
    configs' ops marked as timed by the rate tables (so a prediction measures nothing here)."""
    m = round_rates(key=machine_key(max(1, (os.cpu_count() or 1) // 2)))  # as calibrate keys it
    for cfg in cfgs:
        for op in simulated(cfg, heaviest_rank(cfg)).stream:
            if getattr(op, "recipe", None) is not None:
                m.replayed[replay.key(op.recipe)] = None
    remember(m)
    return m


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """One setting swept on a calibrated machine: (the table, the machine, the config)."""
    cfg = ddpkit.TrainConfig(**CFG)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DDPKIT_CACHE", str(tmp_path_factory.mktemp("calibrated")))
        m = calibrate_with_round_rates(cfg)
        table = ddpkit.sweep(cfg, checkpoint=[None], progress=False)
    return table, m, cfg


def test_a_calibrated_machine_predicts_the_runs_probed_records_and_its_row(swept):
    from ddpkit.cli import summary_table

    table, m, cfg = swept
    seconds = step_time(cfg, machine=m).seconds
    res = table.result[0]
    assert table.predicted_step_ms[0] == pytest.approx(1e3 * seconds)
    assert table.predicted_peak_bytes[0] == predicted_peak(cfg).bytes
    # probed steps: the timeline's (step 1) and the peak's (steps 0 and 1); step 2 is neither
    probed = [r for r in res.metrics if "timeline" in r or "peak_bytes" in r]
    assert {r["step"] for r in probed} == {0, 1} and len(probed) == 4
    assert all(r["predicted_step_s"] == seconds for r in probed)
    assert all("predicted_step_s" not in r for r in res.metrics if r["step"] == 2)
    # each peak beside the prediction of its step: 0 makes the optimizer state, 1 is steady
    assert {r["step"]: r["predicted_peak_bytes"] for r in probed} == {
        s: predicted_peak(cfg, s).bytes for s in (0, 1)}
    s = res.summary()
    assert s["predicted_step_s"] == seconds and "prediction_note" not in s
    assert f"predicted_step_s={seconds:.4f}" in repr(res)
    assert f"predicted {1e3 * seconds:.2f} ms" in summary_table(cfg, res.metrics)


def test_the_swimlanes_set_the_predicted_step_below_the_measured_one(swept):
    table, m, cfg = swept
    res = table.result[0]
    fig, plain = res.swimlanes(predicted=True), res.swimlanes()
    measured = [t for t in fig.data if t.showlegend is not False]
    guess = [t for t in fig.data if t.showlegend is False]
    # the measured lanes as res.swimlanes() draws them, on the first axes
    assert [len(t.x) for t in measured] == [len(t.x) for t in plain.data]
    assert {t.yaxis for t in measured} == {"y"} and {t.yaxis for t in guess} == {"y2"}
    assert fig.layout.xaxis.matches == "x2" or fig.layout.xaxis2.matches == "x"
    # every predicted row drawn, hatched, under the kind's legend entry
    tl = step_time(cfg, machine=m).timeline
    drawn = tl[tl.kind.isin(["forward", "backward", "recompute", "optimizer", "allreduce"])]
    assert sum(len(t.x) for t in guess) == len(drawn) > 0
    assert all(t.marker.pattern.shape == "/" for t in guess)
    assert {t.legendgroup for t in guess} <= {t.legendgroup for t in measured}
    assert list(fig.layout.yaxis2.ticktext) == ["rank 0 all-reduce", "rank 0 compute"]
    assert "predicted" in fig.layout.title.text and fig.layout.yaxis2.title.text == "predicted"


def test_nothing_is_predicted_without_a_cached_calibration_or_when_asked_not_to(
        tmp_path, monkeypatch):
    cfg = ddpkit.TrainConfig(**CFG)
    monkeypatch.setenv("DDPKIT_CACHE", str(tmp_path))
    assert predicted.start(cfg) is None  # nothing cached: a run never calibrates by itself
    calibrate_with_round_rates(cfg)
    assert predicted.start(cfg, predict=False) is None
    p = predicted.start(cfg)
    assert p.wait(60) and p.seconds == step_time(cfg, machine=round_rates()).seconds
    with pytest.raises(ValueError, match=r"train\(predict='yes'\): pass None .* True .* False"):
        predicted.start(cfg, predict="yes")


def test_records_wait_for_the_prediction_and_a_changed_setting_ends_it(tmp_path, monkeypatch):
    """A prediction still running when the records come (one at a time: the one before holds
    the lock): they are stamped once it is ready, a rank's records after a live change never."""
    cfg = ddpkit.TrainConfig(**CFG)
    monkeypatch.setenv("DDPKIT_CACHE", str(tmp_path))
    calibrate_with_round_rates(cfg)
    records = [dict(rank=r, step=s, changed="checkpoint" if (r, s) == (1, 2) else "",
                    **({"peak_bytes": 1} if s < 2 else {}), **({"timeline": []} if s else {}))
               for s in range(4) for r in (0, 1)]
    with predicted._ONE_AT_A_TIME:
        p = predicted.start(cfg)
        seen = []
        watch = p.watch(seen.append)
        for r in records:
            watch(r)
        assert seen == records and not p.wait(0.2)
        assert "still running" in p.note() and not any("predicted_step_s" in r for r in records)
    assert p.wait(60) and p.note() is None
    p.fill()
    stamped = {(r["rank"], r["step"]) for r in records if "predicted_step_s" in r}
    # every record here is probed (a peak, a timeline or both); rank 1 changed at step 2
    assert stamped == {(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)}
    assert records[0]["predicted_peak_bytes"] == predicted_peak(cfg, 0).bytes
    assert all(math.isclose(r["predicted_step_s"], p.seconds) for r in records
               if "predicted_step_s" in r)
