"""The GPU panel's HTML, rendered from `engine.workers.gpus.snapshot(..., history=True)`: pure, no I/O.

Per GPU a card: a stacked memory bar (our weights / activations / other processes / free), the
utilisation, what the GPU holds (components or block ranges), which job and step it runs, and a
small memory-over-time plot as inline SVG (no script: Gradio inserts this with innerHTML, and the
page's timer re-renders it). Every text that comes from elsewhere (GPU names, worker states, job
ids, placement text) is escaped.
"""

from __future__ import annotations

from html import escape

from imgedit.planning.families import FAMILIES
from imgedit.protocol import Progress, as_ran

GIB_PER_MIB = 1 / 1024
# (key in a GPU's reading, label, colour); the bar and the plot use the same colours.
SEGMENTS = (
    ("weights_mib", "our weights", "#2563eb"),
    ("activations_mib", "activations", "#f59e0b"),
    ("other_mib", "other processes", "#9ca3af"),
    ("free_mib", "free", "#e5e7eb"),
)
PLOT_W, PLOT_H = 300, 56  # the SVG's own units; it is drawn at the card's width
STYLE = """<style>
.gpu-panel{font-size:13px;line-height:1.4;max-width:100%}
.gpu-panel .gp-grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(100%,300px),1fr));
 gap:10px}
.gpu-panel .gp-card{border:1px solid var(--border-color-primary,#d1d5db);border-radius:8px;padding:8px 10px;
 min-width:0;background:var(--block-background-fill,transparent)}
.gpu-panel .gp-head{display:flex;justify-content:space-between;align-items:baseline;gap:4px 10px;
 flex-wrap:wrap}
.gpu-panel .gp-name{color:var(--body-text-color-subdued,#6b7280);overflow-wrap:anywhere}
.gpu-panel .gp-util{white-space:nowrap;font-variant-numeric:tabular-nums}
.gpu-panel .gp-meter{display:inline-block;width:48px;height:6px;border-radius:3px;background:#e5e7eb;
 vertical-align:middle;margin-left:4px;overflow:hidden}
.gpu-panel .gp-meter span{display:block;height:100%;background:#10b981}
.gpu-panel .gp-bar{display:flex;height:16px;border-radius:4px;overflow:hidden;margin:6px 0 4px;
 background:#e5e7eb}
.gpu-panel .gp-seg{display:block;height:100%;flex:none}
.gpu-panel .gp-legend{display:flex;flex-wrap:wrap;gap:0 12px;font-size:12px;font-variant-numeric:tabular-nums}
.gpu-panel .gp-key{display:inline-block;width:9px;height:9px;border-radius:2px;margin-right:4px}
.gpu-panel ul.gp-holds{display:flex;flex-wrap:wrap;gap:4px;list-style:none;padding:0;margin:6px 0 4px}
.gpu-panel ul.gp-holds li{background:var(--background-fill-secondary,#f3f4f6);border-radius:10px;
 padding:0 8px;font-size:12px;overflow-wrap:anywhere;margin:0;list-style:none}
.gpu-panel ul.gp-holds li::before,.gpu-panel ul.gp-holds li::marker{content:none}
.gpu-panel ul.gp-holds li.gp-empty{background:none;padding:0;color:var(--body-text-color-subdued,#6b7280)}
.gpu-panel .gp-run{margin:2px 0;overflow-wrap:anywhere}
.gpu-panel .gp-progress{display:block;height:4px;border-radius:2px;background:#e5e7eb;overflow:hidden;
 margin-top:2px}
.gpu-panel .gp-progress span{display:block;height:100%;background:#2563eb}
.gpu-panel .gp-plot{display:block;width:100%;height:56px;margin-top:6px;border-radius:4px;background:#f9fafb}
.gpu-panel .gp-axis{display:flex;justify-content:space-between;font-size:11px;
 color:var(--body-text-color-subdued,#6b7280)}
.gpu-panel .gp-none,.gpu-panel .gp-worker{margin:2px 0;overflow-wrap:anywhere}
.gpu-panel .gp-foot{display:block;margin-top:6px;font-size:12px;color:var(--body-text-color,#1f2937);
 opacity:.85;overflow-wrap:anywhere}
</style>"""


def _gib(mib: float) -> str:
    return f"{mib * GIB_PER_MIB:.1f} GiB"


def bar_segments(gpu: dict) -> list[tuple[str, str, float, float]]:
    """(class, label, MiB, percent of the GPU's memory) per bar segment; the percents add up to 100
    (free takes what rounding leaves)."""
    total = gpu["total_mib"]
    out, taken = [], 0.0
    for key, label, _ in SEGMENTS[:-1]:
        pct = round(100 * gpu.get(key, 0.0) / total, 2) if total > 0 else 0.0
        pct = min(pct, round(100 - taken, 2))
        taken = round(taken + pct, 2)
        out.append((key[:-4], label, gpu.get(key, 0.0), pct))
    out.append(("free", "free", gpu.get("free_mib", 0.0), round(100 - taken, 2)))
    return out


def _bar(gpu: dict) -> str:
    segments = bar_segments(gpu)
    colours = {key[:-4]: colour for key, _, colour in SEGMENTS}
    spans = "".join(
        f'<span class="gp-seg gp-{cls}" style="width:{pct:.2f}%;background:{colours[cls]}" '
        f'title="{escape(label)}: {_gib(mib)}"></span>' for cls, label, mib, pct in segments)
    summary = ", ".join(f"{label} {_gib(mib)}" for _, label, mib, _ in segments)
    legend = "".join(
        f'<span><i class="gp-key" style="background:{colours[cls]}"></i>{escape(label)} {_gib(mib)}</span>'
        for cls, label, mib, _ in segments)
    source = {"measured": "weights as measured after loading", "planned": "weights as planned"}.get(
        gpu.get("weights_source") or "", "")
    note = f' title="{escape(source)}"' if source else ""
    return (f'<div class="gp-bar" role="img" aria-label="GPU {int(gpu["index"])} memory: {escape(summary)}">'
            f'{spans}</div><div class="gp-legend"{note}>{legend}</div>')


def _runs(gpu: dict, workers: list[dict]) -> str:
    """What each worker on this GPU is doing: a busy one its job and step (with a progress bar), an
    idle one just "idle"."""
    device = f"cuda:{int(gpu['index'])}"
    lines = []
    for w in workers:
        if device not in w["devices"]:
            continue
        name = escape(w["name"])
        if w["state"] == "busy" and w.get("job_id"):
            done = Progress.read(w)
            progress = (f'<span class="gp-progress"><span style="width:{100 * done.fraction:.1f}%">'
                        '</span></span>')
            doing = done.text(before="preparing (encoding the prompt and images)")
            lines.append(f'<div class="gp-run gp-busy">{name}: running {escape(w["job_id"])} — {doing}'
                         f'{progress}</div>')
        else:
            lines.append(f'<div class="gp-run gp-{escape(w["state"])}">{name}: {_state_text(w)}</div>')
    return "".join(lines) or '<div class="gp-run">nothing of ours runs here</div>'


def _readiness(data: dict) -> str:
    """The panel's first line: the same readiness /health reports."""
    if data.get("ready"):
        return "ready"
    if any(w["state"] == "failed" for w in data["workers"]):
        return "not ready: a worker failed (see /health)"
    return "loading the model"


BANNER_STYLE = """<style>
.server-banner{padding:6px 10px;border-radius:6px;margin:2px 0;font-size:14px}
.banner-info{background:#eff6ff;color:#1e3a8a}.banner-warn{background:#fffbeb;color:#92400e}
.banner-error{background:#fef2f2;color:#991b1b}
</style>"""


def banner_html(data: dict) -> str:
    """One line above the page's form while something is not as it should be: the model still loading
    (and what it is doing), a worker that could not load (why), or an optimisation that failed to build
    and what runs instead. Empty when the server is ready with every mode it was asked for."""
    lines = []
    for w in data["workers"]:
        if w["state"] == "failed":
            lines.append(("error", f'{w["name"]} could not load: {w.get("error") or "see the server log"}'))
        elif w["state"] in ("loading", "restarting") and not data.get("ready"):
            lines.append(("info", f'Loading the model — {w["name"]}: {w.get("detail") or w["state"]}'))
        lines.extend(("warn", f'{w["name"]}: {why}') for why in w.get("fallbacks") or ())
    if not lines:
        return ""
    return BANNER_STYLE + "".join(f'<div class="server-banner banner-{kind}">{escape(text)}</div>'
                                  for kind, text in lines)


def _state_text(w: dict) -> str:
    state = escape(w["state"])
    if w["state"] in ("failed", "restarting") and (w.get("error") or w.get("detail")):
        return f'{state} — {escape(w.get("error") or w.get("detail") or "")}'
    if w["state"] == "loading" and w.get("detail"):
        return f'{state} — {escape(w["detail"])}'
    return state


def _plot(gpu: dict, window_s: float, interval_s: float) -> str:
    """Stacked areas (weights, activations, other) over the last `window_s` seconds, scaled to the
    GPU's memory. A pause in the readings (no page open) leaves a gap instead of a straight line."""
    history = gpu.get("history") or []
    axis = (f'<div class="gp-axis"><span>{window_s / 60:.0f} min ago</span>'
            f'<span>{_peak(history)}</span><span>now</span></div>')
    if not history:
        return ('<svg class="gp-plot" role="img" aria-label="no memory readings yet" '
                f'viewBox="0 0 {PLOT_W} {PLOT_H}" preserveAspectRatio="none"></svg>{axis}')
    runs, run = [], [history[0]]
    for sample in history[1:]:
        if run[-1][0] - sample[0] > 3 * interval_s:
            runs.append(run)
            run = []
        run.append(sample)
    runs.append(run)
    colours = [colour for _, _, colour in SEGMENTS[:-1]]
    shapes = []
    for run in runs:
        if len(run) == 1:  # one reading: draw it one interval wide
            age, *rest = run[0]
            run = [[age + interval_s, *rest], run[0]]
        xs = [PLOT_W * (1 - min(age, window_s) / window_s) for age, *_ in run]
        lows = [0.0] * len(run)
        for layer in range(3):
            highs = [low + s[1 + layer] for low, s in zip(lows, run, strict=True)]
            top = [f"{x:.1f},{_y(h, s[4]):.1f}" for x, h, s in zip(xs, highs, run, strict=True)]
            bottom = [f"{x:.1f},{_y(lo, s[4]):.1f}" for x, lo, s in zip(xs, lows, run, strict=True)]
            shapes.append(f'<polygon class="gp-area" points="{" ".join(top + bottom[::-1])}" '
                          f'fill="{colours[layer]}"/>')
            lows = highs
    label = f"GPU {int(gpu['index'])} memory over the last {window_s / 60:.0f} minutes"
    return (f'<svg class="gp-plot" role="img" aria-label="{escape(label)}" viewBox="0 0 {PLOT_W} {PLOT_H}" '
            f'preserveAspectRatio="none">{"".join(shapes)}</svg>{axis}')


def _y(mib: float, total: float) -> float:
    return PLOT_H * (1 - min(mib, total) / total) if total > 0 else PLOT_H


def _peak(history: list) -> str:
    if not history:
        return "no readings yet"
    peak = max(s[1] + s[2] for s in history)
    return f"ours at most {_gib(peak)}"


def _card(gpu: dict, workers: list[dict], window_s: float, interval_s: float) -> str:
    util = gpu.get("utilization_percent")
    util_text = "util n/a" if util is None else f"util {util:.0f}%"
    meter = ("" if util is None
             else f'<span class="gp-meter"><span style="width:{min(100.0, util):.0f}%"></span></span>')
    used = f'{gpu["used_mib"] * GIB_PER_MIB:.1f} / {gpu["total_mib"] * GIB_PER_MIB:.1f} GiB'
    holds = "".join(f"<li>{escape(h)}</li>" for h in gpu.get("holds") or ())
    holds = holds or '<li class="gp-empty">nothing of ours</li>'
    return (f'<section class="gp-card gpu" data-index="{int(gpu["index"])}">'
            f'<div class="gp-head"><span><b>GPU {int(gpu["index"])}</b> '
            f'<span class="gp-name">{escape(gpu["name"])}</span></span>'
            f'<span class="gp-util">{used} · {util_text}{meter}</span></div>'
            f'{_bar(gpu)}<ul class="gp-holds">{holds}</ul>{_runs(gpu, workers)}'
            f'{_plot(gpu, window_s, interval_s)}</section>')


def _worker_line(w: dict) -> str:
    busy = w["state"] == "busy" and w.get("job_id")
    step = ""
    if busy:
        step = f' — {escape(w["job_id"])} {Progress.read(w).text()}'
    node = f' (Ray node {escape(w["node"][:8])})' if w.get("node") else ""
    why = ""
    if w["state"] in ("failed", "restarting"):
        why = f' — {escape(w.get("error") or w.get("detail") or "")}'
    return (f'<p class="gp-worker">{escape(w["name"])} on {escape(", ".join(w["devices"]))}{node}: '
            f'{escape(w["state"])}{step}{why}</p>')


def panel_html(data: dict) -> str:
    """The whole panel. Without GPUs: one line saying so, then one line per worker with its state."""
    window_s = float(data.get("history_window_s") or 300)
    interval_s = float(data.get("history_interval_s") or 2)
    workers = data["workers"]
    remote = any(w.get("node") for w in workers)  # WORKERS=ray: the workers' GPUs are on other machines
    parts = [STYLE, '<div class="gpu-panel">', f'<p class="gpu-ready"><b>{_readiness(data)}</b></p>']
    if not data["gpus"]:
        parts.append(f'<p class="gp-none">{escape(data.get("message") or "")}</p>')
    if not data["gpus"] or remote:
        parts.extend(_worker_line(w) for w in workers)
    if data["gpus"]:
        local = [] if remote else workers
        parts.append('<div class="gp-grid">')
        parts.extend(_card(g, local, window_s, interval_s) for g in data["gpus"])
        parts.append("</div>")
    if data.get("loras"):
        names = ", ".join(lora["name"] + (f' (Lightning {n}-step)' if (n := lora["lightning_steps"]) else "")
                          for lora in data["loras"])
        parts.append(f'<small class="gp-foot gpu-loras">LoRAs loaded: {escape(names)}</small>')
    for w in workers:  # optimisations that failed to build, and what runs instead
        parts.extend(f'<small class="gp-foot gp-fallback">{escape(w["name"])}: {escape(why)}</small>'
                     for why in w.get("fallbacks") or ())
    for w in workers:  # each component's dtype/quantization and where it lives
        if line := components_line(w.get("components")):
            if w.get("encode_cache"):
                line += f'; encode cache: {int(w["encode_cache"])} inputs'
            if w.get("fast_weights") not in (None, "", "none"):
                line += f'; fast mode on {w["fast_weights"]}'
            if w.get("cpu_threads"):
                line += f'; {int(w["cpu_threads"])} CPU threads'
            if w.get("under_cap"):
                line += "; under the memory cap: " + ", ".join(w["under_cap"])
            if w.get("features"):
                line += "; features: " + ", ".join(w["features"])
            if w.get("phases"):
                phases = w["phases"].items()
                line += "; start-up: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases)
            parts.append(f'<small class="gp-foot worker-weights">{escape(w["name"])} weights: '
                         f'{escape(line)}</small>')
    if line := defaults_line(data.get("family"), data.get("defaults")):
        parts.append(f'<small class="gp-foot model-defaults">{escape(line)}</small>')
    parts.append(f'<small class="gp-foot">placement: {escape(str(data.get("placement_mode", "")))} — '
                 f'{escape(str(data.get("placement_reason", "")))}; '
                 f'CACHE: {escape(str(data.get("cache", "none")))}'
                 f'; ATTENTION: {escape(str(data.get("attention", "native")))}'
                 f'; compile: {escape(str(data.get("compile_mode", "off")))}'
                 f'; FAST_QUANTIZE: {escape(str(data.get("fast_quantize", "none")))}'
                 f'; waiting: {int(data.get("waiting") or 0)}'
                 + (f'; batch items not yet done: {int(data["batch_items"])}'
                    if data.get("batch_items") else "")
                 + '</small>')
    parts.append("</div>")
    return "".join(parts)


def defaults_line(family: str | None, defaults: dict | None) -> str:
    """The model's defaults as the panel says them: "model: Qwen-Image-2.1 — 40 steps, CFG off, ..."."""
    if not defaults or family not in FAMILIES:
        return ""
    ran = as_ran(defaults)  # the names the pipeline gets them by
    cfg = ran["true_cfg_scale"]
    parts = [f'{ran["steps"]} steps', "CFG off" if cfg <= 1 else f"CFG {cfg:g}",
             f'up to {defaults["max_images"]} input image(s)']
    if defaults.get("text_to_image"):
        parts.append("text to image without one")
    if defaults.get("output_resolution"):
        parts.append(f'{defaults["output_resolution"]}² output by default')
    if defaults.get("transparency"):
        parts.append("keeps transparency")
    return f"model: {FAMILIES[family].model} — " + ", ".join(parts)


def components_line(components: dict[str, dict] | None) -> str:
    """One short line for the panel (from a worker's status data: transformer fp8 @ GPU 0 + CPU
    (streamed); ..."""
    if not components:
        return ""
    parts = []
    for name, c in components.items():
        quant = c["quantization"].split(":")[0] if c["quantization"] != "none" else c["dtype"]
        parts.append(f"{name} {quant} @ {c['location']}")
    return "; ".join(parts)
