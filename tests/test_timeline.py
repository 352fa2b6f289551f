"""Issue #20: the timeline of backward, recompute and each bucket's all-reduce, on real gloo
ranks, checked against DDP's own runtime statistics and the torch profiler."""
import statistics
import time

import pytest
import torch

import ddpkit
from ddpkit.runtime.pool import shared_pool
from ddpkit.engine.timeline import ring_allreduce_s
from ddpkit.runs.timeline import rebuilt_buckets, versus_ddp

CPU = dict(backend="gloo", device="cpu")
# 4 blocks of 2 MiB of weights each: 1 MiB buckets make about 9 of them
BIG = dict(model="mlp", n_blocks=4, width=256, micro_batch=4, world_size=2, steps=4,
           timeline_every=1, **CPU)
# tolerance of the cross-checks. Stamps taken on the rank's main thread (hooks, DDP's comm
# hook, the autograd callback): 6 ms + 10% of the other reading, twice that for a duration
# (they agreed within 0.5 ms; the rest is room for a busy machine). The end of an all-reduce is
# stamped by a Python callback on gloo's thread, which first needs the GIL: while the main
# thread runs Python or a torch op that holds it, it waits (6.6 ms seen on 2 busy cores).
TOL_S, TOL_REL = 6e-3, 0.10
TOL_END_S = 10e-3
FINALIZER_S = 15e-3  # DDP's comm end trails ours by its finalizer's copies: see the test


@pytest.fixture(scope="module")
def pool():
    return shared_pool(2, "gloo", "cpu")  # the kernel's shared warm ranks, as train's default


def close(a, b, stamps=1):
    """Within the tolerance of ``stamps`` readings (a duration is two: twice the wait)."""
    return abs(a - b) <= stamps * TOL_S + TOL_REL * abs(b)


def blocks(tl, kind):
    return tl[(tl.kind == kind) & tl.name.str.startswith("block")]


@pytest.fixture(scope="module")
def small_buckets(pool):
    return ddpkit.train(ddpkit.TrainConfig(**BIG, bucket_cap_mb=1), pool=pool)


def test_small_buckets_overlap_backward_and_match_ddps_rebuilt_buckets(small_buckets):
    res = small_buckets
    tl = res.timeline
    assert set(tl.kind) == {"forward", "backward", "allreduce", "optimizer"}
    assert set(tl["rank"]) == {0, 1} and set(tl.step) == {0, 1, 2, 3}
    want = rebuilt_buckets(res.ddp_stats)
    assert want is not None and len(want) >= 5
    for (rank, step), g in tl.groupby(["rank", "step"]):
        ar = g[g.kind == "allreduce"]
        if step == 0:  # DDP's first iteration puts every gradient in one bucket ...
            assert list(ar["bytes"]) == [sum(want)]
            continue
        # ... and rebuilds them at step 1's forward, in the order gradients became ready
        assert list(ar.sort_values("bucket")["bytes"]) == want
        # some bucket's all-reduce starts before the last backward block ends
        assert ar.start_s.min() < blocks(g, "backward").end_s.max(), (rank, step)
    over = res.overlap()
    assert len(over) == 8 and over.comm_s.gt(0).all()
    assert over.overlap.between(0, 1).all() and (over.exposed_comm_s <= over.comm_s + 1e-9).all()


def test_every_row_lies_inside_its_step(small_buckets):
    m = small_buckets.metrics
    windows = {(r["rank"], r["step"]): r["timeline_window"] for r in m}
    for row in small_buckets.timeline.itertuples():
        lo, hi = windows[(row.rank, row.step)]
        assert lo <= row.start_s <= row.end_s <= hi, row
    assert m[0]["clock_error_s"] == 0.0  # one host: one clock


def test_timeline_agrees_with_ddps_runtime_statistics(small_buckets):
    v = versus_ddp(small_buckets.timeline, small_buckets.ddp_stats)
    # DDP logs an iteration's timers at the next synced forward: steps 0..2 of 4, both ranks
    assert len(v) == 6, v
    # on CPU both stamp the host: one clock (on CUDA DDP's are labelled "host launch")
    assert set(small_buckets.ddp_stats["clock"]) == set(v.ddp_clock) == {"timeline"}
    # in order, always: the reducer stamps its comm start before it calls the comm hook (ours),
    # and its comm end after the hook's futures, whose callbacks stamp our ends, are done
    assert (v.ddp_comm_start_s <= v.comm_start_s + 1e-6).all(), v
    assert (v.comm_end_s <= v.ddp_comm_end_s + 1e-6).all(), v
    # and close: each figure in most rows (the median row's gap within the tolerance; a rank
    # that a busy machine keeps off its core between two stamps moves one row, not most)
    pairs = [("comm_start_s", "ddp_comm_start_s", v),
             ("compute_end_s", "ddp_compute_end_s", v)]
    later = v[v.step >= 1]  # step 0 is DDP's one-bucket iteration (see below)
    pairs += [("compute_s", "ddp_compute_s", later), ("overlap_s", "ddp_overlap_s", later)]
    for ours, theirs, rows in pairs:
        stamps = 1 if ours.endswith(("start_s", "end_s")) else 2
        over = [abs(a - b) - (stamps * TOL_S + TOL_REL * abs(b))
                for a, b in zip(rows[ours], rows[theirs])]
        assert statistics.median(over) <= 0, (ours, rows[[ours, theirs]])
    # DDP's comm time ends in its finalizer, after it copied every bucket back into the
    # gradients; ours when the last all-reduce's future completed: never later (above), and
    # earlier by that copy (11 ms seen with 9 buckets on 2 busy cores; 6 ms for step 0's
    # single 8 MiB bucket)
    trail = [b - a - (FINALIZER_S + TOL_REL * b) for a, b in zip(later.comm_s, later.ddp_comm_s)]
    assert statistics.median(trail) <= 0, later[["comm_s", "ddp_comm_s"]]


def _profiled(ctx, plan):
    """train_rank under the torch profiler: the rank's records and its gloo:all_reduce events."""
    from torch.profiler import ProfilerActivity, profile

    from ddpkit.engine.loop import train_rank

    records, log = [], ctx.log
    ctx.log = lambda **r: (records.append(r), log(**r))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_rank(ctx, plan)
    ctx.log = log
    events = [(e.start_ns(), e.start_ns() + e.duration_ns())
              for e in prof.profiler.kineto_results.events() if e.name() == "gloo:all_reduce"]
    return records, events


def test_allreduce_rows_match_the_profilers_gloo_events(pool):
    # no peak probe: its own profiler window would end this one
    cfg = ddpkit.TrainConfig(**{**BIG, "steps": 3}, bucket_cap_mb=1, measure=["comm"])
    run = pool.launch(_profiled, cfg.rank_plan())
    for rank, (records, events) in enumerate(run.returns):
        origin = records[0]["clock_origin_ns"]  # the profiler stamps ns since the epoch, as we
        events = [((a - origin) / 1e9, (b - origin) / 1e9) for a, b in events]
        rows = sorted((r for rec in records for r in rec.get("timeline", ())
                       if r[3] == "allreduce"), key=lambda r: r[5])
        # every step is probed, and nothing else all-reduces: one event per row, in the order
        # DDP handed the buckets to gloo (gloo's 2 threads may run two at once)
        assert len(rows) >= 1 + 2 * 5 and len(events) == len(rows)
        events = sorted(events)
        for r, (a, b) in zip(rows, events):
            # the event lies inside the row and ends with it (the profiler closes it after the
            # future's callbacks ran, so its end may trail the row's a little)
            assert r[5] <= a, (rank, r, (a, b))
            if r[1] >= 1:  # step 0's one 8 MiB bucket: the event ran on 8 ms past the future
                assert abs(r[6] - b) <= TOL_END_S, (rank, r, (a, b))
            # a row starts when DDP hands the bucket over, the event when a gloo thread runs
            # it: after the two all-reduces gloo's threads may be running, and once a core is
            # free (on 2 cores the ranks' backward holds both: waits of ~5 ms were seen)


def test_one_large_bucket_starts_only_when_every_block_is_done(pool):
    res = ddpkit.train(ddpkit.TrainConfig(**BIG, bucket_cap_mb=1000), pool=pool)
    tl = res.timeline
    groups = list(tl[tl.step >= 1].groupby(["rank", "step"]))
    assert len(groups) == res.config.world_size * len(set(tl.step[tl.step >= 1]))  # not none
    for (rank, step), g in groups:
        ar = g[g.kind == "allreduce"]
        largest = ar.loc[ar["bytes"].idxmax()]
        # after every block's backward: only the stem's last gradients complete the bucket
        assert largest.start_s >= blocks(g, "backward").end_s.max(), (rank, step)
        assert len(ar) == 1  # bucket_cap_mb=1000: one bucket holds every gradient


@pytest.mark.parametrize("no_sync", [True, False])
def test_no_sync_puts_the_allreduces_on_the_last_micro_step_only(pool, no_sync):
    cfg = ddpkit.TrainConfig(**{**BIG, "steps": 3, "width": 64}, accum_steps=4, no_sync=no_sync)
    tl = ddpkit.train(cfg, pool=pool).timeline
    assert set(tl.micro_step) == {0, 1, 2, 3}
    for _, g in tl.groupby(["rank", "step"]):
        micro = set(g[g.kind == "allreduce"].micro_step)
        assert micro == ({3} if no_sync else {0, 1, 2, 3})


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_replays_blocks_inside_backward(pool, reentrant):
    cfg = ddpkit.TrainConfig(**{**BIG, "steps": 2, "width": 64}, checkpoint="full",
                             use_reentrant=reentrant)
    tl = ddpkit.train(cfg, pool=pool).timeline
    rec = tl[tl.kind == "recompute"]
    assert set(rec.name) == {f"block {i}" for i in range(4)}
    for row in rec.itertuples():  # each replay runs inside backward, before its block's grads
        g = tl[(tl["rank"] == row.rank) & (tl.step == row.step) & (tl.micro_step == row.micro_step)]
        bwd = g[g.kind == "backward"]
        assert bwd.start_s.min() <= row.start_s and row.end_s <= bwd.end_s.max()
        assert g[g.kind == "forward"].end_s.max() < row.start_s
    plain = ddpkit.train(cfg.replace(checkpoint=None), pool=pool).timeline
    assert not (plain.kind == "recompute").any()
    assert set(plain[plain.kind == "backward"].name) >= {f"block {i}" for i in range(4)}


def test_a_slow_simulated_link_holds_each_allreduce_and_exposes_more(pool):
    cfg = ddpkit.TrainConfig(**{**BIG, "steps": 3}, bucket_cap_mb=1)
    exposed = {}
    # loopback on 2 busy cores is about as fast as 2 to 10 Gbit/s: slower links than that
    for gbps in (None, 1, 0.25):
        res = ddpkit.train(cfg.replace(link_gbps=gbps), pool=pool)
        tl = res.timeline
        ar = tl[tl.kind == "allreduce"]
        over = res.overlap().set_index(["rank", "step"])
        if gbps:
            ring = [ring_allreduce_s(b, 2, gbps) for b in ar["bytes"]]
            assert ((ar.end_s - ar.start_s).values >= ring).all()
            assert res.metrics[-1]["simulated_link"] == f"simulated link: {gbps} Gbit/s, 0 us latency"
            # the link needs the ring time of all the gradients from the first hand-over on:
            # what backward does not cover after that first bucket is exposed
            for (rank, step), g in tl[tl.step >= 1].groupby(["rank", "step"]):
                a = g[g.kind == "allreduce"]
                hidden = g[g.kind == "backward"].end_s.max() - a.start_s.min()
                need = ring_allreduce_s(a["bytes"].sum(), 2, gbps)
                assert over.loc[(rank, step)].exposed_comm_s >= need - hidden - 1e-3
        exposed[gbps] = over.query("step >= 1").exposed_comm_s.median()
    assert exposed[None] < exposed[1] < exposed[0.25], exposed


def test_ring_time_is_the_textbook_formula():
    # 2(N-1)/N x bytes at the bandwidth, plus 2(N-1) latencies
    assert ring_allreduce_s(1e9, 2, gbps=8) == pytest.approx(1.0)
    assert ring_allreduce_s(1e9, 4, gbps=8) == pytest.approx(1.5)
    assert ring_allreduce_s(0, 4, gbps=8, latency_us=10) == pytest.approx(6 * 10e-6)
    assert ring_allreduce_s(1e9, 1, gbps=8) == 0.0


@pytest.mark.parametrize("field, value, match", [
    ("timeline_every", -1, r"timeline_every=-1: must be an int >= 0; pass timeline_every=0"),
    ("bucket_cap_mb", 0, r"bucket_cap_mb=0: must be a number > 0 or None; pass e\.g\. bucket_cap_mb=1"),
    ("link_gbps", -10, r"link_gbps=-10: must be a number > 0 or None; pass e\.g\. link_gbps=1"),
    ("link_latency_us", -1, r"link_latency_us=-1: must be a number >= 0"),
])
def test_bad_timeline_settings_name_the_field_and_the_fix(field, value, match):
    with pytest.raises(ValueError, match=match):
        ddpkit.TrainConfig(**{field: value}, **CPU)


def test_fsdp_refuses_the_ddp_only_knobs():
    with pytest.raises(ValueError, match=r"link_gbps=1: acts on DDP's buckets and comm hook; "
                                         r"FSDP has neither; pass link_gbps=None"):
        ddpkit.TrainConfig(strategy="fsdp", optimizer="adamw", link_gbps=1, **CPU)
    with pytest.raises(ValueError, match=r"bucket_cap_mb=4: acts on DDP's buckets"):
        ddpkit.TrainConfig(strategy="fsdp", optimizer="adamw", bucket_cap_mb=4, **CPU)


def test_timeline_off_records_nothing_and_the_cli_takes_the_knobs(pool):
    res = ddpkit.train(ddpkit.TrainConfig(**{**BIG, "steps": 2, "width": 64, "timeline_every": 0}),
                       pool=pool)
    assert res.timeline.empty and not any("timeline" in m for m in res.metrics)
    from ddpkit.cli import _config_from, _config_parser
    import argparse

    args = _config_parser(argparse.ArgumentParser()).parse_args(
        ["--bucket-cap-mb", "2.5", "--link-gbps", "10", "--timeline-every", "5"])
    cfg = _config_from(args)
    assert (cfg.bucket_cap_mb, cfg.link_gbps, cfg.timeline_every) == (2.5, 10.0, 5)
    assert "--link-gbps 10.0" in " ".join(cfg.to_cli())


def test_the_lab_draws_the_last_probed_step_at_most_once_a_second():
    cfg = ddpkit.TrainConfig(model="mlp", n_blocks=4, width=64, world_size=2, micro_batch=4,
                             steps=400, timeline_every=5, **CPU)
    with ddpkit.Lab(cfg) as lab:
        lab.set(bucket_cap_mb=0.25, link_gbps=1.0)  # the slider and the link, as a person would
        assert (lab.config().bucket_cap_mb, lab.config().link_gbps) == (0.25, 1.0)
        lab.set(link_gbps=0.0)
        assert lab.config().link_gbps is None and lab.config().bucket_cap_mb == 0.25
        lab.run()
        assert lab.controls["bucket_cap_mb"].disabled  # a new DDP wrapper: fixed mid-run
        row = lab.wait(timeout=180)
        assert row["status"] == "ok"
        assert 1 <= lab.timeline.redraws <= row["wall_s"] + 2
        bars = [t for t in lab.timeline.lanes.data if len(t.x)]
        assert {t.name for t in bars} >= {"forward", "backward", "all-reduce", "optimizer"}
        lanes = {y for t in bars for y in t.y}
        assert {0, -3} <= lanes  # both ranks' compute lanes
        assert lab.timeline.lanes.layout.title.text == "step 399: what each rank did"
        exposed = lab.timeline.exposed.data[0]
        assert list(exposed.x) == list(range(4, 400, 5))  # every probed step, once
        lab.set(link_gbps=1.0)
        lab.run()
        lab.wait(timeout=180)
        assert lab.timeline.lanes.layout.title.text.endswith("SIMULATED link 1 Gbit/s")
        assert "SIMULATED" in lab.timeline.exposed.layout.title.text


@pytest.mark.parametrize("knobs", [dict(static_graph=True), dict(gradient_as_bucket_view=True)])
def test_ddps_own_knobs_pass_through_and_keep_the_timeline_whole(pool, knobs):
    cfg = ddpkit.TrainConfig(**{**BIG, "steps": 4}, bucket_cap_mb=1, **knobs)
    res = ddpkit.train(cfg, pool=pool)
    tl, windows = res.timeline, {(m["rank"], m["step"]): m["timeline_window"] for m in res.metrics}
    assert set(tl.step) == {0, 1, 2, 3}
    for row in tl.itertuples():
        lo, hi = windows[(row.rank, row.step)]
        assert lo <= row.start_s <= row.end_s <= hi, row
    want = rebuilt_buckets(res.ddp_stats)
    # a static graph's buckets are rebuilt after its second iteration, others' after the first
    rebuilt = 2 if knobs.get("static_graph") else 1
    for (rank, step), g in tl.groupby(["rank", "step"]):
        got = list(g[g.kind == "allreduce"].sort_values("bucket")["bytes"])
        assert got == (want if step >= rebuilt else [sum(want)]), (rank, step)
    if knobs.get("static_graph"):  # DDP holds every all-reduce of step 0 to the end of backward
        for _, g in tl[tl.step == 0].groupby("rank"):
            assert g[g.kind == "allreduce"].start_s.min() >= blocks(g, "backward").end_s.max()


def test_gloo_all_reduce_ends_are_host_stamps_also_on_a_shared_gpu():
    # the shared-GPU mode, a rank on GPU 1 over gloo: the end of its all-reduce is stamped in
    # the future's callback on gloo's worker thread, where torch sets no device (gloo's futures
    # carry none). A CUDA event recorded there went to GPU 0, and reading it against the rank's
    # GPU-1 reference event failed. Gloo's end is the host's clock; NCCL's stays a CUDA event
    # on the callback's stream (which torch synchronises with the all-reduce).
    from ddpkit.engine.timeline import TimelineProbe, _CudaClock

    shared = TimelineProbe(1, 3, "cuda:1", every=1, backend="gloo")
    assert isinstance(shared.clock, _CudaClock) and shared.end_stamp is time.time_ns
    nccl = TimelineProbe(1, 2, "cuda:1", every=1, backend="nccl")
    assert nccl.end_stamp == nccl.clock.stamp
    shared.clock.ref_ns = 1_000
    assert shared.clock.read(123_456) == 123_456  # a host stamp beside the rank's events


def test_a_rank_kept_off_its_core_between_ddps_stamp_and_ours_keeps_its_row():
    """On a busy machine a rank can wait tens of ms between DDP's comm-start stamp and the comm
    hook's: its iteration is still set beside its own micro-step, not left out or matched to
    another (DDP's stamp always comes first, and its comm end after ours)."""
    import pandas as pd

    from ddpkit.runs.timeline import COLUMNS

    rows = []
    for step, t0 in ((0, 1.0), (1, 1.2)):  # the first bucket's start, the last one's end
        rows += [(0, step, 0, "forward", "model", t0 - 0.05, t0 - 0.04, 0),
                 (0, step, 0, "backward", "block 0", t0 - 0.04, t0 + 0.01, 0),
                 (0, step, 0, "allreduce", "bucket 0", t0, t0 + 0.02, 1024)]
    tl = pd.DataFrame(rows, columns=COLUMNS)
    ddp = pd.DataFrame([dict(rank=0, iteration=1, clock="timeline",
                             backward_comm_start_s=1.2 - 0.08,  # 80 ms before the hook's
                             backward_comm_end_s=1.2 + 0.021, backward_compute_end_s=1.2 + 0.011,
                             backward_compute_time_s=0.05, backward_comm_time_s=0.101,
                             backward_compute_comm_overlap_time_s=0.09)])
    v = versus_ddp(tl, ddp)
    assert list(v.step) == [1], v
