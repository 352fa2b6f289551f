"""Command line: ``python -m ddpkit train ...`` (or ``ddpkit train``), ``ddpkit demo``, and for a
workshop ``ddpkit check`` and ``ddpkit workshop [DIR]`` (``ddpkit/workshop/``).

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
from .engine.loop import train_rank
from .spec.setting import CheckpointSetting
from .predict.units import MIB, fmt_bytes
from .rank.context import format_record
from .rank.entry import start_job, torchrun_context, torchrun_main
from .runs.demo import DEMO_STEPS, demo
from .runs.result import TrainResult
from .runs.train import train
from .workshop.check import run as run_check
from .workshop.jupyter import workshop


def _checkpoint_arg(text):
    """The setting's text form (`CheckpointSetting.parse`), its error said as argparse's."""
    try:
        return CheckpointSetting.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
                                help="none | S (segments) | full | 1,0,1,0, (one per block)")
        elif f.name == "measure":
            parser.add_argument(flag, type=_measure_arg, default=True,
                                help="true | false | activations,peak,comm")
        elif isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif default is None and "float" in str(f.type):  # bucket_cap_mb, link_gbps
            parser.add_argument(flag, type=float, default=None)
        elif default is None and "int" in str(f.type):  # shard_size, powersgd_rank
            parser.add_argument(flag, type=int, default=None)
        elif default is None:  # backend, device, comm_hook, save_dir: optional strings
            parser.add_argument(flag, default=None)
        else:
            parser.add_argument(flag, type=type(default), default=default)
    return parser


def _config_from(args):
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"extra"}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def _train_under_torchrun(args):
    ctx = torchrun_context(seed=args.seed, backend=args.backend, device=args.device)
    cfg = _config_from(args)
    if cfg.world_size != ctx.world_size:  # torchrun decides the world size
        cfg = cfg.replace(world_size=ctx.world_size)

    def work(ctx):
        start_job(ctx, cfg.seed)  # seeded as a spawned rank would be
        progress = Progress(cfg, args.verbose) if ctx.is_main else None
        ctx.on_record = progress or (lambda record: None)  # only global rank 0 reports
        train_rank(ctx, cfg.rank_plan(), return_weights=False)  # no kernel here to hand them to
        if ctx.is_main:
            progress.close()
            print(summary_table(cfg, ctx.records))
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(ctx.records, fh)

    torchrun_main(ctx, work)


def _train(args):
    if under_torchrun():
        return _train_under_torchrun(args)
    cfg = _config_from(args)
    progress = Progress(cfg, args.verbose)
    try:
        res = train(cfg, on_metric=progress)
    finally:
        progress.close()
    print(summary_table(cfg, res.metrics))
    for f in getattr(res.findings, "notes", []):  # the warnings went to stderr before the run
        print(f"note [{f.pitfall}] at {f.where}: {f.message}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res.metrics, fh)


class Progress:
    """A tqdm bar on stderr for one run, fed rank 0's records (step, loss, memory in MiB,
    ms/step); with ``verbose`` each record is also printed to stdout as ``key=value`` fields."""

    def __init__(self, cfg, verbose=False):
        from tqdm import tqdm

        self.verbose, self.mem, self.started = verbose, None, False
        self.cfg = cfg
        self.bar = tqdm(total=cfg.steps, desc="starting ranks", unit="step", file=sys.stderr,
                        dynamic_ncols=True)

    def __call__(self, record):
        if record.get("rank", 0) != 0:
            return
        if not self.started:  # rates from the first step on, not from the launch
            self.started = True
            self.bar.reset()
            self.bar.set_description("train", refresh=False)
        # memory: the last measured peak (the probe runs every peak_every steps), else the
        # model states plus this step's activations
        states = sum(record.get(k, 0) for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
        self.mem = record.get("peak_bytes", self.mem) or states + record.get("activation_bytes", 0)
        self.bar.set_postfix_str(f"loss {record['loss']:.4f}, mem {self.mem / MIB:.2f} MiB, "
                                 f"{1000 * record['step_time_s']:.1f} ms/step", refresh=False)
        self.bar.update(1)
        if self.verbose:
            self.bar.write(format_record(record), file=sys.stdout)

    def close(self):
        self.bar.close()


def _predicted(summary):
    """The step time predicted for the run's config, where it was (`ddpkit.runs.predicted`)."""
    if "predicted_step_s" not in summary:
        return ""
    return (f"; predicted {1000 * summary['predicted_step_s']:.2f} ms "
            f"(estimate(cfg).step_time(), this machine's calibration)")


def summary_table(cfg, records):
    """What a run came to, in human units (rank 0, medians over the steps after the first)."""
    s = TrainResult(cfg, records, None).summary()
    m0 = [m for m in records if m["rank"] == 0]
    rows = [("steps", f"{len(m0)} of {cfg.steps}, {cfg.world_size} ranks, global batch "
                      f"{cfg.global_batch}"),
            ("final loss", f"{s['final_loss']:.4f} (mean over ranks)"),
            ("step time", f"{1000 * s['step_time_s']:.2f} ms median, IQR "
                          f"{1000 * s['step_time_iqr_s']:.2f} ms" + _predicted(s)),
            ("samples/s", f"{cfg.global_batch / s['step_time_s']:.0f}"),
            ("checkpoint", cfg.checkpoint.label())]
    if "activation_bytes" in s:
        rows.append(("activations", f"{fmt_bytes(s['activation_bytes'])} per rank"))
    if "peak_bytes" in s:
        predicted = (f"; predicted {fmt_bytes(s['predicted_peak_bytes'])}"
                     if "predicted_peak_bytes" in s else "")
        rows.append(("peak memory", f"{fmt_bytes(s['peak_bytes'])} per rank{predicted}"))
    last = m0[-1]
    rows.append(("model states", f"params {fmt_bytes(last['param_bytes'])}, grads "
                                 f"{fmt_bytes(last['grad_bytes'])}, optimizer "
                                 f"{fmt_bytes(last['optimizer_bytes'])}"))
    if "allreduce_calls" in s:
        rows.append(("all-reduce", f"{s['allreduce_calls']:.0f} per step, "
                                   f"{fmt_bytes(s['allreduce_bytes'])} per step"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _demo(args):
    demo(out=args.out, steps=args.steps, predict=not args.no_predict)


def _check(args):
    report = run_check()
    print(json.dumps(report.as_json(), indent=1) if args.json else report.table())
    return 0 if report.ready else 1


def _workshop(args):
    return workshop(args.dir, open_browser=not args.no_browser, check=not args.no_check)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="ddpkit", description="DDP + checkpointing explorer")
    sub = parser.add_subparsers(dest="command", required=True)
    t = _config_parser(sub.add_parser("train", help="train one config (spawns ranks, or joins torchrun's)"))
    t.add_argument("--json", default=None, help="write the raw records (rank 0's under torchrun) as JSON to this file")
    t.add_argument("--verbose", "-v", action="store_true",
                   help="also print every step's record (key=value) on stdout")
    d = sub.add_parser("demo", help="small sweep on CPU + gloo, prints a table, writes an HTML report")
    d.add_argument("--out", default="ddpkit-report.html")
    d.add_argument("--steps", type=int, default=DEMO_STEPS,
                   help="steps per setting (the step-time medians need a few dozen)")
    d.add_argument("--no-predict", action="store_true",
                   help="no step-time predictions, and so no calibration of this machine "
                        "(30-60 s, once) where it has none")
    c = sub.add_parser("check", help="can this machine run the workshop's notebooks? "
                                     "(seconds; exit 0: ready, 1: what to fix)")
    c.add_argument("--json", action="store_true",
                   help="print the result as one JSON object (the progress stays on stderr)")
    w = sub.add_parser("workshop", help="copy the notebooks into DIR (keeping yours), check "
                                        "this machine, start JupyterLab there (127.0.0.1)")
    w.add_argument("dir", nargs="?", default="ddpkit-workshop", metavar="DIR",
                   help="the folder for the notebooks (default: ./ddpkit-workshop)")
    w.add_argument("--no-browser", action="store_true",
                   help="open no browser: print JupyterLab's URL (with its token)")
    w.add_argument("--no-check", action="store_true", help="skip the check (ddpkit check)")
    args = parser.parse_args(argv)
    try:
        return {"train": _train, "demo": _demo, "check": _check,
                "workshop": _workshop}[args.command](args)
    except ValueError as exc:  # config errors already name the field and the fix
        parser.exit(2, f"ddpkit: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
