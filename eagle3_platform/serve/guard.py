"""HTTP-level limits uvicorn does not enforce itself: the time a request's head may take.

uvicorn bounds idle keep-alive connections (`timeout_keep_alive`) and, with its h11 protocol, the
size of an unfinished head (`h11_max_incomplete_event_size`), but nothing bounds how long a client
may take to send a head: one that never finishes it holds its connection forever. `guarded_h11`
returns uvicorn's h11 protocol with a deadline on each head (from the connection's opening or the
head's first byte) and an oversized head answered 431 rather than a bare 400. Both answers are the
server's JSON error shape; the connection closes after them. The body's deadline and every other
request limit are the app's (server.py), where a refusal is counted and answered like any other.
"""
from __future__ import annotations

import json


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": status}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def guarded_h11(header_timeout_s: float, max_header_bytes: int):
    """uvicorn's H11Protocol with a head deadline; pass it as uvicorn.Config(http=...) together with
    h11_max_incomplete_event_size=max_header_bytes (h11 then refuses a longer head)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_bytes, self._head_cycle, self._head_timer = 0, None, None
            self._arm()  # a connection that never sends a byte is closed too

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            waiting = self._waiting_head()
            if waiting:
                self._head_bytes += len(data)
                if self._head_timer is None:  # the first byte after a keep-alive pause
                    self._arm()
            super().data_received(data)
            if waiting and not self._waiting_head():  # the head is complete: a request runs
                self._disarm()
                self._head_bytes = 0

        def on_response_complete(self) -> None:
            self._head_cycle = self.cycle
            super().on_response_complete()  # may start a pipelined request (a new cycle)

        def send_400_response(self, msg: str) -> None:
            # h11 refuses a head longer than max_incomplete_event_size as a protocol error
            if self._waiting_head() and self._head_bytes > max_header_bytes:
                self._refuse(431, "Request Header Fields Too Large",
                             f"request line and headers larger than {max_header_bytes} bytes")
            else:
                super().send_400_response(msg)

        # -- the deadline ---------------------------------------------------------------------
        def _waiting_head(self) -> bool:
            return self.cycle is None or self.cycle is self._head_cycle

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or not self._waiting_head():
                return
            if self._head_bytes:
                self._refuse(408, "Request Timeout",
                             f"request headers not received within {header_timeout_s:g} s")
            else:
                self.transport.close()

        def _refuse(self, status: int, reason: str, message: str) -> None:
            self.logger.info("connection refused before its request: %s", message)
            self.transport.write(_raw_response(status, reason, message))
            self.transport.close()

    return GuardedH11Protocol
