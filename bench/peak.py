"""The step's peak at real sizes: measured on 2 gloo ranks, beside `estimate(cfg).peak()`, and
the process's peak beside the tensors'.

For each row, every probed step (0, 1, 2) of each rank: the measured peak (c10's count of live
CPU allocations in a profiler window), the prediction (the rank's step simulated on fake
tensors), their difference in % of the measured, and whether the phases agree. Acceptance: at
most 3% and the same phase, on every row and step (torch's own MemTracker test accepts 10%).

The process: each record's ``process_peak_bytes`` (the rank's resident high-water mark over the
step, its own memory less what it held before the model was built: `ddpkit.engine.process`), at
step 2 (at steps 0 and 1 blocks made in the step, Adam's moments and DDP's rebuilt buckets, get
their pages only as they are written): the highest, and its ratio to the tensors' peak of the
same record, over both ranks. Its figures are what `ddpkit.predict.gpus.CPU_MEASURED` (the
allowance `fits` and `plan` budget) rests on. ``--mmap-threshold dynamic|N`` sets
``DDPKIT_MMAP_THRESHOLD`` for the ranks (`ddpkit.rank.heap`: glibc's mmap threshold fixed at
128 KiB by default, or at N, or left to glibc's own raising).

With the threshold fixed (glibc then serves every block of that size or more with its own
mapping and returns it to the system when it is freed, so resident memory follows the live
bytes), *RSS* is an independent check of the tensors' count: each rank resets its high-water
mark (``/proc/self/clear_refs``) at each step's record and reads it at the next: the step's
highest resident memory less the resident memory at its start is the step's rise seen by the
operating system, set beside the probe's (its peak less the bytes live when the step began).
At 65536 that check was exact to 0.01%.

    python -m bench.peak            # ~30 minutes on 2 idle cores; --quick: 4 rows
"""
import os
import sys
import time

import ddpkit
from bench._common import machine, table
from ddpkit import devices

MIB = 2**20
FIXED = None  # the threshold the ranks run with (bytes), None: glibc's dynamic one


def gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50257,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      use_cache=False))


def llama_100m():
    """A Llama-style decoder of ~100M parameters: RMSNorm, rotary positions, grouped-query
    attention (12 heads, 4 for keys and values), SwiGLU, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=768, intermediate_size=2048,
                                        num_hidden_layers=8, num_attention_heads=12,
                                        num_key_value_heads=4, vocab_size=32000,
                                        max_position_embeddings=1024, use_cache=False))


def rows(quick=False, device="cpu"):
    """(name, config) for each row: one setting changed at a time from each model's base."""
    run = dict(world_size=2, steps=3, peak_every=1, device=device, optimizer="adamw",
               backend="gloo" if device == "cpu" else None)
    gpt = dict(model=gpt2_small, seq_len=128, micro_batch=1, **run)
    llama = dict(model=llama_100m, seq_len=256, micro_batch=2, **run)
    out = [("GPT-2 s128 b1", gpt),
           ("GPT-2 s128 b1 sgd", {**gpt, "optimizer": "sgd"}),
           ("GPT-2 s512 b4 full", {**gpt, "seq_len": 512, "micro_batch": 4, "checkpoint": "full"}),
           ("Llama s256 b2 fsdp", {**llama, "strategy": "fsdp"})]
    if quick:
        return out
    out += [("GPT-2 s128 b4", {**gpt, "micro_batch": 4}),
            ("GPT-2 s512 b1", {**gpt, "seq_len": 512}),
            ("GPT-2 s512 b1 2 segments", {**gpt, "seq_len": 512, "checkpoint": 2}),
            ("GPT-2 s512 b1 selective", {**gpt, "seq_len": 512,
                                         "checkpoint": [True, False] * 6}),
            ("GPT-2 s128 b1 bucket view", {**gpt, "gradient_as_bucket_view": True}),
            ("GPT-2 s128 b1 sgd bucket view", {**gpt, "optimizer": "sgd",
                                               "gradient_as_bucket_view": True}),
            ("GPT-2 s128 b1 zero1", {**gpt, "strategy": "ddp_zero1"}),
            ("GPT-2 s128 b1 fsdp", {**gpt, "strategy": "fsdp"}),
            ("GPT-2 s128 b1 bf16", {**gpt, "precision": "bf16"}),
            ("GPT-2 s512 b1 bf16 full", {**gpt, "seq_len": 512, "precision": "bf16",
                                         "checkpoint": "full"}),
            ("Llama s256 b2", llama),
            ("Llama s256 b2 sgd", {**llama, "optimizer": "sgd"}),
            ("Llama s256 b2 full", {**llama, "checkpoint": "full"}),
            ("Llama s256 b2 bucket view", {**llama, "gradient_as_bucket_view": True}),
            ("Llama s256 b2 zero1", {**llama, "strategy": "ddp_zero1"}),
            ("Llama s256 b2 bf16", {**llama, "precision": "bf16"}),
            ("Llama s256 b2 fsdp sgd 2 segments", {**llama, "strategy": "fsdp",
                                                   "optimizer": "sgd", "checkpoint": 2})]
    return out


# ----------------------------------------------------------------------------- on the ranks
def _status(key):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def watched_train(ctx, cfg):
    """`train_rank`, with each record also carrying the operating system's view of the step
    before it: the resident memory at the previous record (a step boundary) and its
    high-water mark since."""
    from ddpkit.engine.loop import train_rank

    log, start = ctx.log, [0]

    def with_rss(**record):
        log(rss_start=start[0], rss_high=_status("VmHWM"), **record)
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # the high-water mark starts again from now
        start[0] = _status("VmRSS")

    ctx.log = with_rss
    start[0] = _status("VmRSS")
    return train_rank(ctx, cfg.rank_plan())


# ----------------------------------------------------------------------------- the table
def measure(name, cfg):
    t0 = time.perf_counter()
    est = ddpkit.estimate(cfg)
    predicted = {(r, s): est.peak(step=s, rank=r) for r in range(cfg.world_size) for s in (0, 1)}
    t_predict = time.perf_counter() - t0
    t0 = time.perf_counter()
    # stall_timeout_s: one probed step at real size (a profiler window over every allocation,
    # GPT-2 s512 x 4) took over 300 s on 2 cores at a load of 15
    res = ddpkit.launch(watched_train, cfg, world_size=cfg.world_size, backend=cfg.backend,
                        device=cfg.device, stall_timeout_s=1800)
    t_run = time.perf_counter() - t0
    worst, phases, rss_worst, process = 0.0, True, 0.0, []
    for m in res.metrics:
        if "peak_bytes" not in m:
            continue
        p = predicted[m["rank"], min(m["step"], 1)]
        err = (p.bytes - m["peak_bytes"]) / m["peak_bytes"]
        worst = err if abs(err) > abs(worst) else worst
        phases &= p.phase == m["peak_phase"]
        if m["step"] >= 2 and "process_peak_bytes" in m:  # steps 0, 1: new blocks' pages late
            process.append((m["process_peak_bytes"], m["process_peak_bytes"] / m["peak_bytes"]))
        if m["step"] >= 2 and cfg.device != "cuda" and FIXED:  # the independent check
            # the step's rise above the bytes live at its start, seen by the OS and by torch
            rss_err = ((m["rss_high"] - m["rss_start"]) - (m["peak_bytes"] - m["peak_base"])) \
                / m["peak_bytes"]
            rss_worst = rss_err if abs(rss_err) > abs(rss_worst) else rss_worst
    top = max(res.metrics, key=lambda m: m.get("peak_bytes", 0))
    high = max((b for b, _ in process), default=0)
    ratio = max((r for _, r in process), default=0.0)
    print(f"{name}: worst {100 * worst:+.3f}%, phases {'agree' if phases else 'DIFFER'}, "
          f"process {high / MIB:,.0f} MiB, {ratio:.3f}x, rss {100 * rss_worst:+.2f}% "
          f"({t_predict:.1f} s to predict, {t_run:.0f} s to run)", flush=True)
    ledger = top["peak_ledger"]
    made_of = ", ".join(f"{k} {v / MIB:.0f}" for k, v in sorted(ledger.items(),
                                                                key=lambda kv: -kv[1]) if v > MIB)
    return [name, f"{top['peak_bytes'] / MIB:,.1f}", f"{high / MIB:,.1f}", f"{ratio:.3f}x",
            top["peak_phase"], made_of, f"{100 * worst:+.3f}%", "yes" if phases else "**no**",
            f"{100 * rss_worst:+.2f}%" if FIXED else "-", f"{t_predict:.1f}"], \
        abs(worst) <= 0.03 and phases, [r for _, r in process]


def main(argv=None):
    """``--quick``: 4 rows; ``--device cuda``: on GPUs (NCCL with 2, else the shared-GPU mode),
    against ``max_memory_allocated``: the first two rows (``bench/gpu_check.sh`` runs them)."""
    global FIXED
    argv = sys.argv[1:] if argv is None else argv
    device = argv[argv.index("--device") + 1] if "--device" in argv else "cpu"
    if "--mmap-threshold" in argv:  # before any rank starts (rank/heap.py)
        os.environ[devices.MMAP_ENV] = argv[argv.index("--mmap-threshold") + 1]
    FIXED = devices.mmap_threshold()
    load, t0 = os.getloadavg(), time.perf_counter()
    out, ok, ratios = [], True, []
    chosen = rows(quick="--quick" in argv, device=device)
    for name, kw in (chosen[:2] if device == "cuda" else chosen):
        row, good, grown = measure(name, ddpkit.TrainConfig(**kw))
        out.append(row)
        ok &= good
        ratios += grown
    env = devices.MMAP_ENV
    flag = f" --mmap-threshold {os.environ[env]}" if env in os.environ else ""
    flag += " --quick" if "--quick" in argv else ""
    text = (f"### The step's peak at real sizes (`python -m bench.peak{flag}`)\n\n{machine()}; "
            f"load average at the start {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}; 2 "
            f"{'gloo' if device == 'cpu' else device} ranks, steps 0, 1 and 2 of each rank probed"
            f", glibc's mmap threshold {f'fixed at {FIXED} B' if FIXED else 'dynamic'}. "
            f"*peak*: the tensors' highest measured (MiB, "
            f"per rank); *process*: the rank's own memory at its highest over step 2 "
            f"(`process_peak_bytes`, MiB), and its largest ratio to the tensors' peak of the same "
            f"record over both ranks; "
            f"*made of*: the tensors' ledger (MiB, kinds above 1 MiB); *worst error*: the "
            f"largest (predicted - measured) / measured over every rank and step; *phase*: "
            f"the predicted phase equals the measured one at every rank and step; *RSS* "
            f"(a fixed threshold only): the "
            f"step's rise above the bytes live at its start, read from each rank's resident "
            f"memory (step 2), as (RSS rise - measured rise) / measured peak; *predict s*: the cold simulation of both ranks and steps.\n\n"
            + table(["row", "peak MiB", "process MiB", "process / peak", "phase",
                     "made of (MiB)", "worst error", "phase agrees", "RSS", "predict s"], out)
            + f"\n\nEvery row within 3% with the phase agreeing: {'yes' if ok else 'NO'}. The "
              f"process over the tensors at step 2, every row and rank: "
              f"{min(ratios, default=0):.3f}-{max(ratios, default=0):.3f}x. Ran in "
              f"{(time.perf_counter() - t0) / 60:.0f} min, load average at the end "
              f"{os.getloadavg()[0]:.2f}.\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
