"""The report's charts as inline SVG, written directly: lines with markers, points with error
bars, horizontal bars, linear or log axes with ticks, text as text.

Why not a plotting library: matplotlib drew them until issue 33, and importing it (0.55 s) and
drawing the page's five charts (~0.5 s: tick objects and text measurement) cost ~1 s of every
training run, more than a local DP-SGD run's training at n = 10^5 and a third of its command.
These charts need only lines, bars, ticks and text, which SVG states directly (a few ms).
Text widths are estimated (EM x characters), which only sets the left margin for labels.
"""
from __future__ import annotations

import html
import math
from typing import Sequence

FONT = 12            # px
EM = 0.6 * FONT      # a character's width, about, in the page's sans-serif font
BLUE, LIGHT_BLUE, RED, GREY, DARK = "#1f5fa8", "#7a9cc6", "#b03a2e", "#999999", "#333333"


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _n(value: float) -> str:   # a coordinate
    return f"{value:.2f}".rstrip("0").rstrip(".")


def nice_ticks(low: float, high: float, count: int = 6) -> list[float]:
    """About ``count`` round values (1, 2 or 5 x 10^k apart) covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low] if math.isfinite(low) else [0.0]
    raw = (high - low) / max(1, count - 1)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.floor(low / step + 1e-9)
    last = math.ceil(high / step - 1e-9)
    return [round(k * step, 12) for k in range(first, last + 1)]


def tick_text(value: float, log: bool = False) -> str:
    if log:
        return f"{value:.0e}"
    return f"{value:.6g}"


class _Axes:
    """A plot area of ``width`` x ``height`` px with margins, mapping data to pixels."""

    def __init__(self, width: float, height: float, x_range, y_range, *, left: float = 60,
                 bottom: float = 42, top: float = 14, right: float = 16, x_log: bool = False):
        self.width, self.height, self.x_log = width, height, x_log
        self.left, self.right, self.top, self.bottom = left, width - right, top, height - bottom
        self.x_range = tuple(map(self._fx, x_range))
        self.y_range = y_range
        self.parts: list[str] = []

    def _fx(self, x: float) -> float:
        return math.log10(x) if self.x_log else x

    def x(self, value: float) -> float:
        lo, hi = self.x_range
        return self.left + (self._fx(value) - lo) / ((hi - lo) or 1.0) * (self.right - self.left)

    def y(self, value: float) -> float:
        lo, hi = self.y_range
        return self.bottom - (value - lo) / ((hi - lo) or 1.0) * (self.bottom - self.top)

    def add(self, element: str) -> None:
        self.parts.append(element)

    def line(self, x1, y1, x2, y2, color=GREY, width=1.0, dash: str | None = None) -> None:
        self.add(f'<line x1="{_n(x1)}" y1="{_n(y1)}" x2="{_n(x2)}" y2="{_n(y2)}" '
                 f'stroke="{color}" stroke-width="{width}"'
                 + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")

    def text(self, x, y, text, anchor="middle", size=FONT, rotate: float | None = None,
             color=DARK) -> None:
        transform = f' transform="rotate({rotate} {_n(x)} {_n(y)})"' if rotate else ""
        self.add(f'<text x="{_n(x)}" y="{_n(y)}" font-size="{size}" text-anchor="{anchor}" '
                 f'fill="{color}"{transform}>{_e(text)}</text>')

    def x_axis(self, ticks, label: str) -> None:
        for t in ticks:
            px = self.x(t)
            self.line(px, self.top, px, self.bottom, color="#e3e3e3")
            self.text(px, self.bottom + FONT + 4, tick_text(t, self.x_log))
        self.line(self.left, self.bottom, self.right, self.bottom, color=DARK)
        if label:
            self.text((self.left + self.right) / 2, self.height - 8, label)

    def y_axis(self, ticks, label: str) -> None:
        for t in ticks:
            py = self.y(t)
            self.line(self.left, py, self.right, py, color="#e3e3e3")
            self.text(self.left - 6, py + FONT / 3, tick_text(t), anchor="end")
        self.line(self.left, self.top, self.left, self.bottom, color=DARK)
        if label:
            self.text(14, (self.top + self.bottom) / 2, label, rotate=-90)

    def legend(self, entries: Sequence[tuple[str, str, str]], corner: str) -> None:
        """[(kind "line"/"dash"/"dot", color, text)] in the lower or upper right corner."""
        widest = max(len(text) for _, _, text in entries) * EM + 30
        x0 = self.right - widest
        y0 = self.bottom - 10 - 18 * (len(entries) - 1) if corner == "lower" else self.top + 12
        for i, (kind, color, text) in enumerate(entries):
            y = y0 + 18 * i
            if kind == "dot":
                self.add(f'<circle cx="{_n(x0 + 10)}" cy="{_n(y - 4)}" r="4" fill="{color}"/>')
            else:
                self.line(x0, y - 4, x0 + 20, y - 4, color=color, width=1.2,
                          dash="5 3" if kind == "dash" else None)
            self.text(x0 + 26, y, text, anchor="start")

    def svg(self, title: str) -> str:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{_e(title)}" '
                f'width="{_n(self.width)}" height="{_n(self.height)}" '
                f'viewBox="0 0 {_n(self.width)} {_n(self.height)}" '
                f'font-family="DejaVu Sans, Arial, sans-serif"><title>{_e(title)}</title>'
                + "".join(self.parts) + "</svg>")


def _right_margin(last_tick: float, log: bool = False) -> float:
    """Room for half the last x tick's label, which is centred on the plot's right edge."""
    return max(16.0, EM * len(tick_text(last_tick, log)) / 2 + 6)


def line_chart(xs: Sequence[float], ys: Sequence[float], *, title: str, x_label: str,
               y_label: str, markers: bool = True, x_log: bool = False,
               vlines: Sequence[float] = (), hline: tuple[float, str] | None = None,
               point: tuple[float, float, str] | None = None, legend_corner: str = "lower",
               width: float = 800, height: float = 340) -> str:
    """A line through (xs, ys) from y = 0 up, with dotted vertical lines at ``vlines``, a dashed
    horizontal line ``hline`` (value, legend text) and a marked ``point`` (x, y, legend text)."""
    pairs = [(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)
             and (not x_log or x > 0)]
    y_values = [y for _, y in pairs] + ([hline[0]] if hline else []) + ([point[1]] if point else [])
    x_values = [x for x, _ in pairs] + ([point[0]] if point else [])
    y_ticks = nice_ticks(0.0, max(y_values + [1e-12]) * 1.05)
    if x_log:
        low = math.floor(math.log10(min(x_values)))
        high = math.ceil(math.log10(max(x_values)))
        x_ticks = [10.0 ** k for k in range(low, high + 1)]
    else:
        x_ticks = nice_ticks(0.0, max(x_values + [1.0]))
        if all(float(v).is_integer() for v in x_values):   # counts: no fractional ticks
            x_ticks = [t for t in x_ticks if float(t).is_integer()]
    ax = _Axes(width, height, (x_ticks[0], x_ticks[-1]), (y_ticks[0], y_ticks[-1]),
               left=22 + EM * max(len(tick_text(t)) for t in y_ticks) + 12,
               right=_right_margin(x_ticks[-1], x_log), x_log=x_log)
    ax.y_axis(y_ticks, y_label)
    ax.x_axis(x_ticks, x_label)
    for v in vlines:
        ax.line(ax.x(v), ax.top, ax.x(v), ax.bottom, color=GREY, width=0.8, dash="2 3")
    legend = []
    if hline is not None:
        ax.line(ax.left, ax.y(hline[0]), ax.right, ax.y(hline[0]), color=RED, width=1.2,
                dash="5 3")
        legend.append(("dash", RED, hline[1]))
    if pairs:
        ax.add(f'<polyline fill="none" stroke="{BLUE}" stroke-width="1.8" points="'
               + " ".join(f"{_n(ax.x(x))},{_n(ax.y(y))}" for x, y in pairs) + '"/>')
        if markers:
            for x, y in pairs:
                ax.add(f'<circle cx="{_n(ax.x(x))}" cy="{_n(ax.y(y))}" r="3.2" fill="{BLUE}"/>')
    if point is not None:
        ax.add(f'<circle cx="{_n(ax.x(point[0]))}" cy="{_n(ax.y(point[1]))}" r="5" fill="{RED}"/>')
        legend.append(("dot", RED, point[2]))
    if legend:
        ax.legend(legend, legend_corner)
    return ax.svg(title)


def _row_chart(labels: Sequence[str], values: Sequence[float], errors, x_label: str, title: str,
               draw, width: float, zero_line: bool = False) -> str:
    spans = [v - (errors[i] if errors else 0.0) for i, v in enumerate(values)] + \
            [v + (errors[i] if errors else 0.0) for i, v in enumerate(values)] + [0.0]
    finite = [s for s in spans if math.isfinite(s)]
    x_ticks = nice_ticks(min(finite), max(finite))
    rows = max(len(labels), 2)
    height = 30 * rows + 56
    left = min(0.6 * width, 18 + EM * max((len(str(label)) for label in labels), default=6))
    ax = _Axes(width, height, (x_ticks[0], x_ticks[-1]), (-0.7, rows - 0.3), left=left,
               right=_right_margin(x_ticks[-1]))
    ax.x_axis(x_ticks, x_label)
    ax.line(ax.left, ax.top, ax.left, ax.bottom, color=DARK)
    if zero_line:
        ax.line(ax.x(0.0), ax.top, ax.x(0.0), ax.bottom, color=DARK, width=0.8)
    for i, (label, value) in enumerate(zip(labels, values)):
        row = len(labels) - 1 - i   # the first label on top
        ax.text(ax.left - 6, ax.y(row) + FONT / 3, label, anchor="end")
        if math.isfinite(value):
            draw(ax, row, value, errors[i] if errors else None)
    return ax.svg(title)


def dot_chart(labels: Sequence[str], values: Sequence[float], errors=None, *, title: str,
              x_label: str = "", width: float = 800) -> str:
    """A point per label (rows, the first on top), with +-error bars where ``errors`` given."""
    def draw(ax, row, value, error):
        y = ax.y(row)
        if error is not None and math.isfinite(error):
            ax.line(ax.x(value - error), y, ax.x(value + error), y, color=LIGHT_BLUE, width=1.2)
            for end in (value - error, value + error):
                ax.line(ax.x(end), y - 4, ax.x(end), y + 4, color=LIGHT_BLUE, width=1.2)
        ax.add(f'<circle cx="{_n(ax.x(value))}" cy="{_n(y)}" r="4" fill="{BLUE}"/>')
    return _row_chart(labels, values, errors, x_label, title, draw, width)


def bar_chart(labels: Sequence[str], values: Sequence[float], *, title: str, x_label: str = "",
              width: float = 800) -> str:
    """A bar from 0 per label (rows, the first on top): blue if positive, red if negative."""
    def draw(ax, row, value, _):
        a, b = sorted((ax.x(0.0), ax.x(value)))
        y = ax.y(row)
        ax.add(f'<rect x="{_n(a)}" y="{_n(y - 10)}" width="{_n(max(b - a, 0.5))}" height="20" '
               f'fill="{BLUE if value >= 0 else RED}"/>')

    return _row_chart(labels, values, None, x_label, title, draw, width, zero_line=True)
