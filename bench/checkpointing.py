"""Checkpointing: activation bytes and recompute FLOPs per segment count, measured on 2 ranks,
next to `estimate()`. Bytes and FLOPs are counts, not clock readings: one run suffices.

    python -m bench.checkpointing
"""
import ddpkit
from bench._common import machine, table
from ddpkit.train import recompute_flops_ratio

SETTINGS = [None, 2, 4, 8, "full"]


def main(argv=None):
    rows, worst = [], 0.0
    for model in ("mlp", "gpt"):
        cfg = ddpkit.TrainConfig(model=model, n_blocks=8, width=64, seq_len=32, world_size=2,
                                 micro_batch=4, steps=1)
        sweep = ddpkit.sweep(cfg, checkpoint=SETTINGS)
        for setting, row in zip(SETTINGS, sweep):
            measured, predicted = row["activation_bytes"], row["predicted_activation_bytes"]
            err = abs(measured - predicted) / predicted
            worst = max(worst, err)
            reentrant = recompute_flops_ratio(cfg.replace(checkpoint=setting, use_reentrant=True))
            rows.append((model, row["checkpoint"], measured, predicted, f"{100 * err:.1f}%",
                         row["recompute_flops_ratio"], round(reentrant, 4)))
    text = ("### Checkpointing: measured vs estimate (`python -m bench.checkpointing`)\n\n"
            f"8 blocks, width 64, micro_batch 4 (gpt: seq 32), fp32, 2 ranks gloo. Machine: "
            f"{machine()}\n\n"
            + table(["model", "checkpoint", "activation bytes", "estimate", "error",
                     "FLOP ratio (non-reentrant)", "FLOP ratio (reentrant)"], rows)
            + f"\n\nlargest error {100 * worst:.2f}% (target within 10%): "
              f"{'met' if worst <= 0.10 else 'MISSED'}. Non-reentrant checkpointing stops "
              f"recomputing early, so it recomputes fewer FLOPs than reentrant.\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
