"""How `check`'s tables write seconds and bytes."""


def fmt_s(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.2f} s"


def fmt_b(n: float, digits: int | None = None) -> str:
    """Decimal units, whole numbers; with `digits`, that many significant digits (3.31 GB)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        shown = round(n) if digits is None or unit == "B" else float(f"{n:.{digits}g}")
        if shown < 1000:
            return f"{shown:g} {unit}" if digits and unit != "B" else f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.0f} PB"
