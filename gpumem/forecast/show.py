"""How a forecast shows itself: text table, summary, JSON, plot, HTML, and the
lines an OOM explanation quotes (a mixin of gpumem.forecast.Forecast)."""

from __future__ import annotations

import html as _html
import io
import math
import os
from typing import Dict, List, Optional, Sequence

from .._units import format_size

ALLOCATORS = ("gpumem", "native")

# A largest value past this multiple of the largest one recorded comes with a
# note: some kernels take memory only past some size (measured: a bias
# gradient's reduction buffer, absent at batch 4, left a forecast from batch 2
# and 4 10% short in peak at batch 190; docs/forecast.md).
FAR_FACTOR = 8


class _Showing:
    # ---- showing ---------------------------------------------------------------------

    def values(self, extra: Sequence[int] = ()) -> List[int]:
        """The knob values a table shows: those recorded, `at`, the largest that
        fit the capacity, and any `extra`."""
        vals = set(self.recorded) | set(self.at) | {int(v) for v in extra}
        if self.capacity is not None:
            for a in ALLOCATORS if self.aligned else ("gpumem",):
                v = self.largest(allocator=a)
                if 0 < v < math.inf:
                    vals.add(int(v))
                    vals.add(int(v) + self.multiple)
        return sorted(vals)

    def rows(self, values: Optional[Sequence[int]] = None) -> list:
        """The Prediction of each knob value (default: those `values()` gives)."""
        return [self.predict(k) for k in (self.values() if values is None else values)]

    def _largest_text(self, allocator: str) -> str:
        v = self.largest(allocator=allocator)
        if v == math.inf:
            return "any (no effect)"
        if not self.aligned:
            return f"at most {v}"
        return str(v)

    def summary_lines(self) -> List[str]:
        rec = ", ".join(str(k) for k in self.recorded)
        lines = [f"forecast of {self.name} from recordings at {self.name} {rec}: {self.fit_summary()}"]
        if self.capacity is not None:
            if self.aligned:
                lines.append(
                    f"largest {self.name} that fits {format_size(self.capacity)}: "
                    f"gpumem {self._largest_text('gpumem')}, native {self._largest_text('native')}"
                )
            else:
                lines.append(
                    f"largest {self.name} that fits {format_size(self.capacity)}: "
                    f"{self._largest_text('gpumem')} (a bound from peak live memory only)"
                )
            far = self._far_note()
            if far:
                lines.append(far)
            if self.first is not None:
                was = ", ".join(f"{a} {self.first._largest_text(a)}" for a in ALLOCATORS)
                again = [k for k in self.recorded if k not in self.first.recorded]
                agreed = len(again) < len(self.recorded)
                lines.append(
                    f"refined: recorded again at {self.name} {' and '.join(map(str, again))}, nearer the "
                    f"answer; from {', '.join(map(str, self.first.recorded))} the largest was: {was}"
                    + ("; the new recording agreed with that forecast: all are fitted together" if agreed else "")
                )
        lines.extend(f"warning: {c}" for c in self.caveats())
        return lines

    def _far_note(self) -> Optional[str]:
        """A note when a largest value lies FAR_FACTOR times past the largest recorded, else None."""
        top = self.recorded[-1]
        far = [v for v in (self.largest(allocator=a) for a in ALLOCATORS) if v != math.inf and v > FAR_FACTOR * top]
        if not self.aligned or not far:
            return None
        return (
            f"note: {self.name} {max(far)} is {max(far) / top:.0f}x the largest recorded ({top}); memory a step "
            f"takes only past some size (a reduction's staging buffer, a library's workspace) shows only in a "
            f"recording near that size: run one step there, or record a larger {self.name} too, before relying on it"
        )

    def table(self, values: Optional[Sequence[int]] = None) -> str:
        """The forecast as a text table (a row per knob value)."""
        header = [self.name, "peak live", "gpumem needs", "native needs", "gpumem/live", "native/live"]
        if self.capacity is not None:
            header += ["fits gpumem", "fits native"]
        lines = [header]
        recorded = set(self.recorded)
        for p in self.rows(values):
            live = p.peak_live_bytes
            g, n = p.gpumem_capacity_bytes, p.native_capacity_bytes
            mark = "*" if p.knob in recorded else ""
            row = [
                f"{p.knob}{mark}",
                ("~" if p.estimate_only else "") + format_size(live),
                format_size(g) if g is not None else "-",
                format_size(n) if n is not None else "-",
                f"{g / live:.3f}" if g is not None and live else "-",
                f"{n / live:.3f}" if n is not None and live else "-",
            ]
            if self.capacity is not None:
                if self.aligned:
                    row += [_yes(self.fits(p.knob, allocator="gpumem")), _yes(self.fits(p.knob, allocator="native"))]
                else:
                    row += ["-", "-"]
            lines.append(row)
        widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
        out = []
        for n_row, row in enumerate(lines):
            out.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
            if n_row == 0:
                out.append("  ".join("-" * w for w in widths))
        out.append("(* recorded; needs: the smallest capacity replaying the step with no OOM, to 1 MiB / 2 MiB)")
        return "\n".join(out)

    def text(self) -> str:
        return "\n".join(self.summary_lines() + ["", self.table()])

    __str__ = text

    def __repr__(self) -> str:
        return f"<gpumem.Forecast {self.name} from {self.recorded}, aligned={self.aligned}>"

    def to_json(self) -> dict:
        out = {
            "knob": self.name,
            "recorded": self.recorded,
            "aligned": self.aligned,
            "alignment": self.alignment.message,
            "first_difference": self.alignment.first_difference,
            "set_aside": {str(k): v for k, v in self.alignment.set_aside.items()},
            "fit": dict(self.model.kinds) if self.model else None,
            "caveats": self.caveats(),
            "capacity_bytes": self.capacity,
            "record_seconds": self.record_seconds,
            "rows": [p.to_json() for p in self.rows()],
        }
        if self.capacity is not None:
            for a in ALLOCATORS:
                v = self.largest(allocator=a) if (self.aligned or a == "gpumem") else None
                out[f"largest_{a}"] = None if v is None or v == math.inf else v
            out["largest_is_bound"] = not self.aligned
            out["knob_has_effect"] = self.knob_has_effect
        return out

    def plot(self, path=None, ax=None, values: Optional[Sequence[int]] = None):
        """Peak live and each allocator's capacity against the knob, the
        capacity drawn as a line; needs matplotlib.  Writes `path` if given;
        returns the axes."""
        try:
            import matplotlib

            if ax is None and path is not None:
                matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("Forecast.plot needs matplotlib (pip install matplotlib)") from None
        vals = list(values) if values is not None else self._plot_values()
        rows = self.rows(vals)
        fig = None
        if ax is None:
            fig, ax = plt.subplots(figsize=(7, 4.2))
        gib = float(1 << 30)
        xs = [p.knob for p in rows]
        ax.plot(xs, [p.peak_live_bytes / gib for p in rows], "o-", label="peak live", color="#444444")
        if self.aligned:
            ax.plot(xs, [(p.gpumem_capacity_bytes or 0) / gib for p in rows], "s-", label="gpumem needs")
            ax.plot(xs, [(p.native_capacity_bytes or 0) / gib for p in rows], "^-", label="native needs")
        if self.capacity is not None:
            ax.axhline(self.capacity / gib, color="red", linestyle="--", label=f"capacity {format_size(self.capacity)}")
            marks: Dict[int, List[str]] = {}
            for a in ALLOCATORS if self.aligned else ("gpumem",):
                v = self.largest(allocator=a)
                if 0 < v < math.inf:
                    marks.setdefault(int(v), []).append(a)
            for v, names in marks.items():
                ax.axvline(v, color="gray", linestyle=":", linewidth=1)
                ax.annotate(f"{', '.join(names)}: {v}", (v, self.capacity / gib), rotation=90, va="top", fontsize=8)
        ax.scatter(self.recorded, [self.peak_live(k) / gib for k in self.recorded], zorder=5, color="black")
        ax.set_xlabel(self.name)
        ax.set_ylabel("GiB")
        ax.set_title(f"memory forecast from {self.name} {', '.join(map(str, self.recorded))}")
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
        if path is not None and fig is not None:
            fig.tight_layout()
            fig.savefig(os.fspath(path), dpi=110)
            plt.close(fig)
        return ax

    def _plot_values(self) -> List[int]:
        vals = set(self.values())
        top = max(vals)
        steps = 8
        for i in range(1, steps + 1):
            v = max(1, round(top * i / steps / self.multiple) * self.multiple)
            vals.add(v)
        return sorted(vals)

    def to_html(self, path=None) -> str:
        """The summary, table and (with matplotlib) plot as an HTML fragment; writes `path` if given."""
        parts = ["<div class='gpumem-forecast'>"]
        for line in self.summary_lines():
            cls = " style='color:#b00'" if line.startswith("warning:") else ""
            parts.append(f"<p{cls}>{_html.escape(line)}</p>")
        parts.append(f"<pre>{_html.escape(self.table())}</pre>")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            pass
        else:
            import matplotlib.pyplot as plt

            buf = io.StringIO()
            fig, ax = plt.subplots(figsize=(7, 4.2))
            self.plot(ax=ax)
            fig.tight_layout()
            fig.savefig(buf, format="svg")
            plt.close(fig)
            svg = buf.getvalue()
            parts.append(svg[svg.find("<svg") :])
        parts.append("</div>")
        out = "\n".join(parts)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(f"<!doctype html><meta charset='utf-8'><title>gpumem forecast</title>\n{out}\n")
        return out

    def _repr_html_(self) -> str:
        return self.to_html()

    # ---- the OOM explanation -------------------------------------------------------

    def explain_lines(self, capacity: int) -> List[str]:
        """Lines for an OOM report on a heap of `capacity` bytes: what the values
        asked for (`at`) need, and the largest that fits."""
        largest = self.largest(capacity, "gpumem")
        if largest == math.inf:
            return [f"the {self.name} does not change memory (forecast from {self.name} {self.recorded})"]
        bound = "" if self.aligned else " at most"
        tail = f"the largest that fits {format_size(capacity)} is{bound} {largest}" + (
            "" if self.aligned else " (from peak live alone: the recordings do not line up)"
        )
        lines = []
        for k in self.at:
            p = self.predict(k)
            need = p.gpumem_capacity_bytes if p.gpumem_capacity_bytes is not None else p.peak_live_bytes
            lines.append(f"{self.name} {k} needs {format_size(need)}; {tail}")
        if not lines:
            lines.append(f"{tail[0].upper()}{tail[1:]} {self.name} (forecast from {self.name} {self.recorded})")
        return lines


def _yes(b: bool) -> str:
    return "yes" if b else "NO"
