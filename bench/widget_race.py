"""How often a page that asks for every widget's state while a cell runs is handed a half-made
figure: a plain plotly ``FigureWidget`` against ddpkit's (`lab.fit.figure`, its comm opened
with the whole figure).

JupyterLab 4.6 sends a widget's comm messages on a subshell of the kernel (ipykernel 7), and its
widget manager asks for every widget's state (``request_states`` on the control comm) when it
connects to a kernel, as a page does when a notebook is opened and run at once. The kernel answers
on the subshell's thread while the cell runs. This benchmark does what the page does: one real
kernel builds figures of both kinds in turn in one cell, while a client asks on a subshell every
20 ms. It counts, for each kind, the snapshots that held one of its figures with an empty layout
or without its config (the page draws such a figure blank, 700 px wide, and never fits it,
when the snapshot lands after the figure's own later messages: the page's side is not
modelled here). Each figure is closed 5 ms after it is made, so a snapshot holds the figures
being made and the last pair; ddpkit's count is 0 by its construction (its comm opens whole),
so this shows the race a plain figure meets, and that ddpkit's does not.

    python -m bench.widget_race [--figures 150] [--every 0.02]

Target: no half-made ddpkit figure in any snapshot.
"""
import argparse
import threading
import time
import uuid

from jupyter_client.manager import start_new_kernel

from bench._common import machine

CODE = """
import time
import plotly.graph_objects as go
from ddpkit.lab import fit
for i in range({n}):
    a = go.FigureWidget(layout=dict(title=dict(text="plain %d" % i)))
    a._config = {{"responsive": True}}  # what ddpkit did before: set after the comm opened
    b = fit.figure(dict(title=dict(text="ddpkit %d" % i)))
    time.sleep(0.005)
    a.close(); b.close()  # a snapshot holds the live ones: each carries plotly's 5 MB bundle
"""
# a figure's kind, by the class anywidget names it by in its state
KINDS = {"plotly.graph_objs._figurewidget.FigureWidget": "plain FigureWidget",
         "ddpkit.lab.fit.HeldFigureWidget": "ddpkit figure"}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--figures", type=int, default=150)
    ap.add_argument("--every", type=float, default=0.02)
    args = ap.parse_args(argv)
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        kc.control_channel.send(kc.session.msg("create_subshell_request", {}))
        sub = kc.control_channel.get_msg(timeout=30)["content"]["subshell_id"]
        kc.execute("from ddpkit.lab import fit; import plotly.graph_objects", silent=True)
        kc.get_shell_msg(timeout=120)
        control = uuid.uuid4().hex

        def on_subshell(msg_type, content, **kw):
            msg = kc.session.msg(msg_type, content, **kw)
            msg["header"]["subshell_id"] = sub  # as JupyterLab sends a comm target's messages
            kc.shell_channel.send(msg)

        on_subshell("comm_open", {"comm_id": control, "target_name": "jupyter.widget.control",
                                  "data": {}}, metadata={"version": "1.0.0"})
        done = threading.Event()

        def ask():
            while not done.is_set():
                on_subshell("comm_msg", {"comm_id": control,
                                         "data": {"method": "request_states"}})
                time.sleep(args.every)

        cell = kc.execute(CODE.format(n=args.figures))
        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        snapshots, failed, idle = 0, 0, False
        half, seen = dict.fromkeys(KINDS.values(), 0), dict.fromkeys(KINDS.values(), 0)
        deadline = time.monotonic() + 600
        while not idle and time.monotonic() < deadline:
            try:
                msg = kc.get_iopub_msg(timeout=5)
            except Exception:  # noqa: BLE001 (no message within 5 s: ask again)
                continue
            c = msg["content"]
            if msg["msg_type"] == "comm_msg" and c.get("comm_id") == control:
                snapshots += 1  # counted as it comes, and dropped
                for s in c["data"]["states"].values():
                    kind = KINDS.get(s["state"].get("_anywidget_id"))
                    if kind is None:
                        continue
                    seen[kind] += 1
                    st = s["state"]
                    if not st.get("_widget_layout") or not st.get("_config", {}).get("responsive"):
                        half[kind] += 1
            elif msg["msg_type"] == "stream" and "changed size during iteration" in c["text"]:
                failed += 1  # ipywidgets' own answer raised: the page gets no snapshot
            elif (msg["msg_type"] == "status" and c["execution_state"] == "idle"
                  and msg["parent_header"].get("msg_id") == cell):
                idle = True
        done.set()
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    lines = [f"## A page's snapshot of the widgets while a cell makes figures ({machine()})", "",
             f"{snapshots} snapshots answered while one cell made {args.figures} figures "
             f"of each kind ({failed} more asks failed inside ipywidgets: a widget was made "
             "while it listed them).", "",
             "| figure | seen in snapshots | half made (empty layout or no config) |",
             "|---|---|---|"]
    lines += [f"| {k} | {seen[k]} | {half[k]} |" for k in half]
    text = "\n".join(lines) + "\n"
    print(text)
    return text


if __name__ == "__main__":
    main()
