"""Real sizes from a config alone: how long `estimate`, `peak()` and `plan` take for
Llama-3-8B (8 ranks) and a Llama-3-70B-shaped config (64 ranks), and the cut trace (3 blocks,
figures carried to all) beside the whole trace where the whole one is affordable: GPT-2 small
and a 1B-shaped Llama (bytes and FLOPs of each setting, to the byte and the FLOP).

Each timing starts from empty caches (the trace, the batch and the simulated steps are
memoised per setting: a second call of any of them is instant).

    python -m bench.scale           # a few minutes on 2 cores
"""
import sys
import time

import ddpkit
from bench._common import machine, table

GIB = 2**30


def llama(hidden, inter, layers, heads, kv, vocab=128256):
    def factory():
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=inter,
                                            num_hidden_layers=layers, num_attention_heads=heads,
                                            num_key_value_heads=kv, vocab_size=vocab,
                                            use_cache=False))
    factory.__name__ = f"llama_{hidden}x{layers}"
    return factory


def gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50257,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      use_cache=False))


LLAMA_8B = llama(4096, 14336, 32, 32, 8)
LLAMA_70B = llama(8192, 28672, 80, 64, 8)
LLAMA_1B = llama(2048, 8192, 16, 32, 8)


def _fresh():
    from ddpkit.predict import peak, trace

    for memo in (trace._TRACES, trace._BATCHES, peak._MEMO):
        memo.clear()


def timings():
    rows = []
    for name, factory, world in (("Llama-3-8B", LLAMA_8B, 8), ("Llama-3-70B shapes", LLAMA_70B, 64)):
        base = ddpkit.TrainConfig(model=factory, seq_len=2048, micro_batch=1, optimizer="adamw",
                                  precision="bf16", world_size=world, backend="gloo", device="cpu")
        for strategy in ("ddp", "fsdp"):
            for ck in (None, "full"):
                cfg = base.replace(strategy=strategy, checkpoint=ck)
                _fresh()
                t = time.perf_counter()
                ddpkit.estimate(cfg)
                t_est = time.perf_counter() - t
                p = ddpkit.estimate(cfg).peak()
                t_peak = time.perf_counter() - t - t_est
                t = time.perf_counter()
                ddpkit.plan(cfg, "H100-80GB")
                t_plan = time.perf_counter() - t
                rows.append((name, world, strategy, ck or "none", f"{p.bytes / GIB:.1f}", p.phase,
                             f"{t_est:.1f}", f"{t_peak:.1f}", f"{t_plan:.1f}"))
    return rows


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


def main(argv=None):
    t0 = time.perf_counter()
    eq = equal_traces()
    tm = timings()
    text = ("### Real sizes from a config (`python -m bench.scale`)\n\n"
            "The trace cut to 3 blocks, its figures carried to all, beside the whole trace "
            "(seq 512, micro-batch 1):\n\n"
            + table(("model", "blocks", "checkpoint", "activation bytes", "cut = whole",
                     "step FLOPs", "cut = whole"), eq)
            + "\n\nTimes from empty caches (seq 2048, micro-batch 1, AdamW, bf16; seconds):\n\n"
            + table(("model", "ranks", "strategy", "checkpoint", "peak GiB", "phase",
                     "estimate s", "peak() s", "plan s"), tm)
            + f"\n\nTook {time.perf_counter() - t0:.0f} s on {machine()}.\n")
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
