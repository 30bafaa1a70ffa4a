"""The `indknn` typer app: registers one thin module per subcommand."""

from __future__ import annotations

import logging

import typer

from .. import __version__
from .common import internal_error, set_verbosity, with_verbosity

app = typer.Typer(
    name="indknn",
    help=(
        "Differentially private prediction with Ind-KNN: every record has its own privacy budget, "
        "charged only when it helps answer a query.\n\n"
        "Exit codes: 0 ok, 1 runtime error, 2 usage error / bad input (nothing written), "
        "3 stop serving (public --max-queries allowance used up; operator's --min-active), "
        "4 `account --eps` check failed, 130 interrupted, 143 terminated (SIGTERM; committed work stays)."
    ),
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    add_completion=True,  # indknn --install-completion [bash|zsh|fish|powershell], --show-completion
)


def _register() -> None:
    from .embed import embed_command
    from .index import index_command
    from .serve import serve_command

    app.command("embed")(embed_command)
    app.command("index")(index_command)
    app.command("serve-queries")(serve_command)
    for name, module, attr in (("delete", "delete", "delete_command"), ("account", "account", "account_command"),
                               ("repair", "repair", "repair_command"),
                               ("break-lease", "break_lease", "break_lease_command"),
                               ("bench", "bench", "bench_app")):
        try:
            mod = __import__(f"indknn_cli.cli.{module}", fromlist=[attr])
        except ModuleNotFoundError:
            continue
        obj = getattr(mod, attr)
        if isinstance(obj, typer.Typer):
            app.add_typer(obj, name=name)
        else:
            app.command(name)(obj)
    # --quiet/-q and --verbose/-v on every command, sub-commands of `bench` included
    for prefix, group in [("indknn", app)] + [(f"indknn {g.name}", g.typer_instance) for g in app.registered_groups]:
        for info in group.registered_commands:
            if info.help is None and info.callback.__doc__:
                info.help = _reflow(info.callback.__doc__)
            name = info.name or info.callback.__name__.removesuffix("_command").replace("_", "-")
            info.callback = with_verbosity(info.callback, name=f"{prefix} {name}")


def _reflow(doc: str) -> str:
    """A docstring's paragraphs as single lines, so that help wraps them at the terminal's width (rich keeps a
    docstring's own line breaks: mid-sentence breaks at ~110 columns, review 42, L8). A line starting with "- " or
    "* " stays a list item."""
    import inspect

    paragraphs = []
    for para in inspect.cleandoc(doc).split("\n\n"):
        lines = [ln.strip() for ln in para.splitlines() if ln.strip()]
        out: list[str] = []
        for ln in lines:
            if out and not ln.startswith(("- ", "* ")):
                out[-1] += " " + ln
            else:
                out.append(ln)
        paragraphs.append("\n".join(out))
    return "\n\n".join(paragraphs)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"indknn {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """indknn."""
    set_verbosity()  # a fresh invocation starts at normal verbosity; -q / -v on the command change it


_register()


#: Set once `main` has its exit code (see :func:`_settled`).
_SETTLED = {"done": False}


def _raise_on_sigterm() -> None:
    """SIGTERM raised as :class:`~indknn_cli.errors.Terminated` (a KeyboardInterrupt), so a `kill`, a systemd stop
    or a cron timeout ends a command as Ctrl-C does: the commit in flight finishes, exit 143 with a message."""
    import signal

    from ..errors import Terminated

    def on_term(signum, frame):
        if _SETTLED["done"]:  # the command is over: nothing left to stop (see _settled)
            return
        raise Terminated()

    try:
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):  # a handler set by a host program is kept
            signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        pass


def main() -> None:
    """The console entry point: no traceback ever reaches the terminal unless INDKNN_DEBUG=1."""
    import os

    from ..errors import IndknnError
    from .common import error_message

    _SETTLED["done"] = False
    _raise_on_sigterm()
    if os.environ.get("INDKNN_DEBUG") != "1":
        # zarr's reads run on an asyncio loop: one corrupt chunk left its sibling reads pending, and asyncio logged
        # each as "Task was destroyed but it is pending!" with a stack, after the one-line error (review 54, F3)
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    try:
        try:
            app(prog_name="indknn")  # usage lines and completion scripts say `indknn`, also under python -m
        except IndknnError as exc:  # a typed error raised outside a command's run_library_call: its documented code
            error_message("Error:", str(exc))
            raise SystemExit(exc.exit_code) from None
        except Exception as exc:  # noqa: BLE001 - typer re-raises what no command mapped (pretty exceptions off)
            if os.environ.get("INDKNN_DEBUG") == "1":
                raise
            internal_error(exc)
            raise SystemExit(1) from None
    finally:
        _settled()


def _settled() -> None:
    """The command is over and its exit code decided: indknn's own SIGTERM handler does nothing from here on, while
    the interpreter winds down (about 1.5 s after a serve's last answer line: threads, torch). A SIGTERM there turned
    a finished run into exit 143 with no word (review 55, F8); what it would stop is already complete. Only that
    handler: SIG_IGN was inherited by every child a program calling `main()` started afterwards, and took away a
    host's own handlers (review 57, F5); a host's SIGTERM handler was never replaced, and Ctrl-C is left as it is."""
    _SETTLED["done"] = True
