"""Rank lists as text, shared by the watchdog, the reproduction and the diagnoser."""


def format_ranks(ranks) -> str:
    """[1, 2, 3, 7] -> "1-3,7" (sorted); "none" for no ranks."""
    out, start, prev = [], None, None
    for r in sorted(ranks) + [None]:
        if start is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    return ",".join(out) or "none"
