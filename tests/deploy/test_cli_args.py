"""Every meshserve command line the deploy files give (each Kubernetes overlay's
Deployments, each compose service) parsed by the real CLI parser (typer's click
command, ``make_context``: the flags and their values are checked, nothing runs),
so a renamed or removed flag, or a value the flag refuses, fails here, not in a
cluster."""

import shlex

import pytest
import typer
import typer.main

from meshserve.cli import app
from tests.support.deploy import OVERLAYS, by_kind, compose_config, overlay

CLI = typer.main.get_command(app)
SERVICES = ("kvstore", "scheduler", "executor", "gateway")


def parse(args: list[str]) -> dict:
    """The parameters ``meshserve ARGS`` would run with (raises click's UsageError, or BadParameter)."""
    command = CLI.commands[args[0]]
    return command.make_context(args[0], list(args[1:]), resilient_parsing=False).params


def k8s_args() -> list[tuple[str, list[str]]]:
    return [(f"{name}/{deployment}", d["spec"]["template"]["spec"]["containers"][0]["args"])
            for name in OVERLAYS for deployment, d in sorted(by_kind(overlay(name), "Deployment").items())
            if deployment != "redis"]


def compose_args() -> list[tuple[str, list[str]]]:
    found = []
    for name, service in sorted(compose_config()["services"].items()):
        command = service.get("command")
        if service.get("image") != "meshserve:latest" or not command:
            continue
        if service.get("entrypoint") == ["sh", "-c"]:  # the executor: `exec meshserve executor ...`
            words = shlex.split(command[0])
            assert words[:2] == ["exec", "meshserve"], name
            command = words[2:]
        found.append((f"compose/{name}", command))
    return found


def test_every_kubernetes_deployment_runs_a_command_line_the_cli_accepts():
    parsed = {where: parse(args) for where, args in k8s_args()}
    assert len(parsed) == len(OVERLAYS) * len(SERVICES)
    for name in OVERLAYS:
        assert parsed[f"{name}/executor"]["drain_grace_s"] == 30 and parsed[f"{name}/gateway"]["drain_grace_s"] == 30
        assert parsed[f"{name}/gateway"]["http_port"] == 8080
    assert parsed["cpu/executor"]["num_threads"] == 2
    assert parsed["gpu/executor"]["device"] == "cuda"


def test_every_compose_service_runs_a_command_line_the_cli_accepts():
    parsed = {where: parse(args) for where, args in compose_args()}
    assert set(parsed) == {"compose/certs", *(f"compose/{s}" for s in SERVICES)}
    for service in SERVICES:
        assert parsed[f"compose/{service}"]["traces"] == "otlp", service
    assert parsed["compose/executor"]["num_threads"] == 2


def test_the_parser_rejects_a_renamed_flag_and_a_bad_value():
    args = dict(k8s_args())["cpu/executor"]
    with pytest.raises(Exception, match="No such option: --num-thread") as renamed:
        parse([("--num-thread" if a == "--num-threads" else a) for a in args])
    assert type(renamed.value).__name__ == "NoSuchOption"  # typer's click (its own copy): a UsageError
    with pytest.raises(typer.BadParameter):
        parse([*args, "--drain-grace-s", "soon"])
