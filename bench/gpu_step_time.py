"""The step time on a lent GPU: predicted (this machine's GPU calibration, and the catalogue's
roofline for the card) beside measured, for three configs: DDP on a GPT-2-small-like model,
FSDP in bf16, and activation checkpointing. Run by ``bench/gpu_check.sh``; exits 2 without a
GPU.

    python -m bench.gpu_step_time            # a few minutes: the calibration, then 3 runs

One rank per GPU (NCCL), up to 8; measured = the median step time of rank 0's steps after the
first two (DDP rebuilds its buckets at step 1).
"""
import statistics
import sys
import time

import ddpkit
from bench._common import machine, table

STEPS = 12


def gpt2_like():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50304,
                                      n_positions=1024, activation_function="gelu_pytorch_tanh",
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      use_cache=False))


def llama_like():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=1024, intermediate_size=2816,
                                        num_hidden_layers=12, num_attention_heads=16,
                                        num_key_value_heads=4, vocab_size=32000,
                                        use_cache=False))


def configs(world):
    run = dict(world_size=world, device="cuda", steps=STEPS, optimizer="adamw",
               precision="bf16")
    return [("GPT-2 small, DDP, seq 1024, mb 8",
             ddpkit.TrainConfig(model=gpt2_like, seq_len=1024, micro_batch=8, **run)),
            ("Llama 270M, FSDP bf16, seq 1024, mb 8",
             ddpkit.TrainConfig(model=llama_like, seq_len=1024, micro_batch=8, strategy="fsdp",
                                **run)),
            ("GPT-2 small, DDP, checkpoint full, mb 16",
             ddpkit.TrainConfig(model=gpt2_like, seq_len=1024, micro_batch=16,
                                checkpoint="full", **run))]


def measured_s(res):
    steps = [r["step_time_s"] for r in res.metrics
             if r.get("rank") == 0 and r.get("step", 0) >= 2 and "step_time_s" in r]
    return statistics.median(steps)


def catalogue_name():
    import torch

    from ddpkit.predict import hardware

    device = hardware.device_for(torch.cuda.get_device_name(0))
    return device.name if device is not None else None


def main():
    from ddpkit.devices import cuda_gpus
    from ddpkit.predict.calibrate import calibrate
    from ddpkit.predict.steptime import step_time

    gpus = len(cuda_gpus())
    if not gpus:
        print("bench.gpu_step_time: no CUDA GPU here; run it on a GPU machine")
        return 2
    world = min(gpus, 8)
    start = time.perf_counter()
    calibrated = calibrate(progress=False)
    print(f"calibrated {calibrated.name} in {time.perf_counter() - start:.0f} s")
    card = catalogue_name()
    rows, errors = [], []
    for what, cfg in configs(world):
        res = ddpkit.train(cfg)
        measured = measured_s(res)
        predicted = step_time(cfg, machine=calibrated).seconds
        roofline = step_time(cfg, device=card).seconds if card else float("nan")
        errors.append(predicted / measured - 1)
        rows.append((what, f"{1e3 * measured:.1f}", f"{1e3 * predicted:.1f}",
                     f"{100 * errors[-1]:+.1f}%", f"{1e3 * roofline:.1f}",
                     f"{100 * (roofline / measured - 1):+.1f}%"))
        print(rows[-1], flush=True)
    print(table(("config", "measured ms", "predicted ms (calibrated)", "error",
                 f"predicted ms ({card or 'no catalogue card'})", "error"), rows))
    print(f"predicted vs measured: mean absolute error "
          f"{100 * statistics.mean(abs(e) for e in errors):.1f}% on {world} GPU(s); {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
