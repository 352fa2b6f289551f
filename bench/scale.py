"""Real sizes at the speed of a slider (issue #45): how long `estimate`, `peak()` and `plan`
take for Llama-3-8B (8 ranks), Llama-3-70B shapes (64 ranks), a T5-XL-shaped encoder-decoder
(3B, two stacks of 24 blocks, 8 ranks) and Mixtral-8x7B shapes (64 ranks), for DDP and FSDP (and
ZeRO-1 for the 8B), in bf16 (and fp32 for the 8B and T5), every kind of checkpoint setting; and the cut trace (3
blocks, figures carried to all) beside the whole trace where the whole one is affordable.

**cold**: from empty caches (the trace, the batch, the simulated and composed steps, the
libraries of per-block pieces: what a fresh kernel has, its imports done), the config with no
checkpointing: `estimate`, then `peak()`, then `plan(cfg, 'H100-80GB')`. **warm**: the same
config with each other setting (4 segments, every block, every other block), as a slider moves
it: the slowest `estimate` and the slowest `peak()` of those, and `plan` for another budget.
The composition of each answer (which cut simulations ran, what was extrapolated) is the
result's own (`Simulation.composition`).

    python -m bench.scale           # about 10 minutes on 2 cores
"""
import sys
import time

import ddpkit
from bench._common import machine, table

GIB = 2**30
SETTINGS = (("4 segments", 4), ("full", "full"), ("every other", "alternate"))


def llama(hidden, inter, layers, heads, kv, vocab=128256):
    def factory():
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=inter,
                                            num_hidden_layers=layers, num_attention_heads=heads,
                                            num_key_value_heads=kv, vocab_size=vocab,
                                            use_cache=False))
    factory.__name__ = f"llama_{hidden}x{layers}"
    return factory


def t5_xl():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(d_model=2048, d_ff=5120, d_kv=64, num_heads=32,
                                               num_layers=24, num_decoder_layers=24,
                                               vocab_size=32128, feed_forward_proj="gated-gelu",
                                               dropout_rate=0.0, decoder_start_token_id=0,
                                               pad_token_id=0, eos_token_id=1, use_cache=False))


def mixtral_8x7b():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(hidden_size=4096, intermediate_size=14336,
                                            num_hidden_layers=32, num_attention_heads=32,
                                            num_key_value_heads=8, vocab_size=32000,
                                            num_local_experts=8, num_experts_per_tok=2,
                                            output_router_logits=True, use_cache=False))


def pairs(cfg):
    """Sequence pairs for the encoder-decoder: token ids in, token ids out (one global batch)."""
    import torch

    g = torch.Generator().manual_seed(0)
    n = cfg.world_size * cfg.micro_batch * cfg.accum_steps
    ids = torch.randint(1, 32000, (n, cfg.seq_len), generator=g)
    return torch.utils.data.StackDataset(input_ids=ids, labels=ids.roll(1, 1))


def gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50257,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      use_cache=False))


LLAMA_8B = llama(4096, 14336, 32, 32, 8)
LLAMA_70B = llama(8192, 28672, 80, 64, 8)
LLAMA_1B = llama(2048, 8192, 16, 32, 8)
MODELS = (  # name, config fields, ranks, precisions
    ("Llama-3-8B", dict(model=LLAMA_8B), 8, ("bf16", "fp32")),
    ("Llama-3-70B shapes", dict(model=LLAMA_70B), 64, ("bf16",)),
    ("T5-XL shapes (3B, 24+24)", dict(model=t5_xl, data=pairs, seq_len=512), 8, ("bf16", "fp32")),
    ("Mixtral-8x7B shapes", dict(model=mixtral_8x7b), 64, ("bf16",)),
)


def _fresh():
    from ddpkit.predict import peak, trace

    for memo in (trace._TRACES, trace._BATCHES, peak._MEMO, peak._LIBRARIES):
        memo.clear()


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def _setting(cfg, value):
    if value == "alternate":
        return cfg.checkpoint.with_value([i % 2 == 1 for i in range(cfg.checkpoint.n_blocks)])
    return value


def one(base):
    """(cold estimate, cold peak, cold plan, warm estimate, warm peak, warm plan, the peak of
    no checkpointing, how it was made)."""
    _fresh()
    _, est = _timed(lambda: ddpkit.estimate(base))
    p, pk = _timed(lambda: ddpkit.estimate(base).peak())
    _, pl = _timed(lambda: ddpkit.plan(base, "H100-80GB"))
    warm_est, warm_peak = [], []
    for _, value in SETTINGS:
        cfg = base.replace(checkpoint=_setting(base, value))
        e, t = _timed(lambda: ddpkit.estimate(cfg))
        warm_est.append(t)
        warm_peak.append(_timed(lambda: e.peak())[1])
    _, warm_plan = _timed(lambda: ddpkit.plan(base, "A100-40GB"))
    from ddpkit.predict.peak import simulated

    sim = simulated(base, 0)
    how = "composed" if sim.composition is not None else sim.how
    runs = len(sim.composition.simulated) if sim.composition is not None else 1
    return est, pk, pl, max(warm_est), max(warm_peak), warm_plan, p, f"{how} ({runs} cut sims)"


def cases():
    """(name, fields, ranks, precision, strategy) of each row: DDP and FSDP for every model and
    precision, and ZeRO-1 (the third way a step's state is laid out) for the 8B in bf16."""
    for name, fields, world, precisions in MODELS:
        for precision in precisions:
            for strategy in ("ddp", "fsdp"):
                yield name, fields, world, precision, strategy
            if name == "Llama-3-8B" and precision == "bf16":
                yield name, fields, world, precision, "ddp_zero1"


def timings():
    rows, worst = [], [0.0] * 6
    for name, fields, world, precision, strategy in cases():
        base = ddpkit.TrainConfig(**{**dict(seq_len=2048), **fields}, micro_batch=1,
                                  optimizer="adamw", precision=precision, strategy=strategy,
                                  world_size=world, backend="gloo", device="cpu")
        *times, p, how = one(base)
        worst = [max(a, b) for a, b in zip(worst, times)]
        rows.append((name, world, strategy, precision, f"{p.bytes / GIB:.1f}", p.phase,
                     *(f"{t:.2f}" for t in times), how))
        print(rows[-1], flush=True)
    return rows, worst


def equal_traces():
    from ddpkit.predict.trace import Traced

    rows = []
    for name, factory in (("GPT-2 small", gpt2_small), ("Llama 1B shapes", LLAMA_1B)):
        cfg = ddpkit.TrainConfig(model=factory, seq_len=512, micro_batch=1, world_size=2,
                                 backend="gloo", device="cpu")
        whole, cut = Traced(cfg), Traced(cfg, keep=3)
        n = cfg.n_blocks
        for value in (None, 2, "full", tuple(i % 3 == 0 for i in range(n))):
            s = cfg.checkpoint.with_value(value)
            b = (whole.forward_bytes(s), cut.forward_bytes(s))
            f = (whole.step_flops(s), cut.step_flops(s))
            label = value if not isinstance(value, tuple) else "every 3rd block"
            rows.append((name, n, str(label), b[0], "yes" if b[0] == b[1] else "NO", f[0],
                         "yes" if f[0] == f[1] else "NO"))
    return rows


def _load():
    import os

    return "load average " + ", ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv=None):
    t0 = time.perf_counter()
    start_load = _load()
    eq = equal_traces()
    tm, worst = timings()
    goals = (2, 2, 10, 1, 1, 5)
    met = ", ".join(f"{what} {w:.2f} s (goal {g} s: {'met' if w <= g else 'MISSED'})"
                    for what, w, g in zip(("cold estimate", "cold peak()", "cold plan",
                                           "warm estimate", "warm peak()", "warm plan"),
                                          worst, goals))
    text = ("### Real sizes at the speed of a slider (`python -m bench.scale`)\n\n"
            "The trace cut to 3 blocks, its figures carried to all, beside the whole trace "
            "(seq 512, micro-batch 1):\n\n"
            + table(("model", "blocks", "checkpoint", "activation bytes", "cut = whole",
                     "step FLOPs", "cut = whole"), eq)
            + "\n\nSeconds (seq 2048, T5 512; micro-batch 1, AdamW). cold: empty caches, no "
              "checkpointing; warm: the same config's other settings (4 segments, every block, "
              "every other block: the slowest of them), and plan for another budget:\n\n"
            + table(("model", "ranks", "strategy", "precision", "peak GiB", "phase",
                     "cold estimate", "cold peak()", "cold plan", "warm estimate",
                     "warm peak()", "warm plan", "peak made"), tm)
            + f"\n\nSlowest: {met}.\n\nTook {time.perf_counter() - t0:.0f} s on {machine()}; "
              f"{start_load} at the start, {_load()} at the end.\n")
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
