"""How an exchange with a backend fails below HTTP: raised by the request path's client
(proxy/forwarding/upstream.py) and by the readers of its answers (answer.py); `send`
(send.py) turns them into the client's UpstreamError.

    TransportError           the exchange failed below HTTP
    +-- ConnectFailed        no connection could be made: nothing was sent
    +-- ConnectionDropped    closed or broken before the answer ended
"""

from __future__ import annotations


class TransportError(Exception):
    """The exchange with a backend failed below HTTP."""


class ConnectFailed(TransportError):
    """No connection could be made: nothing was sent."""


class ConnectionDropped(TransportError):
    """The backend closed or broke the connection before its answer ended."""
