"""Checkpointing: activation bytes and recompute FLOPs per segment count, measured on 2 ranks,
next to `estimate()`. Bytes and FLOPs are counts, not clock readings: one run suffices.

    python -m bench.checkpointing
"""
import sys
import time
from pathlib import Path

import ddpkit
from bench._common import machine, table
from ddpkit.runs.sweep import recompute_flops_ratio

SETTINGS = [None, 2, 4, 8, "full"]
OWN = [None, 2, "full", [True, False] * 2]  # your-model rows: 4 blocks each


def _own_models():
    """A notebook-style model (blocks in an nn.Sequential, its own data and loss) and two
    transformers models from small configs (tests/fixtures_module.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import fixtures_module as fm

    base = dict(world_size=2, micro_batch=4, seq_len=32, steps=1, backend="gloo", device="cpu")
    out = {"notebook Net": ddpkit.TrainConfig(model=fm.make_model, data=fm.make_data,
                                              loss=fm.loss_fn, **base)}
    try:
        out["HF GPT-2"] = ddpkit.TrainConfig(model=fm.make_gpt2, **base)
        out["HF Llama"] = ddpkit.TrainConfig(model=fm.make_llama, **base)
    except ImportError:
        pass  # transformers is the optional extra ddpkit[hf]
    return out


def _estimate_seconds(cfg):
    """Cold estimate (fake model built, traced) of a setting not seen before, as the Lab's
    sliders call it."""
    import importlib

    importlib.import_module("ddpkit.predict.trace")._TRACES.clear()  # the module, not the function
    t0 = time.perf_counter()
    ddpkit.estimate(cfg)
    return time.perf_counter() - t0


def main(argv=None):
    rows, worst = [], 0.0
    configs = [(m, ddpkit.TrainConfig(model=m, n_blocks=8, width=64, seq_len=32, world_size=2,
                                      micro_batch=4, steps=1), SETTINGS) for m in ("mlp", "gpt")]
    configs += [(name, cfg, OWN) for name, cfg in _own_models().items()]
    est_times = []
    for model, cfg, settings in configs:
        if not cfg.builtin:
            est_times.append((model, f"{_estimate_seconds(cfg):.2f}"))
        sweep = ddpkit.sweep(cfg, checkpoint=settings, progress=False)
        for setting, (_, row) in zip(settings, sweep.iterrows()):
            measured, predicted = row["activation_bytes"], row["predicted_activation_bytes"]
            err = abs(measured - predicted) / predicted
            worst = max(worst, err)
            reentrant = recompute_flops_ratio(cfg.replace(checkpoint=setting, use_reentrant=True))
            rows.append((model, row["checkpoint"], measured, predicted, f"{100 * err:.1f}%",
                         row["recompute_flops_ratio"], round(reentrant, 4)))
    text = ("### Checkpointing: measured vs estimate (`python -m bench.checkpointing`)\n\n"
            f"Built-in models: 8 blocks, width 64, micro_batch 4 (gpt: seq 32). Your-model rows "
            f"(tests/fixtures_module.py): 4 blocks each, micro_batch 4, seq 32. fp32, 2 ranks "
            f"gloo. Machine: {machine()}\n\n"
            + table(["model", "checkpoint", "activation bytes", "estimate", "error",
                     "FLOP ratio (non-reentrant)", "FLOP ratio (reentrant)"], rows)
            + f"\n\nlargest error {100 * worst:.2f}% (target within 10%): "
              f"{'met' if worst <= 0.10 else 'MISSED'}. Non-reentrant checkpointing stops "
              f"recomputing early, so it recomputes fewer FLOPs than reentrant.\n\n"
            + "Estimate time for your models, cold (fake model built and traced; target < 2 s):"
              "\n\n" + table(["model", "seconds"], est_times) + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
