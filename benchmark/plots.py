"""The speculative-decoding plot both benchmarks draw: TPOT and accept length against K."""

from __future__ import annotations

import re


def plot_spec_rows(rows: list[dict], path: str, conc_key: str, tpot_key: str, title: str) -> None:
    """rows: one per (configuration, concurrency); configuration names carry `k<K>` and
    `expand` or `fia` (or are "off", drawn as a dotted TPOT line per concurrency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for conc in sorted({r[conc_key] for r in rows}, key=str):
        at = [r for r in rows if r[conc_key] == conc]
        for verify, style in (("expand", "--"), ("fia", "-")):
            sel = [r for r in at if verify in r["config"]]
            ks = [int(re.search(r"k(\d+)", r["config"]).group(1)) for r in sel]
            label = f"{verify}, concurrency {conc}"
            ax1.plot(ks, [r[tpot_key] for r in sel], style, marker="o", label=label)
            ax2.plot(ks, [r["accept_length"] for r in sel], style, marker="o", label=label)
        for r in at:
            if r["config"] == "off":
                ax1.axhline(r[tpot_key], color="gray", lw=0.8, ls=":")
    ax1.set(xlabel="draft tokens K", ylabel="median TPOT (ms)", title=title)
    ax2.set(xlabel="draft tokens K", ylabel="mean accept length", title="accept length")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
