"""The `indknn` typer app: registers one thin module per subcommand."""

from __future__ import annotations

import typer

from .. import __version__

app = typer.Typer(
    name="indknn",
    help=(
        "Differentially private prediction with Ind-KNN: every record has its own privacy budget, "
        "charged only when it helps answer a query.\n\n"
        "Exit codes: 0 ok, 1 runtime error, 2 usage error / bad input (nothing written), "
        "3 stop serving (public --max-queries allowance used up; operator's --min-active), "
        "4 `account --eps` check failed."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
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


def _version(value: bool) -> None:
    if value:
        typer.echo(f"indknn {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """indknn."""


_register()


def main() -> None:
    app()
