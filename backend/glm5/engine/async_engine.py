"""The engine on its own thread, for servers: thread-safe add/abort, per-request output streams.

All engine state is touched only by the loop thread; callers talk to it through a command queue,
so ``add_request`` and ``abort`` are safe from any thread (Triton's stub threads, asyncio loops).
``add_request`` still validates synchronously — the caller gets the ValueError for a bad request
at once instead of a failed stream.

Nothing request-proportional runs on the loop thread: ``add_request`` first runs
:meth:`LLMEngine.prepare` (chat template, tokenizer, media decoding, tensor validation, media
hashing) on a pool of ``preprocess_workers`` threads, so at most that many requests are being
decoded at a time and a 10 MB prompt or a long video delays only its own request; the loop thread
then only queues the prepared request.

Failures: a request that fails inside a step (isolated by :class:`LLMEngine`) ends its stream with
:class:`~glm5.engine.errors.RequestFailedError`. An unrecoverable error ends the loop: every stream
gets :class:`~glm5.engine.errors.EngineDeadError`, every later call raises it, and the callbacks
registered with :meth:`AsyncLLMEngine.on_dead` run (the Triton backend takes the server down there).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

import torch

from glm5.engine.args import EngineArgs
from glm5.engine.errors import EngineDeadError, RequestFailedError
from glm5.engine.llm_engine import LLMEngine
from glm5.engine.outputs import EngineStats, PromptInput, RequestOutput
from glm5.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_END = object()


class RequestStream:
    """Outputs of one request, iterable with ``for`` (blocking) or ``async for``.

    Items are buffered in a deque guarded by a condition variable. A blocking consumer waits on
    the condition; an ``async for`` consumer parks an asyncio future that the engine thread
    resolves with ``call_soon_threadsafe``. The async path therefore holds no executor thread
    while waiting: many concurrent streams do not exhaust the loop's default executor, and a
    cancelled consumer leaves no thread behind that would later swallow an output.
    """

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._items: deque = deque()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def _put(self, item) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_wake_future, fut)
            except RuntimeError:  # that event loop is closed: its consumer is gone
                pass

    def _get(self):
        with self._cond:
            while not self._items:
                self._cond.wait()
            return self._items.popleft()

    async def _aget(self):
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._items:
                    return self._items.popleft()
                fut = loop.create_future()
                self._waiters.append((loop, fut))
            await fut

    @staticmethod
    def _check(item) -> bool:
        """True when iteration ends before ``item``; raises a delivered engine error."""
        if item is _END:
            return True
        if isinstance(item, BaseException):
            raise item
        return False

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            item = self._get()
            if self._check(item):
                return
            yield item
            if item.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self._aget()
            if self._check(item):
                return
            yield item
            if item.finished:
                return


def _wake_future(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class AsyncLLMEngine:
    def __init__(self, args: EngineArgs, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(args)
        workers = getattr(args, "preprocess_workers", None) or 2
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="glm5-prepare")
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stats = self.engine.stats()
        self._error: BaseException | None = None
        self._dead_callbacks: list[Callable[[BaseException], None]] = []
        self._thread = threading.Thread(target=self._loop, name="glm5-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public, thread-safe
    def add_request(self, request_id: str, prompt: PromptInput | str | list[int],
                    params: SamplingParams | None = None) -> RequestStream:
        """Prepare the prompt on the worker pool, then queue it; raises ValueError for a bad request.

        Blocks the calling thread (not the engine loop) while the prompt is prepared."""
        self._check_alive()
        if request_id in self._streams:  # fast path; the loop thread re-checks authoritatively
            raise ValueError(f"request id {request_id!r} is already in flight; use a unique id")
        try:
            fut = self._pool.submit(self.engine.prepare, prompt, params)
        except RuntimeError:  # the pool is shut down
            self._check_alive()
            raise
        try:
            prepared, params = fut.result()
        except concurrent.futures.CancelledError:  # the pool was shut down (engine death or shutdown)
            self._check_alive()
            raise RuntimeError("the engine was shut down before this request was prepared") from None
        finally:
            # a rejected prompt's exception holds this frame (and so the prompt) in its traceback, and the
            # future holds the exception: drop the future so that no cycle keeps a 10 MB prompt alive
            # until the next garbage collection
            del fut
        self._check_alive()
        done = threading.Event()
        box: dict = {}
        stream = RequestStream(request_id)
        self._cmds.put(("add", request_id, prepared, params, stream, done, box))
        self._wake.set()
        # The loop thread answers every command it takes; if it stops first (shutdown or a crash)
        # the command is never taken, so wait in slices and re-check instead of blocking forever.
        while not done.wait(timeout=0.1):
            if not self._thread.is_alive():
                self._check_alive()
                raise RuntimeError("the engine loop stopped before taking this request; create a new engine")
        if "error" in box:
            raise box["error"]
        return stream

    @property
    def error(self) -> BaseException | None:
        """The unrecoverable error that ended the loop (None while it serves)."""
        return self._error

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` (from the loop thread) when the engine dies; at once if it already has."""
        with self._lock:
            if self._error is None:
                self._dead_callbacks.append(callback)
                return
        callback(self._error)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine is dead after an unrecoverable error ({self._error}); restart "
                                  "the server") from self._error
        if self._stop.is_set():
            raise RuntimeError("the engine was shut down; create a new AsyncLLMEngine to serve more requests")

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        return self._stats

    def shutdown(self) -> None:
        """Stop the loop thread; requests still in flight end with finish_reason ``"abort"``. Then the engine's
        own resources (a distributed engine's worker processes)."""
        self._stop.set()
        self._wake.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout=30)
        stop = getattr(self.engine, "shutdown", None)  # engines handed in by tests may not have one
        if stop is not None:
            stop()

    # ------------------------------------------------------------------ loop thread
    def _handle(self, cmd) -> None:
        if cmd[0] == "add":
            _, rid, prepared, params, stream, done, box = cmd
            try:
                if rid in self._streams:
                    raise ValueError(f"request id {rid!r} is already in flight; use a unique id")
                self.engine.add_prepared(rid, prepared, params)
                self._streams[rid] = stream
            except Exception as e:  # reported to the caller, engine keeps serving
                box["error"] = e
            finally:
                done.set()
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.error is not None:
                stream._put(RequestFailedError(f"the engine failed this request: {out.error}"))
            else:
                stream._put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _loop(self) -> None:
        device = getattr(self.engine, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # the current device is per thread
        try:
            while not self._stop.is_set():
                while True:
                    try:
                        self._handle(self._cmds.get_nowait())
                    except queue.Empty:
                        break
                fatal = getattr(self.engine, "fatal_error", None)
                if fatal is not None and fatal() is not None:  # e.g. a worker died while the engine was idle
                    raise fatal()
                if not self.engine.has_unfinished():
                    self._stats = self.engine.stats()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._deliver(self.engine.step())
                self._stats = self.engine.stats()
        except BaseException as e:  # surface to every waiting stream instead of hanging them
            logger.exception("engine loop failed; the engine serves no more requests")
            err = e if isinstance(e, EngineDeadError) else EngineDeadError(f"engine loop failed: {e!r}")
            if err is not e:
                err.__cause__ = e
            with self._lock:
                self._error = err
                callbacks, self._dead_callbacks = self._dead_callbacks, []
            for s in self._streams.values():
                s._put(err)
            self._streams.clear()
            self._pool.shutdown(wait=False, cancel_futures=True)
            for cb in callbacks:
                try:
                    cb(err)
                except Exception:  # noqa: BLE001 (one callback must not stop the others)
                    logger.exception("engine-death callback failed")
        finally:
            # Abort what is left and hand each stream its final "abort" output (collected by a
            # step that schedules nothing, since every request is finished), then end it.
            if self._error is None:
                for rid in list(self._streams):
                    self.engine.abort(rid)
                try:
                    self._deliver(self.engine.step())
                except Exception:  # the final outputs are a courtesy; ending the streams is not
                    logger.exception("could not deliver final abort outputs at shutdown")
                self._stats = self.engine.stats()
            for rid in list(self._streams):
                self._streams.pop(rid)._put(_END)
