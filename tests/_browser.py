"""A headless Chromium driven over the DevTools protocol (tornado's websocket client).

``async with Browser(tmp_path) as b: await b.open(url); await b.until(js); await
b.screenshot(path)``. The browser runs in a session of its own and is killed with its whole
process group (its renderer and GPU helpers) when the block ends. Chromium is found as
``chromium`` (Debian's package; ``.ci/run`` installs it) or ``chromium-browser``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from tornado.httpclient import AsyncHTTPClient
from tornado.websocket import websocket_connect


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, tmp_path: Path, width: int = 1400, height: int = 1500) -> None:
        self.tmp_path = tmp_path
        self.size = (width, height)
        self._ids = itertools.count(1)
        self.proc: asyncio.subprocess.Process | None = None
        self.ws: Any = None

    async def __aenter__(self) -> Browser:
        exe = chromium()
        assert exe is not None, "chromium is not installed (apt-get install -y chromium)"
        self.proc = await asyncio.create_subprocess_exec(
            exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--no-default-browser-check", "--remote-debugging-port=0",
            "--remote-allow-origins=*", f"--user-data-dir={self.tmp_path / 'chromium-profile'}",
            f"--window-size={self.size[0]},{self.size[1]}", "about:blank",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            start_new_session=True)
        try:
            port = await asyncio.wait_for(self._port(), 60)
            http = AsyncHTTPClient()
            resp = await http.fetch(f"http://127.0.0.1:{port}/json/new?about:blank",
                                    method="PUT", allow_nonstandard_methods=True, body=b"")
            target = json.loads(resp.body)
            self.ws = await websocket_connect(target["webSocketDebuggerUrl"],
                                              max_message_size=256 << 20)
            await self.call("Page.enable")
            await self.call("Runtime.enable")
        except BaseException:
            await self._kill()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.ws is not None:
            self.ws.close()
        await self._kill()

    async def _port(self) -> int:
        assert self.proc is not None and self.proc.stderr is not None
        while True:
            line = await self.proc.stderr.readline()
            if not line:
                raise RuntimeError("chromium exited before it listened for DevTools")
            m = re.search(rb"DevTools listening on ws://[^:]+:(\d+)/", line)
            if m:
                # keep draining stderr, so that chromium never blocks on a full pipe
                self._drain = asyncio.ensure_future(self._drain_stderr())
                return int(m.group(1))

    async def _drain_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while await self.proc.stderr.readline():
            pass

    async def _kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group: renderer, GPU, zygote
        await self.proc.wait()
        drain = getattr(self, "_drain", None)
        if drain is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(drain, 10)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        await self.ws.write_message(json.dumps({"id": msg_id, "method": method,
                                                "params": params}))
        while True:
            raw = await asyncio.wait_for(self.ws.read_message(), 60)
            assert raw is not None, "the DevTools connection closed"
            msg = json.loads(raw)
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    async def open(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"javascript failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def until(self, expression: str, check: Any, timeout: float = 60.0) -> Any:
        """Evaluate ``expression`` until ``check(value)`` holds; return that value."""
        deadline = time.monotonic() + timeout
        value = None
        while True:
            value = await self.evaluate(expression)
            if value is not None and check(value):
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"the page never satisfied the check; last value: "
                                     f"{json.dumps(value)[:2000]}")
            await asyncio.sleep(0.25)

    async def screenshot(self, path: Path) -> Path:
        result = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(result["data"]))
        return path


#: Collects, from the rendered page: the named (``dds-*``) bokeh data sources with their
#: columns, the canvases and table cells in the shadow DOM, and the navigation links.
PAGE_STATE_JS = r"""
(() => {
  const docs = (window.Bokeh && window.Bokeh.documents) || [];
  if (!docs.length) return null;
  const sources = {};
  for (const doc of docs) {
    for (const m of doc._all_models.values()) {
      if (typeof m.name === "string" && m.name.startsWith("dds-") && m.data !== undefined) {
        const d = m.data;
        const entries = d instanceof Map ? Array.from(d.entries()) : Object.entries(d);
        sources[m.name] = Object.fromEntries(entries.map(([k, v]) => [k, Array.from(v)]));
      }
    }
  }
  let canvases = 0, cells = [];
  const walk = (root) => {
    for (const e of root.querySelectorAll("*")) {
      if (e.tagName === "CANVAS" && e.width > 0 && e.height > 0) canvases++;
      if (e.classList && e.classList.contains("slick-cell")) cells.push(e.textContent);
      if (e.shadowRoot) walk(e.shadowRoot);
    }
  };
  walk(document);
  const nav = Array.from(document.querySelectorAll(".navbar a")).map(a => a.getAttribute("href"));
  return {sources, canvases, cells, nav, title: document.title};
})()
"""
