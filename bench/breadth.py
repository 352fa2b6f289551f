"""Breadth: every transformers family of tests/families.py (tiny configs, nothing downloaded)
trained on 2 gloo ranks with checkpointing none and full, estimated and planned; one row each,
and the families that cannot pass with their reason. The same figures tests/test_breadth.py
asserts (its default list runs in CI, the rest with ``pytest --breadth``).

    python -m bench.breadth [family ...]
"""
import sys
import time
from pathlib import Path

import ddpkit
from bench._common import machine, table


def _families():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import families

    return families


def main(argv=None):
    families = _families()
    names = list(argv) if argv else list(families.FAMILIES)
    rows, skipped, failed = [], [], []
    t0 = time.perf_counter()
    with ddpkit.Pool(world_size=2, backend="gloo", device="cpu") as pool:
        for name in names:
            fam = families.FAMILIES[name]
            if fam.skip:
                skipped.append((name, fam.kind, fam.skip))
                continue
            try:
                out = families.measure(name, pool)
            except Exception as exc:  # noqa: BLE001 (a failing family is a row, not the end)
                failed.append((name, fam.kind, f"{type(exc).__name__}: {str(exc)[:200]}"))
                continue
            blocks = out["blocks"] if isinstance(out["blocks"], str) else ", ".join(out["blocks"])
            exact = out["measured_none"] == out["estimated_none"] and \
                out["measured_full"] == out["estimated_full"]
            rows.append((name, out["kind"], f"`{blocks}`", out["n_blocks"],
                         out["measured_none"], out["measured_full"],
                         "yes" if exact else "NO", f"{out['weight_diff']:.1e}",
                         "yes" if out["plan_fits"] else "NO", out["seconds"]))
    took = time.perf_counter() - t0
    text = ("### Breadth: transformers families (`python -m bench.breadth`)\n\n"
            f"Tiny configs (2 blocks per stack, width 32, dropout 0), micro_batch 4, fp32, SGD, "
            f"2 ranks gloo, 2 steps per run. Machine: {machine()}. {len(rows)} families passed, "
            f"{len(failed)} failed, in {took:.0f} s (seconds per family include its imports; "
            f"a shared machine's timings are noisy).\n\n"
            + table(["family", "kind", "stacks found", "blocks", "activation bytes (none)",
                     "(full)", "= estimate", "weight diff none/full", "plan fits", "seconds"],
                    rows)
            + ("\n\nFailed:\n\n" + table(["family", "kind", "error"], failed) if failed else "")
            + "\n\nKnown not to work:\n\n" + table(["family", "kind", "why"], skipped) + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
