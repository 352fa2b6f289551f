"""The lab without a browser: what its buttons and sliders do, on real gloo ranks."""
import html
import re
import time

import pytest

import ddpkit
import machines
from ddpkit.lab.plots import thin
from ddpkit.predict.gpus import allocator_allowance

CFG = dict(model="mlp", n_blocks=4, width=32, world_size=2, micro_batch=4, accum_steps=1,
           steps=6, peak_every=3)


def rank0_steps(lab):
    return sum(1 for m in lab.metrics if m["rank"] == 0)


def wait_for_steps(lab, n, timeout=60):
    deadline = time.monotonic() + timeout
    while rank0_steps(lab) < n:
        assert time.monotonic() < deadline, "run did not get going"
        time.sleep(0.005)


def wait_for_change(lab, kind, timeout=30):
    """Changes land within ~0.1 s (ranks agree on them at scheduled steps)."""
    deadline = time.monotonic() + timeout
    while not any(kind in m.get("changed", "") for m in list(lab.metrics)):
        assert time.monotonic() < deadline, f"{kind} change never landed"
        time.sleep(0.005)


@pytest.fixture
def lab():
    with ddpkit.Lab(ddpkit.TrainConfig(**CFG)) as lab:
        yield lab


def test_headless_run_matches_train(lab):
    assert lab.run() is not None  # returns at once with the handle; the kernel stays free
    row = lab.wait(timeout=120)
    ref = ddpkit.train(ddpkit.TrainConfig(**CFG)).summary()
    assert row["status"] == "ok" and row["steps_done"] == CFG["steps"]
    assert row["final_loss"] == ref["final_loss"]
    assert row["activation_bytes"] == ref["activation_bytes"]
    assert row["config"]["checkpoint"] is None and len(lab.history) == 1  # to_dict: the plain
    assert len(lab.plots.points("loss", 0)) == CFG["steps"] == len(lab.plots.points("loss", 1))


def test_mid_run_changes_land_on_every_rank_at_one_step(lab):
    lab.set(steps=400)
    lab.run()
    wait_for_steps(lab, 5)
    lab.set(segments=2)              # checkpointing on, mid-run
    wait_for_change(lab, "checkpoint")
    lab.set(accum_steps=2)
    wait_for_change(lab, "accum_steps")
    wait_for_steps(lab, rank0_steps(lab) + 3)
    row = lab.stop()
    assert row["status"] == "stopped"
    changes = dict((kind, step) for step, kind in row["changes"])
    assert set(changes) == {"checkpoint", "accum_steps"}
    by_rank = {r: {m["step"]: m for m in lab.metrics if m["rank"] == r} for r in (0, 1)}
    for kind in changes:  # the same step on both ranks
        assert by_rank[0][changes[kind]]["changed"] == by_rank[1][changes[kind]]["changed"] == kind
    k = changes["checkpoint"]
    before, after = by_rank[0][k - 1]["activation_bytes"], by_rank[0][k]["activation_bytes"]
    assert after < before  # activation memory drops the step checkpointing goes on
    assert by_rank[0][k]["checkpoint"] == "2" and by_rank[0][k - 1]["checkpoint"] == "none"
    # the mark says what the setting means ("ckpt 1" would read as checkpointing on)
    assert f"step {k}: 2 segments" in [a.text for a in lab.plots.loss.layout.annotations]
    a = changes["accum_steps"]
    assert by_rank[1][a - 1]["accum_steps"] == 1 and by_rank[1][a]["accum_steps"] == 2
    # the figure got a marker for each change
    assert len(lab.plots.loss.layout.shapes) == 2


def test_controls_fixed_during_a_run_are_disabled_with_a_reason(lab):
    lab.set(steps=400)
    lab.run()
    wait_for_steps(lab, 1)
    ws = lab.controls["world_size"]
    assert ws.disabled and "Stop first" in ws.tooltip and lab.controls["precision"].disabled
    assert not lab.controls["segments"].disabled and not lab.controls["accum_steps"].disabled
    with pytest.raises(RuntimeError, match="already going"):
        lab.run()
    lab.stop()
    assert not ws.disabled and not lab.run_button.disabled


def test_estimate_readout_and_block_toggles_follow_the_slider(lab):
    before = lab.estimate_html.value
    lab.set(segments=4)
    assert [t.value for t in lab.block_toggles] == [True, True, True, False]  # last segment never
    assert lab.estimate_html.value != before and "activations" in lab.estimate_html.value
    lab.block_toggles[3].value = True  # a per-block toggle makes the policy selective
    assert lab.config().checkpoint == [True, True, True, True]
    lab.set(micro_batch=64, segments=0)
    assert lab.config().checkpoint.value is None
    lab.set(world_size=1, precision="fp16")
    assert "precision='fp16' needs CUDA" in html.unescape(lab.estimate_html.value)
    assert lab.run_button.disabled


def test_a_rank_error_shows_a_banner_and_the_lab_is_ready_again(lab):
    lab.set(steps=400)
    handle = lab.run()
    wait_for_steps(lab, 2)
    handle.send_control(checkpoint="bogus")  # what a broken control would do
    row = lab.wait(timeout=60)
    # every rank refuses the setting at the same step: the culprit is whichever spoke first
    assert row["status"] == "error" and re.search(r"rank [01] failed", row["error"])
    assert "RankPlan.checkpoint='bogus': a CheckpointSetting" in row["error"]
    assert "failed" in lab.banner.value and "#c00" in lab.banner.value
    assert "Traceback" in lab.traceback.children[0].value
    lab.set(steps=3)
    assert lab.run() and lab.wait(timeout=120)["status"] == "ok"
    assert lab.banner.value == ""


def test_figures_update_at_a_bounded_rate(lab):
    lab.set(steps=300)
    lab.run()
    row = lab.wait(timeout=120)
    assert lab.plots.flushes <= lab.plots.max_hz * row["wall_s"] + 2
    assert len(lab.plots.points("loss")) == 300  # every record reached the figure


def test_thin_keeps_the_ends_and_bounds_the_points():
    xs = list(range(10_001))
    tx, ty = thin(xs, xs, 2000)
    assert len(tx) <= 2001 and tx[0] == 0 and tx[-1] == 10_000 and tx == ty
    assert thin(xs[:50], xs[:50], 2000) == (xs[:50], xs[:50])


def test_the_lab_shows_doctor_findings_before_the_run():
    cfg = ddpkit.TrainConfig(**{**CFG, "checkpoint": 2, "dropout": 0.1, "preserve_rng_state": False,
                                "steps": 2})
    with ddpkit.Lab(cfg) as lab, pytest.warns(UserWarning, match="dropout_rng"):
        lab.run()
        assert "ddpkit.doctor" in lab.banner.value and "dropout_rng" in lab.banner.value
        assert lab.wait(timeout=120)["status"] == "ok"


def test_the_yellow_box_is_for_what_to_act_on_and_notes_stay_quiet(recwarn):
    """GPT-2 as transformers ships it (use_cache=True), checkpointed: the doctor's check before a
    run (what Run does first) puts its note in a folded grey line, not the yellow box, and warns
    of nothing; a finding to act on still gets the box."""
    pytest.importorskip("transformers")
    import fixtures_module as fm

    cfg = ddpkit.TrainConfig(model=fm.make_gpt2, micro_batch=2, seq_len=16, checkpoint=2)
    with ddpkit.Lab(cfg) as lab:
        found = lab.runner.check(lab.config())
        assert [(f.pitfall, f.severity) for f in found] == [("hf_use_cache", "note")]
        assert "#fff4d6" not in lab.banner.value  # no yellow box
        assert "<details class='ddpkit-notes'" in lab.banner.value
        assert "1 note (hf_use_cache), nothing to act on" in lab.banner.value
        assert not [w for w in recwarn if "ddpkit.doctor" in str(w.message)]
        lab.set(use_reentrant=True)
        with pytest.warns(UserWarning, match="reentrant_find_unused"):
            found = lab.runner.check(lab.config().replace(find_unused_parameters=True))
        assert "reentrant_find_unused" in [f.pitfall for f in found.warnings]
        assert "#fff4d6" in lab.banner.value and "ddpkit-notes" in lab.banner.value


def test_lab_runs_a_transformers_model_with_its_own_blocks():
    pytest.importorskip("transformers")
    import fixtures_module as fm

    cfg = ddpkit.TrainConfig(model=fm.make_gpt2, world_size=2, micro_batch=2, seq_len=16,
                             steps=400, peak_every=50, backend="gloo", device="cpu")
    with ddpkit.Lab(cfg) as lab:
        # one toggle per detected block, named after the model's own modules
        assert [t.tooltip for t in lab.block_toggles] == [
            f"checkpoint transformer.h.{i}" for i in range(4)]
        lab.run()
        wait_for_steps(lab, 3)
        lab.block_toggles[0].value = lab.block_toggles[2].value = True  # mid-run, per block
        wanted = "1,0,1,0,"  # records carry str(setting); the clicks may land a step apart
        deadline = time.monotonic() + 30
        # both ranks' records of it arrived (a Stop right after one rank's may lose the other's)
        while {m["rank"] for m in list(lab.metrics) if m["checkpoint"] == wanted} != {0, 1}:
            assert time.monotonic() < deadline, "the block toggles never reached the ranks"
            time.sleep(0.005)
        row = lab.stop()
    assert row["status"] == "stopped"
    by_step = {m["step"]: m for m in lab.metrics if m["rank"] == 0}
    step = min(s for s, m in by_step.items() if m["checkpoint"] == wanted)
    assert by_step[step]["changed"] == "checkpoint"
    assert [m["checkpoint"] for m in lab.metrics if m["step"] == step] == [wanted] * 2  # both ranks
    assert by_step[step]["activation_bytes"] == ddpkit.estimate(
        cfg.replace(checkpoint=[True, False, True, False])).activations
    assert by_step[0]["activation_bytes"] == ddpkit.estimate(cfg).activations


def test_the_segments_slider_moves_bytes_wherever_checkpoint_sequential_would():
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    def gpt2_6():
        return GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=32, n_head=4, vocab_size=64,
                                          n_positions=32, bos_token_id=0, eos_token_id=0))

    run = dict(world_size=2, micro_batch=2, seq_len=16, backend="gloo", device="cpu")
    moved = {}
    # GPT-2 loops over its own ModuleList; the built-in gpt calls an nn.Sequential whole, where
    # the segments are checkpoint_sequential's own
    for name, model in (("gpt2", dict(model=gpt2_6)), ("sequential", dict(model="gpt", n_blocks=6))):
        with ddpkit.Lab(ddpkit.TrainConfig(**model, **run)) as lab:
            shown, kept = [], []
            for s in range(0, 7):
                lab.set(segments=s)
                shown.append(lab.estimate_html.value)
                kept.append(ddpkit.estimate(lab.config()).activations)
        moved[name] = [b != a for a, b in zip(kept, kept[1:])]
        assert [b != a for a, b in zip(shown, shown[1:])] == moved[name]  # the read-out too
    # 0 -> 1 keeps the same (one segment, never checkpointed); every later step moves the bytes
    assert moved["gpt2"] == moved["sequential"] == [False, True, True, True, True, True]


def _records(step, world_size=2):
    return [dict(rank=r, step=step, loss=1.0 / (step + 1), step_time_s=0.004, accum_steps=1,
                 checkpoint=None, changed="", activation_bytes=40_000, allreduce_calls=1,
                 **({"peak_bytes": 900_000} if step % 10 == 1 else {}))
            for r in range(world_size)]


def _one_update(plots, steps):
    """Feed `steps` records per rank, then capture every widget message of the next update."""
    import ipywidgets as W

    sent, send = [], W.Widget._send
    for s in steps:
        for rec in _records(s):
            plots.add(rec)
    W.Widget._send = lambda self, msg, buffers=None: sent.append((self, msg))
    try:
        assert plots.flush(force=True)
    finally:
        W.Widget._send = send
    return sent


def _numbers(obj):
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return 1
    if isinstance(obj, dict):
        return sum(_numbers(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_numbers(v) for v in obj)
    return 0


@pytest.mark.parametrize("history", [300, 3000])
def test_a_plot_update_sends_only_the_new_points(history):
    plots = ddpkit.LivePlots(world_size=2, max_points=10_000)
    plots.new_run(2, predict=lambda rec: 40_000)
    for s in range(history):  # a run already this long, flushed as the lab does
        for rec in _records(s):
            plots.add(rec)
        if s % 7 == 0:
            plots.flush(force=True)
    plots.flush(force=True)
    sent = _one_update(plots, range(history, history + 5))  # 5 new optimizer steps
    # one message, to the feeder, carrying the new points only, whatever the run's length: per
    # rank 5 steps x (loss, its EMA, activations, step time) + 1 peak (step history + 1), and
    # rank 0's all-reduce calls and prediction for the 5 steps
    assert [w for w, _ in sent] == [plots.feeder]
    extend = sent[0][1]["content"]["extend"]
    points = 2 * (5 * 4 + 1) + 2 * 5
    assert sum(len(x) for _, _, xs, _ in extend for x in xs) == points
    indices = sum(len(idx) for _, idx, _, _ in extend)
    assert _numbers(extend) == 2 * points + indices  # an x and a y per point, nothing else
    # each figure named by the key the page finds its plot by (its layout's meta), one per figure
    keys = [fig.layout.meta for fig in plots.figures]
    assert len(set(keys)) == 3 and {key for key, *_ in extend} == set(keys)
    assert plots.points("loss", 1)[-1] == 1.0 / (history + 5)


def test_long_runs_are_thinned_with_a_few_full_sends():
    import ipywidgets as W

    plots = ddpkit.LivePlots(world_size=1, max_points=100)
    sent, send = [], W.Widget._send
    W.Widget._send = lambda self, msg, buffers=None: (
        sent.append(msg["content"]) if self is plots.feeder else None)
    try:
        for s in range(2000):
            plots.add(_records(s, 1)[0])
            if s % 5 == 4:
                plots.flush(force=True)
    finally:
        W.Widget._send = send
    loss = plots._traces[("loss", 0)]
    assert loss.shown <= 100 and loss.stride == 32  # 2000 / 32 = 63 points shown
    # the loss trace (index 0 of the loss figure) goes in full once per stride 2, 4, 8, 16, 32;
    # the rest of the messages carry new points only
    full = [ys[idx.index(0)] for msg in sent for key, idx, _, ys in msg["replace"]
            if key == plots.loss.layout.meta and 0 in idx]
    assert len(full) == 5 and all(len(ys) <= 100 for ys in full)
    assert full[-1] == plots.points("loss")[:32 * len(full[-1]):32]
    # what the page holds at the end: the last full copy and the points extended after it
    last = max(i for i, msg in enumerate(sent) for cls, idx, _, _ in msg["replace"]
               if cls.endswith("-0") and 0 in idx)
    after = [y for msg in sent[last + 1:] for cls, idx, _, ys in msg["extend"]
             if cls.endswith("-0") and 0 in idx for y in ys[idx.index(0)]]
    assert full[-1] + after == plots.points("loss")[::32]
    assert len(plots.points("loss")) == 2000  # the kernel keeps every point


def test_a_run_that_ends_sends_every_trace_in_full_to_the_page_last():
    """The feeder draws at the page's pace: extends it has not drawn when the run ends would
    land on the figures' synced state and show those points twice. The end's full copies,
    sent after every extend, take their place in the feeder's queue."""
    import ipywidgets as W

    plots = ddpkit.LivePlots(world_size=2)
    sent, send = [], W.Widget._send
    W.Widget._send = lambda self, msg, buffers=None: (
        sent.append(msg["content"]) if self is plots.feeder else None)
    try:
        for s in range(12):
            for rec in _records(s):
                plots.add(rec)
            plots.flush(force=True)
        plots.sync()
    finally:
        W.Widget._send = send
    last = sent[-1]
    assert not last["extend"]
    full = {(key, i): ys[k] for key, idx, _, ys in last["replace"] for k, i in enumerate(idx)}
    for t in plots._traces.values():  # every trace, as the kernel holds it
        key = t.fig.layout.meta
        i = next(k for k, tr in enumerate(t.fig.data) if tr is t.trace)
        assert full[key, i] == t.thinned()[1] == list(t.trace.y)
    assert len(full[plots.loss.layout.meta, 0]) == 12


def test_the_planner_box_sets_the_block_toggles_to_the_plan():
    cfg = ddpkit.TrainConfig(**{**CFG, "model": "gpt", "width": 32, "optimizer": "adamw"})
    with ddpkit.Lab(cfg) as lab:
        est = ddpkit.estimate(cfg)
        budget = est.params + est.grads + est.optimizer + est.activations // 2
        memory = budget + allocator_allowance(cfg).of(budget)  # and the allocator beside it
        lab.planner.budget.value = f"{memory}B"
        p = ddpkit.plan(lab.config(), memory)
        assert p.budget == budget and f"{p.allowance}" in html.unescape(lab.planner.readout.value)
        assert p.fits and lab.planner.last.checkpoint == p.checkpoint
        assert [t.value for t in lab.block_toggles] == p.checkpoint
        assert lab.config().checkpoint == p.checkpoint
        assert f"FLOP ratio {p.choice.flops_ratio:.3f}" in lab.planner.readout.value
        lab.planner.budget.value = "1B"  # nothing fits: the alternatives are listed
        assert "nothing fits" in lab.planner.readout.value
        lab.planner.budget.value = "12 parsecs"
        assert "pass bytes" in lab.planner.readout.value
        lab.planner.budget.value = ""
        lab.planner.gpu.value = "T4"  # a T4 holds this tiny model without any checkpointing
        assert lab.planner.last.checkpoint is None and not any(t.value for t in lab.block_toggles)


def test_the_all_reduce_axis_counts_whole_calls_from_zero():
    plots = ddpkit.LivePlots(world_size=2)
    for s in range(5):
        for rec in _records(s):  # one all-reduce per step, the whole run
            plots.add(rec)
    plots.flush(force=True)
    y2 = plots.timing.layout.yaxis2
    assert y2.range[0] == 0 and 1 < y2.range[1] <= 2 and y2.dtick == 1 and y2.tickformat == "d"
    for rec in _records(5):  # accumulation off with no_sync off: 8 calls in one step
        plots.add({**rec, "allreduce_calls": 8})
    plots.flush(force=True)
    assert plots.timing.layout.yaxis2.range[1] > 8 and plots.timing.layout.yaxis2.dtick == 2


def _until(check, timeout=60):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.05)


def test_the_readout_shows_the_steps_predicted_peak(lab):
    lab.set(segments=2)
    want = ddpkit.estimate(lab.config()).peak()
    # the simulated step runs on the read-out's own thread: the kernel is not held up
    _until(lambda: "the step's peak" in lab.estimate_html.value)
    text = html.unescape(lab.estimate_html.value)
    assert f"the step's peak</b>: {ddpkit.predict.units.fmt_bytes(want.bytes)} in the " \
           f"{want.phase}" in text


def test_the_readout_predicts_a_steps_time_once_this_machine_is_calibrated(
        monkeypatch, tmp_path):
    from ddpkit.predict import calibrate

    monkeypatch.setenv("DDPKIT_CACHE", str(tmp_path))  # nothing calibrated here
    monkeypatch.setattr(calibrate, "_LOADED", {})
    with ddpkit.Lab(ddpkit.TrainConfig(**CFG)) as lab:
        _until(lambda: "the step's peak" in lab.estimate_html.value)
        assert "ddpkit.calibrate() this machine once" in lab.estimate_html.value
    machines.install(monkeypatch, tmp_path)
    with ddpkit.Lab(ddpkit.TrainConfig(**CFG)) as lab:
        lab.set(segments=2)
        _until(lambda: "predicted here" in lab.estimate_html.value)
        # asked once the read-out's own prediction has run: the first prediction of a step
        # times its ops here (`replay.learn`), and two asked at once would time them twice
        want = ddpkit.estimate(lab.config()).step_time()
        said = f"<b>a step</b>: {1e3 * want.seconds:.1f} ms predicted here"
        _until(lambda: said in html.unescape(lab.estimate_html.value))  # the controls' own


def test_the_peak_panel_sets_each_ranks_peak_beside_the_prediction(lab):
    p = lab.plots  # beside the memory plot
    assert p.widget.children == (p.loss, p.memory, lab.peaks.widget, p.timing, p.feeder)
    lab.set(steps=4)
    lab.run()
    lab.wait(timeout=120)
    panel = lab.peaks

    def predicted():
        panel.refresh(force=True)
        return "%" in panel.table.value and "simulating" not in panel.table.value
    _until(predicted)
    last = {m["rank"]: m for m in lab.metrics if "peak_bytes" in m}
    rows = re.findall(r"<tr><td>rank (\d), step (\d+)</td><td>(.*?)</td><td>(.*?)</td>"
                      r"<td>([-+\d.]+)%</td><td>(.*?)</td></tr>", panel.table.value)
    assert sorted(int(r[0]) for r in rows) == [0, 1]
    fmt = ddpkit.predict.units.fmt_bytes
    for rank, step, measured, predicted, err, process in rows:
        m = last[int(rank)]
        want = ddpkit.estimate(lab.config()).peak(step=min(m["step"], 1), rank=m["rank"])
        assert int(step) == m["step"] and f"in the {m['peak_phase']}" in measured
        assert f"in the {want.phase}" in predicted and abs(float(err)) <= 3
        # the process beside the tensors: its peak, and the allocator's share (the difference)
        share = m["process_peak_bytes"] - m["peak_bytes"]
        assert process.startswith(fmt(m["process_peak_bytes"])) and f"allocator {fmt(share)}" in process
    # one stacked bar per rank measured, one predicted; each bar's tensor segments add up to its
    # peak, and the allocator's segment on top: measured, the process's peak beyond the tensors';
    # predicted, the allowance fits() and plan() take for it
    bars, allocator = {}, {}
    for trace in panel.figure.data:
        for name, x in zip(trace.y, trace.x):
            into = allocator if trace.name == "allocator" else bars
            into[name] = into.get(name, 0) + x
    assert set(bars) == {"r0 measured", "r1 measured", "r0 predicted"}
    unit = dict(ddpkit.predict.units.UNITS)[panel.figure.layout.xaxis.title.text]
    assert bars["r0 measured"] * unit == pytest.approx(last[0]["peak_bytes"], rel=1e-9)
    assert allocator["r0 measured"] * unit == pytest.approx(
        last[0]["process_peak_bytes"] - last[0]["peak_bytes"], rel=1e-9)
    fit = ddpkit.fits(lab.config(), last[0]["peak_bytes"])  # a byte budget: this device's memory
    assert allocator["r0 predicted"] * unit == pytest.approx(
        fit.allowance.of(bars["r0 predicted"] * unit), rel=1e-6)
    assert html.escape(str(fit.allowance)) in panel.table.value


@pytest.mark.parametrize("extra", [dict(checkpoint=2), dict(checkpoint=[True, False, True, False]),
                                   dict(checkpoint=[True, True, False, False], micro_batch=100)])
def test_every_widget_of_a_lab_opens_with_its_whole_state(extra, opening):
    """JupyterLab 4.6 sends widget messages on a kernel subshell, so a page that (re)connects
    can be handed every widget's state as it was at any moment of the cell: a widget's later
    changes can be lost on the page. A figure, opened empty, then drew blank: no title, no
    traces, 700 px wide and never fitted. So the Lab sends nothing while it is made: each
    widget's comm opens with the state it still has when the Lab is made (the figures' layouts,
    traces, config and classes; the toggles, the line above them and the read-out as the
    controls say, a micro batch of 100 shown as the slider's 64), and each live figure carries
    the key the page's feeder finds it by."""
    import threading

    import ipywidgets as W
    from ipywidgets.widgets.widget import _instances, _remove_buffers

    opened = opening  # comm id -> the state its opening message carried
    sent, send = [], W.Widget._send
    main = threading.current_thread()

    def record(self, msg, buffers=None):  # what the main thread sends through an open comm
        if self.comm is not None and threading.current_thread() is main:
            sent.append((type(self).__name__, sorted(msg.get("state", {}))))
        return send(self, msg, buffers)

    W.Widget._send = record
    try:
        lab = ddpkit.Lab(ddpkit.TrainConfig(**{**CFG, **extra}))
    finally:
        W.Widget._send = send
    with lab:
        assert sent == []
        # every widget the Lab made holds what it opened with (the read-out aside: its thread
        # adds the simulated peak), so no snapshot of the page can undo a change
        for model_id, state in opened.items():
            w = _instances.get(model_id)
            if w is None or w is lab.estimate_html:
                continue
            now = _remove_buffers(w.get_state())[0]
            assert now == state, (type(w).__name__, [k for k in now if now[k] != state.get(k)])
        figures = [*lab.plots.figures, lab.peaks.figure, lab.timeline.lanes,
                   lab.timeline.exposed]
        for fig in figures:
            state = opened[fig.comm.comm_id]
            assert state["_widget_layout"] == fig._layout_obj._props  # the figure as it is
            assert state["_widget_data"] == fig._data
            assert state["_widget_layout"]["title"]["text"] == fig.layout.title.text
            assert state["_config"]["responsive"]
        assert opened[lab.plots.loss.comm.comm_id]["_widget_data"]  # the run's traces are in
        assert all(opened[f.comm.comm_id]["_widget_layout"]["meta"] == f.layout.meta
                   for f in lab.plots.figures)
        assert "ddpkit-swimlanes" in opened[lab.timeline.lanes.comm.comm_id]["_dom_classes"]
        assert "ddpkit-lab" in opened[lab.widget.comm.comm_id]["_dom_classes"]
        assert "ddpkit-blocks" in opened[lab.blocks.widget.comm.comm_id]["_dom_classes"]
        mask = lab.config().checkpoint.mask
        assert any(mask) and [opened[t.comm.comm_id]["value"] for t in lab.block_toggles] == mask
        assert [opened[t.comm.comm_id]["button_style"] for t in lab.block_toggles] == [
            "info" if on else "" for on in mask]  # pressed ones in colour
        summary = opened[lab.blocks.summary.comm.comm_id]["value"]
        assert summary == lab.blocks.summary.value and f"({sum(mask)} of 4 blocks)" in summary
        checkpoint = extra["checkpoint"]
        assert opened[lab.controls["segments"].comm.comm_id]["value"] == (
            checkpoint if isinstance(checkpoint, int) else 0)
        # the read-out opened saying what the controls say (a micro batch of 64, not 100)
        assert opened[lab.estimate_html.comm.comm_id]["value"] == ddpkit.lab.sync \
            .readout(lab.config)[0]
        assert list(opened[lab.traceback.comm.comm_id]["titles"]) == ["traceback"]


def test_a_smoothing_factor_outside_0_to_1_is_refused_by_name():
    import threading

    with pytest.raises(ValueError, match=r"LivePlots\(ema=1\): .* \[0, 1\); pass e.g. ema=0.95"):
        ddpkit.LivePlots(ema=1)
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match=r"Lab\(ema=-0.1\): the smoothing factor"):
        ddpkit.Lab(ddpkit.TrainConfig(**CFG), ema=-0.1)
    # refused before the Lab starts its predictor thread
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]


def test_closing_a_lab_leaves_no_thread_of_it_alive():
    import threading

    before = set(threading.enumerate())
    lab = ddpkit.Lab(ddpkit.TrainConfig(**CFG))
    lab.set(segments=2)  # a read-out whose peak the predictor simulates
    mine = [t for t in threading.enumerate() if t not in before]
    assert lab.predictor.thread in mine  # one predictor thread per Lab
    lab.close()
    assert not [t.name for t in mine if t.is_alive()]


def test_a_control_is_one_row_of_the_table():
    from ddpkit.lab import controls

    row = controls.Control("warmup_steps", "warmup_steps", controls.slider("warmup", 0, 100),
                           live=True, mark=lambda v, setting: f"warmup {v}")
    controls.CONTROLS.append(row)  # what adding a control to ddpkit is: one row
    try:
        with ddpkit.Lab(ddpkit.TrainConfig(**CFG, warmup_steps=3)) as lab:
            assert lab.controls["warmup_steps"].value == 3  # the view made it, showing the config
            lab.set(warmup_steps=5)
            assert lab.config().warmup_steps == 5  # the sync reads it into the config
            sent = []
            lab.sync.running, lab.sync.send = (lambda: True), (lambda **kw: sent.append(kw))
            lab.set(warmup_steps=7)  # mid-run: a live row's field goes to the ranks
            assert sent[-1]["warmup_steps"] == 7 and sent[-1]["checkpoint"] == None  # noqa: E711
            lab.view.set_running(True)
            assert not lab.controls["warmup_steps"].disabled and lab.controls["steps"].disabled
        text = controls.change_text({"step": 4, "changed": "warmup_steps", "warmup_steps": 7})
        assert text == "step 4: warmup 7"  # and the plots mark a change by its row
    finally:
        controls.CONTROLS.remove(row)


def test_the_per_block_control_hands_the_lab_its_setting(lab):
    mask = [True, False, True, False]
    lab.sync.on_blocks(lab.cfg.checkpoint.with_value(mask))  # what the control says it chose
    assert lab.config().checkpoint == mask


def test_a_lab_shows_once_as_a_widget_does(tmp_path):
    """In a real kernel: `lab = ddpkit.Lab(cfg)` shows nothing, `lab` on the next cell shows it
    once; `ddpkit.Lab(cfg)` as a cell's value shows one; `display(lab)` one more view of it."""
    import nbformat
    from nbclient import NotebookClient

    cells = ["import ddpkit\ncfg = ddpkit.TrainConfig(model='mlp', n_blocks=4, width=8)",
             "lab = ddpkit.Lab(cfg)", "lab", "ddpkit.Lab(cfg)", "display(lab)",
             "lab.widget.model_id"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={
        "metadata": {"path": str(tmp_path)}}).execute()
    views = [[o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
              for o in c.outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
             for c in nb.cells]
    assert [len(v) for v in views] == [0, 0, 1, 1, 1, 0]
    lab_id = nb.cells[5].outputs[0]["data"]["text/plain"].strip("'")
    assert views[2] == views[4] == [lab_id] != views[3]


def test_python_ending_while_the_readout_simulates_exits_cleanly():
    """A script (or kernel) that ends right after making a Lab, its read-out still simulating
    the step on a thread, exits with 0, not an abort from torch's C++ (exit code 134)."""
    import subprocess
    import sys

    code = ("import ddpkit\nlab = ddpkit.Lab(ddpkit.TrainConfig(model='gpt', n_blocks=8, "
            "width=16, seq_len=16))\nassert 'simulating' in lab.estimate_html.value\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr
