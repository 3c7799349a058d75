"""A job's increments, shaped by a Format: one whole response (`collect`) or an SSE stream
(`stream_sse`). Both close the job when they end, however they end."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from loragw.engine.api import RequestOutput
from loragw.gateway.common.errors import APIError
from loragw.gateway.http.jobs import Choice, GenerationJob
from loragw.gateway.http.outcome import stream_failed
from loragw.gateway.openai.formats import Format

logger = logging.getLogger(__name__)


async def collect(job: GenerationJob, fmt: Format, disconnected: asyncio.Future | None = None):
    """Run the job to the end and build one whole response; 499 if `disconnected` (a task
    that ends when the client goes away) ends first."""
    loop = asyncio.get_running_loop()
    parts: dict[int, list[RequestOutput]] = {c.index: [] for c in job.choices}
    done = loop.create_future()
    pending = job.num_unfinished

    def sink(choice: Choice, out: RequestOutput | BaseException) -> None:
        nonlocal pending
        if done.done():
            return
        if isinstance(out, BaseException):
            done.set_exception(out)
            return
        parts[choice.index].append(out)
        pending -= out.finished
        if pending == 0:
            done.set_result(None)

    try:
        job.start(sink)
        if pending == 0 and not done.done():
            done.set_result(None)
        waiting = {done} if disconnected is None else {done, disconnected}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            raise APIError(499, "the client closed the connection before the response was "
                                "ready", code="client_closed_request")
        done.result()  # raises what the engine raised
    finally:
        job.close()
        if disconnected is not None:
            disconnected.cancel()
    return fmt.whole(job.choices, parts, job.counts)


async def stream_sse(job: GenerationJob, fmt: Format,
                     include_usage: bool) -> AsyncIterator[bytes]:
    """`data: {chunk}` events, a finish chunk per choice, optional usage, then [DONE] (the
    Format's framing: `encode`, `failure`, `end`). What has arrived by the time the client
    takes the next bytes goes out as one write: a client (or a step of n choices) that falls
    behind gets its events coalesced, not one send each."""
    queue: asyncio.Queue = asyncio.Queue()
    try:
        for chunk in fmt.head(job.choices):
            yield fmt.encode(chunk)
        pending = job.num_unfinished
        job.start(lambda choice, out: queue.put_nowait((choice, out)))
        while pending:
            events = [await queue.get()]
            while not queue.empty():
                events.append(queue.get_nowait())
            frames, failure = [], None
            for choice, out in events:
                if isinstance(out, BaseException):
                    failure = out
                    break
                delta = fmt.delta(choice, out)
                if delta is not None:
                    frames.append(fmt.encode(delta))
                if out.finished:
                    pending -= 1
                    frames.append(fmt.encode(fmt.finish(choice)))
            if frames:
                yield b"".join(frames)
            if failure is not None:
                raise failure
        if include_usage:
            yield fmt.encode(fmt.usage_chunk(job.counts))
    except Exception as exc:  # headers are gone: report in-band, as OpenAI and vLLM do
        logger.exception("stream failed")
        stream_failed()  # and log and count it as the server error it is
        yield fmt.encode(fmt.failure(f"generation failed: {exc}"))
    finally:
        job.close()
    yield fmt.end()
