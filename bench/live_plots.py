"""Cost of live plotting on the run: the lab (FigureWidgets fed at <= 10 updates/s) vs the same
config with no plotting, on the same warm ranks, interleaved, inside a real ipykernel (so widget
updates are serialised and sent over the kernel's channels as in a notebook).

    python -m bench.live_plots [--rounds 4] [--steps 300]

Target: median step time with plotting <= 1.02x without.
"""
import argparse
import json

from jupyter_client.manager import start_new_kernel

from bench._common import machine, table

CODE = """
import json, statistics, ddpkit
cfg = ddpkit.TrainConfig(model="mlp", n_blocks=4, width=64, world_size=2, micro_batch=32,
                         steps={steps}, peak_every=10)
lab = ddpkit.Lab(cfg, max_hz={max_hz})
lab.run(); lab.wait()                                   # warm-up: pool up, first-run costs paid
out = {{"plots off": [], "live controls, plots off": [], "lab plots on": []}}
for _ in range({rounds}):
    res = ddpkit.train(cfg, pool=lab._pool)             # same warm ranks, nothing plotted
    out["plots off"] += res.per_rank("step_time_s")[2:]
    res = ddpkit.train(cfg, pool=lab._pool, live=True)  # the lab's control channel alone
    out["live controls, plots off"] += res.per_rank("step_time_s")[2:]
    before = lab.plots.flushes
    lab.run(); lab.wait()
    out.setdefault("flushes_per_s", []).append((lab.plots.flushes - before) / lab.history[-1]["wall_s"])
    out["lab plots on"] += [m["step_time_s"] for m in lab.metrics if m["rank"] == 0][2:]
lab.close()
print("RESULT" + json.dumps(out))
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--max-hz", type=float, default=10.0)
    args = ap.parse_args(argv)
    km, kc = start_new_kernel(kernel_name="python3")
    found = []
    try:
        def hook(msg):
            text = msg["content"].get("text", "")
            if msg["msg_type"] == "stream" and "RESULT" in text:
                found.append(json.loads(text.split("RESULT", 1)[1]))
        reply = kc.execute_interactive(CODE.format(steps=args.steps, rounds=args.rounds,
                                                   max_hz=args.max_hz),
                                       output_hook=hook, timeout=900)
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    import statistics
    res = found[0]
    base = statistics.median(res["plots off"])
    rows = []
    for name in ("plots off", "live controls, plots off", "lab plots on"):
        vals = res[name]
        q = statistics.quantiles(vals, n=4)
        rows.append((name, f"{1000 * statistics.median(vals):.3f}", f"{1000 * q[0]:.3f}-{1000 * q[2]:.3f}",
                     f"{statistics.median(vals) / base:.3f}x", len(vals)))
    ratio = statistics.median(res["lab plots on"]) / statistics.median(res["live controls, plots off"])
    text = (f"### Live plotting (`python -m bench.live_plots --rounds {args.rounds} --steps "
            f"{args.steps}`)\n\n"
            f"Step time of rank 0, mlp 4 blocks width 64, micro_batch 32, 2 ranks gloo, "
            f"{args.rounds} rounds x {args.steps} steps, inside an ipykernel. Machine: {machine()}\n\n"
            + table(["variant", "median ms", "IQR ms", "vs off", "steps"], rows)
            + f"\n\nfigure updates: {max(res['flushes_per_s']):.1f}/s at most (bound "
              f"{args.max_hz:g}/s); lab plots on / live controls alone = {ratio:.3f} (target "
              f"<= 1.02): {'met' if ratio <= 1.02 else 'MISSED'}\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
