"""A rank's return value to the kernel: ddpkit's path (the tensors' bytes beside the pickle,
`ddpkit/rank/returns.py`) against torch's own pickling (``torch.save`` of each storage inside
the pickle, what ddpkit sent before), for weights of GPT-2 small's shapes (124M parameters plus
the untied head ``full_state_dict`` returns: 652 MB).

    python -m bench.returns [--repeat 5]

One warm rank builds the weights, notes the time and returns them; the kernel notes when the
value is in its hands (for torch's pickling: after ``cloudpickle.loads``, which the kernel used
to run on every return). Interleaved round by round. Target: ddpkit's path >= 3x faster.
"""
import argparse
import time

import ddpkit
from bench._common import machine, summary, table

# GPT-2 small: vocabulary 50,257, 1,024 positions, width 768, 12 blocks; the head as returned
V, P, D, L = 50257, 1024, 768, 12


def weights():
    import torch

    sd = {"transformer.wte.weight": torch.ones(V, D), "transformer.wpe.weight": torch.ones(P, D)}
    for i in range(L):
        for name, shape in [("ln_1.weight", (D,)), ("ln_1.bias", (D,)),
                            ("attn.c_attn.weight", (D, 3 * D)), ("attn.c_attn.bias", (3 * D,)),
                            ("attn.c_proj.weight", (D, D)), ("attn.c_proj.bias", (D,)),
                            ("ln_2.weight", (D,)), ("ln_2.bias", (D,)),
                            ("mlp.c_fc.weight", (D, 4 * D)), ("mlp.c_fc.bias", (4 * D,)),
                            ("mlp.c_proj.weight", (4 * D, D)), ("mlp.c_proj.bias", (D,))]:
            sd[f"transformer.h.{i}.{name}"] = torch.ones(shape)
    sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"] = torch.ones(D), torch.ones(D)
    sd["lm_head.weight"] = torch.ones(V, D)
    return sd


def send(ctx, how):
    import time

    import cloudpickle

    value = weights()
    if how == "torch":
        value = cloudpickle.dumps(value)  # torch's reductions: torch.save per storage
    ctx.log(step=0, t=time.time())
    return value


def one(pool, how):
    res = pool.launch(send, how)
    value = res.returns[0]
    if how == "torch":
        import cloudpickle

        value = cloudpickle.loads(value)
    done = time.time()
    assert len(value) == 4 + 12 * L + 1
    return done - res.metrics[0]["t"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    names = {"ddpkit": "tensors beside the pickle (ddpkit)", "torch": "torch's pickling (before)"}
    times = {k: [] for k in names}
    with ddpkit.Pool(world_size=1) as pool:
        one(pool, "ddpkit")  # warm: the rank's imports
        for _ in range(args.repeat):
            for how in names:
                times[how].append(one(pool, how))
    med = {k: summary(v)[0] for k, v in times.items()}
    ratio = med["torch"] / med["ddpkit"]
    rows = [(names[k], summary(v)[1], f"{med[k] / med['ddpkit']:.2f}x") for k, v in times.items()]
    text = (f"### A rank's return value, 652 MB of GPT-2 small's weights, return to value in the "
            f"kernel (`python -m bench.returns --repeat {args.repeat}`)\n\nMachine: {machine()}\n\n"
            + table(["path", "median (spread)", "vs ddpkit"], rows)
            + f"\n\ntorch's pickling / ddpkit's path = {ratio:.1f}x (target >= 3x): "
            + ("met" if ratio >= 3 else "MISSED") + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
