"""``meshserve generate`` and ``meshserve task``: a client of a running gateway.

``generate`` sends prompts (concurrently when several) and prints the answers,
streamed for one prompt and one choice, or submits them as async tasks
(``--async``; a Ctrl-C while it waits prints how to follow the tasks, which go on,
and exits 130); ``task TASK_ID`` reads, waits for or cancels a task submitted
earlier. Both exit 1 when a call failed. Both speak plaintext unless given
``--tls-ca`` (TLS to the gateway; ``--tls-cert``/``--tls-key`` add a client
certificate). gRPC and the client library are imported when a command runs, so
that ``meshserve --help`` stays fast.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
from typing import Optional

import typer

from meshserve.cli.options import InsecureOpt, TLSCAOpt, TLSCertOpt, TLSKeyOpt, tls_settings

DEFAULT_ADDR = "127.0.0.1:50051"
API_KEY_ENV = "MESHSERVE_API_KEY"

_GATEWAY_DEFAULTS = {"max_tokens": "16", "temperature": "1.0", "top_p": "1.0", "top_k": "0", "min_p": "0.0",
                     "min_tokens": "0", "repetition_penalty": "1.0", "presence_penalty": "0.0",
                     "frequency_penalty": "0.0", "n": "1"}
"""What ``--help`` shows as the default of a sampling option left unset: the request then
leaves the field unset and the gateway applies ``meshserve.sampling.SamplingParams``'s
default (written out here, since importing it would import grpc for ``--help``; a test
keeps them equal)."""


def _printable_ascii_key(api_key: Optional[str]) -> Optional[str]:
    """``--api-key``'s check: a key is printable ASCII, as gRPC metadata carries it and as
    a tenants file holds it (a key with a stray ``\\r`` or a non-ASCII letter would fail
    inside gRPC, not as a usage error).

    Raises:
        typer.BadParameter: any other character (exit code 2).
    """
    if api_key is not None and not (api_key.isascii() and api_key.isprintable()):
        raise typer.BadParameter(f"the key (from --api-key or {API_KEY_ENV}) must be printable ASCII; "
                                 "it holds a control or non-ASCII character")
    return api_key


ApiKeyOpt = typer.Option(None, "--api-key", envvar=API_KEY_ENV, show_default="none: the open tenant",
                         callback=_printable_ascii_key,
                         help="The caller's key, sent as x-api-key (a gateway with --tenants needs one).")


def generate(
    addr: str = typer.Option(DEFAULT_ADDR, "--addr", help="Gateway host:port."),
    prompt: list[str] = typer.Option(..., "--prompt", help="Prompt text; repeat to send several concurrently."),
    chat: bool = typer.Option(False, "--chat", help="Send each prompt as one user chat message."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", show_default=_GATEWAY_DEFAULTS["max_tokens"],
                                             help="Most tokens generated per choice."),
    temperature: Optional[float] = typer.Option(None, "--temperature",
                                                show_default=_GATEWAY_DEFAULTS["temperature"],
                                                help="Sampling temperature, >= 0 (0: greedy)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", show_default=_GATEWAY_DEFAULTS["top_p"],
                                          help="Nucleus mass, in (0, 1] (1: off)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", show_default=_GATEWAY_DEFAULTS["top_k"],
                                        help="Keep the k most likely tokens (0 or -1: off; 1: greedy)."),
    seed: Optional[int] = typer.Option(None, "--seed", show_default="none: unseeded",
                                       help="Seed of the sampling (choice i uses seed + i)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Generate past the model's end-of-text token."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string; may repeat."),
    stop_token_ids: list[int] = typer.Option([], "--stop-token-id", help="Stop token id; may repeat (its text "
                                             "is left out unless --include-stop-str-in-output)."),
    include_stop_str: bool = typer.Option(False, "--include-stop-str-in-output",
                                          help="Keep the stop string (or stop token's text) that ended a choice."),
    cache_salt: Optional[str] = typer.Option(None, "--cache-salt", show_default="none",
                                             help="Prefix cache salt: blocks shared only with requests carrying "
                                                  "it (1 to 256 characters)."),
    min_p: Optional[float] = typer.Option(None, "--min-p", show_default=_GATEWAY_DEFAULTS["min_p"],
                                          help="Min-p in [0, 1] (0: off)."),
    min_tokens: Optional[int] = typer.Option(None, "--min-tokens", show_default=_GATEWAY_DEFAULTS["min_tokens"],
                                             help="No EOS / stop token before this many."),
    repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty",
                                                       show_default=_GATEWAY_DEFAULTS["repetition_penalty"],
                                                       help="> 0 (1: off)."),
    presence_penalty: Optional[float] = typer.Option(None, "--presence-penalty",
                                                     show_default=_GATEWAY_DEFAULTS["presence_penalty"],
                                                     help="In [-2, 2] (0: off)."),
    frequency_penalty: Optional[float] = typer.Option(None, "--frequency-penalty",
                                                      show_default=_GATEWAY_DEFAULTS["frequency_penalty"],
                                                      help="In [-2, 2] (0: off)."),
    logit_bias: list[str] = typer.Option([], "--logit-bias", metavar="ID=BIAS",
                                         help="Add BIAS, in [-100, 100], to token ID's logit; may repeat."),
    json_schema: Optional[str] = typer.Option(None, "--json-schema", metavar="FILE", show_default="none",
                                              help="Structured output: JSON that FILE's JSON Schema accepts."),
    json_object: bool = typer.Option(False, "--json-object", help="Structured output: a JSON object."),
    regex: Optional[str] = typer.Option(None, "--regex", metavar="RE", show_default="none",
                                        help="Structured output: text RE matches whole."),
    choice: list[str] = typer.Option([], "--choice", metavar="TEXT",
                                     help="Structured output: exactly one of the --choice strings; repeat for each."),
    grammar: Optional[str] = typer.Option(None, "--grammar", metavar="FILE", show_default="none",
                                          help="Structured output: a sentence of FILE's EBNF grammar (root ::= …). "
                                               "At most one of --json-schema, --json-object, --regex, --choice, "
                                               "--grammar."),
    n: Optional[int] = typer.Option(None, "--n", show_default=_GATEWAY_DEFAULTS["n"],
                                    help="Choices per prompt, in [1, 16]."),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", show_default="none: off",
                                           help="Top-k logprobs per token, in [0, 20] (--json)."),
    prompt_logprobs: Optional[int] = typer.Option(None, "--prompt-logprobs", show_default="none: off",
                                                  help="Top-k logprobs per prompt token, in [0, 20] (--json)."),
    priority: Optional[int] = typer.Option(None, "--priority", show_default="the tenant's",
                                           help="Priority class: higher runs first."),
    request_id: Optional[str] = typer.Option(None, "--request-id", show_default="a new one",
                                             help="The request's id (one --prompt only): a retry under the id of "
                                                  "a call cancelled or timed out waits for its end."),
    api_key: Optional[str] = ApiKeyOpt,
    as_json: bool = typer.Option(False, "--json", help="One JSON object per prompt and choice, one per line, "
                                 "with prompt_index (its --prompt, from 0) and index (its choice)."),
    async_task: bool = typer.Option(False, "--async", help="Submit each prompt as an async task (SubmitTask), "
                                    "poll GetTask until it is done, then print the result."),
    tls_cert: Optional[str] = TLSCertOpt, tls_key: Optional[str] = TLSKeyOpt, tls_ca: Optional[str] = TLSCAOpt,
    insecure: bool = InsecureOpt,
) -> None:
    """Send prompts to a gateway and print the answers (streamed for one prompt and one choice)."""
    import grpc

    from meshserve.client import TaskFailed, build_request, channel, generate_choices, run_task
    from meshserve.v1 import gateway_pb2_grpc

    tls = tls_settings(tls_cert, tls_key, tls_ca, insecure, client=True)
    biases = parse_logit_bias(logit_bias)
    constraint = structured_option(json_schema, json_object, regex, choice, grammar)
    if request_id and len(prompt) > 1:  # "" names nothing: each request gets a new id
        raise typer.BadParameter("one id names one request: give --request-id with one --prompt only",
                                 param_hint="'--request-id'")

    async def main() -> int:
        metadata = (("x-api-key", api_key),) if api_key else ()
        async with channel(addr, tls) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            try:
                reqs = [build_request(None if chat else p, chat=[("user", p)] if chat else None,
                                      request_id=request_id or "", max_tokens=max_tokens, temperature=temperature,
                                      top_p=top_p, top_k=top_k,
                                      seed=seed, stop=stop, ignore_eos=ignore_eos, priority=priority, min_p=min_p,
                                      min_tokens=min_tokens, repetition_penalty=repetition_penalty,
                                      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, n=n,
                                      logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                      stop_token_ids=stop_token_ids, include_stop_str_in_output=include_stop_str,
                                      cache_salt=cache_salt, logit_bias=biases, structured_output=constraint)
                        for p in prompt]
            except ValueError as exc:  # an integer the wire type cannot hold
                print(f"error: bad option value: {exc}", file=sys.stderr)
                return 2
            live = len(reqs) == 1 and not as_json and (n or 1) == 1 and not async_task
            on_delta = (lambda text, _ids, _i: (sys.stdout.write(text), sys.stdout.flush())) if live else None

            def submitted(handle) -> None:  # the id, at once: `meshserve task ID` can follow it
                task_ids.append(handle.task_id)
                print(f"task {handle.task_id} submitted", file=sys.stderr, flush=True)

            calls = (run_task(stub, r, metadata, on_submitted=submitted) if async_task
                     else generate_choices(stub, r, metadata, on_delta=on_delta) for r in reqs)
            results = await asyncio.gather(*calls, return_exceptions=True)
        code, hinted = 0, False
        for prompt_index, (p, choices) in enumerate(zip(prompt, results)):
            if isinstance(choices, (grpc.aio.AioRpcError, TaskFailed)):
                code = 1
                name, details = ((choices.code().name, choices.details()) if isinstance(choices, grpc.aio.AioRpcError)
                                 else (choices.code, choices.message))
                err = {"prompt_index": prompt_index, "error": {"code": name, "message": details}}
                shown = p if len(p) <= 60 else p[:60] + "…"  # a long prompt is named by its start
                whose = f" (prompt {shown!r})" if len(prompt) > 1 else ""  # which one failed: the others printed
                shown_hint = "" if hinted else key_hint(name, api_key)  # said once, not per prompt
                hinted = hinted or bool(shown_hint)
                print(json.dumps(err) if as_json else f"error{whose}: {name}: {details}{shown_hint}",
                      file=sys.stdout if as_json else sys.stderr)
                continue
            if isinstance(choices, BaseException):
                raise choices
            for r in choices:
                if as_json:  # which --prompt it answers, then the choice's own index among its n
                    print(json.dumps({"prompt_index": prompt_index, **r.as_json()}))
                elif live:
                    print(f"\n[{r.finish_reason}; {r.usage['completion_tokens']} tokens; "
                          f"TTFT {r.timings['ttft_s']:.3f} s]")
                else:  # a header only where it tells answers apart: the prompt, the choice
                    title = " ".join(([p] if len(prompt) > 1 else [])
                                     + ([f"[choice {r.index}]"] if len(choices) > 1 else []))
                    task = f"; task {r.task_id}" if r.task_id else ""
                    if title:
                        print(f"### {title}")
                    print(f"{r.text}\n[{r.finish_reason}; {r.usage['completion_tokens']} tokens{task}]")
                    if title:
                        print()  # a blank line between answers
        return code

    task_ids: list[str] = []  # the async tasks submitted, as the gateway acknowledged them
    try:
        code = asyncio.run(main())
    except KeyboardInterrupt:
        if not async_task:
            raise
        follow = ([] if addr == DEFAULT_ADDR else ["--addr", addr]) + _tls_flags(tls_cert, tls_key, tls_ca, insecure)
        key_given = api_key is not None and api_key != os.environ.get(API_KEY_ENV)
        print(interrupted_note(task_ids, len(prompt), follow, key_given), file=sys.stderr)
        code = 130  # as a shell reports a command ended by SIGINT
    sys.exit(code)


def parse_logit_bias(items: list[str]) -> dict[int, float]:
    """``--logit-bias ID=BIAS`` options as a map (the gateway checks the ranges).

    Raises:
        typer.BadParameter: an item that is not an integer id, ``=`` and a number, or an
            id given twice (exit code 2).
    """
    biases: dict[int, float] = {}
    for item in items:
        token_id, sep, bias = item.partition("=")
        try:
            parsed = int(token_id), float(bias)
        except ValueError:
            parsed = None
        if not sep or parsed is None:
            raise typer.BadParameter(f"{item!r} is not ID=BIAS (a token id and a number, such as 4528=100)",
                                     param_hint="'--logit-bias'")
        if parsed[0] in biases:
            raise typer.BadParameter(f"token id {parsed[0]} is given twice", param_hint="'--logit-bias'")
        biases[parsed[0]] = parsed[1]
    return biases


def structured_option(json_schema: Optional[str], json_object: bool, regex: Optional[str], choice: list[str],
                      grammar: Optional[str]):
    """The structured output the options ask for (a ``StructuredOutput``; None: none). The
    gateway checks the spec itself (a bad schema, regex or grammar: INVALID_ARGUMENT).

    Raises:
        typer.BadParameter: two kinds given (``--choice`` may repeat: one kind), a file
            that cannot be read or is not UTF-8, a ``--json-schema`` file that is not JSON or
            not a schema object (exit code 2).
    """
    from meshserve.errors import InvalidArgument
    from meshserve.structured_output import StructuredOutput, json_spec

    given = [name for name, on in (("--json-schema", json_schema is not None), ("--json-object", json_object),
                                   ("--regex", regex is not None), ("--choice", bool(choice)),
                                   ("--grammar", grammar is not None)) if on]
    if len(given) > 1:
        raise typer.BadParameter(f"one structured output at a time: {' and '.join(given)} were given",
                                 param_hint=f"'{given[1]}'")
    if json_schema is not None:
        try:
            return StructuredOutput("json", json_spec(_read_option_file(json_schema, "--json-schema")))
        except InvalidArgument as exc:
            reason = str(exc).removeprefix("structured output json: ")
            raise typer.BadParameter(f"{json_schema}: {reason}", param_hint="'--json-schema'") from None
    if grammar is not None:
        return StructuredOutput("grammar", _read_option_file(grammar, "--grammar"))
    if json_object:
        return StructuredOutput("json_object")
    if regex is not None:
        return StructuredOutput("regex", regex)
    return StructuredOutput("choice", choices=tuple(choice)) if choice else None


def _read_option_file(path: str, option: str) -> str:
    """The text of an option's file.

    Raises:
        typer.BadParameter: it cannot be read, or is not UTF-8 (exit code 2).
    """
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc.strerror or exc}", param_hint=f"'{option}'") from None
    except UnicodeDecodeError as exc:
        raise typer.BadParameter(f"{path} is not UTF-8 text (byte {exc.start})", param_hint=f"'{option}'") from None


def key_hint(code: str, api_key: Optional[str]) -> str:
    """What to add to an error of status ``code`` for a call made with ``api_key``: how
    this command sends a key, when the gateway wanted one and got none."""
    if code == "UNAUTHENTICATED" and not api_key:
        return f" (this command sends one with --api-key KEY or {API_KEY_ENV})"
    return ""


def _tls_flags(cert: Optional[str], key: Optional[str], ca: Optional[str], insecure: bool) -> list[str]:
    """The TLS flags given, to repeat them."""
    flags = [flag for name, value in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)) if value
             for flag in (name, value)]
    return flags + (["--insecure"] if insecure else [])


def interrupted_note(task_ids: list[str], prompts: int, follow: list[str], key_given: bool) -> str:
    """What ``generate --async`` prints on Ctrl-C: the tasks go on on the gateway, and
    the ``meshserve task`` commands that fetch or cancel each (``follow``: the
    ``--addr`` and TLS flags to repeat; ``key_given``: an ``--api-key`` given on the
    command line, which the commands need too and which is not printed)."""
    extra = "".join(f" {shlex.quote(a)}" for a in follow)
    if not task_ids:
        lines = ["interrupted before the gateway acknowledged a task (a submit in flight may still have been "
                 "accepted); no task id to follow"]
    else:
        them = "it" if len(task_ids) == 1 else "them"
        lines = [f"interrupted: task{'s' if len(task_ids) > 1 else ''} {', '.join(task_ids)} "
                 f"{'goes' if len(task_ids) == 1 else 'go'} on without this command; fetch or cancel {them} with:"]
        for task_id in task_ids:
            lines += [f"  meshserve task {task_id}{extra} --wait", f"  meshserve task {task_id}{extra} --cancel"]
        if key_given:
            lines.append("  (each with the --api-key you gave)")
        if len(task_ids) < prompts:
            lines.append(f"{prompts - len(task_ids)} other prompt(s) got no task id (a submit in flight may still "
                         "have been accepted)")
    return "\n".join(lines)


def task_command(
    task_id: str = typer.Argument(..., help="The id SubmitTask returned."),
    addr: str = typer.Option(DEFAULT_ADDR, "--addr", help="Gateway host:port."),
    cancel: bool = typer.Option(False, "--cancel", help="Cancel the task (CancelTask) instead of reading it."),
    wait: bool = typer.Option(False, "--wait", help="Poll until the task is done."),
    api_key: Optional[str] = ApiKeyOpt,
    tls_cert: Optional[str] = TLSCertOpt, tls_key: Optional[str] = TLSKeyOpt, tls_ca: Optional[str] = TLSCAOpt,
    insecure: bool = InsecureOpt,
) -> None:
    """Print an async task's status (GetTask) as one JSON object; exit 1 when it failed or is unknown."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from meshserve.client import cancel_task, channel, get_task, wait_task
    from meshserve.v1 import gateway_pb2, gateway_pb2_grpc

    tls = tls_settings(tls_cert, tls_key, tls_ca, insecure, client=True)

    async def main() -> int:
        metadata = (("x-api-key", api_key),) if api_key else ()
        async with channel(addr, tls) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            try:
                if cancel:
                    status = await cancel_task(stub, task_id, metadata)
                else:
                    status = await (wait_task if wait else get_task)(stub, task_id, metadata)
            except grpc.aio.AioRpcError as exc:
                print(f"error: {exc.code().name}: {exc.details()}{key_hint(exc.code().name, api_key)}",
                      file=sys.stderr)
                return 1
        # every field, zeros too, as GET /v1/tasks/{id} gives them
        print(json.dumps(MessageToDict(status, preserving_proto_field_name=True,
                                       always_print_fields_with_no_presence=True)))
        if cancel and status.state in (gateway_pb2.TASK_STATE_SUCCEEDED, gateway_pb2.TASK_STATE_FAILED):
            state = gateway_pb2.TaskState.Name(status.state).removeprefix("TASK_STATE_")
            print(f"task {task_id} had already finished ({state}): nothing cancelled", file=sys.stderr)
        return 1 if status.state == gateway_pb2.TASK_STATE_FAILED else 0

    sys.exit(asyncio.run(main()))
