"""10.3's crossover measured through a server (``roofline --base-url``), drawn from plain data (the
result's ``to_dict()``): per-request and aggregate decode tok/s against B beside BW / bytes(B) and
B · BW / bytes(B) from the model's config, with what HTTP adds said on the figure."""
from __future__ import annotations

from pathlib import Path
from typing import Any

NAME = "10-3-decode-roofline-http"


def plot_remote_roofline(data: dict[str, Any]):
    import matplotlib.pyplot as plt
    rows = [r for r in data["rows"] if r["per_request_tok_s"] is not None]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    bs = [r["batch"] for r in rows]
    ax.plot(bs, [r["per_request_tok_s"] for r in rows], "o-", color="tab:blue",
            label="per request (measured)")
    agg = [(r["batch"], r["aggregate_tok_s"]) for r in rows if r["aggregate_tok_s"] is not None]
    if agg:
        ax.plot(*zip(*agg), "s-", color="tab:orange", label="aggregate (measured)")
    bounded = [r for r in rows if r.get("bound_per_request_tok_s")]
    if bounded:
        ax.plot([r["batch"] for r in bounded], [r["bound_per_request_tok_s"] for r in bounded], "--",
                color="tab:blue", alpha=0.6, label="BW / bytes(B): one request's bound")
        ax.plot([r["batch"] for r in bounded], [r["bound_aggregate_tok_s"] for r in bounded], "--",
                color="tab:orange", alpha=0.6, label="B · BW / bytes(B): the batch's bound")
    for r in data["rows"]:
        if r["status"] != "ok" and r["per_request_tok_s"] is not None:
            ax.annotate(r["status"], (r["batch"], r["per_request_tok_s"]), fontsize=7, color="tab:red")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("requests decoding at once (B)")
    ax.set_ylabel("decode tokens/s")
    b = data["bound"]
    bw = (f"BW {b['bandwidth'] / 1e9:.0f} GB/s ({b['bandwidth_source']})" if b.get("bandwidth")
          else f"no bound: {b['bandwidth_source']}")
    ax.set_title(f"Decode through HTTP: {data['model']} at {data['base_url']}\n{bw}", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    foot = "measured through HTTP + SSE (one event per token: the server's HTTP stack, the socket and the " \
           "client's event loop are inside these rates)"
    if data.get("stopped"):
        foot += f"\nstopped at the server's limit: {data['stopped']}"
    fig.text(0.01, -0.02, foot, fontsize=7, color="0.3", ha="left", va="top", wrap=True)
    return fig


def save_remote_roofline(data: dict[str, Any], out_dir: str | Path | None = None) -> list[Path]:
    import matplotlib.pyplot as plt

    from minillm.plots.figures import save_figure
    fig = plot_remote_roofline(data)
    stamp = (f"roofline --base-url {data['base_url']} · {data.get('hardware') or 'hardware not stated'} · "
             f"{data.get('parallel')} · {data.get('started')}")
    try:
        return save_figure(fig, NAME, stamp, out_dir, data=data)
    finally:
        plt.close(fig)
