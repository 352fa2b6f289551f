"""Step time, predicted beside measured, on this machine's gloo ranks.

For each config (built-in GPT and MLP and two transformers models; checkpointing none,
segments, full and a selective list; accumulation with and without ``no_sync``; ddp, ddp_zero1,
zero2, fsdp; small and default buckets; simulated links of 10 and 1 Gbit/s; 2 and 4 ranks):
``ddpkit.train`` runs it and the measured step time is the median of rank 0's steps after the
first ``WARMUP``; ``estimate(cfg).step_time()`` predicts it twice, with the calibration this
machine had cached before the run and with one measured again in this run (``refreshed``). The
mean absolute percentage error (MAPE), the worst config, and the ranking (every pair whose
measured times differ by more than 10% must be predicted in the same order) are printed and
written as a section for bench/results.md. Run it alone: the machine's other load is in the
measured times, not in the calibration.

    python -m bench.step_time            # about 6 minutes on 2 cores
    python -m bench.step_time --only gpt # the configs whose name has 'gpt'
"""
import argparse
import itertools
import os
import statistics
import time

import ddpkit
from bench._common import machine, table

WARMUP, MEASURED = 5, 20
GPT = dict(model="gpt", n_blocks=4, width=256, seq_len=128, vocab=256, micro_batch=4,
           optimizer="adamw")
MLP = dict(model="mlp", n_blocks=6, width=512, micro_batch=64)


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=1024,
                                      n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, use_cache=False))


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=688,
                                        num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=1024,
                                        max_position_embeddings=256, use_cache=False))


HF = dict(seq_len=128, micro_batch=4, optimizer="adamw")
CONFIGS = [
    ("gpt", dict(GPT)),
    ("gpt 2 segments", dict(GPT, checkpoint=2)),
    ("gpt full", dict(GPT, checkpoint="full")),
    ("gpt blocks 0,2", dict(GPT, checkpoint=[True, False, True, False])),
    ("gpt accum 4", dict(GPT, micro_batch=1, accum_steps=4)),
    ("gpt accum 4 no no_sync", dict(GPT, micro_batch=1, accum_steps=4, no_sync=False)),
    ("gpt ddp_zero1", dict(GPT, strategy="ddp_zero1")),
    ("gpt zero2", dict(GPT, strategy="zero2")),
    ("gpt fsdp", dict(GPT, strategy="fsdp")),
    ("gpt bucket 1 MB", dict(GPT, bucket_cap_mb=1)),
    ("gpt bucket 1 MB, 10 Gbit/s", dict(GPT, bucket_cap_mb=1, link_gbps=10)),
    ("gpt bucket 1 MB, 1 Gbit/s", dict(GPT, bucket_cap_mb=1, link_gbps=1)),
    ("gpt 1 Gbit/s", dict(GPT, link_gbps=1)),
    ("gpt bf16", dict(GPT, precision="bf16")),
    ("mlp", dict(MLP)),
    ("mlp full", dict(MLP, checkpoint="full")),
    ("mlp accum 4", dict(MLP, micro_batch=16, accum_steps=4)),
    ("mlp bucket 1 MB, 1 Gbit/s", dict(MLP, bucket_cap_mb=1, link_gbps=1)),
    ("gpt x4", dict(GPT, world_size=4)),
    ("gpt full x4", dict(GPT, checkpoint="full", world_size=4)),
    ("gpt fsdp x4", dict(GPT, strategy="fsdp", world_size=4)),
    ("mlp x4", dict(MLP, world_size=4)),
    ("mlp ddp_zero1 x4", dict(MLP, strategy="ddp_zero1", optimizer="adamw", world_size=4)),
    ("hf gpt2", dict(HF, model=hf_gpt2)),
    ("hf gpt2 full", dict(HF, model=hf_gpt2, checkpoint="full")),
    ("hf gpt2 fsdp", dict(HF, model=hf_gpt2, strategy="fsdp")),
    ("hf llama", dict(HF, model=hf_llama)),
    ("hf llama 2 segments", dict(HF, model=hf_llama, checkpoint=2)),
    ("hf llama accum 4 x4", dict(HF, model=hf_llama, micro_batch=1, accum_steps=4,
                                 world_size=4)),
]


def measure(cfg):
    res = ddpkit.train(cfg, check=False)
    steps = [m["step_time_s"] for m in res.metrics if m["rank"] == 0 and m["step"] >= WARMUP]
    return statistics.median(steps), len(steps)


def ranking_errors(rows):
    """Pairs whose measured times differ by more than 10% and are predicted the other way."""
    bad = []
    for a, b in itertools.combinations(rows, 2):
        (na, ma, pa), (nb, mb, pb) = a, b
        if max(ma, mb) / min(ma, mb) > 1.10 and (ma > mb) != (pa > pb):
            bad.append(f"{na} vs {nb}")
    return bad


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    args = ap.parse_args(argv)
    from ddpkit.predict.calibrate import cache_path, calibrate, machine_key
    from ddpkit.predict.steptime import step_time

    had = os.path.exists(cache_path(machine_key(max(1, (os.cpu_count() or 1) // 2))))
    cached = calibrate(progress=False)
    t = time.perf_counter()
    fresh = calibrate(refresh=True, progress=False)
    calibration_s = time.perf_counter() - t
    rows, out = [], []
    for name, kw in CONFIGS:
        if args.only and args.only not in name:
            continue
        cfg = ddpkit.TrainConfig(**{"world_size": 2, **kw}, steps=WARMUP + MEASURED,
                                 backend="gloo", device="cpu")
        t = time.perf_counter()
        pred_fresh = step_time(cfg, machine=fresh)
        predict_s = time.perf_counter() - t
        pred_cached = step_time(cfg, machine=cached)
        measured, n = measure(cfg)
        err = pred_fresh.seconds / measured - 1
        rows.append((name, measured, pred_fresh.seconds))
        out.append((name, cfg.world_size, f"{1e3 * measured:.1f}", n,
                    f"{1e3 * pred_fresh.seconds:.1f}", f"{100 * err:+.1f}%",
                    f"{100 * (pred_cached.seconds / measured - 1):+.1f}%",
                    f"{1e3 * pred_fresh.ledger['exposed_comm']:.1f}", f"{predict_s:.2f}"))
        print(" | ".join(str(c) for c in out[-1]), flush=True)
    ddpkit.shutdown()
    mape = statistics.fmean(abs(p / m - 1) for _, m, p in rows)
    worst = max(rows, key=lambda r: abs(r[2] / r[1] - 1))
    bad = ranking_errors(rows)
    header = ["config", "ranks", "measured ms", "steps", "predicted ms", "error",
              "error (cached calibration)", "predicted exposed comm ms", "prediction s"]
    text = (f"### Step time: predicted beside measured (`python -m bench.step_time`)\n\n"
            f"{machine()}; gloo ranks on this machine; measured = median of rank 0's steps "
            f"{WARMUP}..{WARMUP + MEASURED - 1}. Calibration measured again in this run in "
            f"{calibration_s:.0f} s (the cached one {'from an earlier run' if had else 'made at the start of this run'}).\n\n"
            + table(header, out) +
            f"\n\n**MAPE {100 * mape:.1f}%** over {len(rows)} configs (cached calibration: "
            f"{100 * statistics.fmean(abs(float(r[6][:-1]) / 100) for r in out):.1f}%); worst "
            f"{worst[0]} at {100 * (worst[2] / worst[1] - 1):+.1f}%; ranking: "
            f"{'every pair more than 10% apart in the measured order' if not bad else 'out of order: ' + '; '.join(bad)}.\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
