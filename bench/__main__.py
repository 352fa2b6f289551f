"""Run every benchmark side by side on this machine and write bench/results.md.

    python -m bench            # about 5 minutes on 2 cores
"""
import datetime
from pathlib import Path

from bench import breadth, checkpointing, curriculum, launch, live_plots, overhead, returns
from bench._common import machine


def main():
    parts = [launch.main([]), returns.main([]), overhead.main([]), live_plots.main([]),
             checkpointing.main([]), breadth.main([]), curriculum.main([])]
    head = (f"# ddpkit benchmarks\n\nMeasured by `python -m bench` on "
            f"{datetime.date.today().isoformat()}, {machine()}. Timings are medians with their "
            f"spread, measured side by side in one run; byte and FLOP counts are exact.\n\n")
    out = Path(__file__).resolve().parent / "results.md"
    out.write_text(head + "\n".join(parts))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
