"""The report's figures, drawn with matplotlib into PNG bytes.

matplotlib because it is the field's well-kept plotting library, draws
headless (``matplotlib.figure.Figure`` on its Agg canvas, without pyplot's
global state, so two threads may draw at once) and writes PNGs a browser
shows without any script. It is imported here only, and only when a report
is drawn (the ``report`` extra): the SDK and ``blockctl`` work without it.

Convention the screenshot test relies on: data is drawn in colour, and
everything else (axes, text, grid, reference lines such as the tail-waste
bound) in black and greys, so coloured pixels in a plot are data.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from blockd.core.types import MISS_REASONS
from client.report.advisor import Advice
from client.report.series import NUM_BINS, RunRecord, increase, prefix_intervals, tail_waste_per_seq, utilisation

WIDTH_IN, ROW_IN, DPI = 10.0, 3.0, 100
COLOURS = {"used": "tab:blue", "evictable": "tab:orange", "free": "tab:green", "host": "tab:purple"}
REASON_COLOURS = dict(zip(MISS_REASONS, ("tab:red", "tab:orange", "tab:purple", "tab:cyan", "tab:brown")))
SCHEME_COLOURS = ("tab:blue", "tab:red", "tab:green", "tab:purple")


@dataclass(frozen=True)
class Plot:
    """One figure of the report: its file name (without ``.png``), title, caption and PNG."""

    key: str
    title: str
    caption: str
    png: bytes


def _figure(rows: int = 1, cols: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, ROW_IN * rows), dpi=DPI, layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _time_axis(ax, run: RunRecord) -> None:
    """The run's whole span on every time axis, so a run's panels line up."""
    ax.set_xlim(run.times_s[0], max(run.times_s[-1], run.times_s[0] + 1e-3))
    ax.set_xlabel("seconds since the run began")
    ax.grid(True, color="0.85")


def blocks_by_state(run: RunRecord) -> Plot:
    # from the samples, not the pool's config: a history read from the metrics has no host-tier counts
    num_host_blocks = max(s.num_host_blocks for s in run.stats)
    has_host = num_host_blocks > 0
    fig, axes = _figure(2 if has_host else 1)
    t = run.times_s
    ax = axes[0][0]
    ax.stackplot(t, [s.num_used_blocks for s in run.stats], [s.num_evictable_blocks for s in run.stats],
                 [s.num_free_blocks for s in run.stats], labels=("used", "evictable (cached, ref count 0)", "free"),
                 colors=(COLOURS["used"], COLOURS["evictable"], COLOURS["free"]), step="post")
    ax.set_ylabel("device blocks")
    ax.set_ylim(0, run.pool.num_blocks)
    ax.legend(loc="upper right", fontsize="small")
    _time_axis(ax, run)
    caption = (f"The device tier's {run.pool.num_blocks} blocks of {run.pool.block_size} slots by state "
               "(they add up to the pool).")
    if has_host:
        ax = axes[1][0]
        cached = [s.num_host_cached_blocks for s in run.stats]
        ax.stackplot(t, cached, [s.num_host_blocks - c for s, c in zip(run.stats, cached)],
                     labels=("cached (offloaded)", "free"), colors=(COLOURS["host"], COLOURS["free"]), step="post")
        ax.set_ylabel("host-tier blocks")
        ax.set_ylim(0, num_host_blocks)
        ax.legend(loc="upper right", fontsize="small")
        _time_axis(ax, run)
        caption += f" Below, the host tier's {num_host_blocks} blocks."
    return Plot(f"{run.name}_blocks", f"{run.name}: blocks by state", caption, _png(fig))


def pool_utilisation(run: RunRecord) -> Plot:
    fig, axes = _figure()
    ax = axes[0][0]
    slots, blocks = utilisation(run)
    ax.step(run.times_s, blocks, where="post", color="tab:blue", label="used blocks / all blocks")
    ax.step(run.times_s, slots, where="post", color="tab:green", label="slots holding tokens / all slots")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("ratio")
    ax.legend(loc="upper right", fontsize="small")
    _time_axis(ax, run)
    return Plot(f"{run.name}_utilisation", f"{run.name}: pool utilisation",
                "The gap between the two lines is tail waste: slots of used blocks that hold no token.", _png(fig))


def tail_waste(run: RunRecord) -> Plot:
    fig, axes = _figure()
    ax = axes[0][0]
    b = run.pool.block_size
    per_seq = tail_waste_per_seq(run)
    ax.axhspan(0, b - 1, color="0.93", label=f"the bound: 0 to b-1 = {b - 1} slots per sequence")
    ax.axhline((b - 1) / 2, color="0.4", linestyle=":", label=f"(b-1)/2 = {(b - 1) / 2:g}: uniform lengths' mean")
    ax.step(run.times_s, [float("nan") if v is None else v for v in per_seq], where="post", color="tab:red",
            label="observed: pool tail waste / sequences")
    ax.set_ylim(0, b)
    ax.set_ylabel("tail waste, slots per sequence")
    ax.legend(loc="upper right", fontsize="small")
    _time_axis(ax, run)
    return Plot(f"{run.name}_tail_waste", f"{run.name}: tail waste against the bound",
                f"Unused slots in partly filled last blocks, per running sequence (block size {b}); "
                "the grey band is the seed's bound ceil(T/b)*b - T in [0, b-1].", _png(fig))


def prefix_cache(run: RunRecord) -> Plot:
    fig, axes = _figure(2)
    iv = prefix_intervals(run)
    ax = axes[0][0]
    rates = [float("nan") if r is None else r for r in iv.hit_rate()]
    ax.plot(iv.ends_s, rates, color="tab:blue", marker=".", label=f"hit rate in each 1/{NUM_BINS} of the run")
    queried = increase(run, lambda s: s.prefix_queried_tokens)
    cumulative = [h / q if q else float("nan") for h, q in zip(increase(run, lambda s: s.prefix_hit_tokens), queried)]
    ax.step(run.times_s, cumulative, where="post", color="tab:green", label="since the run began")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("hit tokens / queried")
    ax.legend(loc="upper right", fontsize="small")
    _time_axis(ax, run)
    ax = axes[1][0]
    span = (run.times_s[-1] - run.times_s[0]) / NUM_BINS
    starts = [end - span for end in iv.ends_s]
    widths = [span * 0.9] * len(starts)
    bottom = [0] * len(iv.ends_s)
    for reason in MISS_REASONS:
        counts = iv.missed[reason]
        if any(counts):
            ax.bar(starts, counts, widths, bottom=bottom, align="edge", color=REASON_COLOURS[reason], label=reason)
            bottom = [b + c for b, c in zip(bottom, counts)]
    ax.set_ylabel("missed prompt tokens")
    ax.legend(loc="upper right", fontsize="small", title="miss reason")
    _time_axis(ax, run)
    return Plot(f"{run.name}_prefix", f"{run.name}: prefix cache",
                "Above, the share of allocated prompt tokens served from cache between samples; below, the "
                "tokens that missed, by reason (never stored, evicted from a tier, the partial last block, "
                "cached under other extra keys).", _png(fig))


def latency(run: RunRecord) -> Plot:
    from client.serving import percentile

    fig, axes = _figure(1, 2)
    for ax, values, name, colour in ((axes[0][0], run.ttft_s, "time to first token", "tab:blue"),
                                     (axes[0][1], run.tpot_s, "time per output token", "tab:green")):
        ms = [v * 1e3 for v in values]
        ax.hist(ms, bins=min(40, max(5, len(ms) // 3)), color=colour)
        for q, style in ((50, "--"), (99, ":")):
            ax.axvline(percentile(ms, q), color="black", linestyle=style, label=f"p{q} {percentile(ms, q):.1f} ms")
        ax.set_xlabel(f"{name}, ms ({len(ms)} requests)")
        ax.set_ylabel("requests")
        ax.legend(loc="upper right", fontsize="small")
        ax.grid(True, color="0.85")
    return Plot(f"{run.name}_latency", f"{run.name}: TTFT and TPOT",
                "Distributions over the finished requests (TTFT from arrival; TPOT after the first token, "
                "requests with one output token left out).", _png(fig))


def advisor(advice: Advice) -> Plot:
    fig, axes = _figure()
    ax = axes[0][0]
    labels = [str(c.block_size) for c in advice.costs]
    held = [(c.kv_bytes - c.tail_waste_bytes) / 1024 for c in advice.costs]
    waste = [c.tail_waste_bytes / 1024 for c in advice.costs]
    table = [c.table_bytes / 1024 for c in advice.costs]
    ax.bar(labels, held, color="tab:blue", label="KV of tokens")
    ax.bar(labels, waste, bottom=held, color="tab:red", label="tail waste")
    ax.bar(labels, table, bottom=[h + w for h, w in zip(held, waste)], color="tab:purple", label="block table")
    best = next(i for i, c in enumerate(advice.costs) if c is advice.recommended)
    ax.annotate("recommended", (best, advice.recommended.total_bytes / 1024), ha="center", va="bottom",
                xytext=(0, 4), textcoords="offset points")
    ax.set_xlabel("block size (slots)")
    ax.set_ylabel("KiB per sequence (mean)")
    ax.legend(loc="lower right", fontsize="small")
    ax.grid(True, axis="y", color="0.85")
    return Plot("advisor", "block-size advisor",
                f"Expected bytes per sequence for each candidate block size over the {advice.num_sequences} "
                f"observed sequences: {advice.kv_bytes_per_slot} B of KV per slot, "
                f"{advice.table_bytes_per_block} B of table per block.", _png(fig))


def comparison(runs: list[RunRecord]) -> Plot:
    """Runs side by side (paging against max-length reservation): sequences held, utilisation, TTFT."""
    fig, axes = _figure(1, 3)
    if not all(run.ttft_s for run in runs):
        raise ValueError("runs side by side need their requests' TTFT")
    for run, colour in zip(runs, SCHEME_COLOURS):
        slots, _ = utilisation(run)
        axes[0][0].step(run.times_s, [s.num_seqs for s in run.stats], where="post", color=colour, label=run.name)
        axes[0][1].step(run.times_s, slots, where="post", color=colour, label=run.name)
        ttft = sorted(v * 1e3 for v in run.ttft_s)
        axes[0][2].step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", color=colour,
                        label=run.name)
    for ax, ylabel in zip(axes[0], ("sequences in the pool", "slots holding tokens / all", "share of requests")):
        ax.set_ylabel(ylabel)
        ax.grid(True, color="0.85")
        ax.legend(loc="lower right", fontsize="small")
    axes[0][0].set_xlabel("seconds")
    axes[0][1].set_xlabel("seconds")
    axes[0][2].set_xlabel("TTFT, ms (CDF)")
    names = " against ".join(run.name for run in runs)
    return Plot("comparison", f"side by side: {names}",
                "The same requests on the same pool: how many sequences each scheme keeps in the pool, how full "
                "its slots are, and the time to first token it gives.", _png(fig))


def run_plots(run: RunRecord) -> list[Plot]:
    """A run's figures; TTFT and TPOT only when the run saw requests finish (a
    report from the daemon's statistics alone has none, and no empty axis is drawn)."""
    figures = [blocks_by_state(run), pool_utilisation(run), tail_waste(run), prefix_cache(run)]
    return [*figures, latency(run)] if run.ttft_s else figures
