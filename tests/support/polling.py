"""Wait for an event by polling it, never by sleeping a fixed time a loaded machine could outlast."""

import time


def wait_for(condition, within_s: float = 5.0) -> bool:
    """Whether `condition()` became true within `within_s` seconds (checked every 50 ms)."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
