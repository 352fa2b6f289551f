"""Named hardware against published throughput: `step_time(device=..., link=...)` for Llama-3-8B
(FSDP, bf16) and GPT-2 small, beside figures others measured, each with its source and exact
configuration. Only eager figures are compared (ddpkit's step is eager: no ``torch.compile``,
no float8); a compiled figure is listed for reference and marked so.

    python -m bench.named_hardware            # prints the table (about 6 minutes on 2 cores:
                                              # three 32-block Llama-3-8B simulations)
    python -m bench.named_hardware --write    # and puts it in README.md between its markers

Models are built from transformers' configs (random weights, nothing downloaded).
"""
import dataclasses
import re
import sys
import time

import ddpkit
from bench._common import machine, table
from ddpkit.predict import hardware
from ddpkit.predict.steptime import step_time

TORCHTITAN_2412 = ("torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (Dec 2024): Llama 3.1 "
                   "8B, seq 8192 (llama3_8b.toml), local batch 2, selective AC ('op'), FSDP, eager, "
                   "AdamW; Grand Teton H100s (96 GB HBM2e, 2.4 TB/s, 500 W)")
TORCHTITAN_PERF = ("torchtitan, docs/performance.md (2024): Llama 3 8B on 64 A100-80GB, FSDP2, "
                   "seq 8192, local batch 1, selective layer AC (every 2nd block), compile off "
                   "(llama3_8b.toml)")
NANOGPT = ("karpathy/build-nanogpt train_gpt2.py (use_compile = False: eager; DDP, bf16 autocast, "
           "SDPA flash, B=64, T=1024, vocab 50304, 524,288 tokens a step) on 8x A100 SXM4, run by "
           "D. Saha, 'Eight A100s, $61, and 124M parameters' (debtirthasaha.github.io, 2026): "
           "'sustained throughput 1.1M tokens/sec, ~127 steps/min'")
MINIGPT = ("victorbjorsvik/minigpt README: the same script with torch.compile on 8x A100 80GB "
           "SXM4, 'dt ~0.34 per step, ~1.5M tokens per second'")
MOSAIC = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md, 'A100 80GB' table: MPT-125m "
          "(d 768, 12 layers, 12 heads, vocab 50368: GPT-2 small's shape), 8 GPUs, amp_bf16, "
          "FSDP FULL_SHARD, no activation checkpointing, eager (Composer)")
GRAND_TETON = dataclasses.replace(
    hardware.DEVICES["H100-80GB"], name="H100 96GB HBM2e 500 W", bandwidth=2.4e12,
    bf16=912e12, fp32=61.7e12,
    source="torchtitan's stated bandwidth (2.4 TB/s); bf16 peak *assumed* midway between the "
           "H100 SXM's 989 and the H100 NVL's 835 TFLOPS ('between SXM and NVL', torchtitan)")


def llama_8b():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=4096, intermediate_size=14336,
                                        num_hidden_layers=32, num_attention_heads=32,
                                        num_key_value_heads=8, vocab_size=128256,
                                        max_position_embeddings=8192, rope_theta=500000.0,
                                        use_cache=False))


def gpt2_small(vocab=50304, positions=1024):
    def factory():
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(
            n_embd=768, n_layer=12, n_head=12, vocab_size=vocab, n_positions=positions,
            activation_function="gelu_pytorch_tanh", resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, use_cache=False))
    factory.__name__ = f"gpt2_small_v{vocab}_p{positions}"
    return factory


EVERY_OTHER = [i % 2 == 1 for i in range(32)]  # torchtitan's op-SAC recomputes about half
EVEN_BLOCKS = [i % 2 == 0 for i in range(32)]  # its layer SAC, ac_freq 2: blocks 0, 2, 4...


def rows():
    """(what, config, device, link, published tokens/s per GPU, source, compared?)"""
    llama = dict(model=llama_8b, seq_len=8192, optimizer="adamw", precision="bf16",
                 strategy="fsdp", backend="gloo", device="cpu")
    gpt = dict(optimizer="adamw", precision="bf16", backend="gloo", device="cpu", world_size=8)
    tt8 = ddpkit.TrainConfig(**llama, micro_batch=2, world_size=8, checkpoint=EVERY_OTHER)
    return [
        ("Llama-3-8B, 8 GPUs, FSDP, SAC", tt8, "H100-80GB", None, 5762, TORCHTITAN_2412, True),
        ("Llama-3-8B, 8 GPUs, FSDP, SAC", tt8, GRAND_TETON, None, 5762, TORCHTITAN_2412, True),
        ("Llama-3-8B, 128 GPUs (16 nodes), FSDP, SAC", tt8.replace(world_size=128),
         GRAND_TETON, "400Gbps", 5605, TORCHTITAN_2412 + "; 400 Gb/s RoCE per GPU", True),
        ("Llama-3-8B, 64 GPUs (8 nodes), FSDP, layer SAC",
         ddpkit.TrainConfig(**llama, micro_batch=1, world_size=64, checkpoint=EVEN_BLOCKS),
         "A100-80GB", "200Gbps", 2904, TORCHTITAN_PERF + "; network *assumed* 200 Gb/s per GPU",
         True),
        ("GPT-2 small, 8 GPUs, DDP, B=64 T=1024",
         ddpkit.TrainConfig(**gpt, model=gpt2_small(), seq_len=1024, micro_batch=64),
         "A100-80GB", None, 1.1e6 / 8, NANOGPT, True),
        ("GPT-2 small, 8 GPUs, DDP, compiled", ddpkit.TrainConfig(
            **gpt, model=gpt2_small(), seq_len=1024, micro_batch=64), "A100-80GB", None,
         1.5e6 / 8, MINIGPT, False),
        ("GPT-2 small shape (MPT-125m), 8 GPUs, FSDP, seq 2048, mb 32 x 2",
         ddpkit.TrainConfig(**gpt, model=gpt2_small(50368, 2048), seq_len=2048, micro_batch=32,
                            accum_steps=2, strategy="fsdp"), "A100-80GB", None, 141737, MOSAIC,
         True),
        ("GPT-2 small shape (MPT-125m), 8 GPUs, FSDP, seq 1024, mb 64 x 2",
         ddpkit.TrainConfig(**gpt, model=gpt2_small(50368, 1024), seq_len=1024, micro_batch=64,
                            accum_steps=2, strategy="fsdp"), "A100-80GB", None, 156468, MOSAIC,
         True),
    ]


def predict_all():
    out = []
    for what, cfg, device, link, published, source, compared in rows():
        start = time.perf_counter()
        st = step_time(cfg, device=device, link=link)
        seconds = time.perf_counter() - start
        per_gpu = st.tokens_per_s / cfg.world_size
        name = device if isinstance(device, str) else device.name
        err = per_gpu / published - 1
        out.append((what, f"{name}" + (f", {link}" if link else ""), f"{published:,.0f}",
                    f"{per_gpu:,.0f}", f"{100 * err:+.0f}%" if compared else
                    f"({100 * err:+.0f}%: compiled, not compared)", f"{100 * st.mfu:.0f}%",
                    source, f"{seconds:.1f}"))
        print(out[-1][:6], f"{seconds:.1f} s", flush=True)
    return out


HEADER = ("configuration", "device (network)", "published tok/s/GPU", "predicted tok/s/GPU",
          "error", "predicted MFU", "source", "prediction took s")


def main(write=False):
    start = time.perf_counter()
    results = predict_all()
    body = table(HEADER, results)
    print(body)
    print(f"\n{machine()}; {time.perf_counter() - start:.0f} s")
    if write:
        with open("README.md") as fh:
            text = fh.read()
        new = re.sub(r"(<!-- named-hardware:begin -->\n).*?(\n<!-- named-hardware:end -->)",
                     lambda m: m.group(1) + body + m.group(2), text, flags=re.S)
        with open("README.md", "w") as fh:
            fh.write(new)


if __name__ == "__main__":
    main("--write" in sys.argv)
