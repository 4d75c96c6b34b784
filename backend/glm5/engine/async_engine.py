"""The engine on its own thread, for servers: thread-safe add/abort, per-request output streams.

All engine state is touched only by the loop thread; callers talk to it through a command queue,
so ``add_request`` and ``abort`` are safe from any thread (Triton's stub threads, asyncio loops).
``add_request`` still validates synchronously — the caller gets the ValueError for a bad request
at once instead of a failed stream.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterator

from glm5.engine.args import EngineArgs
from glm5.engine.llm_engine import LLMEngine
from glm5.engine.outputs import EngineStats, PromptInput, RequestOutput
from glm5.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_END = object()


class RequestStream:
    """Outputs of one request, iterable with ``for`` (blocking) or ``async for``."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._q: queue.Queue = queue.Queue()

    def _put(self, item) -> None:
        self._q.put(item)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            item = self._q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        while True:
            item = await loop.run_in_executor(None, self._q.get)
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


class AsyncLLMEngine:
    def __init__(self, args: EngineArgs, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(args)
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stats = self.engine.stats()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="glm5-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public, thread-safe
    def add_request(self, request_id: str, prompt: PromptInput | str | list[int],
                    params: SamplingParams | None = None) -> RequestStream:
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}")
        done = threading.Event()
        box: dict = {}
        stream = RequestStream(request_id)
        self._cmds.put(("add", request_id, prompt, params, stream, done, box))
        self._wake.set()
        done.wait()
        if "error" in box:
            raise box["error"]
        return stream

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        return self._stats

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ loop thread
    def _handle(self, cmd) -> None:
        if cmd[0] == "add":
            _, rid, prompt, params, stream, done, box = cmd
            try:
                if rid in self._streams:
                    raise ValueError(f"request id {rid!r} is already in flight; use a unique id")
                self.engine.add_request(rid, prompt, params)
                self._streams[rid] = stream
            except Exception as e:  # reported to the caller, engine keeps serving
                box["error"] = e
            finally:
                done.set()
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                while True:
                    try:
                        self._handle(self._cmds.get_nowait())
                    except queue.Empty:
                        break
                if not self.engine.has_unfinished():
                    self._stats = self.engine.stats()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    stream._put(out)
                    if out.finished:
                        del self._streams[out.request_id]
                self._stats = self.engine.stats()
        except BaseException as e:  # surface to every waiting stream instead of hanging them
            logger.exception("engine loop failed")
            self._error = e
            for s in self._streams.values():
                s._put(RuntimeError(f"engine loop failed: {e!r}"))
        finally:
            for rid in list(self._streams):
                self.engine.abort(rid)
                self._streams.pop(rid)._put(_END)
