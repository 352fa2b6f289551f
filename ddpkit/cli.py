"""Command line: ``python -m ddpkit train ...`` (or ``ddpkit train``) and ``ddpkit demo``.

``train`` takes one flag per TrainConfig field. Run plainly, it spawns ``--world-size`` ranks
with ddpkit's launcher. Run under torchrun (``torchrun --nproc-per-node N -m ddpkit train ...``)
it sees torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), joins that
process group instead of spawning, and runs the very same `train_rank`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .config import TrainConfig
from .devices import under_torchrun


def _checkpoint_arg(text):
    """none | S (segments) | full | a comma list of 0/1, one per block ("1,0,1,0"; "1," for one)."""
    if text.lower() in ("none", "off"):
        return None
    if text == "full":
        return "full"
    if "," in text:
        return [t.strip() in ("1", "true", "True") for t in text.split(",") if t.strip()]
    return int(text)


def _measure_arg(text):
    """true | false | a comma list of probe names (activations,peak,comm)."""
    if text.lower() in ("true", "1", "all"):
        return True
    if text.lower() in ("false", "0", "none"):
        return False
    return [t.strip() for t in text.split(",") if t.strip()]


def _config_parser(parser):
    for f in dataclasses.fields(TrainConfig):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if f.name == "checkpoint":
            parser.add_argument(flag, type=_checkpoint_arg, default=None,
                                help="none | S (segments) | full | 1,0,1,0 (one per block)")
        elif f.name == "measure":
            parser.add_argument(flag, type=_measure_arg, default=True,
                                help="true | false | activations,peak,comm")
        elif isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif default is None:  # backend, device, comm_hook, save_dir: optional strings
            parser.add_argument(flag, default=None)
        else:
            parser.add_argument(flag, type=type(default), default=default)
    return parser


def _config_from(args):
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"extra"}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def _train_under_torchrun(args):
    from .engine.loop import train_rank
    from .rank.entry import start_job, torchrun_context, torchrun_main

    ctx = torchrun_context(seed=args.seed, backend=args.backend, device=args.device)
    cfg = _config_from(args)
    if cfg.world_size != ctx.world_size:  # torchrun decides the world size
        cfg = cfg.replace(world_size=ctx.world_size)

    def work(ctx):
        start_job(ctx, cfg.seed)  # seeded as a spawned rank would be
        train_rank(ctx, cfg)
        if args.json and ctx.is_main:
            with open(args.json, "w") as fh:
                json.dump(ctx.records, fh)

    torchrun_main(ctx, work)


def _train(args):
    if under_torchrun():
        return _train_under_torchrun(args)
    from .rank.context import format_record
    from .explore.api import train

    res = train(_config_from(args))
    for m in res.metrics:
        if m["rank"] == 0:
            print(format_record(m))
    print(res)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res.metrics, fh)


def _demo(args):
    from .explore.demo import demo

    demo(out=args.out, steps=args.steps)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="ddpkit", description="DDP + checkpointing explorer")
    sub = parser.add_subparsers(dest="command", required=True)
    t = _config_parser(sub.add_parser("train", help="train one config (spawns ranks, or joins torchrun's)"))
    t.add_argument("--json", default=None, help="write the records (rank 0's under torchrun) as JSON to this file")
    d = sub.add_parser("demo", help="small sweep on CPU + gloo, prints a table, writes an HTML report")
    d.add_argument("--out", default="ddpkit-report.html")
    d.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    try:
        return {"train": _train, "demo": _demo}[args.command](args)
    except ValueError as exc:  # config errors already name the field and the fix
        parser.exit(2, f"ddpkit: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
