"""Clean-up work that must finish even when the request that started it is cancelled (an
engine abort, a limit's release): each its own task, failures logged at debug."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine

logger = logging.getLogger(__name__)
_background: set[asyncio.Task] = set()


def spawn(coro: Coroutine) -> None:
    """Run a clean-up coroutine to completion as its own task, outside any cancelled scope."""
    task = asyncio.ensure_future(_quietly(coro))
    _background.add(task)
    task.add_done_callback(_background.discard)


async def _quietly(coro: Coroutine) -> None:
    try:
        await coro
    except Exception:
        logger.debug("clean-up step failed", exc_info=True)
