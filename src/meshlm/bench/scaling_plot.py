"""The plot of `meshlm bench scaling` (bench/scaling.py): throughput and efficiency against the
world size, meshlm and PyTorch side by side, the model's prediction dashed, the machine's ceiling.
Reduces: reading a table of W x engines to see where scaling bends. Costs: matplotlib."""

from __future__ import annotations

from meshlm.bench.scaling import ENGINES


def plot(rows: list[dict], path: str, cores: int | None, title: str) -> None:
    """Throughput and efficiency against W: meshlm solid, PyTorch dotted, the model dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(1, 2, figsize=(12, 5.4))
    worlds = sorted({r["world_size"] for r in rows})
    for color, engine in zip(("tab:blue", "tab:orange", "tab:green"), ENGINES):
        mine = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["world_size"])
        if not mine:
            continue
        w = [r["world_size"] for r in mine]
        for ax, key in ((top, "tokens_per_s"), (bottom, "efficiency")):
            ax.plot(w, [r[f"meshlm_{key}"] for r in mine], "o-", color=color, label=ENGINES[engine][0])
            ax.plot(w, [r[f"reference_{key}"] for r in mine], "s:", color=color, label=mine[0]["reference"])
            ax.plot(w, [r[f"predicted_{key}"] for r in mine], "--", color=color, alpha=0.7,
                    label=f"{ENGINES[engine][0]}, predicted")
    bottom.axhline(1.0, color="grey", lw=0.8)
    ceiling = {r["world_size"]: r["compute_only_efficiency"] for r in rows}
    line, = bottom.plot(list(ceiling), list(ceiling.values()), "-.", color="grey",
                        label="compute only, no communication (the machine's ceiling)")
    bottom.legend(handles=[line], fontsize=8, loc="lower left")
    for ax, ylabel in ((top, "tokens/s (global)"), (bottom, "scaling efficiency")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(worlds, [str(w) for w in worlds])
        ax.set_xlabel("world size W (ranks)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if cores is not None and worlds[-1] > cores:
            ax.axvspan(cores + 0.5, worlds[-1] * 1.2, color="red", alpha=0.08, label=f"W > {cores} cores")
    handles, labels = top.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
