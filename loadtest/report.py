"""Reports of a load test: the JSON result as is, a Markdown summary and PNG plots.

`markdown(result)` is a pure function of the result dict; `plot(result, path)` draws throughput
and latency against load, one line per mode; `write_reports` writes all three next to each other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadtest.metrics import BASELINE, RequestRecord, paired_speedups, percentile


def mode_label(mode: str) -> str:
    if mode == "0":
        return "k = 0 (plain decoding)"
    return "auto" if mode == "auto" else f"k = {mode}"


def _f(value: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}"


def _ratio(value: float | None, base: float | None) -> str:
    return "–" if not value or not base else f"{value / base:.2f}"


def _by_load(result: dict) -> dict[str, dict[str, dict]]:
    """{load label: {mode: run}} in run order."""
    out: dict[str, dict[str, dict]] = {}
    for run in result["runs"]:
        out.setdefault(run["load"], {})[run["mode"]] = run
    return out


def _k_share(spec: dict, top: int = 4) -> str:
    dist = {int(k): v for k, v in spec.get("k_distribution", {}).items()}
    total = sum(dist.values())
    if not total:
        return "–"
    ranked = sorted(dist.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    return ", ".join(f"{k}: {100 * v / total:.0f} %" for k, v in sorted(ranked))


def headline_rows(result: dict, load: str | None = None) -> list[dict[str, Any]]:
    """The compact comparison at one load (default: the first): one row per mode."""
    table = _by_load(result)
    load = load or next(iter(table))
    runs = table[load]
    base = runs.get(BASELINE, {}).get("summary", {}).get("output_throughput")
    rows = []
    for mode, run in runs.items():
        s = run["summary"]
        rows.append({"mode": mode, "load": load, "output_throughput": s["output_throughput"],
                     "vs_k0": s["output_throughput"] / base if base and s["output_throughput"] else None,
                     "paired_vs_k0": (s.get("paired_vs_k0") or {}).get("median"),
                     "request_tok_s_median": s["request_output_throughput"]["median"],
                     "ttft_median": s["ttft"]["median"], "tpot_median": s["tpot"]["median"],
                     "acceptance_rate": s["speculation"]["acceptance_rate"],
                     "tokens_per_round": s["speculation"]["mean_accepted_length"],
                     "completed": s["completed"], "failed": s["failed"]})
    return rows


def headline_table(result: dict, load: str | None = None) -> str:
    lines = ["| mode | output tok/s | × k = 0 | paired × k = 0 (median) | median request tok/s | TTFT median (s) "
             "| TPOT median (ms) | acceptance | tokens/round |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in headline_rows(result, load):
        name = mode_label(r["mode"])
        if r["mode"] == "auto":
            name = f"**{name}**"
        lines.append(f"| {name} | {_f(r['output_throughput'])} | {_f(r['vs_k0'])} | {_f(r['paired_vs_k0'])} "
                     f"| {_f(r['request_tok_s_median'])} "
                     f"| {_f(r['ttft_median'])} | {_f(r['tpot_median'], 0, 1e3)} | {_f(r['acceptance_rate'])} "
                     f"| {_f(r['tokens_per_round'])} |")
    return "\n".join(lines)


def load_table(result: dict) -> str:
    lines = ["| load | mode | done / failed | req/s | output tok/s | × k = 0 | paired × | goodput req/s "
             "| TTFT med / p90 / p99 (s) | TPOT med / p90 (ms) | ITL med / p99 (ms) | chunk ITL med (ms) "
             "| E2EL med / p90 / p99 (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for load, runs in _by_load(result).items():
        base = runs.get(BASELINE, {}).get("summary", {}).get("output_throughput")
        for mode, run in runs.items():
            s = run["summary"]
            t, p, i, c, e = s["ttft"], s["tpot"], s["itl"], s["chunk_itl"], s["e2el"]
            lines.append(
                f"| {load} | {mode_label(mode)} | {s['completed']} / {s['failed']} | {_f(s['request_throughput'], 3)} "
                f"| {_f(s['output_throughput'])} | {_ratio(s['output_throughput'], base)} "
                f"| {_f((s.get('paired_vs_k0') or {}).get('median'))} | {_f(s['goodput'], 3)} "
                f"| {_f(t['median'])} / {_f(t['p90'])} / {_f(t['p99'])} "
                f"| {_f(p['median'], 0, 1e3)} / {_f(p['p90'], 0, 1e3)} "
                f"| {_f(i['median'], 0, 1e3)} / {_f(i['p99'], 0, 1e3)} | {_f(c['median'], 0, 1e3)} "
                f"| {_f(e['median'])} / {_f(e['p90'])} / {_f(e['p99'])} |")
    return "\n".join(lines)


def speculation_table(result: dict) -> str:
    lines = ["| load | mode | acceptance | tokens/round | k run (share of rounds) | mean k | rounds at k = 0 "
             "| fallback rounds |",
             "|---|---|---|---|---|---|---|---|"]
    for load, runs in _by_load(result).items():
        for mode, run in runs.items():
            sp = run["summary"]["speculation"]
            observed = sp["rounds_observed"]
            k0 = f"{sp['k0_rounds']} / {observed}" if observed else "–"
            lines.append(f"| {load} | {mode_label(mode)} | {_f(sp['acceptance_rate'])} "
                         f"| {_f(sp['mean_accepted_length'])} | {_k_share(sp)} | {_f(sp['k_mean'])} | {k0} "
                         f"| {sp['fallback_rounds']} |")
    return "\n".join(lines)


def kind_table(result: dict) -> str:
    """Paired × k = 0 (median over requests) per workload kind: where each mode pays."""
    records = [RequestRecord.from_json(r) for r in result.get("records", [])]
    kinds = sorted({r.kind for r in records})
    lines = ["| load | mode | " + " | ".join(kinds) + " |", "|---|---|" + "---|" * len(kinds)]
    for load, runs in _by_load(result).items():
        base = [r for r in records if r.load == load and r.mode == BASELINE]
        if not base:
            continue
        for mode in runs:
            if mode == BASELINE:
                continue
            cells = []
            for kind in kinds:
                ratios = paired_speedups([r for r in base if r.kind == kind],
                                         [r for r in records if r.load == load and r.mode == mode and r.kind == kind])
                cells.append(f"{percentile(ratios, 50):.2f} ({len(ratios)})" if ratios else "–")
            lines.append(f"| {load} | {mode_label(mode)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def first_vs_rest_table(result: dict) -> str:
    """Shared-system runs: the TTFT of each phase's first request (cold shared prefix) against the rest."""
    lines = ["| load | mode | first request TTFT (s, median over phases) | later requests TTFT median (s) "
             "| first ÷ later | requests (first / later) |",
             "|---|---|---|---|---|---|"]
    for load, runs in _by_load(result).items():
        for mode, run in runs.items():
            s = run["summary"]
            if "ttft_first_s" not in s:
                continue
            first, rest = s["ttft_first_s"], s["ttft_rest_median_s"]
            lines.append(f"| {load} | {mode_label(mode)} | {_f(first, 3)} | {_f(rest, 3)} | {_ratio(first, rest)} "
                         f"| {s['ttft_first_count']} / {s['ttft_rest_count']} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def turn_table(result: dict) -> str:
    """Multi-turn runs: median prompt tokens and TTFT per turn (later turns carry the history)."""
    records = [RequestRecord.from_json(r) for r in result.get("records", [])]
    turns = sorted({r.turn for r in records})
    if len(turns) < 2:
        return ""
    lines = ["| load | mode | " + " | ".join(f"turn {t + 1}: prompt tokens / TTFT (s)" for t in turns) + " |",
             "|---|---|" + "---|" * len(turns)]
    for load, runs in _by_load(result).items():
        for mode in runs:
            cells = []
            for t in turns:
                mine = [r for r in records if r.load == load and r.mode == mode and r.turn == t and r.ok]
                tokens = percentile([r.prompt_tokens for r in mine], 50) if mine else None
                ttfts = [r.ttft for r in mine if r.ttft is not None]
                cells.append(f"{_f(tokens, 0)} / {_f(percentile(ttfts, 50) if ttfts else None, 3)} ({len(mine)})")
            lines.append(f"| {load} | {mode_label(mode)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def failures_line(result: dict) -> str:
    total: dict[str, int] = {}
    for run in result["runs"]:
        for status, n in run["summary"]["failures"].items():
            total[status] = total.get(status, 0) + n
    if not total:
        return "Failures: none."
    return "Failures by status: " + ", ".join(f"{k} × {v}" for k, v in sorted(total.items())) + "."


def chaos_section(chaos: dict) -> str:
    rec, out = chaos["recovery_s"], chaos["outage_s"]
    lines = [
        f"## Chaos: the draft SIGKILLed every {chaos['every_s']:g} s of its uptime and restarted",
        "",
        f"- kills: {chaos['kills']}, restarts healthy: {chaos['restarts_healthy']}, "
        f"speculation resumed after: {chaos['recovered']}",
        f"- client-visible errors: {chaos['errors']}" + (f" ({chaos['failures']})" if chaos["failures"] else ""),
        f"- rounds that fell back to k = 0 (draft_fallback): {chaos['fallback_rounds']}",
        f"- recovery (new draft healthy → first round that speculated again): median {_f(rec['median'])} s, "
        f"max {_f(rec['max'])} s; outage (kill → speculation again): median {_f(out['median'])} s, "
        f"max {_f(out['max'])} s",
        "",
        "| kill at (s) | healthy at (s) | resumed at (s) | recovery (s) | fallback rounds | error |",
        "|---|---|---|---|---|---|",
    ]
    for e in chaos["events"]:
        lines.append(f"| {_f(e['killed_at'], 1)} | {_f(e['healthy_at'], 1)} | {_f(e['resumed_at'], 1)} "
                     f"| {_f(e['recovery_s'])} | {e['fallback_rounds']} | {e['error'] or '–'} |")
    return "\n".join(lines)


DEFINITIONS = """\
Definitions (vLLM `bench serve` / GuideLLM): TTFT from sending a request to its first token;
E2EL from sending to the end of the stream; TPOT = (E2EL − TTFT) / (output tokens − 1); ITL per
token: each gap between streamed chunks divided evenly over the later chunk's tokens (gRPC only;
its mean is TPOT); chunk ITL: one value per chunk gap (what `bench serve` records). Throughput:
completed requests or output tokens over the mode's wall time at that load; goodput: requests
meeting every SLO over the same time. Paired × k = 0: the median, over requests, of a request's
tokens per second of latency over the same request's at k = 0 (same prompt, same block).
Acceptance: accepted / proposed draft tokens; tokens/round: (accepted + rounds) / rounds; k run:
rounds per draft length actually run (a fallback counts at 0).
Percentiles interpolate linearly between closest ranks."""


def markdown(result: dict, command: str = "") -> str:
    cfg = result["config"]
    m = result["machine"]["before"]
    loads = ", ".join(run for run in _by_load(result))
    server = result.get("server") or {}
    slos = ", ".join(f"{k} ≤ {v:g} s" for k, v in cfg["slos"].items()) or "none"
    if cfg["num_requests"]:
        count = str(cfg["num_requests"])
    else:
        count = f"for {cfg['duration_s']:g} s" if cfg["duration_s"] else "12"
    parts = [
        f"# Load test: {', '.join(mode_label(x) for x in cfg['modes'])} side by side ({result['api']})",
        "",
        *([f"Command: `{command}`", ""] if command else []),
        f"- machine: {m['cpus']} CPUs ({m['platform']}), load average {m['loadavg_1m']} before and "
        f"{result['machine']['after']['loadavg_1m']} after (others may share it)",
        f"- server: {server.get('address', '?')}" + _models(server),
        f"- loads: {loads}; requests per mode and load: "
        f"{count}, in interleaved blocks (mode order turning every block); warm-up {cfg['warmup']} per mode",
        f"- workload: {result['workload']['items']} prompts ({', '.join(result['workload']['kinds'])}), "
        f"max_tokens {cfg['max_tokens']}, temperature {cfg['temperature']:g}"
        + (f", inputs set to {cfg['input_words']} words" if cfg["input_words"] is not None else "")
        + f", seed {cfg['seed']}",
        f"- SLOs for goodput: {slos}",
        f"- outputs offered to the suffix drafts' corpus: {_sharing(result)}",
        f"- wall time {result['wall_s']:.0f} s",
        "",
        f"## At {next(iter(_by_load(result)))}",
        "",
        headline_table(result),
        "",
        "## Throughput and latency against load",
        "",
        load_table(result),
        "",
        failures_line(result),
        "",
        "## Speculation",
        "",
        speculation_table(result),
        "",
    ]
    kinds = kind_table(result)
    if kinds:
        parts += ["## Paired × k = 0 by workload kind (median over requests; how many in brackets)", "", kinds, ""]
    shared = first_vs_rest_table(result)
    if shared:
        parts += ["## Shared system prompt: the first request of each phase against the later ones", "",
                  "The system prompt is new to every phase: its first request computes it, the later ones may "
                  "find it in the prefix cache (at concurrency > 1 the first few start together).", "", shared, ""]
    turns = turn_table(result)
    if turns:
        parts += ["## Multi-turn sessions: median per turn (completed requests in brackets)", "", turns, ""]
    if result.get("chaos"):
        parts += [chaos_section(result["chaos"]), ""]
    parts += [DEFINITIONS, ""]
    return "\n".join(parts)


def _sharing(result: dict[str, Any]) -> str:
    shared = result.get("shared_outputs")
    if shared is None:  # a result written before the loadtest planned sharing
        return "every request's (the server's setting)"
    if not shared:
        return "none (the run's sends were not known ahead, or it shared none)"
    return (f"{shared} requests', each the last send of its prompt, so no request drafted from an answer to its own "
            "prompt (when the server shares outputs)")


def _models(server: dict) -> str:
    """"(target: NAME float32; draft: NAME ngram)" from GetStatus, or the HTTP API's model."""
    names = [f"{b.get('role', '?')}: {b.get('model', '?')} {b.get('kind') or ''} {b.get('dtype') or ''}".rstrip()
             for b in server.get("backends", []) or []]
    if server.get("default_draft_length"):
        names.append(f"default draft length {server['default_draft_length']}")
    if server.get("model"):
        names.append(f"model: {server['model']}")
    return f" ({'; '.join(names)})" if names else ""


def plot(result: dict, path: str | Path) -> None:
    """Throughput and latency against load, one line per mode (median solid, p90 dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    kind = runs[0]["load_kind"] if runs else "concurrency"
    xlabel = "concurrency (closed loop)" if kind == "concurrency" else "request rate, req/s (open loop)"
    panels = [
        ("output token throughput (tok/s)", [("output_throughput", None, "-")]),
        ("request throughput and goodput (req/s)", [("request_throughput", None, "-"), ("goodput", None, ":")]),
        ("TTFT (s)", [("ttft", "median", "-"), ("ttft", "p90", "--")]),
        ("TPOT (ms)", [("tpot", "median", "-"), ("tpot", "p90", "--")]),
        ("end-to-end latency (s)", [("e2el", "median", "-"), ("e2el", "p90", "--")]),
        ("tokens per round", [("speculation", "mean_accepted_length", "-")]),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, series) in zip(axes.flat, panels):
        for mi, mode in enumerate(modes):
            mine = [r for r in runs if r["mode"] == mode]
            xs = [r["load_value"] for r in mine]
            for key, sub, style in series:
                ys = []
                for r in mine:
                    v = r["summary"][key]
                    v = v.get(sub) if isinstance(v, dict) else v
                    if v is not None and title.startswith("TPOT"):
                        v *= 1e3
                    ys.append(v)
                if all(y is None for y in ys):
                    continue
                label = mode_label(mode) + ("" if style == "-" else f" ({sub or key})")
                ax.plot(xs, [float("nan") if y is None else y for y in ys], style, marker="o",
                        color=colours[mi % len(colours)], label=label)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_xticks(sorted({r["load_value"] for r in runs}))
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    axes.flat[2].legend(fontsize=7)
    fig.suptitle(f"specdec load test ({result['api']}): medians solid, p90 dashed, goodput dotted")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_reports(result: dict, out_prefix: str | Path, *, command: str = "", plots: bool = True) -> dict[str, Path]:
    """`<prefix>.json`, `<prefix>.md` and (with plots) `<prefix>.png`; returns the paths."""
    prefix = Path(out_prefix)
    if prefix.suffix in (".json", ".md", ".png"):
        prefix = prefix.with_suffix("")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = {"json": prefix.with_name(prefix.name + ".json"), "md": prefix.with_name(prefix.name + ".md")}
    result = {**result, "command": command}
    paths["json"].write_text(json.dumps(result, indent=1, default=str) + "\n")
    paths["md"].write_text(markdown(result, command))
    if plots:
        paths["png"] = prefix.with_name(prefix.name + ".png")
        plot(result, paths["png"])
    return paths
