"""Shared plumbing of the CLI: env fallbacks, JSON lines on stdout, errors on stderr."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from ..errors import EXIT_RUNTIME, IndknnError
from ..wording import count

T = TypeVar("T")
DEFAULT_STORE = "indknn-store.zarr"
DEFAULT_LEDGER = "indknn-ledger"


# Verbosity of this process, set by --quiet/-q and --verbose/-v on every command (VerbosityCommand below):
# 0 quiet (only errors on stderr), 1 normal, 2 verbose.
_VERBOSITY = {"level": 1}


def verbosity() -> int:
    return _VERBOSITY["level"]


def set_verbosity(*, quiet: bool = False, verbose: bool = False, public_only: bool = False) -> None:
    """``public_only`` (serve-queries): -v's log lines exclude those whose figures may depend on the private data."""
    _VERBOSITY["level"] = 0 if quiet else 2 if verbose else 1
    _VERBOSITY["public_only"] = public_only
    _log_indknn_to_stderr(verbose)


#: Loggers silenced on serve-queries' stderr: a lock wait lasts as long as another run held the lock (a serve's
#: scoring time depends on its candidates, an index's or delete's on the records), review 50 F1.
NOT_PUBLIC_LOGGERS = ("indknn_cli.locking",)


def _public_only(record) -> bool:
    return not (_VERBOSITY.get("public_only") and record.name.startswith(NOT_PUBLIC_LOGGERS))


def _log_indknn_to_stderr(on: bool) -> None:
    """-v: indknn's own INFO lines on stderr, and only indknn's. The root logger was configured before, so a library
    imported in a branch one private record could flip (FAISS, when a halved batch fell below the bf16 screen's
    minimum) printed its loading lines only in that world (review 31): serve's stderr must hold public figures only."""
    import logging

    class _Stderr(logging.StreamHandler):  # the current sys.stderr at each line (CliRunner swaps it)
        @property
        def stream(self):
            return sys.stderr

        @stream.setter
        def stream(self, value):
            pass

    log = logging.getLogger("indknn_cli")
    ours = [h for h in log.handlers if getattr(h, "_indknn", False)]
    if not on:  # a later invocation in the same process without -v
        for h in ours:
            log.removeHandler(h)
        if ours:
            log.setLevel(logging.NOTSET)
        return
    if not ours:
        h = _Stderr()
        h._indknn = True
        h.addFilter(_public_only)
        h.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log.addHandler(h)
    log.setLevel(logging.INFO)


def _width(stream) -> int | None:
    """$INDKNN_WIDTH (columns, at least 20) when it is a whole number, else 1000 off a terminal (cron mail, a log file:
    one message, one line; review 42, L7), else the terminal's. Anything else in the variable is ignored (review 54,
    F2: `INDKNN_WIDTH=abc` ended every command in a traceback, after `delete` had erased; 0 dropped every line)."""
    width = (os.environ.get("INDKNN_WIDTH") or "").strip()
    if width.isascii() and width.isdigit() and int(width) >= 20:
        return int(width)
    try:
        return None if stream.isatty() else 1000
    except (AttributeError, ValueError):  # closed or replaced
        return 1000


def stderr_console(*, errors: bool = False) -> Console:
    """The stderr console for messages and progress; silent under --quiet unless ``errors`` (errors always show)."""
    return Console(stderr=True, width=_width(sys.stderr), highlight=False, quiet=verbosity() == 0 and not errors)


def say(text: str, *, style: str | None = None, errors: bool = False) -> None:
    """Print one message on stderr, escaped: ids, paths and messages are text, never rich markup
    (``'indknn[image]'`` and ``no[red]x[/red].csv`` print as written). ``style`` colours the whole line."""
    body = escape(str(text))
    stderr_console(errors=errors).print(f"[{style}]{body}[/]" if style else body, soft_wrap=True)


def detail(text: str) -> None:
    """One line of detail on stderr under --verbose only (dim; escaped like :func:`say`)."""
    if verbosity() >= 2:
        say(text, style="dim")


def error_message(prefix: str, text: str) -> None:
    """``Error: <text>`` on stderr, also under --quiet; the text is escaped."""
    stderr_console(errors=True).print(f"[bold red]{escape(prefix)}[/] {escape(str(text))}", soft_wrap=True)


def stdout_console() -> Console:
    """Tables on stdout; redirected (not a terminal), a wide console so that ids are never cut at 80 columns."""
    return Console(width=_width(sys.stdout), highlight=False)


@contextlib.contextmanager
def progress_bar(description: str, *, total: int | None = None):
    """A rich bar on stderr, only on a terminal and not under --quiet (cron mail gets nothing).

    Yields ``update(completed=None, total=None, advance=None, description=None)``; off a terminal a no-op.
    """
    con = stderr_console()
    if verbosity() == 0 or not con.is_terminal:
        yield lambda **_: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # redirect_stdout=False: JSON lines written while the bar runs stay on stdout (rich would capture them)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=con, transient=False, redirect_stdout=False, redirect_stderr=False) as bar:
        task = bar.add_task(escape(description), total=total)

        def update(*, completed=None, total=None, advance=None, description=None) -> None:
            kw = {k: v for k, v in dict(completed=completed, total=total, advance=advance).items() if v is not None}
            if description is not None:
                kw["description"] = escape(description)
            bar.update(task, **kw)

        yield update


def emit_json(obj: dict) -> None:
    """One compact JSON line on stdout (data only), flushed so pipes see it at once."""
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def emit_json_lines(objs: list[dict]) -> None:
    """JSON lines as :func:`emit_json` writes them, in one write and one flush (a part of answers at a time)."""
    if objs:
        sys.stdout.write("".join(json.dumps(o, ensure_ascii=False) + "\n" for o in objs))
        sys.stdout.flush()


def stdout_closed(*, released: int, batch: str | None, batch_id_given: bool, replayed: int = 0) -> Exception:
    """The error for answers whose stdout was closed by its reader (``| head -1``: EPIPE; review 66, F10): exit 1
    (a runtime error), saying that the answers were released — charged and committed — and how to print them
    again. stdout then points at /dev/null, so that the interpreter's last flush at exit prints no "Exception
    ignored … BrokenPipeError" line."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test runner's stdout)
        pass
    again = (f"re-running with the same --batch-id {batch} prints them again without charging" if batch_id_given
             else f"re-running the same command (batch {batch!r}) prints them again without charging")
    before = (f"{count(replayed, 'answer')} released by an earlier run (printed again, nothing charged)"
              if replayed else "")
    if not released:  # review 73, F3: a batch answered before said "released (charged and committed)"
        return IndknnError(f"stdout was closed by its reader after {before}; {again}")
    return IndknnError(f"stdout was closed by its reader after {count(released, 'answer')} of this run "
                       f"{'was' if released == 1 else 'were'} released (charged and committed to the ledger)"
                       f"{f', and {before}' if before else ''}; {again}")


def run_library_call(fn: Callable[[], T]) -> T:
    """Run a library call; map typed errors to a message on stderr and the documented exit code.

    Unexpected exceptions print their type only (never a traceback with local
    values or private data) unless INDKNN_DEBUG=1.
    """
    try:
        return fn()
    except IndknnError as exc:
        error_message("Error:", str(exc))
        raise typer.Exit(code=exc.exit_code) from None
    except KeyboardInterrupt as exc:
        _exit_interrupted(exc)
    except OSError as exc:
        error_message("Error:", f"{exc.strerror or type(exc).__name__}{': ' + str(exc.filename) if exc.filename else ''}")
        raise typer.Exit(code=EXIT_RUNTIME) from None
    except Exception as exc:  # noqa: BLE001 - last line of defence: no private data in tracebacks
        if os.environ.get("INDKNN_DEBUG") == "1":
            raise
        internal_error(exc)
        raise typer.Exit(code=EXIT_RUNTIME) from None


def internal_error(exc: BaseException) -> None:
    error_message("Internal error:", f"{type(exc).__name__} (set INDKNN_DEBUG=1 for a traceback; "
                  "it may show private values)")


def with_verbosity(fn: Callable, *, name: str = "indknn") -> Callable:
    """``fn`` with --quiet/-q and --verbose/-v added (every command gets them; app.py applies this). ``name``: the
    command as typed (``indknn bench audit``), for -v's closing line."""
    import functools
    import inspect

    @functools.wraps(fn)
    def wrapper(*args, quiet: bool = False, verbose: bool = False, **kwargs):
        if quiet and verbose:
            error_message("Error:", "--quiet and --verbose cannot be used together")
            raise typer.Exit(code=2)
        serving = name.endswith("serve-queries")
        set_verbosity(quiet=quiet, verbose=verbose, public_only=serving)
        # not for serve-queries: its stderr holds public figures only (review 31), and how long a batch took
        # depends on the private data (how many candidates each query had)
        if not verbose or serving:
            return _interruptible(fn, args, kwargs)
        import time

        start, code = time.monotonic(), 0
        try:
            return _interruptible(fn, args, kwargs)  # an interrupt leaves it as typer.Exit (130 or 143)
        except (typer.Exit, SystemExit) as exc:
            code = exc.exit_code if isinstance(exc, typer.Exit) else exc.code
            raise
        except IndknnError as exc:  # raised past run_library_call: main() exits with its code
            code = exc.exit_code
            raise
        except BaseException:
            code = EXIT_RUNTIME  # main(): "Internal error", exit 1
            raise
        finally:
            detail(f"{name}: finished in {time.monotonic() - start:.2f} s, exit {code}")

    sig = inspect.signature(fn)
    extra = [inspect.Parameter("quiet", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=typer.Option(
                 False, "--quiet", "-q", help="Only errors on stderr (no progress, warnings or summaries); stdout "
                 "is unchanged.")),
             inspect.Parameter("verbose", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=typer.Option(
                 False, "--verbose", "-v", help="More detail on stderr: the store and ledger used and where each came from, lock waits, each step "
                 "(indknn's own log lines; no other library's) and the time taken."))]
    wrapper.__signature__ = sig.replace(parameters=list(sig.parameters.values()) + extra)
    wrapper.__annotations__ = {**getattr(fn, "__annotations__", {}), "quiet": bool, "verbose": bool}
    return wrapper


def _interruptible(fn, args, kwargs):
    """``fn`` with an interrupt that lands outside its library call (while it prints, say) ended as inside one: a
    message and exit 130 (SIGINT) or 143 (SIGTERM). Typer turned either into a silent exit 130 (review 51, F2)."""
    try:
        return fn(*args, **kwargs)
    except KeyboardInterrupt as exc:
        _exit_interrupted(exc)


def _exit_interrupted(exc: KeyboardInterrupt):
    """Ctrl-C: "Interrupted.", exit 130; SIGTERM (:class:`~indknn_cli.errors.Terminated`): "Terminated.", exit 143."""
    from ..errors import Terminated

    if isinstance(exc, Terminated):
        error_message("Terminated.", "(SIGTERM) what was committed stays; re-running resumes")
        raise typer.Exit(code=143) from None
    error_message("Interrupted.", "(Ctrl-C) what was committed stays; re-running resumes")  # review 55, F8
    raise typer.Exit(code=130) from None


def deprecated_alias(value, old_value, *, new: str, old: str, typed: bool | None = None):
    """A hidden, deprecated option spelling (``old``, default None) folded into ``new``: a note on stderr; both at
    once with different values is a usage error (exit 2). ``typed``: whether ``new`` was typed on the command line
    (:func:`given_on_command_line`), for a ``new`` with a default other than None; else ``new`` counts as given
    when it is not None."""
    if old_value is None:
        return value
    if (value is not None if typed is None else typed) and value != old_value:
        error_message("Error:", f"{old} is the old name of {new}: give one of them")
        raise typer.Exit(code=2)
    say(f"note: {old} is deprecated, use {new}")
    return old_value


def parse_number_list(text: str, *, flag: str, distinct: bool = False, finite: bool = True) -> tuple:
    """A comma-separated list of numbers (``--eps 0.5,1,2``, ``--tune-taus 0.2,0.3``), the one parser of every
    such option. An empty item (``0.5,,1``, ``1,``) is a typo, not a list: refused (BadInputError, exit 2) with
    the flag and the value named; so are an empty list, a word, and (``finite``) NaN or ±inf. ``distinct``:
    a value given twice is refused too (a tuning grid, where a repeated point would count twice)."""
    import math

    from ..errors import BadInputError

    items = [v.strip() for v in str(text).split(",")]
    if not "".join(items):  # `--eps ""` ran with no ε at all (review 38)
        raise BadInputError(f"{flag}: no number given ({text!r}); give comma-separated numbers, e.g. 0.5,1,2")
    if any(not v for v in items):  # "0.1,,0.2" or "0.3,": a typo, not a list (review 16, F2)
        raise BadInputError(f"{flag} {text!r}: give comma-separated numbers without empty items, e.g. 0.5,1,2")
    try:
        vals = tuple(float(v) for v in items)
    except ValueError:
        raise BadInputError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    bad = [v for v in vals if finite and not math.isfinite(v)]
    if bad:
        raise BadInputError(f"{flag}: {bad[0]!r} is not a finite number (in {text!r})")
    if distinct and len(set(vals)) != len(vals):  # a repeated point would count twice in the exponential mechanism
        raise BadInputError(f"{flag} lists a value twice, got {text!r}")
    return vals


def resolve_store(path: str | Path | None, *, source: str = "--store") -> Path:
    """--store, else $INDKNN_STORE, else ./indknn-store.zarr. An ``s3://`` (fsspec) URL becomes its local
    state folder (docs/OBJECT_STORAGE.md), which the library takes as the store's path."""
    from ..errors import BadInputError
    from ..object_store import local_path

    if path is not None and not str(path).strip():  # read as "." before: the working folder taken as the store
        raise BadInputError("--store is empty; give the feature store's path or URL (or leave --store out for "
                            "$INDKNN_STORE, else ./indknn-store.zarr)")
    from ..output_files import refuse_control_characters

    env = env_value("INDKNN_STORE")
    refuse_control_characters(path if path is not None else (env or DEFAULT_STORE),
                              option=source if path is not None else ("$INDKNN_STORE" if env else source))
    resolved = local_path(path if path is not None else (env or DEFAULT_STORE))
    detail(f"store: {resolved} ({_source(path, source, env, 'INDKNN_STORE', DEFAULT_STORE)})")
    return resolved


def env_value(name: str) -> str | None:
    """An environment fallback: unset, empty or blank (spaces only) all mean "not set" (review 48, F7: a blank
    $INDKNN_STORE was taken as a path named by its spaces)."""
    value = os.environ.get(name)
    return value if value and value.strip() else None


def _source(path, source: str, env: str | None, env_name: str, default: str) -> str:
    """Where a path came from, for --verbose."""
    if path is not None:
        return f"{source} or ${env_name}" if source == "--store" and env is not None and str(path) == env else source
    if env is not None:
        return f"from ${env_name}"
    blank = f"; ${env_name} is blank" if os.environ.get(env_name) else ""
    return f"the default ./{default}{blank}"


_DEVICE = re.compile(r"auto|cpu|cuda(?::\d+)?")


def check_device(value: str) -> str:
    """Typer callback of every --device: auto, cpu, cuda or cuda:N, else a usage error (exit 2) before anything
    runs. `--device tpu` reached torch after the query batch was stored and ended in "Internal error: RuntimeError"
    (review 38, F5)."""
    if value is not None and not _DEVICE.fullmatch(str(value)):
        error_message("Error:", f"--device {value!r} is not a device: give auto, cpu, cuda or cuda:N")
        raise typer.Exit(code=2)
    if value is not None and value.startswith("cuda"):  # cuda:N passed the library's `== "cuda"` check (review 40)
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(value.split(":", 1)[1]) if ":" in value else 0
        if index >= n:
            error_message("Error:", f"--device {value}: " + ("no CUDA device is available here" if n == 0 else
                                                             f"this machine has {count(n, 'CUDA device')}, "
                                                             f"cuda:0..cuda:{n - 1}") + "; use --device cpu or auto")
            raise typer.Exit(code=2)
    return value


def given_on_command_line(ctx, name: str) -> bool:
    """Whether option ``name`` was typed on the command line (not its default, nor an environment fallback).
    Compared by name: typer's vendored click has its own ParameterSource enum."""
    return getattr(ctx.get_parameter_source(name), "name", "DEFAULT") == "COMMANDLINE"


def resolve_ledger(path: Path | None) -> Path:
    """--ledger, else $INDKNN_LEDGER, else ./indknn-ledger."""
    from ..output_files import refuse_control_characters

    env = env_value("INDKNN_LEDGER")
    refuse_control_characters(path if path is not None else (env or DEFAULT_LEDGER),
                              option="--ledger" if path is not None or not env else "$INDKNN_LEDGER")
    resolved = Path(path) if path is not None else Path(env or DEFAULT_LEDGER)
    detail(f"ledger: {resolved} ({_source(path, '--ledger', env, 'INDKNN_LEDGER', DEFAULT_LEDGER)})")
    return resolved


def stdin_is_pipe() -> bool:
    """Whether stdin is a pipe (``a | b``), not a terminal, a file or /dev/null."""
    import stat

    try:
        return sys.stdin is not None and stat.S_ISFIFO(os.fstat(sys.stdin.fileno()).st_mode)
    except (OSError, ValueError, AttributeError):
        return False


def read_json_line_from_stdin(*, hint: str = "") -> dict | None:
    """The JSON line of an upstream `indknn embed` on a pipe (None when stdin is a terminal or empty). ``hint``:
    added to the refusal of anything else (serve-queries: how to pipe query data, review 66 F2)."""
    if sys.stdin is None or sys.stdin.isatty():
        return None
    text = sys.stdin.read().strip()
    if not text:
        return None
    last = text.splitlines()[-1]
    try:
        obj = json.loads(last)
    except ValueError:
        from ..errors import BadInputError

        raise BadInputError("stdin: expected the JSON line printed by `indknn embed`" + hint) from None
    return obj if isinstance(obj, dict) else None


def parse_size(text: str, *, flag: str = "--max-memory") -> int:
    """'2G', '512M', '1048576' → bytes (a finite, non-negative size; else BadInputError naming the value)."""
    import math

    from ..errors import BadInputError

    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        number, unit = (t[:-1], mult[t[-1]]) if t and t[-1] in mult else (t, 1)
        value = float(number)
    except ValueError:
        raise BadInputError(f"cannot read size {text!r} (use e.g. 512M or 2G)") from None
    if not math.isfinite(value) or value < 0 or value * unit >= 1 << 62:
        raise BadInputError(f"{flag} must be a finite size (e.g. 512M or 2G), got {text!r}")
    return int(value * unit)


def check_lock_timeout(seconds: float, *, flag: str = "--lock-timeout") -> float:
    """A lock wait in seconds: finite and ≥ 0 (NaN would wait forever, inf never gives up)."""
    import math

    from ..errors import BadInputError

    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
        raise BadInputError(f"{flag} must be a finite number of seconds ≥ 0, got {seconds!r}")
    return float(seconds)
