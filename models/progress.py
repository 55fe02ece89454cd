"""When to draw progress bars: only when someone can see them."""

from __future__ import annotations

from flotilla import envs


def progress_disabled(progress: bool) -> bool | None:
    """tqdm's `disable`: True when not asked for; False (draw) when the runtime says our piped stderr ends on
    a terminal (FLOTILLA_PROGRESS=1, set for actor processes); None (tqdm decides: a tty or not) otherwise."""
    if not progress:
        return True
    return False if envs.FLOTILLA_PROGRESS else None
