"""The Lab's history: one row per finished run (its status, figures and mid-run changes), and
the table that shows them."""
from __future__ import annotations

import html

from ..predict.units import fmt_bytes
from ..runs.result import summarize

COLUMNS = [("run", "run"), ("status", "status"), ("steps_done", "steps"),
           ("final_loss", "final loss"), ("peak_bytes", "peak"),
           ("activation_bytes", "activations"), ("comm_bytes", "sent/step"),
           ("step_time_s", "step ms"), ("wall_s", "wall s"),
           ("changes", "changes")]


def history_row(index, cfg, handle, metrics, wall_s):
    """One finished run as a history row: ``handle`` its `RunHandle`, ``metrics`` its records."""
    error = handle.error
    status = "error" if error else ("stopped" if handle.result and handle.result.stopped else "ok")
    m0 = [m for m in metrics if m["rank"] == 0]
    s = summarize(metrics) if m0 else {}
    return {"run": index, "status": status, "steps_done": len(m0),
            "final_loss": s.get("final_loss"), "peak_bytes": s.get("peak_bytes"),
            # the last step's, not the median: checkpointing may have changed mid-run
            "activation_bytes": m0[-1].get("activation_bytes") if m0 else None,
            # bytes this rank sent in its last step, every collective (engine/collectives.py)
            "comm_bytes": m0[-1].get("comm_bytes") if m0 else None,
            "step_time_s": s.get("step_time_s"), "wall_s": round(wall_s, 3),
            "changes": [(m["step"], m["changed"]) for m in m0 if m.get("changed")],
            "config": cfg.to_dict(), "error": str(error) if error else None}


def _cell(column, value):
    if column in ("peak_bytes", "activation_bytes", "comm_bytes"):
        return fmt_bytes(value)
    if column == "step_time_s" and value is not None:
        return f"{1000 * value:.2f}"
    return f"{value:.4g}" if isinstance(value, float) else html.escape(str(value))


def history_html(rows):
    """The rows as an HTML table (bytes in the unit that suits them, step time in ms)."""
    body = "".join("<tr>" + "".join(f"<td>{_cell(c, r[c])}</td>" for c, _ in COLUMNS) + "</tr>"
                   for r in rows)
    heads = "".join(f"<th>{h}</th>" for _, h in COLUMNS)
    return f"<div style='overflow-x:auto'><table><tr>{heads}</tr>{body}</table></div>"
