"""The silence map, rendered: a PNG heat map (layers x channels) and a self-contained
interactive HTML page around it (no network: the PNG and the data are inlined).

Layout: one band of `ROW_PX` pixel rows per layer; MLP channels from the left, then a `GAP`
pixel gap, then attention channels. Colour is log10 mean |a| (dark blue = quiet, yellow =
loud); confirmed silent channels are red, flagged but unconfirmed ones (protected layers or a
rejected ablation) orange, bias-like channels magenta.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import zlib
from typing import Any

import numpy as np
import torch

from sparse_engine.compression.silence import ChannelSet, ChannelSite, SilenceMap

ROW_PX, GAP = 6, 8
LOG_MIN, LOG_SPAN = -8.0, 12.0  # series quantisation: log10 |a| in [-8, 4] over 0..255
SILENT, FLAGGED, BIAS, EMPTY = (230, 20, 20), (255, 150, 0), (255, 0, 255), (40, 40, 40)
# A viridis-like ramp, interpolated linearly.
RAMP = np.array(
    [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)], dtype=float
)


def widths(smap: SilenceMap) -> tuple[int, int]:
    return max(lm.mlp.size for lm in smap.layers), max(lm.attn.size for lm in smap.layers)


def png_size(smap: SilenceMap) -> tuple[int, int]:
    """(width, height) in pixels of the heat map."""
    mlp, attn = widths(smap)
    return mlp + GAP + attn, ROW_PX * len(smap.layers)


def log_range(smap: SilenceMap) -> tuple[float, float]:
    values = [v for lm in smap.layers for cs in lm.kinds().values() for v in cs.mean if v > 0]
    high = math.log10(max(values)) if values else 0.0
    low = max(math.log10(min(values)), high - 6.0) if values else -6.0
    return low, max(high, low + 1e-6)


def colour_grid(smap: SilenceMap) -> np.ndarray:
    """(layers, width, 3) uint8: one pixel row per layer."""
    mlp_width, _ = widths(smap)
    width, _ = png_size(smap)
    low, high = log_range(smap)
    grid = np.empty((len(smap.layers), width, 3), dtype=np.uint8)
    grid[:] = EMPTY
    for row, lm in enumerate(smap.layers):
        for offset, cs in ((0, lm.mlp), (mlp_width + GAP, lm.attn)):
            grid[row, offset : offset + cs.size] = _colours(cs, low, high)
    return grid


def _colours(cs: ChannelSet, low: float, high: float) -> np.ndarray:
    logs = np.log10(np.maximum(np.asarray(cs.mean, dtype=float), 1e-30))
    scaled = np.clip((logs - low) / (high - low), 0.0, 1.0) * (len(RAMP) - 1)
    base = np.minimum(np.floor(scaled).astype(int), len(RAMP) - 2)
    frac = (scaled - base)[:, None]
    colours = RAMP[base] * (1 - frac) + RAMP[base + 1] * frac
    colours[cs.flagged] = FLAGGED
    colours[cs.silent] = SILENT
    colours[cs.bias_like] = BIAS
    result: np.ndarray = colours.round().astype(np.uint8)
    return result


def render_png(smap: SilenceMap) -> bytes:
    pixels = np.repeat(colour_grid(smap), ROW_PX, axis=0)
    return encode_png(pixels)


def encode_png(pixels: np.ndarray) -> bytes:
    """RGB8 PNG of an (height, width, 3) uint8 array, with zlib and no imaging library."""
    height, width, _ = pixels.shape
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunks = [(b"IHDR", header), (b"IDAT", zlib.compress(raw, 9)), (b"IEND", b"")]
    return b"\x89PNG\r\n\x1a\n" + b"".join(_chunk(tag, data) for tag, data in chunks)


def _chunk(tag: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(tag + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", crc)


def quantise_series(series: torch.Tensor) -> str:
    """(samples, channels) mean |a| -> base64 of uint8 log codes, channel-major."""
    logs = torch.log10(series.float().clamp_min(10**LOG_MIN))
    codes = ((logs - LOG_MIN) / LOG_SPAN * 255).round().clamp(0, 255).to(torch.uint8)
    return base64.b64encode(codes.t().contiguous().numpy().tobytes()).decode("ascii")


def page_data(smap: SilenceMap, series: dict[ChannelSite, torch.Tensor]) -> dict[str, Any]:
    mlp_width, _ = widths(smap)
    data = smap.to_dict()
    data["view"] = {"row_px": ROW_PX, "gap": GAP, "mlp_width": mlp_width}
    data["view"]["log_min"], data["view"]["log_span"] = LOG_MIN, LOG_SPAN
    data["series"] = {f"{u[0]}:{u[1]}": quantise_series(s) for u, s in series.items()}
    data["series_samples"] = {f"{u[0]}:{u[1]}": int(s.shape[0]) for u, s in series.items()}
    return data


def render_html(smap: SilenceMap, series: dict[ChannelSite, torch.Tensor]) -> str:
    png = base64.b64encode(render_png(smap)).decode("ascii")
    payload = json.dumps(page_data(smap, series), separators=(",", ":")).replace("</", "<\\/")
    title = f"Silence map: {smap.model_id} on {smap.corpus}"
    return (
        _PAGE.replace("__TITLE__", _escape(title))
        .replace("__SUMMARY__", _escape(_summary(smap)))
        .replace("__PNG__", png)
        .replace("__DATA__", payload)
    )


def _summary(smap: SilenceMap) -> str:
    ab = smap.ablation
    silent = sum(len(cs.silent) for lm in smap.layers for cs in lm.kinds().values())
    bias = sum(len(cs.bias_like) for lm in smap.layers for cs in lm.kinds().values())
    verdict = "accepted" if ab.accepted else "rejected"
    return (
        f"{smap.samples} samples, {smap.tokens} tokens; {silent} silent channels, {bias} "
        f"bias-like; ablation ({ab.metric}) {ab.dense:.4g} -> {ab.ablated:.4g} "
        f"({ab.change_pct:+.3f}%) {verdict}; protected layers {smap.protected_layers}"
    )


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:13px system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}
#wrap{position:relative;overflow-x:auto;border:1px solid #ccc;background:#282828}
#map{display:block;image-rendering:pixelated;cursor:crosshair}
#tip{position:fixed;pointer-events:none;background:#fff;border:1px solid #888;padding:4px 6px;
white-space:pre;font:12px monospace;display:none}
#chart{border:1px solid #ccc;background:#fff;margin-top:8px}
.key span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;vertical-align:middle}
</style></head><body>
<h2>__TITLE__</h2><p>__SUMMARY__</p>
<p class="key">left: MLP intermediate channels, right: attention output channels; rows: layers.
<span style="background:rgb(230,20,20)"></span>silent
<span style="background:rgb(255,150,0)"></span>flagged, not confirmed
<span style="background:rgb(255,0,255)"></span>bias-like
<span style="background:linear-gradient(90deg,#440154,#21918c,#fde725)"></span>log10 mean |a|</p>
<div id="wrap"><img id="map" src="data:image/png;base64,__PNG__" alt="silence map"></div>
<div id="tip"></div>
<p id="picked">Click a channel to plot its mean |a| over the samples.</p>
<canvas id="chart" width="900" height="220"></canvas>
<script id="data" type="application/json">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const V = D.view, img = document.getElementById("map"), tip = document.getElementById("tip");
const ZOOM = 2;
img.onload = () => { img.style.width = img.naturalWidth * ZOOM + "px";
  img.style.height = img.naturalHeight * ZOOM + "px"; };
function locate(ev) {
  const r = img.getBoundingClientRect();
  const x = Math.floor((ev.clientX - r.left) / ZOOM), y = Math.floor((ev.clientY - r.top) / ZOOM);
  const row = Math.floor(y / V.row_px);
  if (row < 0 || row >= D.layers.length) return null;
  let kind = "mlp", ch = x;
  if (x >= V.mlp_width) { kind = "attn"; ch = x - V.mlp_width - V.gap; }
  const cs = D.layers[row][kind];
  if (ch < 0 || ch >= cs.size) return null;
  return {layer: D.layers[row].layer, kind: kind, ch: ch, cs: cs};
}
function describe(p) {
  const cs = p.cs, has = (list) => list.indexOf(p.ch) >= 0 ? "yes" : "no";
  return `layer ${p.layer} ${p.kind} channel ${p.ch}\\n` +
    `mean |a|        ${cs.mean[p.ch]}\\nstd             ${cs.std[p.ch]}\\n` +
    `signed mean     ${cs.signed_mean[p.ch]}\\nnear-zero share ${cs.near_zero_share[p.ch]}\\n` +
    `silent          ${has(cs.silent)}\\nflagged by rule ${has(cs.flagged)}\\n` +
    `bias-like       ${has(cs.bias_like)}`;
}
img.addEventListener("mousemove", (ev) => {
  const p = locate(ev);
  if (!p) { tip.style.display = "none"; return; }
  tip.textContent = describe(p); tip.style.display = "block";
  tip.style.left = ev.clientX + 14 + "px"; tip.style.top = ev.clientY + 14 + "px";
});
img.addEventListener("mouseleave", () => { tip.style.display = "none"; });
function seriesOf(p) {
  const key = p.layer + ":" + p.kind, n = D.series_samples[key] || 0;
  const bytes = atob(D.series[key] || ""), out = [];
  for (let i = 0; i < n; i++) {
    const code = bytes.charCodeAt(p.ch * n + i);
    out.push(V.log_min + code / 255 * V.log_span);
  }
  return out;
}
img.addEventListener("click", (ev) => {
  const p = locate(ev); if (!p) return;
  const s = seriesOf(p), c = document.getElementById("chart"), g = c.getContext("2d");
  document.getElementById("picked").textContent =
    `layer ${p.layer} ${p.kind} channel ${p.ch}: log10 mean |a| per sample (${s.length} samples)`;
  g.clearRect(0, 0, c.width, c.height);
  if (!s.length) return;
  const lo = Math.min(...s) - 0.5, hi = Math.max(...s) + 0.5, pad = 40;
  const X = (i) => pad + i * (c.width - pad - 10) / Math.max(s.length - 1, 1);
  const Y = (v) => c.height - 20 - (v - lo) / (hi - lo) * (c.height - 30);
  g.fillStyle = "#555"; g.font = "11px monospace";
  g.fillText(hi.toFixed(1), 2, Y(hi) + 10); g.fillText(lo.toFixed(1), 2, Y(lo));
  g.fillText("sample", c.width / 2, c.height - 4);
  g.strokeStyle = "#21918c"; g.beginPath();
  s.forEach((v, i) => { if (i) g.lineTo(X(i), Y(v)); else g.moveTo(X(i), Y(v)); });
  g.stroke(); g.fillStyle = "#440154";
  s.forEach((v, i) => g.fillRect(X(i) - 1.5, Y(v) - 1.5, 3, 3));
});
</script></body></html>
"""
