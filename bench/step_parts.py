"""A step's parts, measured beside predicted: where a step-time prediction goes wrong.

For each named config of `bench.step_time` (run in alternation with a reference config, a few
rounds): the rank runs its steps as `engine.loop.train_rank` does (the same probes, hooks and
wrapping) and reads, per step, the wall and this thread's CPU seconds of each phase (forward,
backward, optimizer), the process's CPU seconds (gloo's threads too), and the collectives it
issued; beside it the prediction's ledger and its phases' spans.

    python -m bench.step_parts "mlp accum 4" "gpt fsdp" --ref gpt --rounds 3
"""
import argparse
import contextlib
import statistics
import time

import ddpkit


def parts(ctx, plan, steps=25, warm=5):
    """Rank 0's medians over steps ``warm``.. of: each phase's wall and thread seconds, the
    step's wall (``measure.seconds``, the bench's figure), thread and process CPU seconds, and
    the collectives counted per step (by kind)."""
    from ddpkit.engine import strategies
    from ddpkit.engine.data import RankBatches, make_dataset
    from ddpkit.engine.loop import LiveSettings
    from ddpkit.engine.measure import Measure
    from ddpkit.engine.step import train_step, zero_grad
    from ddpkit.engine.timeline import TimelineProbe
    from ddpkit.spec.model import build_model

    measure = Measure(plan, ctx.device, ctx.rank)
    model = build_model(plan)[0]
    settings = LiveSettings(plan, model)
    timeline = TimelineProbe.from_plan(plan, ctx)
    wrapped, optimizer, comm = strategies.wrap(plan, model, ctx, count_comm="comm" in plan.probes,
                                               watch=timeline.watch if timeline else None)
    if timeline:
        timeline.attach(wrapped)
    data = RankBatches(make_dataset(plan), ctx.rank, ctx.world_size, shuffle=False)
    rows, consumed, now = [], 0, {}

    @contextlib.contextmanager
    def phase(name):
        w, c = time.perf_counter(), time.thread_time()
        yield
        now[name + "_wall"] = now.get(name + "_wall", 0.0) + time.perf_counter() - w
        now[name + "_cpu"] = now.get(name + "_cpu", 0.0) + time.thread_time() - c
    with measure.running(comm, 0, timeline):
        for step in range(steps):
            now.clear()
            batches = data.micro_batches(consumed, plan.micro_batch, plan.accum_steps)
            consumed += ctx.world_size * plan.micro_batch * plan.accum_steps
            c, p = time.thread_time(), time.process_time()
            with measure.step(step, [], model, optimizer, settings.policy) as acts:
                train_step(wrapped, optimizer, batches, accum_steps=plan.accum_steps,
                           no_sync=plan.no_sync, precision=strategies.autocast_precision(plan),
                           device=ctx.device, activation_probe=acts, inner=model,
                           loss_fn=plan.loss_fn, phase=measure.phase or phase)
            now.update(wall=measure.seconds, cpu=time.thread_time() - c,
                       proc=time.process_time() - p)
            rec = measure.read(model, optimizer)
            for k, v in rec.items():
                if k.endswith("_calls"):
                    now[k] = v
            zero_grad(optimizer)
            rows.append(dict(now))
            ctx.log(step=step)
    if ctx.rank:
        return None
    keys = set().union(*rows[warm:])
    return {k: statistics.median(r.get(k, 0.0) for r in rows[warm:]) for k in sorted(keys)}


def predicted(cfg, machine):
    from ddpkit.predict.steptime import step_time

    st = step_time(cfg, machine=machine)
    tl = st.timeline
    out = {"wall": st.seconds, **{"L_" + k: v for k, v in st.ledger.items()}}
    for kind in ("forward", "backward", "recompute", "optimizer"):
        rows = tl[tl.kind == kind]
        out[kind + "_span"] = float((rows.end_s - rows.start_s).sum())
    comm = tl[~tl.kind.isin(["forward", "backward", "recompute", "optimizer"])]
    out["comm_calls"] = len(comm)
    out["comm_s"] = st.comm_s
    return out


def run(name, machine):
    from bench.step_time import CONFIGS

    from ddpkit.predict.calibrate import _launch

    kw = dict(CONFIGS)[name]
    cfg = ddpkit.TrainConfig(**{"world_size": 2, **kw}, steps=25, backend="gloo", device="cpu")
    got = _launch(parts, cfg.rank_plan(), world_size=cfg.world_size).returns[0]
    return got, predicted(cfg, machine)


def fmt(d):
    return " ".join(f"{k}={v:g}" if k.endswith("calls") else f"{k}={1e3 * v:.1f}"
                    for k, v in d.items())


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="+")
    ap.add_argument("--ref", default="gpt")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    from ddpkit.predict.calibrate import calibrate

    machine = calibrate(progress=False)
    for r in range(args.rounds):
        for name in args.names:
            for n in (args.ref, name):
                got, pred = run(n, machine)
                print(f"[{r}] {n}: measured {fmt(got)}\n      predicted {fmt(pred)}", flush=True)
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
