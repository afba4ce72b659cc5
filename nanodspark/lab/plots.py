"""Pictures of measurements, with no plotting library: a PNG writer and the reliability diagram.

The idea
    `write_png` writes an [H, W, 3] uint8 array as an 8-bit RGB PNG with nothing but `zlib` and
    `struct` (one IDAT chunk, no filter), so a figure can be drawn on a machine that has numpy
    and nothing else. `save_reliability_png` draws the confidence head's calibration
    (calibration.py): one panel per draft position, the raw head's cumulative survival in red
    and the calibrated one (STS) in blue against the observed prefix rate, the diagonal being
    perfect calibration, with a histogram of bin counts below. `bench pareto` (bench_engine.py)
    draws its Pareto plot with `write_png` too.

Invariants
    * Drawing reads its inputs and changes nothing: the bins are those of
      `calibration.reliability`, the temperatures those of `calibration.fit_sts` when not given.
    * A pixel outside the image is clipped, never an error (`_dot`).

Used by `train_heads.py` (benchmarks/drafter/reliability.png) and `python -m nanodspark.bench
pareto`. Walkthrough: chapter 06 (the reliability diagram) and chapter 09 (the Pareto plots).
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from ..calibration import (N_BINS, ReliabilityBins, apply_temperatures, as_float64, fit_sts, reliability,
                           survival)

_WHITE, _GRID, _AXIS = (255, 255, 255), (225, 225, 225), (40, 40, 40)
_RAW, _CAL, _BAR = (214, 39, 40), (31, 119, 180), (150, 150, 150)


def write_png(path, rgb: np.ndarray) -> None:
    """Write an [H, W, 3] uint8 image as an 8-bit RGB PNG (no filter, one IDAT chunk)."""
    h, w, _ = rgb.shape

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    rows = b"".join(b"\x00" + rgb[i].astype(np.uint8).tobytes() for i in range(h))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    Path(path).write_bytes(png)


def _dot(img: np.ndarray, x: int, y: int, color, radius: int) -> None:
    img[max(0, y - radius):y + radius + 1, max(0, x - radius):x + radius + 1] = color


def _panel(bins_raw: ReliabilityBins, bins_cal: ReliabilityBins, size: int, hist: int,
           radius: int) -> np.ndarray:
    """One position: diagonal, raw (red) and STS (blue) points, count histogram below."""
    img = np.full((size + hist, size, 3), _WHITE, dtype=np.uint8)
    for t in range(0, size, max(1, size // 10)):
        img[:size, t] = _GRID
        img[t, :] = _GRID
    for i in range(size):                                     # the diagonal: perfect calibration
        img[size - 1 - i, i] = _AXIS
    img[size - 1, :], img[:size, 0] = _AXIS, _AXIS
    for bins, color in ((bins_raw, _RAW), (bins_cal, _CAL)):
        for mp, ml, c in zip(bins.mean_pred.tolist(), bins.mean_label.tolist(), bins.count.tolist()):
            if c > 0:
                _dot(img, round(mp * (size - 1)), size - 1 - round(ml * (size - 1)), color, radius)
    counts = bins_cal.count.to(torch.float64)
    n_bins, top = counts.numel(), float(counts.max()) if counts.numel() else 0.0
    for b, c in enumerate(counts.tolist()):
        if top > 0 and c > 0:
            x0, x1 = b * size // n_bins, max(b * size // n_bins + 1, (b + 1) * size // n_bins - 1)
            height = max(1, round((hist - 2) * c / top))
            img[size + hist - height:size + hist, x0:x1] = _BAR
    return img


def save_reliability_png(path, logits, labels, valid=None, temps=None, n_bins: int = N_BINS,
                         panel_px: int = 160, hist_px: int = 40, gap_px: int = 8,
                         dot_radius: int = 2, shifts=None) -> Path:
    """Reliability diagrams of cumulative survival, one panel per position, side by side.

    Red = raw head (T = 1), blue = after STS (`temps`, fitted if None; with `shifts` if given); grey bars = how many
    samples fall in each bin after STS. x = mean predicted survival, y = observed prefix rate.
    """
    z = as_float64(logits)
    temps = fit_sts(z, labels, valid, n_bins=n_bins) if temps is None else as_float64(temps)
    v = torch.ones_like(z, dtype=torch.bool) if valid is None else torch.as_tensor(valid).cpu().bool()
    cal = survival(apply_temperatures(z, temps, None if shifts is None else as_float64(shifts)))
    raw, y = survival(torch.sigmoid(z)), as_float64(labels)
    panels = []
    for k in range(z.shape[-1]):
        rk = reliability(raw[v[:, k], k], y[v[:, k], k], n_bins)
        ck = reliability(cal[v[:, k], k], y[v[:, k], k], n_bins)
        panels.append(_panel(rk, ck, panel_px, hist_px, dot_radius))
        panels.append(np.full((panel_px + hist_px, gap_px, 3), _WHITE, dtype=np.uint8))
    write_png(path, np.concatenate(panels[:-1], axis=1))
    return Path(path)
