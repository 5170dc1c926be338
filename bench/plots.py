"""PNG plots of a benchmark's results (matplotlib, Agg backend), one function per figure."""
from __future__ import annotations

from pathlib import Path

from bench.workloads import CATEGORIES


def _speedup_vs_k(ax, ks: dict) -> None:
    kk = sorted(int(m[7:]) for m in ks["modes"] if m.startswith("fixed_K"))
    ax.plot(kk, [ks["modes"][f"fixed_K{k}"]["speedup"] for k in kk], "o-", label="fixed K")
    for i, (p, v) in enumerate(ks["policies"].items()):
        ax.axhline(v["speedup"], ls="--", color=f"C{i + 1}", label=f"{p} (mean K {v['mean_draft_length']:.1f})")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("draft length K")
    ax.set_ylabel("speedup over autoregressive")
    ax.set_title(f"speedup vs K ({ks['drafter']} drafter, greedy, batch 1)")
    ax.legend(fontsize=8)


def _speedup_vs_batch(a1, a2, bt: dict) -> None:
    by = bt["by_batch_size"]
    bs = sorted(int(b) for b in by)
    for i, m in enumerate(("ar", "fixed", "budget", "ngram_fixed", "ngram_budget")):
        if not all(m in by[str(b)] for b in bs):
            continue
        ngram = m in ("ngram_fixed", "ngram_budget")      # result keys of the batching section
        label = m.replace("_", " ") if ngram else (m if m == "ar" else f"{bt['drafter']} {m}")
        style = "s--" if ngram else "o-"
        a1.plot(bs, [by[str(b)][m]["tokens_per_s"] for b in bs], style, color=f"C{i}", label=label)
        if m != "ar":
            a2.plot(bs, [by[str(b)][m]["speedup"] for b in bs], style, color=f"C{i}", label=label)
    if all("ar_again" in by[str(b)] for b in bs):
        a2.plot(bs, [by[str(b)]["ar_again"]["speedup"] for b in bs], "x:", color="gray", label="AR again (noise)")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch size")
        a.legend(fontsize=8)
    a1.set_ylabel("tokens/s")
    a2.set_ylabel("speedup over autoregressive")
    a2.axhline(1.0, color="gray", lw=0.8)
    a1.set_title("throughput vs batch size")
    a2.set_title(f"speedup vs batch size (K={bt['draft_length']})")


def _acceptance_per_position(ax, cats: dict, main: str) -> None:
    for cat in CATEGORIES:
        acc = cats[cat].get(main, {}).get("acceptance_rate_per_position", [])
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, "o-", label=cat)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(drafts 0..i all accepted)")
    ax.set_title(f"acceptance per position ({main} drafter, greedy)")
    ax.legend(fontsize=8)


def _speedup_per_category(ax, cats: dict) -> None:
    drafters = [m for m in cats[CATEGORIES[0]] if m != "ar"]
    w = 0.8 / max(len(drafters), 1)
    for i, m in enumerate(drafters):
        ax.bar([j + i * w for j in range(len(CATEGORIES))], [cats[c][m]["speedup"] for c in CATEGORIES],
               width=w, label=m)
    ax.set_xticks([j + w * (len(drafters) - 1) / 2 for j in range(len(CATEGORIES))])
    ax.set_xticklabels(CATEGORIES)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("speedup over autoregressive")
    ax.set_title("speedup per prompt category (greedy, batch 1)")
    ax.legend(fontsize=8)


def _expected_accepted(ax, ks: dict) -> None:
    e = ks["expected_accepted"]
    kk = sorted(int(k) for k in e)
    ax.plot(kk, [e[str(k)]["measured"] for k in kk], "o-", label="measured")
    ax.plot(kk, [e[str(k)]["formula_iid"] for k in kk], "s--", label=f"sum r^i (r={ks['r']:.2f})")
    ax.plot(kk, [e[str(k)]["formula_per_position"] for k in kk], "^:", label="sum of measured survival rates")
    ax.set_xlabel("K")
    ax.set_ylabel("mean accepted drafts per step")
    ax.legend(fontsize=8)
    ax.set_title("expected accepted tokens: formula vs measured")


def write_plots(res: dict, out: Path) -> list[str]:
    """The figures of the sections present in ``res`` (JSON form: string keys); their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)

    ks, bt, cats = res.get("k_sweep"), res.get("batch"), res.get("categories")
    if ks:
        fig, ax = plt.subplots(figsize=(6, 4))
        _speedup_vs_k(ax, ks)
        save(fig, "speedup_vs_k.png")
    if bt:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        _speedup_vs_batch(a1, a2, bt)
        save(fig, "speedup_vs_batch.png")
    if cats:
        fig, ax = plt.subplots(figsize=(6, 4))
        _acceptance_per_position(ax, cats, res["meta"]["main_drafter"])
        save(fig, "acceptance_per_position.png")
        fig, ax = plt.subplots(figsize=(7, 4))
        _speedup_per_category(ax, cats)
        save(fig, "speedup_per_category.png")
    if ks:
        fig, ax = plt.subplots(figsize=(6, 4))
        _expected_accepted(ax, ks)
        save(fig, "expected_accepted.png")
    return files


def plot_cost_curve(res: dict, out: Path) -> None:
    """cost_curve.png: target step time vs tokens verified, one line per batch size (skipped
    without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for B, e in res["by_batch"].items():
        tt = e["target_step_s"]
        ax.plot([int(t) for t in tt], [v / tt["1"] for v in tt.values()], "o-", label=f"batch {B}")
    ax.set_xlabel("tokens verified per request")
    ax.set_ylabel("target step time / 1-token step")
    ax.set_title("verification cost curve")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "cost_curve.png", dpi=110)
    plt.close(fig)
