"""The TLS flags of the command line: services refuse to start without certificates
unless ``--insecure``; ``meshserve certs``; what ``meshserve up`` hands each service."""

from __future__ import annotations

import pytest
from cryptography import x509
from typer.testing import CliRunner

from meshserve.certs import ROLES, role_uri
from meshserve.cli import app
from meshserve.cli.launcher import Mesh
from meshserve.cli.mesh_config import MeshConfig
from meshserve.tls import TLSConfig
from tests.support.tls import cert_dir

SERVICES = {"scheduler": [], "kvstore": [], "gateway": ["--scheduler", "127.0.0.1:1"],
            "executor": ["--scheduler", "127.0.0.1:1"]}


@pytest.mark.parametrize("command", sorted(SERVICES))
def test_a_service_without_certificates_or_insecure_refuses_to_start(command):
    """Exit code 2 (usage error) and one line naming the flags, before anything loads."""
    result = CliRunner().invoke(app, [command, *SERVICES[command]])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["error: mutual TLS needs --tls-cert, --tls-key, --tls-ca (a development "
                                          "set: `meshserve certs DIR`), or --insecure for plaintext"]


@pytest.mark.parametrize("command", sorted(SERVICES))
def test_insecure_with_a_tls_flag_is_a_usage_error(command):
    d = cert_dir()
    result = CliRunner().invoke(app, [command, *SERVICES[command], "--insecure", "--tls-ca", str(d / "ca.pem")])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["error: --insecure (plaintext) cannot be combined with --tls-ca"]


def test_a_missing_certificate_file_is_a_usage_error(tmp_path):
    d = cert_dir()
    result = CliRunner().invoke(app, ["kvstore", "--tls-cert", str(tmp_path / "nope.pem"), "--tls-key",
                                      str(d / "kvstore-key.pem"), "--tls-ca", str(d / "ca.pem")])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [f"error: --tls-cert {tmp_path / 'nope.pem'}: no such readable file"]


def test_client_tls_flags():
    d = cert_dir()
    assert not TLSConfig.from_flags(None, None, None, False, client=True).enabled  # no flag: plaintext
    assert TLSConfig.from_flags(None, None, str(d / "ca.pem"), False, client=True) == TLSConfig(ca=str(d / "ca.pem"))
    with pytest.raises(ValueError, match="needs --tls-ca"):
        TLSConfig.from_flags(str(d / "client.pem"), str(d / "client-key.pem"), None, False, client=True)
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key"):
        TLSConfig.from_flags(str(d / "client.pem"), None, str(d / "ca.pem"), False, client=True)


def test_certs_makes_a_ca_and_one_certificate_per_role_naming_it(tmp_path):
    result = CliRunner().invoke(app, ["certs", str(tmp_path / "c"), "--host", "executor-1.internal"])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == sorted(["ca.pem", "ca-key.pem", *(f"{r}.pem" for r in ROLES), *(f"{r}-key.pem" for r in ROLES)])
    ca = x509.load_pem_x509_certificate((tmp_path / "c" / "ca.pem").read_bytes())
    for role in ROLES:
        cert = x509.load_pem_x509_certificate((tmp_path / "c" / f"{role}.pem").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [role_uri(role)]
        assert san.get_values_for_type(x509.DNSName) == ["localhost", role, "executor-1.internal"]
        assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1"]
        cert.verify_directly_issued_by(ca)
    assert (tmp_path / "c" / "ca-key.pem").stat().st_mode & 0o077 == 0
    before = (tmp_path / "c" / "ca.pem").read_bytes()
    again = CliRunner().invoke(app, ["certs", str(tmp_path / "c")])  # a complete set is kept
    assert again.exit_code == 0 and (tmp_path / "c" / "ca.pem").read_bytes() == before


@pytest.mark.parametrize("host", ["executor", "Executor.", "scheduler"])
def test_certs_refuses_a_role_name_as_an_extra_host(tmp_path, host):
    """Found by a review: ``--host executor`` put the name by which the gateway knows an
    executor into every role's certificate, so a client's certificate could pose as one."""
    result = CliRunner().invoke(app, ["certs", str(tmp_path / "c"), "--host", "a.internal", "--host", host])
    assert result.exit_code == 2
    assert f"--host {host} is a role's name, which only that role's certificate carries" in " ".join(
        result.output.replace("│", " ").split())
    assert not (tmp_path / "c").exists()
    assert CliRunner().invoke(app, ["certs", str(tmp_path / "d")]).exit_code == 0  # a set exists: checked still
    again = CliRunner().invoke(app, ["certs", str(tmp_path / "d"), "--host", host])
    assert again.exit_code == 2


def test_certs_says_new_hosts_are_not_added_to_a_kept_set(tmp_path):
    assert CliRunner().invoke(app, ["certs", str(tmp_path / "c")]).exit_code == 0
    again = CliRunner().invoke(app, ["certs", str(tmp_path / "c"), "--host", "executor-1.internal"])
    assert (again.exit_code, again.output) == (0, f"{tmp_path / 'c'} already holds a CA and every role's certificate: "
                                                  "kept (--host executor-1.internal not added: remove the directory to "
                                                  "issue new ones)\n")


def test_up_runs_plaintext_by_default_and_mutual_tls_with_a_tls_dir(tmp_path):
    assert Mesh(MeshConfig())._tls_args("executor") == ["--insecure"]
    assert not Mesh(MeshConfig()).tls().enabled
    d = cert_dir()
    mesh = Mesh(MeshConfig(tls_dir=d))
    assert mesh._tls_args("executor") == ["--tls-cert", str(d / "executor.pem"), "--tls-key",
                                          str(d / "executor-key.pem"), "--tls-ca", str(d / "ca.pem")]
    assert mesh.tls() == TLSConfig(str(d / "client.pem"), str(d / "client-key.pem"), str(d / "ca.pem"))
