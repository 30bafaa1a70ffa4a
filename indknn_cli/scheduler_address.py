"""A Dask scheduler address checked before a client is made (review 38, F6).

``--scheduler notaurl`` (or ``$INDKNN_SCHEDULER``) reached ``distributed.Client``, which waited its whole connect
timeout (20 s), then the command printed its error and a traceback from ``Client.__del__`` (the half-made client
collected). An address Dask cannot parse is bad input: refused at once, exit 2, no client made. A well-formed
address that cannot be reached (:func:`open_client`) fails after the timeout without that traceback.

:func:`resolve_scheduler` and :func:`connect` are the one way both ``embed --scheduler`` and ``serve-queries
--scheduler`` find and reach a scheduler (they were two near-copies, one of which took a blank
``$INDKNN_SCHEDULER`` for an address).
"""

from __future__ import annotations

import os

from .errors import BadInputError, SchedulerError

SCHEDULER_ENV = "INDKNN_SCHEDULER"
CONNECT_TIMEOUT = 10.0


def resolve_scheduler(address: str | None) -> str | None:
    """``--scheduler ADDRESS``, else ``$INDKNN_SCHEDULER``; None (blank) = in process."""
    if address is None:
        address = os.environ.get(SCHEDULER_ENV)
    address = (address or "").strip()
    return address or None


def connect(address: str, *, timeout: float = CONNECT_TIMEOUT):
    """A ``distributed.Client`` on the scheduler at ``address``; SchedulerError when it cannot be reached,
    BadInputError for an address Dask cannot parse or a timeout that is not a positive number of seconds."""
    try:
        import distributed  # noqa: F401 - installed? (open_client makes the client)
    except ImportError:
        raise SchedulerError("--scheduler needs Dask's distributed scheduler: pip install 'indknn[dask]'") from None
    if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise BadInputError(f"--scheduler-timeout must be a positive number of seconds, got {timeout!r}")
    address = check_scheduler_address(address)  # a malformed one waited the whole timeout (review 38, F6)
    try:
        return open_client(address, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - OSError, TimeoutError, TypeError (tls:// without certificates), ...
        if tls_unconfigured(address, exc):  # review 43, L3: not "unreachable"
            raise SchedulerError(TLS_NOTE.format(address=address)) from None
        raise SchedulerError(
            f"cannot reach the Dask scheduler at {address!r} within {timeout:g} s ({type(exc).__name__}); start one "
            "with `dask scheduler` and workers with `dask worker ADDRESS`, or leave --scheduler and "
            f"${SCHEDULER_ENV} unset to work in process. Nothing was written.") from None


def check_scheduler_address(address: str, *, option: str = "--scheduler") -> str:
    """``scheme://host:port`` or ``host:port`` as Dask parses them (``distributed.comm.addressing``), the scheme one
    a separate process can reach: tcp, tls, ws, wss or ucx (review 40: ``inproc://x`` and ``udp://h:1`` waited the
    whole timeout and printed a traceback). ``inproc://HOST/PID/N`` only when PID is this process (a library caller's
    ``LocalCluster(processes=False)``)."""
    try:
        from distributed.comm.addressing import parse_address, parse_host_port
    except ImportError:
        return address  # the caller says distributed is missing
    text = str(address).strip()
    try:
        scheme, loc = parse_address(text)
        if scheme == "inproc":  # an in-process cluster (LocalCluster(processes=False)) of this very process only
            parts = loc.split("/")
            if len(parts) == 3 and parts[1].isdigit() and int(parts[1]) == os.getpid():
                return text
            raise ValueError("inproc address of another process")
        if scheme not in ("tcp", "tls", "ws", "wss", "ucx"):
            raise ValueError(f"scheme {scheme}")
        host, port = parse_host_port(loc)
        if not host or not 0 < int(port) < 65536:
            raise ValueError("host or port")
    except (ValueError, TypeError):
        raise BadInputError(f"{option} {address!r} is not a Dask scheduler address: give tcp://HOST:PORT (for "
                            "example tcp://127.0.0.1:8786)") from None
    return text


def quiet_dask_logs() -> None:
    """``distributed`` gives its loggers a stderr handler of their own when imported (INFO and up), so serve's stderr
    carried more than indknn's lines, some gated on time: "Event loop was unresponsive in Client for N s" follows a
    busy client, and how long a serve keeps it busy grows with the candidate pairs, which depend on the private data
    (review 59, L1). They are set to CRITICAL (``INDKNN_DEBUG=1`` keeps them): a failure still reaches the user as
    indknn's own error."""
    import logging
    import os

    if os.environ.get("INDKNN_DEBUG") == "1":
        return
    for name in list(logging.root.manager.loggerDict):
        if name.split(".")[0] in ("distributed", "tornado", "bokeh"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def open_client(address: str, *, timeout: float):
    """``distributed.Client(address)``; when it cannot connect, the half-made client is closed here, briefly, and its
    ``__del__`` does nothing, so the caller's error is all the user sees (review 40: an unreachable ``tls://``
    address printed ``Client.__del__``'s traceback 20 s after the error, and ``embed`` said "Internal error" for
    the TypeError a TLS address without certificates raises). The exception passes through."""
    from distributed import Client

    quiet_dask_logs()

    class _QuietClient(Client):
        _failed = False

        def __init__(self, *args, **kwargs):
            try:
                super().__init__(*args, **kwargs)
            except BaseException:
                self._failed = True
                try:
                    super().close(timeout=1)
                except Exception:  # noqa: BLE001 - it never connected: nothing of ours to close
                    pass
                raise

        def __del__(self):
            if not self._failed:
                super().__del__()

    return _QuietClient(address, timeout=timeout, set_as_default=False)


#: A ``tls://`` address without certificates fails at once with a TypeError in ``distributed``: not "unreachable".
TLS_NOTE = ("--scheduler {address!r}: TLS needs certificates, and none are configured (Dask's distributed.comm.tls "
            "settings: ca-file, and the client's cert and key); nothing was written")


def tls_unconfigured(address: str, exc: BaseException) -> bool:
    """Whether connecting to ``address`` failed for want of TLS certificates (review 43, L3)."""
    return isinstance(exc, TypeError) and str(address).startswith("tls://")

