"""``--help`` names the default of every option a command leaves to someone else: the
sampling options of ``generate`` (the gateway's defaults), the API key, the executor's
torch threads."""

import dataclasses

from typer.main import get_command
from typer.testing import CliRunner

from meshserve.cli import app
from meshserve.cli.client import _GATEWAY_DEFAULTS
from meshserve.sampling import SamplingParams

runner = CliRunner()


def _shown(command: str) -> dict[str, object]:
    """Flag → its ``show_default`` in ``meshserve COMMAND``, for the optional ones whose default is None."""
    params = get_command(app).commands[command].params
    return {p.opts[0]: p.show_default for p in params
            if p.opts[0].startswith("--") and p.default is None and not p.required}


def test_the_sampling_defaults_shown_are_the_gateways():
    defaults = {f.name: str(f.default) for f in dataclasses.fields(SamplingParams) if f.name in _GATEWAY_DEFAULTS}
    assert _GATEWAY_DEFAULTS == defaults


def test_generate_shows_a_default_for_every_option_it_leaves_unset():
    assert _shown("generate") == {
        "--max-tokens": "16", "--temperature": "1.0", "--top-p": "1.0", "--top-k": "0", "--seed": "none: unseeded",
        "--min-p": "0.0", "--min-tokens": "0", "--repetition-penalty": "1.0", "--presence-penalty": "0.0",
        "--frequency-penalty": "0.0", "--n": "1", "--logprobs": "none: off", "--prompt-logprobs": "none: off",
        "--priority": "the tenant's", "--api-key": "none: the open tenant", "--request-id": "a new one",
        "--cache-salt": "none", "--json-schema": "none", "--regex": "none", "--grammar": "none",
        "--tls-cert": True, "--tls-key": True, "--tls-ca": True}  # no certificate: plaintext (their help)


def test_generate_help_prints_the_defaults():
    result = runner.invoke(app, ["generate", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "--max-tokens <int> Most tokens generated per choice. [default: (16)]" in text
    assert "--temperature <float> Sampling temperature, >= 0 (0: greedy). [default: (1.0)]" in text
    assert ("--api-key <str> The caller's key, sent as x-api-key (a gateway with --tenants needs one). "
            "[env var: MESHSERVE_API_KEY; default: (none: the open tenant)]") in text


def test_task_and_executor_show_theirs():
    assert _shown("task")["--api-key"] == "none: the open tenant"
    assert _shown("executor")["--num-threads"] == "torch's own, about one per core"
