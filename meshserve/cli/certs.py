"""``meshserve certs DIR``: a development CA and one certificate per role (``meshserve.certs``)."""

from __future__ import annotations

import typer


def certs(
    directory: str = typer.Argument(..., help="Directory to write ca.pem, <role>.pem and <role>-key.pem into."),
    host: list[str] = typer.Option([], "--host", help="Extra DNS name or IP in every certificate (the names peers "
                                   "dial, e.g. executor-1.internal); may repeat."),
    valid_days: int = typer.Option(365, "--valid-days", min=1, help="Days the certificates are valid."),
) -> None:
    """Make a development CA and one certificate per role (kept if DIR holds a set)."""
    from meshserve.certs import ROLES, check_extra_hosts, has_certs, write_certs

    try:
        check_extra_hosts(host)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if has_certs(directory):
        ignored = f" (--host {', '.join(host)} not added: remove the directory to issue new ones)" if host else ""
        typer.echo(f"{directory} already holds a CA and every role's certificate: kept{ignored}")
        return
    try:
        written = write_certs(directory, ROLES, host, valid_days)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    typer.echo(f"wrote {len(written)} files to {directory}: ca.pem and, for each of {', '.join(ROLES)}, "
               f"<role>.pem and <role>-key.pem")
