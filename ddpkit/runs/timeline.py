"""The timeline of a run, read: rows as a DataFrame, exposed communication per step, DDP's own
statistics beside ours (the figures: `figures.py`; live in the Lab: `ddpkit.lab.timeline`).

Rows come from `ddpkit.engine.timeline.TimelineProbe` inside each probed step's record
(``timeline``: tuples; ``timeline_window``: the step's start and end; ``ddp_stats``: what DDP's
reducer timed). Times are seconds on one clock shared by the ranks (see the probe); on CUDA,
DDP's own timestamps are the host's launch times beside the GPU's (their ``clock`` column).
"""
from __future__ import annotations

COLUMNS = ["rank", "step", "micro_step", "kind", "name", "start_s", "end_s", "bytes"]
COMPUTE = ("forward", "backward", "recompute", "optimizer")


def timeline_frame(metrics):
    """Every probed step's rows, all ranks, one DataFrame (``COLUMNS``; ``bucket``: the DDP
    bucket index of an all-reduce row, else -1), sorted by rank, step and start."""
    import pandas as pd

    rows = [r for m in metrics for r in m.get("timeline", ())]
    df = pd.DataFrame(rows, columns=COLUMNS)
    df["bucket"] = [int(n.split()[1]) if k == "allreduce" else -1
                    for k, n in zip(df["kind"], df["name"])]
    return df.sort_values(["rank", "step", "start_s"], kind="stable").reset_index(drop=True)


def ddp_frame(metrics):
    """DDP's own runtime statistics (``_get_ddp_logging_data()``), one row per rank and synced
    iteration it timed; its timestamps in the timeline's seconds."""
    import pandas as pd

    return pd.DataFrame([{"rank": m["rank"], **s} for m in metrics for s in m.get("ddp_stats", ())])


def _union(spans):
    """Total length of the union of (start, end) spans, and the merged spans."""
    merged = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return sum(b - a for a, b in merged), merged


def _exposed(comm, compute):
    """Length of the comm spans not covered by any compute span."""
    _, comp = _union(compute)
    total, spans = 0.0, _union(comm)[1]
    for a, b in spans:
        covered = sum(max(0.0, min(b, d) - max(a, c)) for c, d in comp)
        total += (b - a) - covered
    return total


def overlap(timeline):
    """One row per rank and step: ``compute_s`` (union of forward, backward, recompute and
    optimizer rows), ``comm_s`` (union of all-reduce rows), ``exposed_comm_s`` (all-reduce time
    with no compute under it: what the step waits for) and ``overlap`` (the hidden fraction,
    1 - exposed/comm, 0..1; NaN where the step had no all-reduce)."""
    import pandas as pd

    out = []
    for (rank, step), g in timeline.groupby(["rank", "step"], sort=True):
        spans = lambda kinds: list(zip(g.start_s[g.kind.isin(kinds)],  # noqa: E731
                                       g.end_s[g.kind.isin(kinds)]))
        compute, comm = spans(COMPUTE), spans(("allreduce",))
        comm_s = _union(comm)[0]
        exposed = _exposed(comm, compute)
        out.append(dict(rank=rank, step=step, compute_s=_union(compute)[0], comm_s=comm_s,
                        exposed_comm_s=exposed,
                        overlap=1 - exposed / comm_s if comm_s > 0 else float("nan")))
    return pd.DataFrame(out, columns=["rank", "step", "compute_s", "comm_s", "exposed_comm_s",
                                      "overlap"])


def versus_ddp(timeline, ddp):
    """DDP's figures for each iteration it timed beside the timeline's for the same synced
    micro-step (found by the first all-reduce's start): backward compute (DDP: end of its
    forward to the end of the autograd pass; here: end of the model's forward to the end of
    the backward), comm (first bucket handed over to the last one done) and overlap (comm start
    to compute end). Iterations whose micro-step the timeline did not probe are left out."""
    import pandas as pd

    rows = []
    for _, d in ddp.iterrows():
        mine = timeline[(timeline["rank"] == d["rank"])]
        ar = mine[mine.kind == "allreduce"]
        if ar.empty or d["backward_comm_start_s"] is None:
            continue
        firsts = ar.groupby(["step", "micro_step"]).start_s.min()
        key = _iteration(firsts, d)
        if key is None:  # not a probed micro-step
            continue
        g = mine[(mine.step == key[0]) & (mine.micro_step == key[1])]
        fwd_end = g[g.kind == "forward"].end_s.max()
        bwd_end = g[g.kind.isin(("backward", "recompute"))].end_s.max()
        a = g[g.kind == "allreduce"]
        rows.append(dict(rank=d["rank"], iteration=d["iteration"], step=key[0],
                         micro_step=key[1], ddp_clock=d.get("clock", "timeline"),
                         ddp_compute_s=d["backward_compute_time_s"],
                         compute_s=bwd_end - fwd_end,
                         ddp_comm_s=d["backward_comm_time_s"],
                         comm_s=a.end_s.max() - a.start_s.min(),
                         ddp_overlap_s=d["backward_compute_comm_overlap_time_s"],
                         overlap_s=bwd_end - a.start_s.min(),
                         ddp_comm_start_s=d["backward_comm_start_s"],
                         comm_start_s=a.start_s.min(),
                         ddp_comm_end_s=d["backward_comm_end_s"], comm_end_s=a.end_s.max(),
                         ddp_compute_end_s=d["backward_compute_end_s"], compute_end_s=bwd_end))
    return pd.DataFrame(rows)


def _iteration(firsts, d):
    """The (step, micro-step) of ``firsts`` (each one's first all-reduce start) that DDP's
    iteration ``d`` timed, or None. On one host clock (``clock`` "timeline") the reducer stamps
    its comm start before it calls the comm hook, which stamps ours, and its comm end after the
    hook's futures, whose callbacks stamp ours, are done: the micro-step is the first whose
    all-reduce starts at or after DDP's comm start, if that is before DDP's comm end, however
    long a busy machine keeps the rank from running between the stamps. DDP's CUDA stamps are
    the host's launch times: the nearest start within 50 ms."""
    start = d["backward_comm_start_s"]
    if d.get("clock", "timeline") == "timeline" and d.get("backward_comm_end_s") is not None:
        after = firsts[firsts >= start - 1e-6]
        if after.empty or after.min() > d["backward_comm_end_s"] + 1e-6:
            return None
        return after.idxmin()
    key = (firsts - start).abs().idxmin()
    return key if abs(firsts[key] - start) <= 0.05 else None


def rebuilt_buckets(ddp):
    """DDP's bucket sizes in bytes after its rebuild (bucket index order), from its stats."""
    for text in ddp.get("rebuilt_bucket_sizes", ()):
        if text:
            return [int(x) for x in text.split(",")]
    return None


def link_label(cfg):
    """'1 Gbit/s' (', 5 µs' with a latency) for a config with a simulated link, else None."""
    if cfg.link_gbps is None and not cfg.link_latency_us:
        return None
    bw = f"{cfg.link_gbps:g} Gbit/s" if cfg.link_gbps else "no bandwidth limit"
    return bw + (f", {cfg.link_latency_us:g} µs" if cfg.link_latency_us else "")
