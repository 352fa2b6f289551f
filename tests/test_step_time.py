"""`estimate(cfg).step_time()`: the rank's simulated step played on a machine's rates.

These tests use a machine of stated round rates (`RATES`), so what they check is how the step
is played (what overlaps, what waits, what recompute adds, what a link costs), not how fast
this machine is; `bench/step_time.py` sets predictions beside measured runs.
"""
import dataclasses
import math

import pytest

import ddpkit
from ddpkit.predict import streams
from ddpkit.predict.optrace import Mark, Op
from ddpkit.predict.simulate import simulate
from ddpkit.predict.steptime import COLUMNS, LEDGER, play, step_time
from ddpkit.runs.timeline import COLUMNS as RUN_COLUMNS
from machines import synthetic as machine

def predict(**kw):
    cfg = ddpkit.TrainConfig(**{**dict(model="gpt", n_blocks=4, width=64, seq_len=16,
                                       micro_batch=2, world_size=2), **kw})
    return step_time(cfg, machine=machine())


def test_the_ledger_adds_up_and_the_timeline_has_the_runs_columns():
    st = predict(optimizer="adamw", checkpoint=2, bucket_cap_mb=0.01)
    assert set(st.ledger) == set(LEDGER)
    assert math.isclose(sum(st.ledger.values()), st.seconds, rel_tol=1e-9)
    assert st.ledger["recompute"] > 0 and st.ledger["optimizer"] > 0
    assert COLUMNS == RUN_COLUMNS
    tl = st.timeline
    assert set(tl.kind) >= {"forward", "backward", "recompute", "allreduce", "optimizer"}
    assert {f"block {i}" for i in range(4)} <= set(tl.name[tl.kind == "forward"])
    assert (tl.end_s >= tl.start_s).all() and tl.end_s.max() <= st.seconds + 1e-12


def test_small_buckets_start_during_backward_one_bucket_waits_for_its_end():
    small, one = predict(bucket_cap_mb=0.01), predict(bucket_cap_mb=100)
    buckets = lambda st: st.timeline[st.timeline.kind == "allreduce"]  # noqa: E731
    assert len(buckets(one)) == 1 and len(buckets(small)) > 4
    backward_end = small.timeline[small.timeline.kind == "backward"].end_s.max()
    assert buckets(small).start_s.min() < backward_end  # overlapped with the backward
    assert small.overlap > one.overlap
    # one bucket starts with the last gradient: little of the backward is left to hide it
    assert one.ledger["exposed_comm"] > 0.8 * one.comm_s


def test_no_sync_all_reduces_once_per_step_and_without_it_every_micro_step():
    synced, skipped = predict(accum_steps=4, no_sync=False), predict(accum_steps=4)
    ar = lambda st: st.timeline[st.timeline.kind == "allreduce"]  # noqa: E731
    assert sorted(set(ar(synced).micro_step)) == [0, 1, 2, 3]
    assert sorted(set(ar(skipped).micro_step)) == [3]
    assert skipped.comm_s < synced.comm_s and skipped.seconds < synced.seconds


def test_recompute_is_the_checkpointed_blocks_forward_again():
    none, full = predict(), predict(checkpoint="full")
    assert none.ledger["recompute"] == 0
    # every block's forward runs again (torch stops each a little early: at most that much)
    blocks = none.timeline[(none.timeline.kind == "forward")
                           & none.timeline.name.str.startswith("block")]
    again = (blocks.end_s - blocks.start_s).sum()
    assert 0.5 * again < full.ledger["recompute"] <= 1.05 * again
    assert full.seconds > none.seconds


def test_a_slower_simulated_link_exposes_more_communication():
    fast, slow = predict(bucket_cap_mb=0.01), predict(bucket_cap_mb=0.01, link_gbps=0.01)
    assert slow.ledger["exposed_comm"] > fast.ledger["exposed_comm"]
    assert slow.comm_s > fast.comm_s


def test_fsdp_and_zero1_play_their_collectives():
    fsdp = predict(strategy="fsdp", optimizer="adamw")
    kinds = set(fsdp.timeline.kind)
    assert {"allgather", "reduce_scatter"} <= kinds and "allreduce" not in kinds
    zero1 = predict(strategy="ddp_zero1", optimizer="adamw")
    assert "broadcast" in set(zero1.timeline.kind)


@pytest.mark.parametrize("kw", [dict(), dict(checkpoint="full", accum_steps=2),
                                dict(strategy="fsdp", optimizer="adamw", checkpoint="full")])
def test_a_stream_carried_from_3_and_4_blocks_plays_as_the_whole(kw):
    base = dict(model="gpt", width=32, seq_len=8, micro_batch=2, world_size=2, **kw)
    sims = {n: simulate(ddpkit.TrainConfig(n_blocks=n, **base), 0).stream for n in (3, 4, 6)}
    carried = streams.extend(sims[3], sims[4], 6)
    ops = lambda s: [(e.name, e.bytes, e.flops, e.phase) for e in s if isinstance(e, Op)]  # noqa: E731
    marks = lambda s: [(e.what, e.block) for e in s  # noqa: E731
                       if isinstance(e, Mark) and e.what.startswith(("block_", "recompute_"))]
    assert marks(carried) == marks(sims[6])
    assert len(ops(carried)) == len(ops(sims[6]))
    whole, built = (play(s, machine(), ranks=2)[0] for s in (sims[6], carried))
    assert built == pytest.approx(whole, rel=2e-3)


def test_a_named_device_reports_mfu_and_a_network_slows_a_multi_node_step():
    cfg = ddpkit.TrainConfig(model="gpt", n_blocks=4, width=256, seq_len=64, micro_batch=8,
                             world_size=16, precision="bf16", optimizer="adamw")
    one_node = step_time(cfg.replace(world_size=8), device="H100")
    assert 0 < one_node.mfu < 1 and one_node.tokens_per_s > 0
    fast = step_time(cfg, device="H100", link="400Gbps")
    slow = step_time(cfg, device="H100", link="10Gbps")
    assert slow.comm_s > fast.comm_s
    with pytest.raises(ValueError, match="not a device ddpkit knows"):
        step_time(cfg, device="Z80")


def test_a_collective_that_holds_the_core_delays_compute_by_its_own_work_not_the_links():
    """CPU ranks that fill the cores: gloo's copies and sums run on the core the rank computes
    on (``comm_cpu_share=1``): the backward waits while each bucket's all-reduce runs, and the
    wait is booked as exposed communication; a simulated link's extra time is a wait on the
    wire, not work, and holds no core."""
    cfg = ddpkit.TrainConfig(model="gpt", n_blocks=4, width=64, seq_len=16, micro_batch=2,
                             world_size=2, bucket_cap_mb=0.01)
    free, held = (step_time(cfg, machine=machine(comm_share=s)) for s in (0.0, 1.0))
    assert held.seconds > free.seconds
    compute = [k for k in LEDGER if k != "exposed_comm"]
    assert sum(held.ledger[k] for k in compute) == pytest.approx(
        sum(free.ledger[k] for k in compute), rel=1e-9)  # the delay is communication's
    assert held.seconds == pytest.approx(sum(held.ledger.values()), rel=1e-9)
    # every bucket's own seconds are taken from compute: the step is the compute plus them
    # (the last bucket's, which nothing hides, at most once)
    assert held.seconds >= sum(free.ledger[k] for k in compute) + 0.99 * held.comm_s
    slow = cfg.replace(link_gbps=0.01)
    wire_free, wire_held = (step_time(slow, machine=machine(comm_share=s)) for s in (0.0, 1.0))
    own = held.seconds - free.seconds  # what holding the core costs without the wire
    assert wire_held.seconds - wire_free.seconds <= own * 1.01


def test_calibration_fits_the_share_and_the_per_byte_cost_it_is_shown():
    """`calibrate.fit_share` recovers the share of a core that reproduces reference steps'
    wall times, and `fit_costs` the per-byte cost that reproduces their ops' in-step seconds."""
    from ddpkit.predict import calibrate, replay

    cfgs = [ddpkit.TrainConfig(model=m, n_blocks=2, width=w, micro_batch=4, world_size=2)
            for m, w in (("mlp", 256), ("gpt", 32))]
    streams_ = [simulate(cfg, 0).stream for cfg in cfgs]
    truth = machine(comm_share=0.6)
    refs = [(s, {"wall": play(s, truth, ranks=2)[0]}) for s in streams_]
    guess = machine(comm_share=0.0)
    assert calibrate.fit_share(guess, refs, ranks=2) == pytest.approx(0.6)

    alone, per_byte = 1e-6, 2e-10
    m = machine()
    refs = []
    for stream in streams_:
        ops = [e for e in stream if isinstance(e, Op) and e.kind != "collective"
               and e.phase in calibrate.PHASES and e.recipe is not None]
        inside = {}
        for op in ops:
            m.replayed[replay.key(op.recipe)] = alone
            key = f"{op.phase}/{op.name}"
            inside[key] = inside.get(key, 0.0) + alone + per_byte * op.bytes
        phases = {p: sum(t for k, t in inside.items() if k.startswith(p + "/"))
                  for p in calibrate.PHASES}
        refs.append((stream, {**phases, "ops": inside, "step": sum(phases.values())}))
    _, _, fitted, _ = calibrate.fit_costs(m, refs)
    assert fitted and all(v == pytest.approx(per_byte, rel=1e-6) for v in fitted.values())


def test_a_small_steps_prediction_measures_no_rate_table(monkeypatch):
    """Every op of a small step is run again at its own shapes (`replay`), so learning it (what
    `calibrate` does for its reference steps) measures none of the rate tables a real-size op
    needs (about 16 s on 2 cores): not for the profiler ranges' ends either, which move no bytes
    and cost their dispatch alone."""
    from ddpkit.predict import rates, replay
    from ddpkit.predict.machine import Machine
    from ddpkit.predict.player import play as play_stream

    def tables(threads):
        raise AssertionError("the rate tables were measured for a small step")
    monkeypatch.setattr(rates, "tables", tables)
    cfg = ddpkit.TrainConfig(model="mlp", n_blocks=2, width=16, micro_batch=2, world_size=2)
    stream = simulate(cfg, 0).stream
    assert any(getattr(e, "name", "") == "_record_function_exit" for e in stream)
    m = Machine("measured here", threads=1, collectives=machine().collectives,
                overhead=machine().overhead)
    assert replay.learn(m, stream) > 0 and m.needs_tables()
    end = next(e for e in stream if getattr(e, "name", "") == "_record_function_exit")
    assert m.op_s(end) == m.overhead[end.phase or "other"]  # its dispatch, no work
    assert play_stream(stream, m, ranks=2)[0] > 0


def test_a_composed_models_step_time_plays_a_simulated_stream(monkeypatch):
    """A large model's bytes are composed from per-block pieces (no op stream); its step time
    plays the stream of the model cut to 3 and 4 blocks, extended (a setting alike on every
    block), or of the whole model: the same time as without composing."""
    from ddpkit.predict import peak, scale

    cfg = ddpkit.TrainConfig(model="gpt", n_blocks=9, width=32, seq_len=8, micro_batch=2,
                             world_size=2)
    values = (None,)  # a setting alike on every block: the stream extended from 3 and 4 blocks
    whole = {i: step_time(cfg.replace(checkpoint=v), machine=machine()).seconds
             for i, v in enumerate(values)}
    monkeypatch.setattr(peak, "SCALE_ABOVE", 0)  # every model composed
    monkeypatch.setattr(scale, "SCALE_ABOVE", 0)
    monkeypatch.setattr(peak, "_MEMO", {})  # and none of the whole ones remembered
    for i, v in enumerate(values):
        c = cfg.replace(checkpoint=v)
        assert peak.simulated(c, 0).how == "composed" and peak.simulated(c, 0).stream is None
        assert step_time(c, machine=machine()).seconds == pytest.approx(whole[i], rel=2e-3)


def _renumbered(stream):
    """The stream with its op indices counted from its first op and a CUDA rank's events
    numbered as first named (a step simulated after a shorter step 0 starts its counts
    earlier; only which op or event a wait names is read)."""
    first = next(e.index for e in stream if isinstance(e, Op))
    events = {}
    for e in stream:
        if isinstance(e, Mark) and e.what in ("record", "wait_event", "sync_event"):
            events.setdefault(e.block, len(events))
    return [dataclasses.replace(e, index=e.index - first) if isinstance(e, Op) else
            dataclasses.replace(e, block=e.block - first) if e.what == "wait" else
            dataclasses.replace(e, block=events[e.block]) if e.block in events and
            e.what in ("record", "wait_event", "sync_event") else e for e in stream]


def _micro_cases():
    """(strategy, k, no_sync, on H100): three in the default run (a synced DDP step, ZeRO-2's
    reduce-scatter every micro-step, FSDP as a CUDA rank's streams and events), the matrix
    under --breadth."""
    ci = {("ddp", 4, True, False), ("zero2", 4, False, False), ("fsdp", 4, False, True)}
    cases = [(s, k, n, False) for s in ("ddp", "ddp_zero1", "zero2", "fsdp") for k in (4, 8)
             for n in (True, False)] + [("fsdp", 4, False, True)]
    return [pytest.param(*c, marks=() if c in ci else pytest.mark.breadth) for c in cases]


@pytest.mark.parametrize("strategy, k, no_sync, on_h100", _micro_cases())
def test_a_step_of_many_micro_steps_simulated_with_three_is_the_whole_step(
        strategy, k, no_sync, on_h100, monkeypatch):
    """A step of k >= 4 micro-steps is simulated with its first, one middle and its last
    micro-step (`simulate.SHORT`: the planner's micro-batch 1 with accumulation 8 took 8.7 s,
    16 micro-steps for two steps): its peaks are the whole step's to the byte (phase, ledger
    and each phase's too) and its stream is the whole step's, entry for entry, so the same
    step time is played from it."""
    from ddpkit.predict import hardware, simulate as sim_module

    shortened = []
    real = sim_module.repeat_middle
    monkeypatch.setattr(sim_module, "repeat_middle",
                        lambda stream, k: shortened.append(k) or real(stream, k))
    target = hardware.target("H100") if on_h100 else None
    cfg = ddpkit.TrainConfig(model="gpt", n_blocks=2, width=16, seq_len=8, vocab=32,
                             micro_batch=1, accum_steps=k, no_sync=no_sync, strategy=strategy,
                             optimizer="adamw", world_size=2)
    whole = simulate(cfg, 0, target=target, short=False)
    short = simulate(cfg, 0, target=target)
    assert shortened[-1] == k  # simulated with 3 micro-steps, then carried
    assert short.peaks == whole.peaks
    assert _renumbered(short.stream) == _renumbered(whole.stream)


def test_a_calibration_is_kept_per_mmap_threshold_the_ranks_run_with(monkeypatch):
    """CPU ranks with glibc's mmap threshold fixed (``DDPKIT_MMAP_THRESHOLD=131072``) ran
    1.26-1.40x slower than with glibc's own (bench.malloc): a calibration measured under one
    is not the other's, so each has its own cache entry."""
    from ddpkit.predict.calibrate import cache_path, machine_key

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("DDPKIT_MMAP_THRESHOLD", raising=False)
    dynamic = machine_key(1)
    monkeypatch.setenv("DDPKIT_MMAP_THRESHOLD", "131072")
    fixed = machine_key(1)
    assert "mmap threshold dynamic" in dynamic and "mmap threshold 131072" in fixed
    assert cache_path(dynamic) != cache_path(fixed)
